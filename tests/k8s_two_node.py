"""What deploy/k8s-2node must hold for targets to run on one node and drafters on another:
:func:`two_node_problems` lists, in words, everything that would keep it from working.

Each check reads the recipe as the cluster would run it: the configuration a pod's `hsd` command line
resolves to (its ConfigMap plus its overrides, through the real parser and ``load_config``), the key
files its Secret volumes mount (made by the recipe's own `hsd keys` command, then loaded as the
dispatcher and the workers load them), the Service its endpoints name, its affinity, volumes and
network policy.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
from pathlib import Path

from deploy_scan import DEPLOY
from k8s_recipe import Pod, container_env, expand, hsd_invocations, matches, pods, quantity_bytes

from common.run.config import ConfigError, load_config
from common.wire.curve import client_from_config, server_from_config
from common.run.slot_layout import SlotLayout
from hsd.cli import build_parser
from hsd.cli import main as cli_main

RECIPE = DEPLOY / "k8s-2node"
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
POD_IP = "10.0.0.7"
DOWNWARD = {"status.podIP": POD_IP, INDEX_FIELD: "0"}
CURVE_FILES = ("server_public_key", "server_secret_key", "client_secret_key")


def documented(pattern: str) -> re.Match:
    match = re.search(pattern, (RECIPE / "kustomization.yaml").read_text())
    assert match, f"kustomization.yaml does not document {pattern}"
    return match


def keys_command() -> list[str]:
    """The `hsd keys` command line the recipe documents, from ``keys`` on."""
    return documented(r"hsd (keys [^\n]+)").group(1).split()


def make_keys(out: Path) -> None:
    """Run the documented `hsd keys` (in this process), writing into ``out`` instead."""
    argv = keys_command()
    argv[argv.index("--out") + 1] = str(out)
    assert cli_main(argv) == 0


@functools.lru_cache(maxsize=1)
def _parser():
    return build_parser()


def _invocations(pod: Pod) -> list[tuple[dict, list[str]]]:
    return [(c, argv) for c in pod.containers for argv in hsd_invocations(c)]


def _resolve(pod: Pod, container: dict, argv: list[str], objects: list[dict], tmp_path: Path, *, index: str = "0"):
    """The config `argv` runs with: its --config read from the ConfigMap the pod mounts there."""
    env = container_env(container, {**DOWNWARD, INDEX_FIELD: index})
    args = _parser().parse_args(expand(argv, env)[1:])
    held = pod.mounted_volume(container, args.config)
    if held is None or "configMap" not in held[0]:
        raise ConfigError(f"{pod.name}: {args.config} is on no ConfigMap volume")
    volume, key = held
    maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    text = maps[volume["configMap"]["name"]]["data"].get(key)
    if text is None:
        raise ConfigError(f"{pod.name}: ConfigMap {volume['configMap']['name']} has no {key}")
    path = tmp_path / f"{pod.name}-{key}"
    path.write_text(text)
    return args, load_config(path, args.overrides)


def _endpoint(endpoint: str) -> tuple[str, int]:
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def _materialize_keys(pod: Pod, container: dict, keys: Path, root: Path) -> list[str]:
    """Copy into ``root`` the key files the pod's Secret volumes mount; problems of missing keys."""
    problems = []
    for mount in container.get("volumeMounts", []):
        secret = pod.volumes()[mount["name"]].get("secret")
        if secret is None:
            continue
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for item in secret.get("items") or [{"key": p.name, "path": p.name} for p in keys.iterdir()]:
            if not (keys / item["key"]).is_file():
                problems.append(f"{pod.name}: Secret {secret['secretName']} (hsd keys) has no file {item['key']}")
                continue
            shutil.copy(keys / item["key"], target / item["path"])
    return problems


