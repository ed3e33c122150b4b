"""The dispatcher's composition root: ``build_dispatcher(config)`` makes every part of a serving
dispatcher, each from its own config section, and hands them to the socket loop.

In order: the dataset checked whole (a bad one is refused naming its file) and the endpoints checked
before anything is created; then the run directory's lock, its resolved config and free space; the
data plane's slot memory, the journal, the pool and the core; the sockets, bound with their
authentication; the long polls, the durable-reply gate and the handlers; the state file other
commands find the dispatcher by. What it holds beyond the loop's own parts (the lock, the slot
memory, the files) is released, in reverse, when the loop closes, or at once if building fails.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import zmq

from common.run.config import Config, write_resolved
from common.run.records.lengths import load_lengths
from common.run.records.rundir import STATE_FILE, DispatcherState, check_free_space, write_state_file
from common.run.slot_layout import SlotLayout
from common.wire.client import run_id_for
from common.wire.curve import server_from_config
from dispatcher.allocator import pin_mmap_threshold
from dispatcher.auth import CurveAuth
from dispatcher.core import DispatcherCore
from dispatcher.core_types import CoreOptions
from dispatcher.handlers import ControlHandlers, RegisterTerms, StatsView
from dispatcher.journal import Journal
from dispatcher.liveness import ProcessWatch
from dispatcher.loop_cpu import LoopCpu
from dispatcher.long_polls import LongPolls
from dispatcher.metrics import MetricsServer
from dispatcher.pool import HSPool
from dispatcher.rundir import check_endpoint, lock_run_dir, warn_about_changed_settings
from dispatcher.server import DispatcherServer, DurableReplies, LoopOptions, send_reply
from dispatcher.transport_setup import DataPlane

log = logging.getLogger("hsd.dispatcher")

HARD_MESSAGE_LIMIT = 64 << 20  # beyond this ZeroMQ drops the peer instead of buffering the message


def serve_dispatcher(config: Config) -> int:
    """``hsd dispatcher``: build the dispatcher and serve until it stops; its exit code."""
    pin_mmap_threshold()
    return build_dispatcher(config).serve_forever()


def build_dispatcher(config: Config) -> DispatcherServer:
    run_dir = config.run_dir
    lengths = load_lengths(config.data, config.schedule, config.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    for endpoint in (config.control_endpoint, config.stats_endpoint):
        check_endpoint(endpoint, config.dispatcher.secret, curve=config.curve.enabled,
                       multi_node=config.pool.transport == "nixl")
    curve = server_from_config(config.curve)
    held = ExitStack()  # closed by the loop at its end, in reverse
    held.callback(lock_run_dir(run_dir).close)
    with ExitStack() as on_error:
        on_error.callback(held.close)
        check_free_space(run_dir, config.run.min_free_mb)
        warn_about_changed_settings(run_dir, config)
        write_resolved(config)
        run_id = run_id_for(run_dir)
        hostname = socket.gethostname()
        liveness = ProcessWatch(hostname)  # whether this host's workers' processes still run
        held.callback(liveness.close)
        data_plane = DataPlane.create(SlotLayout.from_config(config), config.pool, target=config.target,
                                      drafter=config.drafter, nodes=config.nodes, run_id=run_id)
        held.callback(data_plane.close)
        journal = Journal(run_dir, sync_in_background=True)
        on_error.callback(journal.close)
        pool = HSPool(min_ready=config.pool.min_ready, target_credits=config.pool.target_credits,
                      pull=config.pool.pull, seed=config.run.seed, num_buckets=len(config.schedule.buckets),
                      locality=config.nodes.locality, remote_after_s=config.nodes.remote_after_s)
        core = DispatcherCore(CoreOptions.from_config(config), run_dir=run_dir, lengths=lengths, journal=journal,
                              pool=pool, shared_slots=data_plane.shared_slots, now=time.monotonic())
        dispatcher = config.dispatcher
        context = zmq.Context()
        auth = CurveAuth(context, curve)
        control = bind_router(context, config.control_endpoint, max_bytes=dispatcher.max_message_bytes, auth=auth)
        stats = bind_router(context, config.stats_endpoint, max_bytes=dispatcher.max_message_bytes, auth=auth)
        auth.watch(control, stats)
        send = functools.partial(send_reply, control)
        replies = DurableReplies(journal, send)
        loop_cpu = LoopCpu()  # the socket loop's CPU by what it was spent on (hsd stats' loop_cpu_s)
        polls = LongPolls(core, send, loop_cpu=loop_cpu)
        terms = RegisterTerms.of(run_id, dispatcher=dispatcher, drafter=config.drafter, schedule=config.schedule,
                                 run=config.run)
        handlers = ControlHandlers(core, data_plane=data_plane, polls=polls, liveness=liveness, terms=terms,
                                   when_durable=replies.when_durable, run_dir=run_dir)
        stats_view = StatsView(core=core, data_plane=data_plane, polls=polls, auth=auth,
                               secret=bool(dispatcher.secret), run_dir=run_dir, run_id=run_id,
                               loop_cpu=loop_cpu)
        write_state_file(run_dir, DispatcherState(pid=os.getpid(), host=hostname, run_id=run_id,
                                                  control=config.control_endpoint, stats=config.stats_endpoint,
                                                  started=time.time()))
        held.callback((run_dir / STATE_FILE).unlink, missing_ok=True)
        for endpoint in (config.control_endpoint, config.stats_endpoint):
            if endpoint.startswith("ipc://"):
                held.callback(Path(endpoint[len("ipc://"):]).unlink, missing_ok=True)
        metrics = None
        if dispatcher.metrics_port:
            metrics = MetricsServer(dispatcher.metrics_host, dispatcher.metrics_port)
            held.callback(metrics.close)
            log.info("Prometheus metrics on http://%s:%d/metrics", dispatcher.metrics_host, metrics.port)
        server = DispatcherServer(
            core, options=LoopOptions.of(dispatcher, config.run), context=context, control=control, stats=stats,
            auth=auth, handlers=handlers, stats_view=stats_view, polls=polls, replies=replies, journal=journal,
            liveness=liveness, metrics=metrics, slot_bytes=data_plane.layout.slot_bytes, loop_cpu=loop_cpu,
            release=held.close)
        on_error.pop_all()
    _log_serving(config, run_id, data_plane, core)
    return server


def bind_router(context: zmq.Context, endpoint: str, *, max_bytes: int, auth: CurveAuth) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(HARD_MESSAGE_LIMIT, 4 * max_bytes))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    auth.secure(sock)
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)  # a stale socket file of a dead dispatcher
    sock.bind(endpoint)
    return sock


def _log_serving(config: Config, run_id: str, data_plane: DataPlane, core: DispatcherCore) -> None:
    log.info("serving %s (stats %s), run %s, %s", config.control_endpoint, config.stats_endpoint, run_id,
             data_plane.describe())
    if core.contract is not None:  # else the first worker that declares one sets it (logged then)
        log.info("capture contract of this run (from the target model's config.json): %s", core.contract.to_dict())
    needed = config.target.count * config.pool.target_credits + config.pool.min_ready
    if data_plane.kind == "shm" and config.pool.slots < needed:
        log.warning("pool.slots=%d < target.count x pool.target_credits + pool.min_ready = %d: targets will "
                    "often wait for a free slot; raise pool.slots if memory allows", config.pool.slots, needed)
