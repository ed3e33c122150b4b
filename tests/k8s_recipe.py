"""Read a Kubernetes recipe of deploy/ as kubectl and the kubelet would: its objects, the pods its
workloads make, the environment a container sees, and the `hsd` command lines it runs.

A container runs hsd either in exec form (``command``/``args`` from an ``hsd`` element on) or from
a ``bash -c SCRIPT``; in a script, every line that runs ``hsd`` is one invocation, up to the first
shell operator (``&``, ``;``, ``|``). Shell variables are left as written (``"$HSD_NODE"``) unless
:func:`expand` is given the container's environment.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

WORKLOADS = ("Job", "Deployment", "StatefulSet", "DaemonSet")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SHELL_OPERATORS = {"&", "&&", ";", "|", "||", ";;"}


def load_file(path: Path) -> list[dict]:
    """The Kubernetes objects of one manifest."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict) and "kind" in doc]


def load_objects(directory: Path) -> list[dict]:
    """Every object of a recipe directory, its Kustomization included."""
    return [doc for path in sorted(directory.glob("*.y*ml")) for doc in load_file(path)]


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes quantity (``24Gi``, ``500M``, ``1024``) in bytes."""
    match = _QUANTITY.match(str(text))
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass
class Pod:
    """The pod template of one workload."""

    workload: dict

    @property
    def name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"].get("labels", {})

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    @property
    def containers(self) -> list[dict]:
        return self.spec["containers"]

    def volumes(self) -> dict[str, dict]:
        return {v["name"]: v for v in self.spec.get("volumes", [])}

    def mounted_volume(self, container: dict, path: str) -> tuple[dict, str] | None:
        """(the volume, the path inside it) that holds ``path`` in ``container``, or None."""
        best = None
        for mount in container.get("volumeMounts", []):
            root = mount["mountPath"].rstrip("/")
            if path == root or path.startswith(root + "/"):
                if best is None or len(root) > len(best[0]):
                    best = (root, mount["name"])
        if best is None:
            return None
        return self.volumes()[best[1]], path[len(best[0]):].lstrip("/")

    def mount_of(self, container: dict, mount_path: str) -> dict | None:
        """The volume mounted exactly at ``mount_path``."""
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"].rstrip("/") == mount_path.rstrip("/"):
                return self.volumes()[mount["name"]]
        return None


def pods(objects: list[dict]) -> list[Pod]:
    return [Pod(o) for o in objects if o["kind"] in WORKLOADS]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` of a defined variable replaced, ``$$`` made ``$``, anything else (``$(seq 3)``) kept,
    as the kubelet does in env values, ``command`` and ``args``."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, downward: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet sets it: references to earlier variables expanded,
    ``fieldRef`` values taken from ``downward`` (field path -> value)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = kubelet_expand(str(item["value"]), env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def kubelet_argv(container: dict, env: dict[str, str]) -> list[str]:
    """The argv the container's process gets: ``command`` + ``args``, references expanded."""
    return [kubelet_expand(a, env) for a in container.get("command", []) + container.get("args", [])]


def shell_script(container: dict) -> str | None:
    """The script of a ``bash -c SCRIPT`` (or ``sh -c``) container, or None."""
    argv = container.get("command", []) + container.get("args", [])
    if len(argv) >= 3 and Path(argv[0]).name in ("bash", "sh") and argv[1] == "-c":
        return argv[2]
    return None


def hsd_invocations(container: dict) -> list[list[str]]:
    """Every `hsd ...` command line the container runs, from ``hsd`` on."""
    argv = container.get("command", []) + container.get("args", [])
    if "hsd" in argv:
        return [argv[argv.index("hsd"):]]
    script = shell_script(container)
    if script is None:
        return []
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        if "hsd" not in tokens:
            continue
        tokens = tokens[tokens.index("hsd"):]
        end = next((i for i, t in enumerate(tokens) if t in _SHELL_OPERATORS), len(tokens))
        found.append(tokens[:end])
    return found


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """``$VAR`` and ``${VAR}`` of ``env`` substituted in each token; other variables left as they are."""
    pattern = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
    return [pattern.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), token) for token in argv]