def _curve_problems(pod: Pod, container: dict, config, role: str, keys: Path, root: Path) -> list[str]:
    problems = _materialize_keys(pod, container, keys, root)
    curve = copy.deepcopy(config.curve)
    for name in CURVE_FILES:
        if getattr(curve, name):
            setattr(curve, name, str(root / getattr(curve, name).lstrip("/")))
    curve.allowed_client_keys = [str(root / k.lstrip("/")) for k in curve.allowed_client_keys]
    checks = [client_from_config] + ([server_from_config] if role == "launch" else [])
    for check in checks:
        try:
            check(curve)
        except ConfigError as exc:
            problems.append(f"{pod.name}: {exc}")
    server_secret = config.curve.server_secret_key
    if role == "drafter" and server_secret and (root / server_secret.lstrip("/")).exists():
        problems.append(f"{pod.name}: a drafter pod is given the dispatcher's secret key")
    return problems


def two_node_problems(objects: list[dict], tmp_path: Path, *, keys: Path | None = None) -> list[str]:
    """Everything that keeps the recipe from running targets on one node and drafters on another.
    ``keys``: what the documented `hsd keys` wrote, made into ``tmp_path`` when not given."""
    problems: list[str] = []
    if keys is None:
        keys = tmp_path / "keys"
        make_keys(keys)
    heads, drafters, configs = [], [], {}
    for pod in pods(objects):
        for container, argv in _invocations(pod):
            role = argv[1]
            try:
                _, config = _resolve(pod, container, argv, objects, tmp_path)
            except (ConfigError, SystemExit) as exc:
                problems.append(f"{pod.name}: {' '.join(argv)}: {exc}")
                continue
            configs[pod.name] = config
            (heads if role == "launch" else drafters).append(pod)
            if role not in ("launch", "drafter"):
                problems.append(f"{pod.name} runs hsd {role}: the head runs hsd launch, drafter pods hsd drafter")
            if config.pool.transport != "nixl":
                problems.append(f"{pod.name}: pool.transport={config.pool.transport}, not nixl")
            if role == "launch" and (config.drafter.count or not config.target.count):
                problems.append(f"{pod.name}: hsd launch with target.count={config.target.count} "
                                f"drafter.count={config.drafter.count}: the head runs targets only")
            if role == "drafter" and "--node" not in argv:
                problems.append(f"{pod.name}: hsd drafter without --node")
            if role == "drafter" and not config.drafter.gpus:
                problems.append(f"{pod.name}: drafter.gpus is empty: the drafters would train on the CPU")
            root = tmp_path / "mounts" / pod.name
            problems += _curve_problems(pod, container, config, role, keys, root)
            problems += _pod_problems(pod, container, config, role, objects)
    if len(heads) != 1 or not drafters:
        return problems + [f"expected one head pod running hsd launch and drafter pods, got {len(heads)} and "
                           f"{len(drafters)}"]
    head = heads[0]
    problems += _node_problems(head, drafters, configs, objects, tmp_path)
    problems += _service_problems(head, drafters, configs[head.name], objects)
    every_pod = [head, *drafters]
    for pod in every_pod:
        for other in every_pod:
            if other is not pod and not _repels(pod, other):
                problems.append(f"{pod.name} does not keep {other.name} off its node (podAntiAffinity)")
    for pod in every_pod:
        for other in every_pod:
            if not _admits(objects, pod, other):
                problems.append(f"no NetworkPolicy lets {other.name} reach {pod.name} on every port")
    return list(dict.fromkeys(problems))


