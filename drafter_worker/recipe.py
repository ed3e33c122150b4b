"""What every drafter trainer shares: the optimizer and learning-rate recipe, the compute dtype and
the figures of an applied step.

Both drafters (DFlash, EAGLE-3) train a few float32 master tensors beside the target's frozen
embedding and LM head, with AdamW under a linear-warmup cosine schedule; their config sections
declare the same recipe keys (:class:`common.config.TrainingRecipe`), checked here once.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from common.config import ConfigError, TrainingRecipe


@dataclass
class StepStats:
    step: int              # steps applied, this one included
    loss: float            # the step's weighted loss (sum over its micro-batches / total weight)
    grad_norm: float       # global gradient norm before clipping
    lr: float              # learning rate this step was applied with
    weight: float          # total weight the gradients were divided by
    num_micro_batches: int
    accuracy: list[float] = field(default_factory=list)  # top-1 accuracy per drafted position


def warmup_cosine(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """LR factor of step s (0-based): linear warmup over ``ceil(ratio * total)`` steps, then cosine."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def validate_recipe(section: str, recipe: TrainingRecipe) -> None:
    """The recipe values a training run needs, checked before a model is built; ``section`` names the keys."""
    if recipe.total_steps <= 0:
        raise ConfigError(f"{section} total_steps must be positive (it sets the learning-rate schedule), "
                          f"got {recipe.total_steps}")
    if recipe.lr <= 0:
        raise ConfigError(f"{section} lr must be positive, got {recipe.lr}")
    if len(recipe.betas) != 2 or not all(0 <= b < 1 for b in recipe.betas):
        raise ConfigError(f"{section} betas must be two numbers in [0, 1), got {recipe.betas}")
    if not 0 <= recipe.warmup_ratio < 1:
        raise ConfigError(f"{section} warmup_ratio must be in [0, 1), got {recipe.warmup_ratio}")
    if not 0 <= recipe.min_lr_ratio <= 1:
        raise ConfigError(f"{section} min_lr_ratio must be in [0, 1], got {recipe.min_lr_ratio}")
    if recipe.loss_chunk_size <= 0:
        raise ConfigError(f"{section} loss_chunk_size must be positive, got {recipe.loss_chunk_size}")
    if recipe.grad_clip < 0:
        raise ConfigError(f"{section} grad_clip must not be negative, got {recipe.grad_clip}")
    if recipe.dtype not in ("auto", "bfloat16", "float32"):
        raise ConfigError(f"{section} dtype {recipe.dtype!r} is not one of auto, bfloat16, float32")


def resolve_dtype(recipe: TrainingRecipe, device: torch.device) -> torch.dtype:
    if recipe.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, recipe.dtype)


def build_optimizer(params: list[torch.nn.Parameter], recipe: TrainingRecipe):
    """(AdamW, its warmup-cosine LambdaLR) over ``params``."""
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=tuple(recipe.betas), weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(recipe.total_steps, recipe.warmup_ratio, recipe.min_lr_ratio))
    return optimizer, scheduler


def clip_and_step(params: list[torch.nn.Parameter], optimizer, scheduler, grad_clip: float, *,
                  num_jobs: int = 1) -> tuple[float, float]:
    """Clip (0 = not), optimizer step, ``num_jobs`` scheduler steps (the schedule counts jobs trained,
    so a group's world size cannot shift it), zero the gradients; (grad norm before clipping, lr used)."""
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    for _ in range(num_jobs):
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def scale_gradients(params: list[torch.nn.Parameter], total_weight: float) -> None:
    """Divide accumulated gradients by the step's total weight (all ranks summed); 0 = nothing supervised."""
    if total_weight <= 0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.div_(total_weight)


class AccumulatingTrainer:
    """The step bookkeeping every drafter trainer shares: unnormalised sums over the micro-batches of
    a step (weight total, weighted loss, top-1 hits and counts per drafted position), the sums a
    data-parallel group adds up, and the step that divides by the total before clipping.

    A subclass sets ``params``, ``optimizer``, ``scheduler``, ``config`` (a :class:`TrainingRecipe`),
    ``device``, ``compute_dtype`` and ``step``, and names ``num_positions`` (the length of the
    per-position counts) and ``first_reported`` (the first position the accuracy reports).
    """

    num_positions: int
    first_reported = 0

    def _reset_accumulators(self) -> None:
        self._weighted_sum = 0.0
        self._weight_total = 0.0
        self._num_micro_batches = 0
        self._correct = torch.zeros(self.num_positions, dtype=torch.long)
        self._count = torch.zeros(self.num_positions, dtype=torch.long)

    @property
    def local_weight_total(self) -> float:
        """Total weight of this rank's micro-batches since the last step (to all-reduce)."""
        return self._weight_total

    def step_sums(self) -> torch.Tensor:
        """What a data-parallel group sums besides the gradients, float64 on the trainer's device:
        ``[weight total, weighted loss sum, top-1 hits per position..., counts per position...]``
        of this rank's micro-batches since the last step."""
        local = torch.cat([torch.tensor([self._weight_total, self._weighted_sum], dtype=torch.float64),
                           self._correct.double(), self._count.double()])
        return local.to(self.device)

    def adopt_group_sums(self, sums: torch.Tensor) -> float:
        """Take :meth:`step_sums` summed over the group as this step's own: the gradients are divided
        by the group's weight, and the step's loss and accuracy are the group's, not this rank's
        share of them. Returns the group's weight total."""
        sums = sums.detach().to("cpu", torch.float64)
        n = self.num_positions
        if sums.numel() != 2 + 2 * n:
            raise ValueError(f"group sums of {sums.numel()} values, expected {2 + 2 * n}")
        self._weight_total, self._weighted_sum = float(sums[0]), float(sums[1])
        self._correct = sums[2:2 + n].round().long()
        self._count = sums[2 + n:].round().long()
        return self._weight_total

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def scale_gradients(self, total_weight: float) -> None:
        """Divide the accumulated gradients by the step's total weight (all ranks summed)."""
        scale_gradients(self.params, total_weight)

    def apply_step(self, *, total_weight: float | None = None, num_jobs: int = 1) -> StepStats:
        """Scale, clip, optimizer and scheduler step, zero the gradients; ``step += 1``.

        ``total_weight`` defaults to this trainer's own total; a data-parallel group passes the sum
        over its ranks. The schedule advances by ``num_jobs``, the micro-batches the step trained.
        """
        total = self._weight_total if total_weight is None else float(total_weight)
        self.scale_gradients(total)
        grad_norm, lr = clip_and_step(self.params, self.optimizer, self.scheduler, self.config.grad_clip,
                                      num_jobs=num_jobs)
        self.step += 1
        first = self.first_reported
        stats = StepStats(step=self.step, loss=self._weighted_sum / total if total > 0 else math.nan,
                          grad_norm=grad_norm, lr=lr, weight=total, num_micro_batches=self._num_micro_batches,
                          accuracy=(self._correct[first:] / self._count[first:].clamp(min=1)).tolist())
        self._reset_accumulators()
        return stats

    def drop_step(self) -> None:
        """Forget the accumulated micro-batches (the dispatcher refused the step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_accumulators()
