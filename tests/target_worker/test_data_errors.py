"""A target that meets a data error (a sample other than scheduled) reports the job failed and
stops at once with the error, which `hsd target` turns into the unusable exit code: every later job
would read the same data, so neither the loop nor `hsd launch` tries again."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from common.run.prepared import DataError
from common.wire.client import run_id_for
from loop_harness import FakeDispatcher, make_job, worker_config
from target_worker.hf_backend import pad_job
from target_worker.loop import TargetLoop
from target_worker.sim import SimTarget


class InMemory:
    def __init__(self, lengths):
        self.samples = [(np.ones(n, dtype=np.uint32), np.ones(n, dtype=np.uint8)) for n in lengths]

    def sample(self, index):
        if not 0 <= index < len(self.samples):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self.samples)} samples")
        return self.samples[index]


def test_pad_job_names_a_sample_the_dataset_does_not_hold_as_scheduled():
    job = make_job(7, slot=0, generation=1, lengths=(16, 12))
    with pytest.raises(DataError, match="job 7: sample 1 has 11 tokens .* the schedule says 12"):
        pad_job(job, InMemory([16, 11]), tokens_per_batch=64)
    with pytest.raises(DataError, match="job 7: sample 1 out of range for a dataset of 1 samples"):
        pad_job(job, InMemory([16]), tokens_per_batch=64)


def test_pad_job_pins_the_token_inputs_only_when_asked():
    job = make_job(7, slot=0, generation=1, lengths=(16, 12))
    batch = pad_job(job, InMemory([16, 12]), tokens_per_batch=64)
    assert not batch.input_ids.is_pinned() and not batch.attention_mask.is_pinned()
    assert batch.input_ids[1, :12].tolist() == [1] * 12 and batch.input_ids[1, 12:].tolist() == [0] * 4
    if torch.cuda.is_available():  # a GPU target's H2D copies of the ids and mask run from page-locked memory
        pinned = pad_job(job, InMemory([16, 12]), tokens_per_batch=64, pin=True)
        assert pinned.input_ids.is_pinned() and pinned.attention_mask.is_pinned()
        assert torch.equal(pinned.input_ids, batch.input_ids)


class ReadsTheDataset(SimTarget):
    def __init__(self, config, dataset):
        super().__init__(config)
        self.dataset, self.extracted = dataset, []

    def extract(self, job, slot):
        self.extracted.append(job.job_id)
        pad_job(job, self.dataset, tokens_per_batch=64)
        return super().extract(job, slot)


def test_a_data_error_stops_the_target_after_reporting_the_job(tmp_path):
    fake = FakeDispatcher(f"ipc://{tmp_path / 'control.sock'}", run_id_for(tmp_path / "run"))
    try:
        for job_id in (1, 2, 3):
            fake.add_job(make_job(job_id, slot=job_id - 1, generation=1))
        config = worker_config(tmp_path / "run", fake.endpoint)
        backend = ReadsTheDataset(config.target, InMemory([16, 11]))
        loop = TargetLoop.from_config(config, "target-0", backend)
        loop.poll_ms = 100
        raised: list[BaseException] = []
        thread = threading.Thread(target=lambda: raised.extend(_run(loop)), daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], DataError)  # at once: not after 3 failures in a row
        assert backend.extracted == [1]
        assert [e.request.job_id for e in fake.ops("job_failed")] == [1]
        assert "sample 1 has 11 tokens" in fake.ops("job_failed")[0].request.reason
    finally:
        fake.close()


def _run(loop) -> list[BaseException]:
    try:
        loop.run()
    except BaseException as exc:  # noqa: BLE001 - the test reads what ended the loop
        return [exc]
    return []
