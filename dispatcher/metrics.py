"""Prometheus text exposition of the dispatcher's stats snapshot, served over plain HTTP.

The snapshot is taken on the dispatcher's loop thread (the core is single-threaded) and handed to
the HTTP thread as finished text, so a scrape never touches live state.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _line(name: str, value: float, **labels: Any) -> str:
    if labels:
        text = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                        for k, v in labels.items())
        return f"{name}{{{text}}} {value}"
    return f"{name} {value}"


def render_prometheus(s: dict[str, Any]) -> str:
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

    metric("hsd_up", "gauge", "1 while the dispatcher serves; 0 once every epoch is committed.",
           [_line("hsd_up", 0 if s["done"] else 1)])
    metric("hsd_jobs", "gauge", "Jobs by ledger state.",
           [_line("hsd_jobs", n, state=state) for state, n in s["jobs_by_state"].items()])
    metric("hsd_ready_slots", "gauge", "Ready hidden-state slots per bucket (q_hsb).",
           [_line("hsd_ready_slots", n, bucket=b) for b, n in s["q_hsb"].items()])
    metric("hsd_pool_slots", "gauge", "Pool slots by state.",
           [_line("hsd_pool_slots", n, state=state) for state, n in s["pool"].items()])
    metric("hsd_pool_bytes", "gauge", "Bytes of the hidden-state pool.", [_line("hsd_pool_bytes", s["transport"]["pool_bytes"])])
    metric("hsd_steps_total", "counter", "Committed optimizer steps.", [_line("hsd_steps_total", s["steps"])])
    metric("hsd_epoch_jobs_committed", "gauge", "Committed jobs of each started epoch.",
           [_line("hsd_epoch_jobs_committed", e["committed"], epoch=e["epoch"]) for e in s["epochs"]])
    metric("hsd_epoch_jobs", "gauge", "Jobs of each started epoch.",
           [_line("hsd_epoch_jobs", e["jobs"], epoch=e["epoch"]) for e in s["epochs"]])
    metric("hsd_prefix_deviation", "gauge", "Prefix deviation in batches, of the schedule and of the consumed stream.",
           [_line("hsd_prefix_deviation", e[f"{stream}_prefix_deviation"], epoch=e["epoch"], stream=stream)
            for e in s["epochs"] for stream in ("schedule", "consumed")])
    workers = s["workers"]
    metric("hsd_worker_tokens_per_second", "gauge", "Tokens per second of each worker since it registered.",
           [_line("hsd_worker_tokens_per_second", w["tokens_per_s"], worker=w["name"], role=w["role"]) for w in workers])
    metric("hsd_worker_idle_ratio", "gauge", "Share of its time a worker spent waiting.",
           [_line("hsd_worker_idle_ratio", w["idle_ratio"], worker=w["name"], role=w["role"]) for w in workers])
    metric("hsd_worker_heartbeat_age_seconds", "gauge", "Seconds since a worker was last heard from.",
           [_line("hsd_worker_heartbeat_age_seconds", w["heartbeat_age_s"], worker=w["name"], role=w["role"])
            for w in workers])
    metric("hsd_workers", "gauge", "Workers by role and state.",
           [_line("hsd_workers", sum(1 for w in workers if w["role"] == role and w["state"] == state),
                  role=role, state=state)
            for role in ("target", "drafter") for state in ("busy", "idle", "starved", "blocked")])
    metric("hsd_errors_total", "counter", "Error replies by code.",
           [_line("hsd_errors_total", n, code=code) for code, n in s["errors"].items()])
    metric("hsd_given_back_total", "counter", "Jobs given back by reason.",
           [_line("hsd_given_back_total", n, reason=reason) for reason, n in s["given_back"].items()])
    return "\n".join(out) + "\n"


class MetricsServer:
    def __init__(self, host: str, port: int):
        self._text = b"# no snapshot yet\n"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = server._text
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def update(self, snapshot: dict[str, Any]) -> None:
        self._text = render_prometheus(snapshot).encode()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
