"""target_worker/sim.py: the sim target's cost grows with the bucket length (attention), not only the tokens."""

import pytest

from common.run.config import load_config
from target_worker.sim import SimTarget
from worker_jobs import held_job


def test_sim_costs_follow_length_and_sequence_count():
    config = load_config(None, ["target.sim_cost_per_token=1e-5", "target.sim_cost_attention=2e-8"])
    target = SimTarget(config.target)
    long_job = held_job(num_tokens=8000, samples=[0, 1], lengths=[4000, 4000], seq_len=4096)
    short_job = held_job(num_tokens=8000, samples=range(64), lengths=[125] * 64, seq_len=128)
    assert target.cost_s(long_job) == pytest.approx(8000 * 1e-5 + 2 * 4096 ** 2 * 2e-8)
    assert target.cost_s(long_job) > 5 * target.cost_s(short_job)
