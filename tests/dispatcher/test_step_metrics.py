"""A drafter's step figures ride on commit_step (and checkpoint): kept per worker, shown by the stats
snapshot, journaled with the step they are of."""

from __future__ import annotations

import msgpack
import pytest

from common.wire import messages
from common.wire.messages import MAX_STEP_METRICS, ErrorCode, ProtocolError
from core_harness import make_core, register
from common.run.records.events import Checkpointed, StepCommitted
from common.run.records.journal import read_journal
from dispatcher.snapshot import build_snapshot
from ops.stats_view import step_metric_lines


def test_commit_metrics_show_in_the_snapshot(tmp_path):
    core = make_core(tmp_path, epochs=1, min_ready=1)
    (t,), (d,) = register(core, "target", 1), register(core, "drafter", 1)
    grant = core.get_job(t, 1.0)
    core.job_ready(t, grant.job.job_id, grant.job.generation, 0.0, 1.0)
    hs, _ = core.get_hs(d, 1.0)
    core.consumed(d, hs.job.job_id, 1.0)
    assert next(w for w in build_snapshot(core, 1.0).workers if w.id == d).metrics is None
    core.commit_step(d, [hs.job.job_id], 0.0, 1.0, model="m", step=1, metrics={"loss": 2.5, "acc1": 0.25})
    snapshot = build_snapshot(core, 2.0)
    assert next(w for w in snapshot.workers if w.id == d).metrics == {"loss": 2.5, "acc1": 0.25}
    assert step_metric_lines(snapshot.workers) == ["drafter0     last step: loss 2.5  acc1 0.25"]


def test_step_figures_are_journaled_with_their_step_and_replayed_past(tmp_path):
    """A commit's figures are the drafter's previous step's, named with it; a checkpoint's are its own
    step's (so the last step's reach the journal). A restart replays the records as before: the figures
    are a field it does not read."""
    core = make_core(tmp_path, epochs=1, min_ready=1)
    (t,), (d,) = register(core, "target", 1), register(core, "drafter", 1)
    for step in (1, 2):
        grant = core.get_job(t, 1.0)
        core.job_ready(t, grant.job.job_id, grant.job.generation, 0.0, 1.0)
        hs, _ = core.get_hs(d, 1.0)
        core.consumed(d, hs.job.job_id, 1.0)
        core.commit_step(d, [hs.job.job_id], 0.0, 1.0, model="m", step=step,
                         metrics={"step": 1, "loss": 2.5} if step == 2 else None)
    core.checkpoint(d, 2, 2.0, model="m", metrics={"step": 2.0, "loss": 2.25})
    assert next(w for w in build_snapshot(core, 2.0).workers if w.id == d).metrics == {"loss": 2.5}
    core.journal.close()
    core.close()
    records = list(read_journal(tmp_path, only=(StepCommitted, Checkpointed)))
    assert [(type(e), e.step, e.metrics) for e in records] == [
        (StepCommitted, 1, None), (StepCommitted, 2, {"step": 1, "loss": 2.5}),
        (Checkpointed, 2, {"step": 2, "loss": 2.25})]
    resumed = make_core(tmp_path, epochs=1, min_ready=1)
    assert resumed.ledger.model_step["m"] == 2 and resumed.checkpoints["m"] == 2


def test_metrics_field_is_checked():
    def step_metrics(value):  # as the dispatcher decodes a checkpoint report's
        return messages.decode_request(msgpack.packb({"v": messages.PROTOCOL_VERSION, "op": "checkpoint",
                                                      "model": "m", "step": 1, "metrics": value})).metrics
    assert step_metrics(None) is None
    assert step_metrics({"loss": 1, "lr": 1e-3}) == {"loss": 1.0, "lr": 1e-3}
    for bad in ([1.0], {"loss": "low"}, {"ok": True}, {f"m{i}": 0.0 for i in range(MAX_STEP_METRICS + 1)}):
        with pytest.raises(ProtocolError) as refused:
            step_metrics(bad)
        assert refused.value.code == ErrorCode.MALFORMED and "$.metrics" in refused.value.message
