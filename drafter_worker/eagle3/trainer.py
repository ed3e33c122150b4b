"""One EAGLE-3 training step, split the way the drafter worker runs it (as DFlash's): micro-batches
accumulate unnormalised gradients, then the step is applied (after the commit) or dropped.

A micro-batch's captured rows are ``[B, S, 4 × H]``: the three fused target layers, then the
target's final-norm state, which the frozen target LM head (held here, on the drafter's device)
turns into the target's distribution. The training-time test then unrolls ``ttt_steps`` steps
(:mod:`drafter_worker.eagle3.ttt`); the loss is :mod:`drafter_worker.eagle3.loss`'s.

Gradient weighting: ``micro_batch`` backpropagates the step-weighted soft CE summed over its
supervised (step, position) pairs; ``apply_step`` divides the gradients by the step's total weight
(a data-parallel group's, once :meth:`Eagle3Trainer.adopt_group_sums` took the group's sums), so
one process accumulating micro-batches and a group splitting them train the same step.

A micro-batch reads nothing on the host (as DFlash's): the target's distribution is computed at
every position, each step's loss covers every position it could be trained against with the
unsupervised ones weighing 0, and the sums accumulate as tensors; the step's one read is in
:meth:`apply_step`. On GPUs the TTT attention is flex attention with a block mask cached per
length (:mod:`drafter_worker.eagle3.ttt_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from drafter_worker.eagle3.config import NUM_FUSED_LAYERS, Eagle3TrainConfig
from drafter_worker.eagle3.loss import soft_ce_chunked, step_weights, target_probs
from drafter_worker.eagle3.model import Eagle3DraftModel, build_drafter
from drafter_worker.eagle3.ttt import shift_left, step_targets
from drafter_worker.recipe import AccumulatingTrainer, resolve_dtype


@dataclass
class MicroStats:
    """One micro-batch's figures, tensors on the device (each property below is a host read)."""
    weighted_sum: torch.Tensor  # weighted soft CE of this micro-batch
    weight_sum: torch.Tensor    # total step weight of its supervised (step, position) pairs
    num_tokens: torch.Tensor    # real tokens of its sequences
    correct_K: torch.Tensor     # top-1 hits per TTT step
    count_K: torch.Tensor       # predicted positions per TTT step, out-of-draft-vocabulary ones included

    @property
    def loss(self) -> float:
        """Weighted soft CE of this micro-batch alone (nan when nothing was supervised)."""
        weight = float(self.weight_sum)
        return float(self.weighted_sum) / weight if weight > 0 else math.nan

    @property
    def weight(self) -> float:
        return float(self.weight_sum)

    @property
    def correct(self) -> list[int]:
        return [int(c) for c in self.correct_K.tolist()]

    @property
    def count(self) -> list[int]:
        return [int(c) for c in self.count_K.tolist()]


def _resolve_attention(device: torch.device) -> str:
    if device.type != "cuda":
        return "structured"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "structured"
    return "flex"


class Eagle3Trainer(AccumulatingTrainer):
    def __init__(self, config: Eagle3TrainConfig, *, target_dir: str, layer_ids: list[int], device, seed: int,
                 d2t: torch.Tensor, t2d: torch.Tensor):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.compute_dtype = resolve_dtype(config, self.device)
        self.model_config = config.model_config(target_dir, layer_ids)
        self.model: Eagle3DraftModel
        self.model, head = build_drafter(self.model_config, target_dir, d2t=d2t, t2d=t2d, dtype=self.compute_dtype)
        self.target_head = head.to(self.device)
        self.model.init_weights(seed)
        self.model.to(self.device)
        self.params = [p for _, p in self.model.draft_named_parameters()]
        self.weights = step_weights(self.model_config.ttt_steps, self.model_config.loss_decay)
        self.draft_ids = t2d.nonzero().squeeze(1).to(self.device)  # target ids of the draft tokens, read once
        self.model.attention = _resolve_attention(self.device)
        self.step = 0
        self._reset_accumulators()

    @property
    def num_positions(self) -> int:
        return self.model_config.ttt_steps

    def micro_batch(self, hs, input_ids, loss_mask, seq_lens) -> MicroStats:
        """Forward + backward of one micro-batch; gradients accumulate.

        ``hs [B, S, 4*H]`` (three layers, then the final-norm state; padded to S),
        ``input_ids``/``loss_mask [B, S]``, ``seq_lens [B]``.
        """
        hidden_size = self.model_config.target.hidden_size
        width = (NUM_FUSED_LAYERS + 1) * hidden_size
        hs, input_ids, loss_mask, seq_lens = self._batch_on_device(hs, input_ids, loss_mask, seq_lens, width=width,
                                                                   width_is="(3 layers + final norm) x H")
        device = self.device
        batch, seq_len = input_ids.shape
        target = target_probs(hs[..., -hidden_size:], self.target_head, self.draft_ids, self.model.t2d,
                              chunk_size=self.config.loss_chunk_size)
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        correct = torch.zeros_like(self._correct)
        count = torch.zeros_like(self._count)
        total = torch.zeros((), dtype=torch.float32, device=device)
        weight_total = torch.zeros((), dtype=torch.float64, device=device)
        with self._autocast():
            hidden = self.model.fuse(hs[..., :NUM_FUSED_LAYERS * hidden_size])
            cache: list = []
            for k, weight in enumerate(self.weights):
                tokens, predicted = step_targets(input_ids, loss_mask, seq_lens, k)
                # The loss trains where the target's choice is a draft token; the accuracy counts every
                # predicted position, as a served drafter is judged: out of its vocabulary is a miss.
                supervised = predicted & shift_left(target.in_vocab_BS, 1 + k, fill=False)
                hidden, normed = self.model.step(hidden, tokens, positions + k, cache, ttt=True)
                # Step k at position t is trained against the target at t + 1 + k: the positions that
                # have one (the last 1 + k have none, and are never predicted).
                span = seq_len - 1 - k
                if span <= 0:
                    continue
                step_sum, hits = soft_ce_chunked(normed[:, :span].flatten(0, 1), self.model.lm_head.weight,
                                                 target.probs_BSV[:, 1 + k:].flatten(0, 1),
                                                 supervised[:, :span].flatten(), chunk_size=self.config.loss_chunk_size)
                total = total + weight * step_sum
                weight_total = weight_total + weight * supervised.sum().double()  # float64, as the step's sums
                correct[k], count[k] = hits, predicted.sum()
        if total.requires_grad:  # a graph exists (zeros when nothing was supervised): no need to read it
            total.backward()
        weighted_sum = total.detach()
        self._accumulate(weighted_sum, weight_total, correct, count)
        return MicroStats(weighted_sum=weighted_sum, weight_sum=weight_total, num_tokens=seq_lens.sum(),
                          correct_K=correct, count_K=count)

    def state_dict(self) -> dict:
        """Model (draft tensors and vocabulary) + optimizer + scheduler + step."""
        return self._state(ttt_steps=self.model_config.ttt_steps,
                           target_layer_ids=list(self.model_config.target_layer_ids))

    def load_state_dict(self, state: dict) -> None:
        if not torch.equal(state["model"]["d2t"].cpu(), self.model.d2t.cpu()):
            raise ValueError("training state was saved with another draft vocabulary (d2t differs): "
                             "the dataset it was counted on changed")
        self._load_state(state, ttt_steps=self.model_config.ttt_steps,
                         target_layer_ids=list(self.model_config.target_layer_ids))
