"""The run directory's housekeeping: one dispatcher at a time, its state file, safe endpoints."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import socket
from pathlib import Path
from typing import Any

import yaml

from common.run.config import RESOLVED_CONFIG_NAME, Config, ConfigError
from common.run.durable import atomic_write, format_bytes, free_bytes
from common.run.witness import MODELS_DIR

log = logging.getLogger("hsd.dispatcher")

STATE_FILE = "dispatcher.json"  # pid and endpoints of the serving dispatcher; hsd launch waits for it
LOCK_FILE = "dispatcher.lock"
RESUME_SENSITIVE = ("run", "data", "schedule")


def resolve_host(host: str) -> list[str]:
    """Every address ``host`` resolves to here (a literal address is itself)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror as exc:
        raise ConfigError(f"cannot bind {host!r}: it does not resolve on this host ({exc.strerror})") from None


def check_endpoint(endpoint: str, secret: str, *, curve: bool = False, multi_node: bool = False) -> None:
    """Refuse an endpoint a run cannot use: a TCP host that resolves to loopback only when workers
    of other nodes must connect (``multi_node``), which is warned about otherwise; a non-loopback
    bind without CURVE or a secret; an ipc path too long for a Unix socket."""
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        addresses = [] if host == "*" else resolve_host(host)
        loopback = bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
        if loopback and host not in ("127.0.0.1", "::1", "localhost"):
            # A name that resolves to loopback (Debian and Ubuntu map the hostname to 127.0.1.1): no
            # other node can connect. A literal loopback address is a choice (one machine, tests).
            message = (f"{endpoint}: {host!r} resolves to {', '.join(addresses)}, a loopback address: workers on "
                       f"other nodes cannot connect; bind the address on the route to them (the src of "
                       f"`ip route get <a drafter node's address>`)")
            if multi_node:
                raise ConfigError(message + " (pool.transport=nixl runs across nodes)")
            log.warning("%s", message)
        if not loopback and not (secret or curve):
            raise ConfigError(f"binding {endpoint} on a non-loopback address requires CURVE keys (curve.*, made by "
                              "hsd keys) or at least dispatcher.secret")
    elif endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if len(path.encode()) > 100:
            raise ConfigError(f"ipc endpoint path is too long for a Unix socket ({len(path)} > 100 bytes): {path}; "
                              "use a shorter run.dir or set dispatcher.endpoint")


def lock_run_dir(run_dir: Path):
    """One dispatcher per run directory: two would interleave one journal. The lock dies with us."""
    lock_file = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        try:
            holder = f" (pid {json.loads((run_dir / STATE_FILE).read_text())['pid']})"
        except (OSError, ValueError, KeyError):
            holder = ""
        raise ConfigError(f"another dispatcher{holder} is serving {run_dir}") from None
    return lock_file


RESUME_SENSITIVE = ("run", "data", "schedule")


def warn_about_changed_settings(run_dir: Path, config: Config) -> None:
    """A resume with other data or schedule settings changes only the epochs not yet started."""
    previous_path = run_dir / RESOLVED_CONFIG_NAME
    if not previous_path.exists():
        return
    try:
        previous = yaml.safe_load(previous_path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return
    current = config.to_dict()
    changed = [f"{section}.{key}: {previous[section][key]!r} -> {value!r}"
               for section in RESUME_SENSITIVE for key, value in current[section].items()
               if key in previous.get(section, {}) and previous[section][key] != value]
    if changed:
        log.warning("resuming %s with changed settings (started epochs keep their persisted schedule): %s",
                    run_dir, "; ".join(changed))


JOURNAL_HEADROOM_BYTES = 64 << 20  # journal segments and snapshots written between two checkpoints


def largest_checkpoint_bytes(run_dir: Path) -> int:
    """The size of the largest checkpoint (``models/<model>/step-*``) already in ``run_dir``."""
    largest = 0
    for step_dir in (run_dir / MODELS_DIR).glob("*/step-*"):
        if step_dir.is_dir():
            largest = max(largest, sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()))
    return largest


def check_free_space(run_dir: Path, min_free_mb: int) -> None:
    """Refuse to start where ``run_dir`` cannot hold one more checkpoint set and the journal's headroom:
    ``min_free_mb``, or with 0 the largest checkpoint already there plus JOURNAL_HEADROOM_BYTES."""
    needed = min_free_mb << 20 if min_free_mb else largest_checkpoint_bytes(run_dir) + JOURNAL_HEADROOM_BYTES
    free = free_bytes(run_dir)
    if free is not None and free < needed:
        raise ConfigError(f"run.dir {run_dir} has {format_bytes(free)} free, less than the {format_bytes(needed)} a "
                          "run needs there (one checkpoint set and the journal's headroom; run.min_free_mb sets "
                          "it): free space or choose another run.dir")


def write_state_file(run_dir: Path, state: dict[str, Any]) -> None:
    atomic_write(run_dir / STATE_FILE, json.dumps(state))
