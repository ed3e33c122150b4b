"""The run directory's housekeeping: one dispatcher at a time, safe endpoints, settings changed on a resume
(the run directory's files themselves are ``common/run/records/rundir.py``'s)."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
from pathlib import Path

import yaml

from common.run.config import RESOLVED_CONFIG_NAME, Config, ConfigError
from common.run.records.rundir import read_state_file

log = logging.getLogger("hsd.dispatcher")

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
        state = read_state_file(run_dir)
        holder = f" (pid {state.pid})" if state is not None else ""
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
