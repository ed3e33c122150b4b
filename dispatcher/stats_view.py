"""``hsd stats``: ask a running dispatcher's read-only stats socket and print the answer."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from common.client import DispatcherClient, DispatcherUnavailable
from common.config import ConfigError, load_run_config

DEFAULT_RUN_DIR = "runs/demo"


def resolve_stats_endpoint(endpoint: str | None, run_dir: str | None) -> tuple[str, str]:
    """(endpoint, secret) from --endpoint, or from the run directory's resolved config."""
    if endpoint:
        return endpoint, ""
    run_dir = run_dir or DEFAULT_RUN_DIR
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist (give --run-dir or --endpoint)")
    config = load_run_config(run_dir)
    return config.stats_endpoint, config.dispatcher.secret


def fetch_stats(endpoint: str, secret: str = "", timeout_s: float = 3.0) -> dict[str, Any]:
    client = DispatcherClient(endpoint, secret=secret, timeout_s=timeout_s)
    try:
        return client.call("stats")["stats"]
    finally:
        client.close()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_stats(s: dict[str, Any]) -> str:
    t = s["transport"]
    lines = [f"run {s['run_dir']}  (run id {s['run_id']}, dispatcher pid {s['pid']}, up {s['uptime_s']:.0f}s)"
             + ("  DONE" if s["done"] else "")]
    for e in s["epochs"]:
        pct = e["committed"] / max(1, e["jobs"])
        lines.append(f"epoch {e['epoch'] + 1}/{s['epochs_total']}: {e['committed']}/{e['jobs']} committed ({pct:.0%}), "
                     f"{e['taken']} taken; prefix deviation schedule {e['schedule_prefix_deviation']:.2f} "
                     f"consumed {e['consumed_prefix_deviation']:.2f}")
    lines.append("jobs      " + "  ".join(f"{k} {v}" for k, v in s["jobs_by_state"].items()))
    lines.append("q_hsb     " + ("  ".join(f"b{b}:{n}" for b, n in s["q_hsb"].items()) or "(no ready slot)"))
    lines.append(f"pool      {t['kind']}, {t['num_slots']} slots{' per target' if t['per_target'] else ''} x "
                 f"{_mib(t['slot_bytes'])} = {_mib(t['pool_bytes'])}; "
                 + "  ".join(f"{k} {v}" for k, v in s["pool"].items()))
    lines.append(f"steps     {s['steps']}   given back {s['given_back'] or 0}   errors {s['errors'] or 0}")
    lines.append("")
    lines.append(f"{'worker':<12} {'id':<5} {'role':<8} {'state':<8} {'jobs':>6} {'tok/s':>10} {'idle':>6} "
                 f"{'hb age':>7}  pid@host")
    for w in sorted(s["workers"], key=lambda w: (w["role"], w["name"])):
        lines.append(f"{w['name']:<12} {w['id']:<5} {w['role']:<8} {w['state']:<8} {w['jobs']:>6} "
                     f"{w['tokens_per_s']:>10,.0f} {w['idle_ratio']:>6.1%} {w['heartbeat_age_s']:>6.1f}s  "
                     f"{w['pid']}@{w['host']}")
    if not s["workers"]:
        lines.append("(no worker registered)")
    return "\n".join(lines)


def run_stats(*, endpoint: str | None, run_dir: str | None, as_json: bool, watch_s: float | None) -> int:
    endpoint, secret = resolve_stats_endpoint(endpoint, run_dir)
    while True:
        try:
            stats = fetch_stats(endpoint, secret)
        except DispatcherUnavailable:
            print(f"no dispatcher answers at {endpoint}")
            if not watch_s:
                return 1
        else:
            if as_json:
                print(json.dumps(stats), flush=True)
            else:
                if watch_s:
                    print("\033[2J\033[H", end="")
                print(format_stats(stats), flush=True)
        if not watch_s:
            return 0
        time.sleep(watch_s)
