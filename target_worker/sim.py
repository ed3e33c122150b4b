"""A simulated target: the full protocol and data plane, with a modeled forward-pass cost.

It sleeps ``target.sim_cost_per_token`` seconds per token of the job plus, for attention,
``target.sim_cost_attention`` seconds per sequence per squared bucket length (a forward runs at the
bucket's fixed length L, and attention grows with L²: a batch of long sequences costs more than a
batch of short ones holding as many tokens). Then it fills its slot with a pattern derived from the
job id, which the sim drafter verifies: an end-to-end check of the control plane and the
hidden-state bytes before any real model is involved.
"""

from __future__ import annotations

import time

from common.run.config import TargetSection
from common.wire import messages
from common.dataplane.slot_pattern import fill_pattern
from common.dataplane.slots import SlotView


class SimTarget:
    contract = None
    device = None  # computes nothing: its slots live where the transport's kind says

    def __init__(self, target: TargetSection):
        self.cost_per_token = target.sim_cost_per_token
        self.cost_attention = target.sim_cost_attention

    def cost_s(self, job: messages.Job) -> float:
        return self.cost_per_token * job.num_tokens + self.cost_attention * len(job.samples) * job.seq_len ** 2

    def extract(self, job: messages.Job, slot: SlotView) -> None:
        time.sleep(self.cost_s(job))
        fill_pattern(slot, job_id=job.job_id, generation=job.generation, bucket=job.bucket,
                     batch_size=len(job.samples), seq_len=job.seq_len, seq_lens=job.lengths)