def _admits(objects: list[dict], pod: Pod, other: Pod) -> bool:
    """A NetworkPolicy that selects ``pod`` takes traffic from ``other`` on every port."""
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        if not matches(policy["spec"]["podSelector"].get("matchLabels", {}), pod.labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("ports") and any(matches(f.get("podSelector", {}).get("matchLabels", {}), other.labels)
                                             for f in rule.get("from", [])):
                return True
    return False


def _repels(pod: Pod, other: Pod) -> bool:
    """``pod`` may not be scheduled on a node where ``other`` runs."""
    anti = pod.spec.get("affinity", {}).get("podAntiAffinity", {})
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    return any(t.get("topologyKey") == "kubernetes.io/hostname"
               and matches(t.get("labelSelector", {}).get("matchLabels", {}), other.labels) for t in terms)


def _gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _pod_problems(pod: Pod, container: dict, config, role: str, objects: list[dict]) -> list[str]:
    problems = []
    gpus = _gpus(container)
    env = container_env(container, DOWNWARD)
    if role == "launch" and not set(config.target.gpus[:config.target.count]) <= set(range(gpus)):
        problems.append(f"{pod.name}: target.gpus {config.target.gpus} but {gpus} GPUs requested")
    if role == "drafter" and env.get("HSD_GPUS") != str(gpus):
        problems.append(f"{pod.name}: HSD_GPUS={env.get('HSD_GPUS')} drafters but {gpus} GPUs requested")
    shm = pod.mount_of(container, "/dev/shm")
    if shm is None or shm.get("emptyDir", {}).get("medium") != "Memory":
        problems.append(f"{pod.name}: /dev/shm is no memory-backed emptyDir")
    elif role == "launch":
        pool_bytes = config.pool.slots * SlotLayout.from_config(config).slot_bytes
        if quantity_bytes(shm["emptyDir"]["sizeLimit"]) < pool_bytes:
            problems.append(f"{pod.name}: /dev/shm ({shm['emptyDir']['sizeLimit']}) is smaller than the pool "
                            f"({pool_bytes / 2**30:.1f} GiB)")
        limit = container.get("resources", {}).get("limits", {}).get("memory")
        if limit is None or quantity_bytes(limit) <= quantity_bytes(shm["emptyDir"]["sizeLimit"]):
            problems.append(f"{pod.name}: the memory limit does not cover /dev/shm")
    held = pod.mounted_volume(container, config.run.dir)
    claim_name = held[0].get("persistentVolumeClaim", {}).get("claimName") if held else None
    claim = next((o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim_name),
                 None)
    if claim is None or "ReadWriteMany" not in claim["spec"]["accessModes"]:
        problems.append(f"{pod.name}: run.dir {config.run.dir} is not on a ReadWriteMany PVC of the recipe")
    return problems


def _node_problems(head: Pod, drafters: list[Pod], configs: dict, objects: list[dict], tmp_path: Path) -> list[str]:
    """Every drafter pod names a node of its own, never the head's."""
    problems = []
    for pod in drafters:
        names = set()
        for index in ("0", "1"):
            for container, argv in _invocations(pod):
                args, _ = _resolve(pod, container, argv, objects, tmp_path, index=index)
                names.add(args.node)
        if configs[head.name].nodes.name in names:
            problems.append(f"{pod.name}: drafters name the head's node {configs[head.name].nodes.name!r}")
        if pod.workload["spec"].get("completionMode") == "Indexed" and len(names) < 2:
            problems.append(f"{pod.name}: the pods of the Indexed Job all name node {names}")
    return problems


def _service_problems(head: Pod, drafters: list[Pod], config, objects: list[dict]) -> list[str]:
    problems = []
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for key in ("endpoint", "stats_endpoint"):
        endpoint = getattr(config.dispatcher, key)
        if not endpoint.startswith("tcp://"):
            problems.append(f"dispatcher.{key}={endpoint!r} is not TCP")
            continue
        host, port = _endpoint(endpoint)
        service = services.get(host.split(".")[0])
        if service is None:
            problems.append(f"dispatcher.{key}: {host} is no Service of the recipe")
            continue
        spec = service["spec"]
        if port not in {p["port"] for p in spec.get("ports", [])}:
            problems.append(f"dispatcher.{key}: Service {host} does not expose port {port}")
        if spec.get("clusterIP") != "None":
            problems.append(f"Service {host} is not headless: the dispatcher cannot bind a cluster IP")
        selector = spec.get("selector", {})
        if not matches(selector, head.labels) or any(matches(selector, d.labels) for d in drafters):
            problems.append(f"Service {host} does not select the head pod alone")
    host, port = _endpoint(config.dispatcher.endpoint) if config.dispatcher.endpoint.startswith("tcp://") else ("", 0)
    for pod in (head, *drafters):
        for container in pod.containers:
            env = container_env(container, DOWNWARD)
            if env.get("HSD_DISPATCHER_HOST") != host or env.get("HSD_DISPATCHER_PORT", str(port)) != str(port):
                problems.append(f"{pod.name}: HSD_DISPATCHER_HOST/PORT {env.get('HSD_DISPATCHER_HOST')}:"
                                f"{env.get('HSD_DISPATCHER_PORT')} are not dispatcher.endpoint's {host}:{port}")
    return problems
