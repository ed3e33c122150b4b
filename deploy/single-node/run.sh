#!/usr/bin/env bash
# Run hsdispatch on this machine: the dispatcher, the target workers and the drafter workers,
# all started and supervised by `hsd launch`. Exits 0 once the last epoch is committed.
# Running the same command again with the same run.dir resumes an interrupted run.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: run.sh CONFIG [section.key=value ...]

  CONFIG             YAML run configuration (e.g. deploy/configs/8gpu-qwen3-8b.yaml)
  section.key=value  overrides, applied after CONFIG (e.g. run.dir=/data/runs/q3 drafter.count=2)

Environment:
  HSD_BIN      hsd executable (default: hsd from PATH)
  HSD_RUN_DIR  run directory; passed as run.dir=... before the other overrides

Examples:
  run.sh deploy/configs/8gpu-qwen3-8b.yaml run.dir=/data/runs/q3 data.path=/data/q3-regen
  HSD_RUN_DIR=/data/runs/q3 run.sh deploy/configs/8gpu-qwen3-8b.yaml target.count=4 'target.gpus=[0,1,2,3]'

Progress, from another shell:  hsd stats --run-dir RUN_DIR --watch 2
USAGE
}

if [[ $# -lt 1 ]]; then
    usage >&2
    exit 2
fi
case "$1" in
    -h|--help) usage; exit 0 ;;
esac

config=$1
shift
if [[ ! -f "$config" ]]; then
    echo "run.sh: config file not found: $config" >&2
    exit 2
fi

hsd_bin=${HSD_BIN:-hsd}
if ! command -v "$hsd_bin" >/dev/null 2>&1; then
    echo "run.sh: '$hsd_bin' not found; install hsdispatch with 'pip install -e .' from the repository root" >&2
    exit 127
fi

overrides=()
if [[ -n "${HSD_RUN_DIR:-}" ]]; then
    overrides+=("run.dir=$HSD_RUN_DIR")
fi
overrides+=("$@")

# exec: the launcher becomes this process, so Ctrl-C and SIGTERM reach it directly and it can
# stop its workers cleanly.
# (The ${a[@]+...} form keeps `set -u` of bash < 4.4 quiet about an empty array.)
exec "$hsd_bin" launch --config "$config" ${overrides[@]+"${overrides[@]}"}
