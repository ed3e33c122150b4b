"""One DFlash training step, split the way the drafter worker runs it: micro-batches first, then
the step is applied (once the dispatcher acknowledged the commit) or dropped (when it refused).

Gradient weighting: the loss of a step is the position-weighted CE summed over every supervised
position of all its micro-batches (of every data-parallel rank), divided by the total weight of
those positions. The total is known only at the end of the step, so ``micro_batch`` backpropagates
the *unnormalised* weighted sum and ``apply_step`` divides the gradients by the total before
clipping. A data-parallel group sums the gradients and :meth:`DFlashTrainer.step_sums` (weight total,
loss sum, accuracy counts) over its ranks and hands the sums back (:meth:`DFlashTrainer.adopt_group_sums`)
before :meth:`DFlashTrainer.apply_step`; then a long micro-batch and a short one weigh by their
supervised positions, not one each, and the step's loss and accuracy are the whole group's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter_worker.dflash.anchors import IGNORE, check_anchors, block_labels, sample_anchors
from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.loss import position_weights, weighted_ce_chunked
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter
from drafter_worker.recipe import AccumulatingTrainer, build_optimizer, resolve_dtype
from drafter_worker.recipe import StepStats, warmup_cosine  # noqa: F401  (re-exported: callers import them from here)


@dataclass
class MicroStats:
    loss: float            # weighted CE of this micro-batch alone (nan when nothing was supervised)
    weight: float          # total position weight of its supervised positions
    num_blocks: int        # anchors (blocks) drawn
    num_positions: int     # supervised block positions
    num_tokens: int        # real tokens of its sequences
    correct: list[int]     # top-1 hits per block position k (index 0 unused)
    count: list[int]       # supervised positions per block position k


def _resolve_attention(config: DFlashTrainConfig, device: torch.device) -> str:
    if config.attention != "auto":
        return config.attention
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flex" if device.type == "cuda" else "sdpa"


class DFlashTrainer(AccumulatingTrainer):
    first_reported = 1  # block position 0 is the anchor: never predicted

    def __init__(self, config: DFlashTrainConfig, *, target_dir: str, layer_ids: list[int], device, seed: int):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.compute_dtype = resolve_dtype(config, self.device)
        self.model_config = config.model_config(target_dir, layer_ids)
        # Trainable tensors stay float32 (master weights); the frozen shared ones take the compute dtype.
        self.model: DFlashDraftModel = build_drafter(self.model_config, target_dir, dtype=self.compute_dtype)
        self.model.init_weights(seed)
        self.model.to(self.device)
        self.model.attention = _resolve_attention(config, self.device)
        self.params = [p for _, p in self.model.draft_named_parameters()]
        self.optimizer, self.scheduler = build_optimizer(self.params, config)
        # Anchors are drawn on the CPU from a generator of the trainer's own: checkpointed, and
        # independent of whatever else uses the global RNG in the process.
        self.anchor_generator = torch.Generator().manual_seed(seed)
        self.weights_K = position_weights(self.model_config.block_size, self.model_config.gamma)
        self.step = 0
        self._reset_accumulators()

    @property
    def num_positions(self) -> int:
        return self.model_config.block_size

    def micro_batch(self, hs, input_ids, loss_mask, seq_lens, *, anchors=None) -> MicroStats:
        """Forward + backward of one micro-batch; gradients accumulate.

        ``hs [B, S, K*H]`` (padded to S), ``input_ids``/``loss_mask [B, S]``, ``seq_lens [B]``;
        ``anchors [B, N]`` (``-1`` = unused) pins the blocks instead of drawing them.
        """
        num_fused = self.model_config.num_context_layers * self.model_config.hidden_size
        if hs.dim() != 3 or hs.shape[-1] != num_fused or hs.shape[:2] != input_ids.shape:
            raise ValueError(f"hidden states {tuple(hs.shape)} do not match input_ids {tuple(input_ids.shape)} "
                             f"and K*H = {num_fused}")
        device = self.device
        hs, input_ids = hs.to(device, non_blocking=True), input_ids.to(device, non_blocking=True).long()
        loss_mask, seq_lens = loss_mask.to(device).bool(), seq_lens.to(device).long()
        if anchors is None:
            anchors = sample_anchors(loss_mask, seq_lens, num_anchors=self.model_config.num_anchors,
                                     generator=self.anchor_generator)
        else:
            anchors = torch.as_tensor(anchors, dtype=torch.long)
            check_anchors(anchors, loss_mask, seq_lens)
            anchors = anchors.to(device)
        labels = block_labels(input_ids, loss_mask, seq_lens, anchors, self.model_config.block_size)
        supervised = labels != IGNORE
        block_pos = torch.arange(labels.shape[-1], device=device).expand_as(labels)[supervised]
        with self._autocast():
            hidden = self.model(hs, input_ids, anchors)
            # Only supervised positions reach the LM head, in chunks: the vocabulary projection
            # dominates the memory of a step.
            result = weighted_ce_chunked(hidden[supervised], self.model.lm_head.weight, labels[supervised],
                                         block_pos, self.weights_K, chunk_size=self.config.loss_chunk_size)
        if result.weight_total > 0:
            result.weighted_sum.backward()
        self._weighted_sum += float(result.weighted_sum.detach())
        self._weight_total += result.weight_total
        self._num_micro_batches += 1
        self._correct += result.correct_K
        self._count += result.count_K
        return MicroStats(loss=result.loss, weight=result.weight_total,
                          num_blocks=int((anchors >= 0).sum()), num_positions=int(supervised.sum()),
                          num_tokens=int(seq_lens.sum()), correct=result.correct_K.tolist(),
                          count=result.count_K.tolist())

    def state_dict(self) -> dict:
        """Model (draft tensors only) + optimizer + scheduler + step + the anchor RNG."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.draft_state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "anchor_rng": self.anchor_generator.get_state(),
            "block_size": self.model_config.block_size,
            "target_layer_ids": list(self.model_config.target_layer_ids),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = (self.model_config.block_size, list(self.model_config.target_layer_ids))
        theirs = (state["block_size"], list(state["target_layer_ids"]))
        if mine != theirs:
            raise ValueError(f"training state was saved for (block_size, target_layer_ids) = {theirs}, "
                             f"this trainer has {mine}")
        self.model.load_draft_state_dict({k: v.to(self.device) for k, v in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.anchor_generator.set_state(state["anchor_rng"])
        self.drop_step()
