"""``hsd bench transport --remote``: slot reads across nodes through NIXL beside a ZeroMQ copy.

Two processes stand for two nodes: an owner ("node a") holds a block of slots in its own shared
memory, registered with NIXL once, exactly as a target of a ``pool.transport=nixl`` run; a reader
("node b") reads whole used slots, cycling through the block:

- ``nixl``: :class:`common.dataplane.node_slots.NodeSlotReader` across nodes: three one-sided READs per slot
  (header, rows, generation again) into its registered staging slot; the owner's CPU is idle.
- ``zmq``: the same bytes asked for over a ZeroMQ REQ/REP pair and copied into a staging buffer:
  what a transport of our own over plain sockets would give, the owner's CPU sending every byte.

Both go over loopback TCP (``UCX_TLS=tcp,self`` unless UCX_TLS is set; ``tcp://127.0.0.1``), so on
one host the figures show the protocol cost of each path, not a network's. GB/s is 1e9 bytes/s,
over every read and at the median read.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import torch
import zmq

from common.dataplane.slot_pattern import fill_pattern, verify_pattern
from common.dataplane.slots import SlotLayout
from common.dataplane.transport_info import engine_missing

NUM_SLOTS = 4
SLOT_TOKENS, SLOT_LAYERS = 8192, 5


def _layout(slot_mb: float) -> SlotLayout:
    if not slot_mb > 0:
        raise ValueError(f"--slot-mb must be positive, got {slot_mb}")
    hidden = max(1, round(slot_mb * 2**20 / (SLOT_TOKENS * SLOT_LAYERS * 2)))
    return SlotLayout(tokens_per_batch=SLOT_TOKENS, num_layers=SLOT_LAYERS, hidden_size=hidden, dtype="bfloat16",
                      max_seqs=1)


def _owner(layout_dict: dict, run_id: str, port: int, to_parent: Any, stop: Any) -> None:
    from common.dataplane.node_slots import NodeSlotBlock
    torch.set_num_threads(1)
    layout = SlotLayout.from_dict(layout_dict)
    block = NodeSlotBlock(run_id, layout, NUM_SLOTS, "a")
    try:
        for slot in range(NUM_SLOTS):
            fill_pattern(block.slot(slot), job_id=slot, generation=1, bucket=SLOT_TOKENS, batch_size=1,
                         seq_len=SLOT_TOKENS, seq_lens=[SLOT_TOKENS])
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.bind(f"tcp://127.0.0.1:{port}")
        to_parent.put(block.export())
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                slot = int(rep.recv())
                rep.send(block.slot(slot).buffer.numpy(), copy=False)  # the whole slot, zero-copy send
        rep.close(linger=0)
        ctx.term()
    finally:
        block.close()


def _timed(read: Any, seconds: float, slot_bytes: int) -> dict[str, float]:
    for slot in range(NUM_SLOTS):  # warm-up: connections, registrations, first pages
        read(slot)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        read(len(times) % NUM_SLOTS)
        times.append(time.perf_counter() - t0)
    times.sort()
    total = sum(times)
    median = times[len(times) // 2]
    # The median read's rate too: on a busy host a few reads that lost the CPU drag the mean down.
    return {"gb_per_s": round(len(times) * slot_bytes / total / 1e9, 3),
            "gb_per_s_median": round(slot_bytes / median / 1e9, 3), "reads": len(times),
            "p50_ms": round(times[len(times) // 2] * 1e3, 3), "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 3)}


def measure_remote(*, slot_mb: float, seconds: float) -> dict[str, Any]:
    import multiprocessing
    from common.dataplane.node_slots import NodeSlotReader
    missing = engine_missing()
    if missing:
        raise RuntimeError(missing)
    os.environ.setdefault("UCX_TLS", "tcp,self")
    layout = _layout(slot_mb)
    ctx = multiprocessing.get_context("spawn")
    to_parent, stop = ctx.Queue(), ctx.Event()
    with zmq.Context() as zctx:
        probe = zctx.socket(zmq.REQ)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.unbind(probe.last_endpoint)
        probe.close(linger=0)
    owner = ctx.Process(target=_owner, args=(layout.to_dict(), uuid.uuid4().hex[:12], port, to_parent, stop),
                        name="hsd-bench-remote-owner")
    owner.start()
    reader = NodeSlotReader(layout, "b", torch.device("cpu"))
    zsock = None
    try:
        export = to_parent.get(timeout=120)
        staging = torch.empty(layout.slot_bytes, dtype=torch.uint8)
        batch = reader.start_read(export, 0, 1, owner="a").wait()
        verify_pattern(batch.hs, batch.input_ids, batch.loss_mask, batch.seq_lens, job_id=0)
        figures: dict[str, Any] = {"slot_bytes": layout.slot_bytes, "ucx_tls": os.environ["UCX_TLS"]}
        figures["nixl"] = _timed(lambda slot: reader.start_read(export, slot, 1, owner="a").wait(), seconds, layout.slot_bytes)
        zctx = zmq.Context.instance()
        zsock = zctx.socket(zmq.REQ)
        zsock.connect(f"tcp://127.0.0.1:{port}")

        def zmq_read(slot: int) -> None:
            zsock.send(str(slot).encode())
            frame = zsock.recv(copy=False)
            staging.copy_(torch.frombuffer(frame.buffer, dtype=torch.uint8))

        figures["zmq"] = _timed(zmq_read, seconds, layout.slot_bytes)
        figures["nixl_vs_zmq"] = round(figures["nixl"]["gb_per_s"] / max(figures["zmq"]["gb_per_s"], 1e-9), 2)
        return figures
    finally:
        if zsock is not None:
            zsock.close(linger=0)
        reader.close()
        stop.set()
        owner.join(30)
        if owner.is_alive():
            owner.kill()
            owner.join(10)


def run_remote_bench(*, slot_mb: float, seconds: float, as_json: bool) -> int:
    try:
        figures = measure_remote(slot_mb=slot_mb, seconds=seconds)
    except (RuntimeError, ValueError) as exc:
        print(f"hsd bench transport --remote: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(figures))
        return 0
    print(f"slot {figures['slot_bytes'] / 2**20:.1f} MiB across two processes over loopback TCP "
          f"(UCX_TLS={figures['ucx_tls']})")
    for path in ("nixl", "zmq"):
        f = figures[path]
        print(f"  {path:5s} {f['gb_per_s']:7.3f} GB/s ({f['gb_per_s_median']:.3f} at the median read)   p50 {f['p50_ms']:8.2f} ms   p99 {f['p99_ms']:8.2f} ms   "
              f"({f['reads']} reads)")
    print(f"  nixl / zmq: x{figures['nixl_vs_zmq']}")
    return 0
