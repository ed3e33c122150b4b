#!/usr/bin/env bash
# The installed package, not the checkout: build the wheel, install it into a fresh venv (with the
# pinned CPU torch), then from outside the checkout import every module, run `hsd config` and a
# one-epoch `hsd demo --objective eagle3` at its smallest settings (a real target and an EAGLE-3
# drafter process reading the configs shipped in the wheel). The last line says whether it passed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
started=$(date +%s)
tmp="$(mktemp -d /tmp/hsd-wheel-XXXXXX)"
trap 'rm -rf "$tmp"' EXIT

step() { echo "[wheel-smoke $(( $(date +%s) - started ))s] $*"; }
fail() { echo "wheel smoke: FAILED: $* ($(( $(date +%s) - started ))s)"; exit 1; }

step "building the wheel"
# From a copy of the tree: setuptools' build/ in the checkout would carry files of earlier builds.
mkdir "$tmp/src"
tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./runs --exclude=./.whl \
    --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$tmp/src" -xf -
"$python" -m pip wheel -q --no-deps -w "$tmp/dist" "$tmp/src" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "wheel build"; }
wheel="$(ls "$tmp"/dist/hsdispatch-*.whl)"
step "installing $(basename "$wheel") into a fresh venv"
"$python" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/pip" install -q --no-compile)  # byte-compiling torch would take minutes of CPU
"${pip[@]}" "$torch_spec" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "torch install"; }
"${pip[@]}" -c <(echo "$torch_spec") "$wheel" >>"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "wheel install"; }

cd "$tmp"  # nothing of the checkout on sys.path from here on
export PATH="$tmp/venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
step "importing every module of the installed packages"
python - "$tmp/venv" <<'EOF' || fail "module imports"
import importlib, pkgutil, sys
venv = sys.argv[1]
failed, count = [], 0
for top in ("common", "dispatcher", "target_worker", "drafter_worker", "ops", "benchmarks", "hsd"):
    package = importlib.import_module(top)
    assert package.__file__.startswith(venv), f"{top} imported from {package.__file__}, not the venv"
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{top}."):
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - every failure is listed
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
print(f"{count} modules imported, {len(failed)} failed")
for line in failed:
    print("  " + line)
sys.exit(1 if failed else 0)
EOF
step "hsd config"
hsd config >"$tmp/config.txt" || fail "hsd config"
grep -q "pool.transport" "$tmp/config.txt" || fail "hsd config printed no pool.transport"
step "hsd demo --objective eagle3, one epoch at the smallest settings"
hsd demo --objective eagle3 --out "$tmp/demo" --samples 12 --eval-prompts 2 --max-new-tokens 8 --tiny-steps 5 \
    run.epochs=1 >"$tmp/demo.log" 2>&1 || { tail -n 60 "$tmp/demo.log"; fail "hsd demo --objective eagle3"; }
summary="$(tail -n 1 "$tmp/demo.log")"
python -c 'import json, sys; s = json.loads(sys.argv[1]); assert s, s' "$summary" || {
    tail -n 30 "$tmp/demo.log"; fail "the demo's last line is not its JSON summary"; }
step "demo summary: $summary"
echo "wheel smoke: PASSED in $(( $(date +%s) - started ))s (built, installed fresh, every module imported, hsd config, hsd demo --objective eagle3)"
