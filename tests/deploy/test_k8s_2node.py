"""deploy/k8s-2node: the head pod runs the dispatcher and the targets, the drafter pods only drafters,
on different nodes, over the headless Service with CURVE keys from the Secret; its scripts run
with stand-ins for hsd and getent that record what they were asked."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from k8s_recipe import Pod, container_env, hsd_invocations, kubelet_argv, load_objects, pods, shell_script
from k8s_two_node import DOWNWARD, RECIPE, documented, keys_command, make_keys, two_node_problems

from hsd.cli import build_parser


# -- the checks ------------------------------------------------------------------------------------
def test_the_two_node_recipe_puts_targets_and_drafters_on_their_nodes(tmp_path):
    objects = load_objects(RECIPE)
    assert {o["kind"] for o in objects} >= {"Job", "Service", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    assert two_node_problems(objects, tmp_path) == []


def _breaks(objects: list[dict], kind: str, name: str, change) -> list[dict]:
    broken = copy.deepcopy(objects)
    change(next(o for o in broken if o["kind"] == kind and o["metadata"]["name"] == name))
    return broken


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _set_env(container: dict, name: str, value: str) -> None:
    next(e for e in container["env"] if e["name"] == name).update(value=value)


def _keys_volume(job: dict) -> dict:
    return next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys")["secret"]


MISTAKES = {
    "head starts drafters": ("Job", "hsd-2node-head", lambda j: _container(j)["args"].remove("drafter.count=0"),
                             "the head runs targets only"),
    "drafter pod runs a target": ("Job", "hsd-2node-drafters",
                                  lambda j: _container(j).update(args=[_container(j)["args"][0].replace(
                                      "hsd drafter", "hsd target")]), "runs hsd target"),
    "no anti-affinity": ("Job", "hsd-2node-drafters", lambda j: j["spec"]["template"]["spec"].pop("affinity"),
                         "does not keep hsd-2node-head off its node"),
    "wrong stats port": ("Service", "hsd-head", lambda s: s["spec"]["ports"][1].update(port=5557),
                         "does not expose port 5556"),
    "not headless": ("Service", "hsd-head", lambda s: s["spec"].pop("clusterIP"), "is not headless"),
    "endpoint on another name": ("ConfigMap", "hsd-2node-config",
                                 lambda c: c["data"].update({"config.yaml": c["data"]["config.yaml"].replace(
                                     "tcp://hsd-head:5555", "tcp://hsd-dispatcher:5555")}),
                                 "hsd-dispatcher is no Service"),
    "drafters lack their key": ("Job", "hsd-2node-drafters", lambda j: _keys_volume(j)["items"].pop(),
                                "no key file"),
    "drafters get the dispatcher's secret": ("Job", "hsd-2node-drafters", lambda j: _keys_volume(j)["items"].append(
        {"key": "dispatcher.key_secret", "path": "dispatcher.key_secret"}), "the dispatcher's secret key"),
    "a key the Secret lacks": ("Job", "hsd-2node-head", lambda j: _keys_volume(j)["items"].append(
        {"key": "head.key", "path": "head.key"}), "has no file head.key"),
    "small /dev/shm": ("Job", "hsd-2node-head", lambda j: j["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]
                       .update(sizeLimit="8Gi"), "is smaller than the pool"),
    "run.dir on one node": ("PersistentVolumeClaim", "hsd-2node-runs",
                            lambda p: p["spec"].update(accessModes=["ReadWriteOnce"]), "ReadWriteMany"),
    "drafters on the head's node": ("Job", "hsd-2node-drafters", lambda j: _set_env(_container(j), "HSD_NODE", "head"),
                                    "name the head's node"),
    "one node for every index": ("Job", "hsd-2node-drafters",
                                 lambda j: _set_env(_container(j), "HSD_NODE", "drafters"), "all name node"),
    "wait on another port": ("Job", "hsd-2node-drafters",
                             lambda j: _set_env(_container(j), "HSD_DISPATCHER_PORT", "5556"), "HSD_DISPATCHER_HOST"),
    "GPUs and drafters differ": ("Job", "hsd-2node-drafters",
                                 lambda j: _set_env(_container(j), "HSD_GPUS", "4"), "HSD_GPUS=4"),
    "ports filtered": ("NetworkPolicy", "hsd-2node",
                       lambda p: p["spec"]["ingress"][0].update(ports=[{"port": 5555}]), "every port"),
}


def test_the_two_node_check_sees_mistakes(tmp_path):
    objects = load_objects(RECIPE)
    make_keys(tmp_path / "keys")
    for what, (kind, name, change, expected) in MISTAKES.items():
        checked = tmp_path / re.sub(r"\W+", "-", what)
        checked.mkdir()
        problems = two_node_problems(_breaks(objects, kind, name, change), checked, keys=tmp_path / "keys")
        assert any(expected in p for p in problems), f"{what}: {problems}"


def test_the_secret_is_made_as_documented():
    """The documented `kubectl create secret` takes the directory `hsd keys --out` wrote, under the
    name every pod mounts."""
    argv = keys_command()
    out, names = argv[argv.index("--out") + 1], [argv[i + 1] for i, a in enumerate(argv) if a == "--name"]
    assert set(names) == {"targets", "drafters"}
    created = documented(r"kubectl create secret generic (\S+) --from-file=(\S+)")
    assert created.group(2).rstrip("/") == out.rstrip("/")
    mounted = {v["secret"]["secretName"] for pod in pods(load_objects(RECIPE)) for v in pod.volumes().values()
               if "secret" in v}
    assert mounted == {created.group(1)}


# -- the containers' scripts, run with stand-ins ---------------------------------------------------
HSD_STUB = """#!/bin/bash
out="$HSD_STUB_DIR/$1-${CUDA_VISIBLE_DEVICES:-none}-$$"
printf '%s\\0' "$@" > "$out.argv"
if [[ -n "${HSD_STUB_CRASH:-}" && "$CUDA_VISIBLE_DEVICES" == "$HSD_STUB_CRASH" && ! -e "$HSD_STUB_DIR/crashed" ]]; then
    touch "$HSD_STUB_DIR/crashed"; exit 3
