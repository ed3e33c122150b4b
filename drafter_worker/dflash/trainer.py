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

import contextlib
import math
from dataclasses import dataclass, field

import torch

from drafter_worker.dflash.anchors import IGNORE, check_anchors, block_labels, sample_anchors
from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.loss import position_weights, weighted_ce_chunked
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter


@dataclass
class MicroStats:
    loss: float            # weighted CE of this micro-batch alone (nan when nothing was supervised)
    weight: float          # total position weight of its supervised positions
    num_blocks: int        # anchors (blocks) drawn
    num_positions: int     # supervised block positions
    num_tokens: int        # real tokens of its sequences
    correct: list[int]     # top-1 hits per block position k (index 0 unused)
    count: list[int]       # supervised positions per block position k


@dataclass
class StepStats:
    step: int              # steps applied, this one included
    loss: float            # the step's weighted CE (sum over its micro-batches / total weight)
    grad_norm: float       # global gradient norm before clipping
    lr: float              # learning rate this step was applied with
    weight: float          # total weight the gradients were divided by
    num_micro_batches: int
    accuracy: list[float] = field(default_factory=list)  # top-1 accuracy per block position 1..B-1


def warmup_cosine(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """LR factor of step s (0-based): linear warmup over ``ceil(ratio * total)`` steps, then cosine."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _resolve_dtype(config: DFlashTrainConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def _resolve_attention(config: DFlashTrainConfig, device: torch.device) -> str:
    if config.attention != "auto":
        return config.attention
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flex" if device.type == "cuda" else "sdpa"


class DFlashTrainer:
    def __init__(self, config: DFlashTrainConfig, *, target_dir: str, layer_ids: list[int], device, seed: int):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.compute_dtype = _resolve_dtype(config, self.device)
        self.model_config = config.model_config(target_dir, layer_ids)
        # Trainable tensors stay float32 (master weights); the frozen shared ones take the compute dtype.
        self.model: DFlashDraftModel = build_drafter(self.model_config, target_dir, dtype=self.compute_dtype)
        self.model.init_weights(seed)
        self.model.to(self.device)
        self.model.attention = _resolve_attention(config, self.device)
        self.params = [p for _, p in self.model.draft_named_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(config.total_steps, config.warmup_ratio, config.min_lr_ratio))
        # Anchors are drawn on the CPU from a generator of the trainer's own: checkpointed, and
        # independent of whatever else uses the global RNG in the process.
        self.anchor_generator = torch.Generator().manual_seed(seed)
        self.weights_K = position_weights(self.model_config.block_size, self.model_config.gamma)
        self.step = 0
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        self._weighted_sum = 0.0
        self._weight_total = 0.0
        self._num_micro_batches = 0
        block = self.model_config.block_size
        self._correct = torch.zeros(block, dtype=torch.long)
        self._count = torch.zeros(block, dtype=torch.long)

    @property
    def local_weight_total(self) -> float:
        """Total position weight of this rank's micro-batches since the last step (to all-reduce)."""
        return self._weight_total

    def step_sums(self) -> torch.Tensor:
        """What a data-parallel group sums besides the gradients, float64 on the trainer's device:
        ``[weight total, weighted CE sum, top-1 hits per block position..., counts per block position...]``
        of this rank's micro-batches since the last step."""
        local = torch.cat([torch.tensor([self._weight_total, self._weighted_sum], dtype=torch.float64),
                           self._correct.double(), self._count.double()])
        return local.to(self.device)

    def adopt_group_sums(self, sums: torch.Tensor) -> float:
        """Take :meth:`step_sums` summed over the group as this step's own: the gradients are divided
        by the group's weight, and the step's loss and accuracy are the group's, not this rank's
        share of them. Returns the group's weight total."""
        sums = sums.detach().to("cpu", torch.float64)
        block = self.model_config.block_size
        if sums.numel() != 2 + 2 * block:
            raise ValueError(f"group sums of {sums.numel()} values, expected {2 + 2 * block}")
        self._weight_total, self._weighted_sum = float(sums[0]), float(sums[1])
        self._correct = sums[2:2 + block].round().long()
        self._count = sums[2 + block:].round().long()
        return self._weight_total

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

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

    def scale_gradients(self, total_weight: float) -> None:
        """Divide the accumulated gradients by the step's total position weight (all ranks summed)."""
        if total_weight <= 0:
            return  # nothing was supervised: the gradients are zero already
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(total_weight)

    def apply_step(self, *, total_weight: float | None = None, num_jobs: int = 1) -> StepStats:
        """Scale, clip, optimizer and scheduler step, zero the gradients; ``step += 1``.

        ``total_weight`` defaults to this trainer's own total; a data-parallel group passes the sum
        over its ranks. The schedule advances by ``num_jobs``, the micro-batches the step trained
        (the drafter backend's schedule counts jobs, so a group's world size cannot shift it).
        """
        total = self._weight_total if total_weight is None else float(total_weight)
        self.scale_gradients(total)
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        for _ in range(num_jobs):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        count = self._count[1:].clamp(min=1)
        stats = StepStats(step=self.step, loss=self._weighted_sum / total if total > 0 else math.nan,
                          grad_norm=grad_norm, lr=lr, weight=total, num_micro_batches=self._num_micro_batches,
                          accuracy=(self._correct[1:] / count).tolist())
        self._reset_accumulators()
        return stats

    def drop_step(self) -> None:
        """Forget the accumulated micro-batches (the dispatcher refused the step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_accumulators()

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
