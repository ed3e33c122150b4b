"""The processes of ``hsd bench transport``: one producer and one consumer per hidden-state path.

Each public function is the entry point of one spawned process and takes ``(..., stop, results)``:
``stop`` is an Event the parent sets when the measurement is over, ``results`` a queue on which the
consumer puts its figures (and any process its traceback). Producers start from a preallocated,
pre-faulted source; consumers copy each item into a preallocated, pre-faulted destination of their
own (what a drafter does: copy out, release) and count the hidden-state bytes they received over
a steady-state window opened after a warm-up (:class:`Meter`). Every process uses one intra-op
thread: on a two-core host the processes must not fight over the cores.
"""

from __future__ import annotations

import logging
import math
import queue
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import msgspec
import torch
import zmq

from common.run.config import Config
from common.dataplane.slots import SlotHeader, SlotLayout, SlotView
from common.dataplane.transport import open_drafter_transport, open_target_transport
from common.run.descriptors import SlotExport, TransportInfo

POLL_MS = 100  # how long a producer's long-poll waits before it looks at ``stop`` again


@dataclass(frozen=True)
class BenchSpec:
    layout: SlotLayout
    seconds: float  # length of the measured window
    warmup_s: float  # time between the first item and the window

    @property
    def hs_shape(self) -> tuple[int, int]:
        return self.layout.tokens_per_batch, self.layout.row_width


