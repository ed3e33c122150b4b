"""Waiting for a collective without trusting it to end on its own.

Under gloo a collective whose peer died raises: the peer's socket closed, or gloo's own timeout
expired. Under NCCL it does not: the host only queues the kernel, which then spins on the GPU
waiting for the dead peer's data, and any host read queued behind it (``.tolist()``, a
synchronize) blocks until NCCL's watchdog gives up — whose default answer is to kill the
process. So every collective of a group is issued ``async_op=True`` and its host waits here:
:func:`wait_bounded` polls the work's completion against a deadline, and past it the caller
aborts the communicator (which ends the spinning kernel) instead of waiting any longer.

The poll starts at a few tens of microseconds and backs off to a millisecond: a step's gradient
buckets are summed one after another, and a coarse poll would leave the link idle between them.
"""

from __future__ import annotations

import time
import threading
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")

POLL_FIRST_S = 20e-6  # the first pause between two looks at the work
POLL_MAX_S = 1e-3  # the longest: what a completed collective may wait before the host sees it
WATCH_S = 0.05  # how often a wait looks at what the dispatcher said of its peers (a lock and a read)


class Work(Protocol):
    """What :func:`wait_bounded` needs of ``torch.distributed``'s ``Work``."""

    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


def wait_bounded(work: Work, *, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, watch: Callable[[], None] | None = None,
                 watch_s: float = WATCH_S) -> bool:
    """True once ``work`` completed, False when ``timeout_s`` passed first (the work may still be
    running: the caller aborts the communicator; it must not call ``work.wait()`` then, which on a
    GPU would make the compute stream wait for a kernel that never ends).

    ``watch()`` is called every ``watch_s`` while the work is not complete: it raises when waiting
    on is pointless (the dispatcher says a peer is gone, and one that is only stopped never closes
    its sockets: gloo would wait out the whole bound). What it raises ends the wait, the work
    still running, as a timeout does.

    A completed work is then waited on: that raises the collective's error if it failed (gloo's
    closed peer, NCCL's async error) and, on a GPU, orders the caller's stream after it."""
    deadline = clock() + timeout_s
    next_watch = clock() + watch_s
    pause = POLL_FIRST_S
    while not work.is_completed():
        now = clock()
        if now >= deadline:
            return False
        if watch is not None and now >= next_watch:
            watch()
            next_watch = now + watch_s
        sleep(min(pause, deadline - now))
        pause = min(2 * pause, POLL_MAX_S)
    work.wait()
    return True


def call_bounded(fn: Callable[[], T], *, bound_s: float, on_overrun: Callable[[], None]) -> T:
    """``fn()`` on this thread; should it not have returned within ``bound_s``, ``on_overrun()`` runs on
    a watchdog thread (for a call that cannot be interrupted, such as NCCL's communicator init blocked
    on a rank that died after it arrived: the caller's ``on_overrun`` ends the process, which its
    launcher restarts). A call that returns or raises in time leaves no trace."""
    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(bound_s):
            on_overrun()

    threading.Thread(target=watch, name="hsd-bounded-call", daemon=True).start()
    try:
        return fn()
    finally:
        finished.set()
