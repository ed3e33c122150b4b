"""What every drafter trainer shares: the optimizer and learning-rate recipe, the compute dtype and
the figures of an applied step.

Both drafters (DFlash, EAGLE-3) train a few float32 master tensors beside the target's frozen
embedding and LM head, with AdamW under a linear-warmup cosine schedule; their config sections
declare the same recipe keys (:class:`common.config.TrainingRecipe`), checked here once.
"""

from __future__ import annotations

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


def clip_and_step(params: list[torch.nn.Parameter], optimizer, scheduler, grad_clip: float) -> tuple[float, float]:
    """Clip (0 = not), optimizer and scheduler step, zero the gradients; (grad norm before clipping, lr used)."""
    clip = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
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