fi
if [[ -n "${HSD_STUB_LINGER:-}" ]]; then
    trap 'sleep 0.3; echo term > "$out.term"; kill "$sleeper"; exit 0' TERM  # a drafter takes a while to leave
    sleep 30 & sleeper=$!
    touch "$out.up"
    wait
fi
"""
GETENT_STUB = """#!/bin/bash
# No answer to the first question (the name not published yet), then the pod's IP.
echo "$*" >> "$HSD_STUB_DIR/getent.calls"
(( $(wc -l < "$HSD_STUB_DIR/getent.calls") > 1 )) && echo "$POD_IP       hsd-head.default.svc.cluster.local"
exit 0
"""


def _stubs(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("hsd", HSD_STUB), ("getent", GETENT_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _pod(name: str) -> tuple[Pod, dict]:
    pod = next(p for p in pods(load_objects(RECIPE)) if p.name == name)
    return pod, pod.containers[0]


@contextlib.contextmanager
def _running(container: dict, tmp_path: Path, **env: str):
    """The container's script under bash, as the kubelet starts it; its whole process group is
    killed on the way out, whatever the test saw."""
    pod_env = container_env(container, DOWNWARD)
    argv = kubelet_argv(container, pod_env)
    assert Path(argv[0]).name == "bash" and argv[1] == "-c" and shell_script(container)
    environ = {"PATH": f"{_stubs(tmp_path)}:{os.environ['PATH']}", "HSD_STUB_DIR": str(tmp_path), **pod_env, **env}
    proc = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _calls(tmp_path: Path, role: str) -> dict[str, list[list[str]]]:
    """Recorded argv per CUDA_VISIBLE_DEVICES."""
    calls: dict[str, list[list[str]]] = {}
    for path in sorted(tmp_path.glob(f"{role}-*.argv")):
        calls.setdefault(path.name.split("-")[1], []).append(path.read_text().split("\0")[:-1])
    return calls


@pytest.fixture
def control_port():
    """A listening socket where the drafter pod waits for the dispatcher's control port."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_head_container_waits_for_its_name_then_execs_hsd_launch(tmp_path):
    pod, container = _pod("hsd-2node-head")
    with _running(container, tmp_path) as proc:
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    # it asked again after the first, empty answer, for the name of dispatcher.endpoint
    assert (tmp_path / "getent.calls").read_text().splitlines() == ["hosts hsd-head"] * 2
    (argv,) = _calls(tmp_path, "launch")["none"]
    assert argv == hsd_invocations(container)[0][1:]


def test_drafter_container_runs_a_drafter_per_gpu_and_restarts_a_crash(tmp_path, control_port):
    pod, container = _pod("hsd-2node-drafters")
    with _running(container, tmp_path, HSD_DISPATCHER_HOST="127.0.0.1", HSD_DISPATCHER_PORT=str(control_port),
                  HSD_STUB_CRASH="3") as proc:
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    calls = _calls(tmp_path, "drafter")
    gpus = int(container_env(container, DOWNWARD)["HSD_GPUS"])
    assert sorted(calls) == [str(g) for g in range(gpus)]
    assert [len(calls[str(g)]) for g in range(gpus)] == [2 if g == 3 else 1 for g in range(gpus)]
    assert "drafters-0-gpu3 exited with code 3: restart 1 of 3" in output
    names = set()
    for gpu, (argv, *_) in calls.items():
        args = build_parser().parse_args(argv)
        assert args.node == "drafters-0" and args.config == "/etc/hsdispatch/config.yaml"
        names.add(args.name)
    assert len(names) == gpus


def test_drafter_container_passes_sigterm_to_every_drafter(tmp_path, control_port):
    pod, container = _pod("hsd-2node-drafters")
    gpus = int(container_env(container, DOWNWARD)["HSD_GPUS"])
    with _running(container, tmp_path, HSD_DISPATCHER_HOST="127.0.0.1", HSD_DISPATCHER_PORT=str(control_port),
                  HSD_STUB_LINGER="1") as proc:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.up"))) < gpus and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(tmp_path.glob("*.up"))) == gpus
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
        # every drafter was asked to stop, and the pod's shell waited until it had
        assert len(list(tmp_path.glob("*.term"))) == gpus


def test_the_claim_names_a_storage_class_and_the_keys_are_readable_by_the_image_user():
    """A ReadWriteMany claim on a block-storage default class never binds: storageClassName is a
    parameter the recipe sets (a placeholder to replace, documented), never left to the default; the
    key Secrets are mounted 0440, so each pod that mounts one sets an fsGroup for the image's user."""
    objects = load_objects(RECIPE)
    claim = next(o for o in objects if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["storageClassName"]
    assert "storageClassName is REQUIRED" in (RECIPE / "pvc.yaml").read_text()
    assert "`storageClassName` is required" in (RECIPE.parent / "README.md").read_text()
    for pod in pods(objects):
        secrets = [v["secret"] for v in pod.volumes().values() if "secret" in v]
        if any(s.get("defaultMode", 0o644) & 0o004 == 0 for s in secrets):
            assert pod.spec.get("securityContext", {}).get("fsGroup") is not None, pod.name