class Meter:
    """Bytes delivered per second over a window that opens ``warmup_s`` after the first item."""

    MIN_ITEMS = 3

    def __init__(self, spec: BenchSpec):
        self.spec = spec
        self._first: float | None = None
        self._start: float | None = None
        self.start_ns = 0  # the window's opening, time.perf_counter_ns
        self._last = 0.0
        self.num_bytes = 0
        self.num_items = 0

    def add(self, num_bytes: int) -> bool:
        """Count one delivered item; True once the window is complete."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            return False
        if self._start is None:
            if now - self._first >= self.spec.warmup_s:
                self._start, self.start_ns = now, time.perf_counter_ns()
            return False
        self.num_bytes += num_bytes
        self.num_items += 1
        self._last = now
        return now - self._start >= self.spec.seconds and self.num_items >= self.MIN_ITEMS

    def result(self) -> dict[str, float]:
        assert self._start is not None and self.num_items > 0, "the window never opened"
        elapsed = self._last - self._start
        return {"gbps": self.num_bytes / elapsed / 1e9, "items": self.num_items, "elapsed_s": elapsed}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _init_process() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


@contextmanager
def _errors_to(results: Any) -> Iterator[None]:
    """A failing process tells the parent why, instead of leaving its peer waiting."""
    try:
        yield
    except BaseException:
        results.put({"error": traceback.format_exc()})
        raise


def _scratch_slot(layout: SlotLayout, device: torch.device | str = "cpu") -> SlotView:
    """A process-private, pre-faulted slot: the producer's source or the consumer's destination."""
    view = SlotView(torch.zeros(layout.slot_bytes, dtype=torch.uint8, device=device), layout)
    view.hs.fill_(0.5)
    return view


# -- plain copies -------------------------------------------------------------------------------
def copy_buffers(spec: BenchSpec, num_buffers: int, device: str = "cpu") -> list[torch.Tensor]:
    """Slot-sized buffers, each written once: the copies run between resident pages only."""
    return [torch.full(spec.hs_shape, 0.5, dtype=spec.layout.torch_dtype, device=device) for _ in range(num_buffers)]


def measure_copy(spec: BenchSpec, buffers: list[torch.Tensor]) -> float:
    """GB/s of copying ``buffers[i]`` into ``buffers[i + 1]`` round the ring (two buffers: src and dst)."""
    meter = Meter(spec)
    nbytes, cuda = buffers[0].nbytes, buffers[0].is_cuda
    # On a GPU, copies are queued and timed in batches of ~20 GB so the synchronize is amortized.
    batch = max(1, int(2e10 // nbytes)) if cuda else 1
    i = 0
    while True:
        for _ in range(batch):
            buffers[(i + 1) % len(buffers)].copy_(buffers[i % len(buffers)])
            i += 1
        if cuda:
            torch.cuda.synchronize(buffers[0].device)
        if meter.add(batch * nbytes):
            return meter.result()["gbps"]


def copy_until_stopped(spec: BenchSpec, stop: Any, results: Any) -> None:
    """The second copy on the memory bus: copies between two private buffers until stopped."""
    _init_process()
    with _errors_to(results):
        src, dst = copy_buffers(spec, 2)
        while not stop.is_set():
            dst.copy_(src)


def copy_measured(spec: BenchSpec, stop: Any, results: Any) -> None:
    """A plain memcpy measured while :func:`copy_until_stopped` runs in another process."""
    _init_process()
    with _errors_to(results):
        results.put({"gbps": measure_copy(spec, copy_buffers(spec, 2))})


# -- the dispatcher ------------------------------------------------------------------------------
def serve_dispatcher(config: Config) -> int:
    _init_process()
    from dispatcher.build import build_dispatcher
    return build_dispatcher(config).serve_forever()


# -- torch.multiprocessing Queue -----------------------------------------------------------------
def queue_producer(spec: BenchSpec, shared_alloc: bool, items: Any, drained: Any, stop: Any, results: Any) -> None:
    """Put a fresh tensor per item: a target produces new hidden states for every batch, and the
    consumer owns what it got, so the producer cannot recycle one buffer.

    Without ``shared_alloc`` the tensor is ordinary memory and put() first moves it into a new
    shared-memory segment (torch's own copy): how a producer usually calls it. With it, the tensor
    is allocated in shared memory up front and put() only sends its handle: the queue's best case.
    """
    _init_process()
    with _errors_to(results):
        src = torch.full(spec.hs_shape, 0.5, dtype=spec.layout.torch_dtype)
        while not stop.is_set():
            if shared_alloc:
                storage = torch.UntypedStorage._new_shared(src.nbytes)
                item = torch.empty(0, dtype=src.dtype).set_(storage, 0, src.shape).copy_(src)
            else:
                item = torch.empty_like(src).copy_(src)
            while not stop.is_set():
                try:
                    items.put(item, timeout=POLL_MS / 1000)
                    break
                except queue.Full:
                    continue
            del item
        # Items still queued name fds this process hands out on request: it may exit only once the
        # consumer has drained the queue up to the sentinel.
        items.put(None, timeout=30)
        items.close()
        items.join_thread()
        drained.wait(30)


def queue_consumer(spec: BenchSpec, items: Any, drained: Any, stop: Any, results: Any) -> None:
    _init_process()
    with _errors_to(results):
        dst = torch.zeros(spec.hs_shape, dtype=spec.layout.torch_dtype)
        meter = Meter(spec)
        while True:
            item = items.get(timeout=60)
            dst.copy_(item)
            del item
            if meter.add(dst.nbytes):
                break
        results.put(meter.result())
        while items.get(timeout=60) is not None:
            pass
        drained.set()


@contextmanager
def _socket(kind: int, endpoint: str, *, bind: bool, options: dict[int, int] | None = None) -> Iterator[zmq.Socket]:
    """One socket on a context of its own, its ``options`` set before it binds or connects, closed
    with its context."""
    context = zmq.Context()
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
        yield sock
    finally:
        sock.close(linger=0)
        context.term()


# -- ZeroMQ PUSH/PULL over ipc:// ----------------------------------------------------------------
ZMQ_HWM = 2  # messages queued per side: bounds memory to a few items


def zmq_producer(spec: BenchSpec, endpoint: str, stop: Any, results: Any) -> None:
    _init_process()
    with _errors_to(results):
        src = torch.full(spec.hs_shape, 0.5, dtype=spec.layout.torch_dtype)
        payload = src.view(torch.uint8).numpy()  # zero copy: zmq keeps a reference until sent
        with _socket(zmq.PUSH, endpoint, bind=False, options={zmq.SNDHWM: ZMQ_HWM, zmq.SNDTIMEO: POLL_MS}) as sock:
            while not stop.is_set():
                try:
                    sock.send(payload, copy=False)
                except zmq.Again:
                    continue


def zmq_consumer(spec: BenchSpec, endpoint: str, stop: Any, results: Any) -> None:
    _init_process()
    with _errors_to(results):
        dst = torch.zeros(spec.hs_shape, dtype=spec.layout.torch_dtype)
        meter = Meter(spec)
        with _socket(zmq.PULL, endpoint, bind=True, options={zmq.RCVHWM: ZMQ_HWM}) as sock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            while True:
                frame = sock.recv(copy=False)
                dst.view(-1).copy_(torch.frombuffer(frame.buffer, dtype=dst.dtype))
                del frame
                if meter.add(dst.nbytes):
                    break
        results.put(meter.result())


# -- slots handed over through a pipe: the data plane alone, no dispatcher ---------------------
class Exported(msgspec.Struct, tag=True):
    """The piped target's first message: its CUDA IPC block (None for shm)."""
    block: SlotExport | None


class Written(msgspec.Struct, tag=True):
    """A slot the piped target wrote and published at ``generation``."""
    slot: int
    generation: int


class Freed(msgspec.Struct, tag=True):
    """A slot the piped drafter has copied out: the target may write it again."""
    slot: int


_pipe_encoder = msgspec.msgpack.Encoder()
_pipe_decoder = msgspec.msgpack.Decoder(Exported | Written | Freed)


def _send(conn: Any, message: Exported | Written | Freed) -> None:
    conn.send_bytes(_pipe_encoder.encode(message))


def _recv(conn: Any, kind: type) -> Any:
    message = _pipe_decoder.decode(conn.recv_bytes())
    if not isinstance(message, kind):
        raise RuntimeError(f"expected {kind.__name__} on the bench pipe, got {type(message).__name__}")
    return message


def _open_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def piped_target(spec: BenchSpec, info: TransportInfo, device: str, conn: Any, stop: Any, results: Any) -> None:
    """Write slots of the transport ``info`` names as the consumer frees them, told over ``conn``.

    On ``conn`` the target sends :class:`Exported` once, then :class:`Written` per slot; the consumer
    answers :class:`Freed` when it has copied a slot out. What a pipe costs is all that stands in
    for the control plane: the paths' ceiling.
    """
    _init_process()
    with _errors_to(results):
        transport = open_target_transport(info, _open_device(device))
        src = _scratch_slot(spec.layout, transport.device)
        rows = spec.layout.tokens_per_batch
        _send(conn, Exported(block=transport.export()))
        free = list(range(transport.num_slots))
        generation = 0
        try:
            while not stop.is_set():
                while conn.poll(0 if free else POLL_MS / 1000):
                    free.append(_recv(conn, Freed).slot)
                if not free:
                    continue
                slot = free.pop(0)
                generation += 1
                view = transport.slot(slot)
                view.begin_write()
                view.hs.copy_(src.hs)
                header = SlotHeader(generation=generation, job_id=generation, bucket=0, batch_size=1,
                                    seq_len=rows, num_tokens=rows)
                transport.finish_write(slot, header)
                _send(conn, Written(slot=slot, generation=generation))
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # the consumer is done and gone
        finally:
            conn.close()
            transport.close()


def piped_drafter(spec: BenchSpec, info: TransportInfo, device: str, conn: Any, stop: Any, results: Any) -> None:
    _init_process()
    with _errors_to(results):
        export = _recv(conn, Exported).block
        transport = open_drafter_transport(info, _open_device(device))
        row_bytes = spec.layout.row_width * spec.layout.torch_dtype.itemsize
        meter = Meter(spec)
        try:
            while not stop.is_set():
                message = _recv(conn, Written)
                # read() copies (on a side stream on a GPU, synchronized): the bytes are here on return.
                batch = transport.read(message.slot, message.generation, ipc=export, owner="bench-target")
                rows = batch.header.num_rows
                del batch
                _send(conn, Freed(slot=message.slot))
                if meter.add(rows * row_bytes):
                    break
        finally:
            conn.close()
            transport.close()
        results.put(meter.result())


# -- the round trip's floor: a bare echo in place of the dispatcher -------------------------------
def zmq_echo(endpoint: str, reply: bytes, stop: Any, results: Any) -> None:
    """A ROUTER answering every request at once with ``reply``: no decode, no handler, no journal."""
    _init_process()
    with _errors_to(results), _socket(zmq.ROUTER, endpoint, bind=True) as sock:
        while not stop.is_set():
            if sock.poll(POLL_MS):
                identity, _ = sock.recv_multipart()
                sock.send_multipart([identity, reply])


def zmq_echo_client(endpoint: str, requests: tuple[bytes, ...], num_cycles: int, stop: Any, results: Any) -> None:
    """Time cycles of the ``requests`` (a drafter's get_hs carrying consumed, as the wire encodes it),
    each sent on a DEALER and its answer waited for on the caller's thread: what a round trip between
    two Python processes costs on this host, the floor under the dispatcher's cycle."""
    _init_process()
    with _errors_to(results):
        cycle_ms: list[float] = []
        num_warmup = max(20, num_cycles // 20)
        with _socket(zmq.DEALER, endpoint, bind=False) as sock:
            for i in range(num_warmup + num_cycles):
                started = time.perf_counter()
                for request in requests:
                    sock.send(request)
                    if not sock.poll(10_000):
                        raise RuntimeError("the echo did not answer within 10 s")
                    sock.recv()
                if i >= num_warmup:
                    cycle_ms.append(1e3 * (time.perf_counter() - started))
                if stop.is_set():
                    break
        results.put({"rtt_floor_p50_ms": percentile(cycle_ms, 50), "rtt_floor_p99_ms": percentile(cycle_ms, 99),
                     "rtt_floor_cycles": len(cycle_ms)})
