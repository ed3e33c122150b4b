"""The deploy recipes parse, and every `hsd` subcommand, option and config key they use exists."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from common.run.config import load_config
from deploy_scan import DEPLOY, REPO, deploy_files, invocation_problems, is_shell, key_problems, snippets
from k8s_recipe import hsd_invocations, load_file, load_objects, matches, pods

MANIFESTS = sorted(p for p in deploy_files() if p.suffix in (".yaml", ".yml"))
SCRIPTS = sorted(p for p in deploy_files() if is_shell(p))


def _name(path) -> str:
    return str(path.relative_to(DEPLOY))


def test_the_recipes_are_found():
    assert len(MANIFESTS) >= 5 and len(SCRIPTS) >= 2
    assert {p.suffix for p in SCRIPTS} >= {".sh", ".sbatch"}


@pytest.mark.parametrize("path", MANIFESTS, ids=_name)
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
        if "apiVersion" in doc:  # a Kubernetes object
            assert doc.get("kind") and (doc.get("metadata") or {}).get("name") or doc["kind"] == "Kustomization", \
                f"{path}: a Kubernetes object needs kind and metadata.name"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", SCRIPTS, ids=_name)
def test_shell_syntax(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


K8S_RECIPES = ["k8s", "k8s-2node"]  # one pod; one pod per node


def _k8s_objects(recipe: str) -> list[dict]:
    return load_objects(DEPLOY / recipe)


def _assert_loads_as_written(path: Path) -> None:
    """The config loads (unknown sections or keys, ill-typed or inconsistent values raise ConfigError)
    and holds every value the file sets, as the file sets it (a relative run.dir made absolute)."""
    config = load_config(path)
    for section, values in (yaml.safe_load(path.read_text()) or {}).items():
        for key, written in (values or {}).items():
            loaded = getattr(getattr(config, section), key)
            if (section, key) == ("run", "dir"):
                loaded, written = Path(loaded), Path(written).resolve()
            assert loaded == written, f"{path.name}: {section}.{key} loads as {loaded!r}, the file says {written!r}"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("configs/*.y*ml")), ids=_name)
def test_config_files_load(path):
    _assert_loads_as_written(path)


@pytest.mark.parametrize("recipe", K8S_RECIPES)
def test_k8s_configmap_holds_a_valid_config(tmp_path, recipe):
    maps = [o for o in _k8s_objects(recipe) if o["kind"] == "ConfigMap"]
    assert maps
    for cm in maps:
        for name, text in cm["data"].items():
            if name.endswith((".yaml", ".yml")):
                (tmp_path / name).write_text(text)
                _assert_loads_as_written(tmp_path / name)


@pytest.mark.parametrize("recipe", K8S_RECIPES)
def test_k8s_references_resolve(recipe):
    objects = _k8s_objects(recipe)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "Kustomization"}
    text = "\n".join(p.read_text() for p in (DEPLOY / recipe).glob("*.y*ml"))
    (kustomization,) = [o for o in objects if o["kind"] == "Kustomization"]
    for resource in kustomization["resources"]:
        assert (DEPLOY / recipe / resource).is_file(), f"kustomization lists a missing {resource}"
    listed = {(o["kind"], o["metadata"]["name"]) for resource in kustomization["resources"]
              for o in load_file(DEPLOY / recipe / resource)}
    assert listed == names, f"objects the kustomization does not list: {names - listed}"
    workloads = pods(objects)
    assert workloads
    for pod in workloads:
        for volume in pod.volumes().values():
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
            if "secret" in volume:  # made by hand, from keys no manifest may hold: documented how
                assert f"kubectl create secret generic {volume['secret']['secretName']} " in text
        mounted = {m["name"] for c in pod.containers for m in c.get("volumeMounts", [])}
        assert mounted <= set(pod.volumes())
    for o in objects:
        if o["kind"] == "Service":
            assert any(matches(o["spec"]["selector"], pod.labels) for pod in workloads), o["metadata"]["name"]
        if o["kind"] == "NetworkPolicy":
            assert any(matches(o["spec"]["podSelector"]["matchLabels"], pod.labels) for pod in workloads)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
@pytest.mark.parametrize("recipe", K8S_RECIPES)
def test_kustomize_builds_the_objects_the_tests_read(recipe):
    proc = subprocess.run(["kubectl", "kustomize", str(DEPLOY / recipe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    built = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(proc.stdout) if o}
    assert built == {(o["kind"], o["metadata"]["name"]) for o in _k8s_objects(recipe) if o["kind"] != "Kustomization"}


def test_systemd_units_use_only_variables_the_env_file_sets():
    env = (DEPLOY / "systemd" / "env.example").read_text()
    defined = set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", env, flags=re.M))
    for unit in DEPLOY.glob("systemd/*.service"):
        text = unit.read_text()
        own = set(re.findall(r"^Environment=([A-Z_][A-Z0-9_]*)=", text, flags=re.M))
        for line in text.splitlines():
            if line.startswith("ExecStart"):
                used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", line))
                assert used <= defined | own, f"{unit.name}: {sorted(used - defined - own)} not set in env.example"


def test_every_hsd_invocation_and_config_key_exists():
    problems = []
    for path in deploy_files():
        for snippet in snippets(path):
            problems += invocation_problems(snippet)
            problems += key_problems(snippet)
    assert not problems, "\n".join(problems)


def test_the_check_sees_mistakes(tmp_path, monkeypatch):
    """The scanner itself: a wrong subcommand, option, section or key is reported where it is."""
    import deploy_scan
    bad = tmp_path / "deploy"
    bad.mkdir()
    (bad / "run.sh").write_text('#!/bin/bash\n# (default: hsd from PATH)\n"$hsd_bin" lanch --config c.yaml\n'
                                'hsd stats --run-dir d --wach 2\nhsd launch --config c pool.slot=3\n'
                                "hsd bench transprt\nhsd launch schedul.buckets=[1]\n")
    (bad / "notes.md").write_text("Run `hsd schedule --lengths F` and raise `pool.target_credit`.\n\n"
                                  "```bash\nhsd reprot --run-dir D   # comment\n```\n")
    monkeypatch.setattr(deploy_scan, "REPO", tmp_path)
    found = []
    for path in sorted(bad.iterdir()):
        for snippet in snippets(path):
            found += invocation_problems(snippet) + key_problems(snippet)
    text = "\n".join(found)
    assert "deploy/run.sh:3: 'hsd lanch' is not a subcommand" in text
    assert "deploy/run.sh:4: 'hsd stats' has no option --wach" in text
    assert "deploy/run.sh:5: unknown config key pool.slot" in text
    assert "deploy/run.sh:6: 'hsd bench transprt' is not a subcommand" in text
    assert "deploy/run.sh:7: unknown config section 'schedul'" in text
    assert "deploy/notes.md:1: unknown config key pool.target_credit" in text
    assert "deploy/notes.md:4: 'hsd reprot' is not a subcommand" in text
    assert "from" not in text and "schedule --lengths" not in text
    assert REPO.is_dir()


# -- the scripts run, with a stand-in for hsd that records what it was asked ----------------------
STUB = """#!/bin/bash
printf '%s\\0' "$@" > "$HSD_STUB_DIR/$1.argv"
"""


def _run_with_stub(tmp_path, script, *args, env_extra: dict) -> dict[str, list[str]]:
    import os
    stub = tmp_path / "hsd"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HSD_BIN": str(stub), "HSD_STUB_DIR": str(tmp_path), **env_extra}
    proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {p.stem: p.read_text().split("\0")[:-1] for p in tmp_path.glob("*.argv")}


def _resolved(argv: list[str]):
    from hsd.cli import build_parser
    args = build_parser().parse_args(argv)
    return load_config(args.config, args.overrides)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_single_node_script_runs_hsd_launch(tmp_path):
    config = DEPLOY / "configs" / "8gpu-qwen3-8b.yaml"
    calls = _run_with_stub(tmp_path, DEPLOY / "single-node" / "run.sh", str(config), "drafter.count=2",
                           "drafter.gpus=[5,6]", env_extra={"HSD_RUN_DIR": str(tmp_path / "run")})
    resolved = _resolved(calls["launch"])
    assert resolved.run.dir == str(tmp_path / "run") and resolved.drafter.count == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("split", [(5, 3), (6, 2), (7, 1)])
def test_sbatch_script_passes_a_valid_split(tmp_path, split):
    targets, drafters = split
    calls = _run_with_stub(tmp_path, DEPLOY / "slurm" / "hsd-node.sbatch", "pool.slots=30",
                           env_extra={"HSD_CONFIG": str(DEPLOY / "configs" / "8gpu-qwen3-8b.yaml"),
                                      "HSD_RUN_DIR": str(tmp_path / "run"), "NUM_TARGETS": str(targets),
                                      "NUM_DRAFTERS": str(drafters)})
    resolved = _resolved(calls["launch"])
    assert resolved.target.gpus == list(range(targets))
    assert resolved.drafter.gpus == list(range(targets, targets + drafters))
    assert resolved.pool.slots == 30 and resolved.run.dir == str(tmp_path / "run")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_sbatch_script_gives_a_tensor_parallel_target_its_gpus(tmp_path):
    calls = _run_with_stub(tmp_path, DEPLOY / "slurm" / "hsd-node.sbatch",
                           env_extra={"HSD_CONFIG": str(DEPLOY / "configs" / "8gpu-llama-70b-tp4.yaml"),
                                      "HSD_RUN_DIR": str(tmp_path / "run"), "NUM_TARGETS": "1",
                                      "TARGET_TP_SIZE": "4", "NUM_DRAFTERS": "4"})
    resolved = _resolved(calls["launch"])
    assert (resolved.target.count, resolved.target.tp_size, resolved.target.gpus) == (1, 4, [0, 1, 2, 3])
    assert resolved.drafter.gpus == [4, 5, 6, 7]


@pytest.mark.parametrize("recipe", K8S_RECIPES)
def test_k8s_job_reads_the_config_its_configmap_mounts(recipe):
    objects = _k8s_objects(recipe)
    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    for pod in pods(objects):
        for container in pod.containers:
            invocations = hsd_invocations(container)
            assert invocations, f"{pod.name} runs no hsd"
            for argv in invocations:
                config_path = argv[argv.index("--config") + 1]
                held = pod.mounted_volume(container, config_path)
                assert held, f"{config_path} is on no volume of the container"
                volume, key = held
                assert "configMap" in volume, f"{config_path} is not on a ConfigMap volume"
                assert key in maps[volume["configMap"]["name"]]["data"], f"ConfigMap has no {key}"


SRUN_STUB = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
# As STUB, but `hsd launch` lasts a moment, as the run would: the drafters start while it is up.
LASTING_STUB = STUB + """[[ "$1" == launch ]] && sleep 3
exit 0
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_two_node_sbatch_puts_targets_and_drafters_on_their_nodes(tmp_path):
    """The heterogeneous job: launch with the targets and the dispatcher on the first node, a drafter per
    GPU on the others naming their node, all over TCP with CURVE and pool.transport=nixl."""
    import os
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN_STUB)
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "hsd").write_text(LASTING_STUB)
    (bin_dir / "hsd").chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((DEPLOY / "configs" / "8gpu-qwen3-8b.yaml").read_text())  # as launch leaves it
    # The drafter nodes: scontrol names them; the script binds its source address on the route there
    # (loopback here) and starts the drafters only once that port listens (the stand-in dispatcher's).
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho localhost\n')
    (bin_dir / "scontrol").chmod(0o755)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        calls = _run_with_stub(tmp_path, DEPLOY / "slurm" / "hsd-2node.sbatch", "pool.slots=24",
                               env_extra={"HSD_CONFIG": str(DEPLOY / "configs" / "8gpu-qwen3-8b.yaml"),
                                          "HSD_RUN_DIR": str(run), "NUM_TARGETS": "6", "NUM_DRAFTERS": "2",
                                          "HSD_PORT": str(port),
                                          "SLURM_JOB_NODELIST_HET_GROUP_1": "localhost",
                                          "PATH": f"{bin_dir}:{os.environ['PATH']}", "HSD_BIN": str(bin_dir / "hsd")})
    finally:
        listener.close()
    assert calls["keys"][calls["keys"].index("--out") + 1] == str(run / "keys")
    head = _resolved(calls["launch"])
    assert head.pool.transport == "nixl" and head.nodes.name and head.pool.slots == 24
    assert head.target.gpus == list(range(6)) and head.drafter.count == 0
    assert head.dispatcher.endpoint == f"tcp://127.0.0.1:{port}" and head.curve.enabled
    assert len(head.curve.allowed_client_keys) == 2
    drafter = calls["drafter"]
    assert drafter[drafter.index("--node") + 1] and drafter[drafter.index("--config") + 1] == str(run / "config.yaml")
    resolved = _resolved(drafter)
    assert resolved.curve.client_secret_key == str(run / "keys" / "drafters.key_secret")
    # every drafter of component 1 (one node here, 2 GPUs) is a rank of one group (meeting over TCP:
    # the config launch resolves says pool.transport=nixl)
    assert resolved.drafter.grouped and resolved.drafter.count == 2 and resolved.drafter.gpus == [0, 1]
