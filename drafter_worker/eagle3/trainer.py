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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from drafter_worker.eagle3.config import NUM_FUSED_LAYERS, Eagle3TrainConfig
from drafter_worker.eagle3.loss import soft_ce_chunked, step_weights, target_rows
from drafter_worker.eagle3.model import Eagle3DraftModel, build_drafter
from drafter_worker.eagle3.ttt import shift_left, step_targets, ttt_mask
from drafter_worker.recipe import AccumulatingTrainer, resolve_dtype


@dataclass
class MicroStats:
    loss: float            # weighted soft CE of this micro-batch alone (nan when nothing was supervised)
    weight: float          # total step weight of its supervised (step, position) pairs
    num_tokens: int        # real tokens of its sequences
    correct: list[int]     # top-1 hits per TTT step
    count: list[int]       # supervised positions per TTT step


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
        hidden_size = self.model_config.hidden_size
        width = (NUM_FUSED_LAYERS + 1) * hidden_size
        if hs.dim() != 3 or hs.shape[-1] != width or hs.shape[:2] != input_ids.shape:
            raise ValueError(f"hidden states {tuple(hs.shape)} do not match input_ids {tuple(input_ids.shape)} "
                             f"and (3 layers + final norm) x H = {width}")
        device = self.device
        hs, input_ids = hs.to(device, non_blocking=True), input_ids.to(device, non_blocking=True).long()
        loss_mask, seq_lens = loss_mask.to(device).bool(), seq_lens.to(device).long()
        batch, seq_len = input_ids.shape
        # Target position j is trained against when token j+1 is a response token (some step predicts it).
        needed = step_targets(input_ids, loss_mask, seq_lens, -1)[1]
        target = target_rows(hs[..., -hidden_size:], self.target_head, self.model.t2d, needed,
                             chunk_size=self.config.loss_chunk_size)
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        correct = torch.zeros_like(self._correct)
        count = torch.zeros_like(self._count)
        total = torch.zeros((), dtype=torch.float32, device=device)
        weight_total = 0.0
        with self._autocast():
            hidden = self.model.fuse(hs[..., :NUM_FUSED_LAYERS * hidden_size])
            cache: list = []
            for k, weight in enumerate(self.weights):
                tokens, supervised = step_targets(input_ids, loss_mask, seq_lens, k)
                rows = shift_left(target.row_of_BS, 1 + k, fill=-1)
                supervised &= shift_left(target.in_vocab_BS, 1 + k, fill=False)
                mask = ttt_mask(seq_len, k, device=device)
                hidden, normed = self.model.step(hidden, tokens, positions + k, cache, mask)
                step_sum, hits = soft_ce_chunked(normed[supervised], self.model.lm_head.weight,
                                                 target.probs_RV[rows[supervised]],
                                                 chunk_size=self.config.loss_chunk_size)
                num = int(supervised.sum())
                total = total + weight * step_sum
                weight_total += weight * num
                correct[k], count[k] = hits, num
        if weight_total > 0:
            total.backward()
        self._weighted_sum += float(total.detach())
        self._weight_total += weight_total
        self._num_micro_batches += 1
        self._correct += correct
        self._count += count
        return MicroStats(loss=float(total.detach()) / weight_total if weight_total else math.nan,
                          weight=weight_total, num_tokens=int(seq_lens.sum()), correct=correct.tolist(),
                          count=count.tolist())

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
