"""A collective's host wait is bounded: completed work is waited on (its error raised), work that
does not complete by the deadline is given up on without waiting on it, and a group whose
collective failed or timed out is aborted at once and can be opened again for the next version.

The fake work stands in for NCCL's only where no GPU exists: a kernel that spins for a dead peer is
a work whose ``is_completed`` stays false. tests/drafter_worker/test_group_abort.py kills a real
gloo peer inside the all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from drafter_worker.collective_wait import POLL_FIRST_S, POLL_MAX_S, wait_bounded
from drafter_worker.process_group import CollectiveFailed, NCCL_ENV, StepGroup, prepare_nccl_env


class FakeWork:
    def __init__(self, *, completes_after: int | None, error: Exception | None = None):
        self.completes_after, self.error = completes_after, error
        self.polls = 0
        self.waited = 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.completes_after is not None and self.polls > self.completes_after

    def wait(self):
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_completed_work_is_waited_on_once_and_the_poll_backs_off():
    clock, work = FakeClock(), FakeWork(completes_after=12)
    assert wait_bounded(work, timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert work.waited == 1 and work.polls == 13
    assert clock.pauses[0] == POLL_FIRST_S and max(clock.pauses) == POLL_MAX_S
    assert clock.pauses == sorted(clock.pauses)


def test_work_that_never_completes_is_given_up_at_the_deadline_and_never_waited_on():
    clock, work = FakeClock(), FakeWork(completes_after=None)
    assert not wait_bounded(work, timeout_s=2.0, clock=clock, sleep=clock.sleep)
    assert work.waited == 0  # on a GPU, wait() would make the compute stream wait for the spinning kernel
    assert clock.now == pytest.approx(102.0)  # not a poll past the deadline


def test_a_failed_collective_raises_its_error():
    clock, work = FakeClock(), FakeWork(completes_after=0, error=RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        wait_bounded(work, timeout_s=2.0, clock=clock, sleep=clock.sleep)


def _group(tmp_path, version: int, timeout_s: float = 5.0) -> StepGroup:
    return StepGroup(store=str(tmp_path / f"store-v{version}"), rank=0, world_size=1, version=version,
                     timeout_s=timeout_s, max_jobs=2)


def test_a_collective_that_does_not_complete_aborts_the_group_and_the_next_version_opens(tmp_path):
    group = _group(tmp_path, 1, timeout_s=0.2)
    try:
        with pytest.raises(CollectiveFailed, match="did not complete within 0.2s"):
            group._run("all_reduce", lambda *args, async_op: FakeWork(completes_after=None))
        assert group.broken and not dist.is_initialized()  # aborted at once, before the caller closes it
        group.close()
    finally:
        group.close()
    nxt = _group(tmp_path, 2)
    try:
        total = torch.tensor([2.0])
        nxt.all_reduce(total)
        assert total.item() == 2.0 and not nxt.broken
    finally:
        nxt.close()
    assert not dist.is_initialized()


def test_an_error_aborts_the_group(tmp_path):
    group = _group(tmp_path, 1)
    try:
        with pytest.raises(CollectiveFailed, match="broadcast of membership 1 failed: peer gone"):
            group._run("broadcast", lambda *args, async_op: FakeWork(completes_after=0,
                                                                     error=RuntimeError("peer gone")))
        assert group.broken and not dist.is_initialized()
    finally:
        group.close()


def test_the_nccl_watchdog_is_told_not_to_act(caplog):
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    prepare_nccl_env(environ)
    assert environ == NCCL_ENV and environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 overridden" in caplog.text


def test_a_group_that_fails_while_it_is_built_is_let_go_of(tmp_path, monkeypatch):
    """init_process_group registering the group, then failing (as an NCCL communicator that cannot
    connect at device_id's eager init would): the rank is left with no group, so the next opens."""
    init = dist.init_process_group

    def half_built(*args, **kwargs):
        init(*args, **kwargs)
        raise RuntimeError("NCCL error: remote process exited")
    monkeypatch.setattr(dist, "init_process_group", half_built)
    with pytest.raises(CollectiveFailed, match="rendezvous of membership 1 failed: NCCL error"):
        _group(tmp_path, 1)
    assert not dist.is_initialized()
    monkeypatch.setattr(dist, "init_process_group", init)
    _group(tmp_path, 2).close()


def test_a_bounded_call_in_time_leaves_no_trace_and_one_past_its_bound_runs_the_overrun():
    """NCCL's communicator init cannot be interrupted: past its bound the rank's overrun (an exit) runs
    beside it. Here the call waits on an event the overrun sets."""
    import threading

    from drafter_worker.collective_wait import call_bounded
    overran = threading.Event()
    assert call_bounded(lambda: 7, bound_s=0.05, on_overrun=overran.set) == 7
    with pytest.raises(ValueError, match="refused"):
        call_bounded(lambda: (_ for _ in ()).throw(ValueError("refused")), bound_s=0.05, on_overrun=overran.set)
    assert not overran.wait(0.2)  # neither call overran: no watchdog fired after it returned

    released = threading.Event()

    def hung_init() -> str:
        assert released.wait(10), "the overrun never ran"
        return "returned once the overrun let it"
    assert call_bounded(hung_init, bound_s=0.05, on_overrun=released.set) == "returned once the overrun let it"
