"""What every drafter trainer shares: the optimizer and learning-rate recipe, the compute dtype and
the figures of an applied step.

Both drafters (DFlash, EAGLE-3) train a few float32 master tensors beside the target's frozen
embedding and LM head, with AdamW under a linear-warmup cosine schedule; their config sections
declare the same recipe keys (:class:`common.run.config.TrainingRecipe`), checked here once.

A step reads the device once: the sums of its micro-batches (weight total, weighted loss, top-1 hits
and counts) are tensors on the trainer's device, the gradients are divided and clipped as tensors,
and :meth:`AccumulatingTrainer.apply_step` reads the step's figures in one transfer at its end (for
the log line and the commit). On a GPU every read waits for all queued work.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from common.run.config import ConfigError, TrainingRecipe


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
    """The recipe values a training run needs, checked before a model is built; ``section`` names the keys.
    (The section's choices, such as ``dtype``, it checked itself when it was built.)"""
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


def resolve_dtype(recipe: TrainingRecipe, device: torch.device) -> torch.dtype:
    if recipe.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, recipe.dtype)


def build_optimizer(params: list[torch.nn.Parameter], recipe: TrainingRecipe):
    """(AdamW, its warmup-cosine LambdaLR) over ``params``. Fused: one kernel for all tensors, its
    step counts on the device (the unfused versions read each one on the host)."""
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=tuple(recipe.betas), weight_decay=recipe.weight_decay,
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(recipe.total_steps, recipe.warmup_ratio, recipe.min_lr_ratio))
    return optimizer, scheduler


def scale_gradients(params: list[torch.nn.Parameter], total_weight: torch.Tensor) -> None:
    """Divide accumulated gradients by the step's total weight (all ranks summed), a tensor: nothing is read.
    A total of 0 means nothing was supervised: the gradients are zero (or None), and stay so divided by 1."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, torch.where(total_weight > 0, total_weight, 1.0))


class AccumulatingTrainer:
    """The step bookkeeping every drafter trainer shares: unnormalised sums over the micro-batches of
    a step (weight total, weighted loss, top-1 hits and counts per drafted position), the sums a
    data-parallel group adds up, and the step that divides by the total before clipping. The sums
    are float64 tensors on the trainer's device (the counts are integers, exact in float64).

    A subclass sets ``params``, ``config`` (a :class:`TrainingRecipe`), ``device``,
    ``compute_dtype`` and ``step``, and names ``num_positions`` (the length of the per-position
    counts) and ``first_reported`` (the first position the accuracy reports).

    The optimizer and its schedule (:func:`build_optimizer` over ``params``) are built on first
    use: creating a ``torch.optim`` optimizer imports ``torch._dynamo``, seconds of a drafter's
    start that it then spends after registering, not before. A state loaded before that (a
    checkpoint a restarted rank resumes) keeps their part until they are built.
    """

    num_positions: int
    first_reported = 0
    _optimizer: torch.optim.Optimizer | None = None
    _scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    _loaded: tuple[dict, dict] | None = None  # (optimizer, scheduler) state loaded before they were built

    def _batch_on_device(self, hs, input_ids, loss_mask, seq_lens, *, width: int, width_is: str):
        """A micro-batch checked (``hs [B, S, width]`` against ``input_ids [B, S]``; ``width_is`` says
        what the width is made of) and moved to the trainer's device: hs as it is, the token ids and
        lengths as int64, the loss mask as bool."""
        if hs.dim() != 3 or hs.shape[-1] != width or hs.shape[:2] != input_ids.shape:
            raise ValueError(f"hidden states {tuple(hs.shape)} do not match input_ids {tuple(input_ids.shape)} "
                             f"and {width_is} = {width}")
        device = self.device
        return (hs.to(device, non_blocking=True), input_ids.to(device, non_blocking=True).long(),
                loss_mask.to(device, non_blocking=True).bool(), seq_lens.to(device, non_blocking=True).long())

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer, self._scheduler = build_optimizer(self.params, self.config)
            if self._loaded is not None:
                optimizer_state, scheduler_state = self._loaded
                self._loaded = None
                self._optimizer.load_state_dict(optimizer_state)
                self._scheduler.load_state_dict(scheduler_state)
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        self.optimizer
        return self._scheduler

    def _reset_accumulators(self) -> None:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float64, device=self.device)
        self._weighted_sum, self._weight_total = zeros(), zeros()
        self._correct, self._count = zeros(self.num_positions), zeros(self.num_positions)
        self._num_micro_batches = 0

    def _accumulate(self, weighted_sum: torch.Tensor, weight_total: torch.Tensor, correct: torch.Tensor,
                    count: torch.Tensor) -> None:
        """Add one micro-batch's sums (tensors on the device: nothing is read)."""
        self._weighted_sum = self._weighted_sum + weighted_sum.double()
        self._weight_total = self._weight_total + weight_total
        self._correct = self._correct + correct
        self._count = self._count + count
        self._num_micro_batches += 1

    @property
    def local_weight_total(self) -> float:
        """Total weight of this rank's micro-batches since the last step (a host read)."""
        return float(self._weight_total)

    def step_sums(self) -> torch.Tensor:
        """What a data-parallel group sums besides the gradients, float64 on the trainer's device:
        ``[weight total, weighted loss sum, top-1 hits per position..., counts per position...]``
        of this rank's micro-batches since the last step."""
        return torch.cat([self._weight_total.view(1), self._weighted_sum.view(1), self._correct, self._count])

    def adopt_group_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Take :meth:`step_sums` summed over the group as this step's own: the gradients are divided
        by the group's weight, and the step's loss and accuracy are the group's, not this rank's
        share of them. Returns the group's weight total (a tensor on the device: nothing is read)."""
        n = self.num_positions
        if sums.numel() != 2 + 2 * n:
            raise ValueError(f"group sums of {sums.numel()} values, expected {2 + 2 * n}")
        sums = sums.detach().to(self.device, torch.float64)
        self._weight_total, self._weighted_sum = sums[0], sums[1]
        self._correct, self._count = sums[2:2 + n], sums[2 + n:]
        return self._weight_total

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def scale_gradients(self, total_weight: torch.Tensor) -> None:
        """Divide the accumulated gradients by the step's total weight (all ranks summed)."""
        scale_gradients(self.params, total_weight)

    def apply_step(self, *, total_weight: float | torch.Tensor | None = None, num_jobs: int = 1) -> StepStats:
        """Scale, clip, optimizer and ``num_jobs`` scheduler steps (the schedule counts jobs trained, so a
        group's world size cannot shift it), zero the gradients; ``step += 1``.

        ``total_weight`` defaults to this trainer's own total; a data-parallel group passes the sum
        over its ranks. The step's figures are read to the host here, once; a step with nothing
        supervised changes no weight.
        """
        total = self._weight_total if total_weight is None else torch.as_tensor(
            total_weight, dtype=torch.float64, device=self.device)
        self.scale_gradients(total)
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        # A tensor (the foreach kernels where the device has them); checking it for inf/nan would read it.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip, error_if_nonfinite=False)
        lr = self.optimizer.param_groups[0]["lr"]
        first = self.first_reported
        figures = torch.cat([total.view(1), self._weighted_sum.view(1),
                             grad_norm.to(self.device, torch.float64).view(1), self._correct[first:], self._count[first:]])
        weight, weighted_sum, grad_norm, *counts = figures.tolist()  # the step's one read
        if weight <= 0:  # nothing supervised: no update at all (zero gradients would still decay the weights)
            self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.step()
        for _ in range(num_jobs):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        num_reported = self.num_positions - first
        correct, count = counts[:num_reported], counts[num_reported:]
        stats = StepStats(step=self.step, loss=weighted_sum / weight if weight > 0 else math.nan,
                          grad_norm=grad_norm, lr=lr, weight=weight, num_micro_batches=self._num_micro_batches,
                          accuracy=[c / max(n, 1.0) for c, n in zip(correct, count)])
        self._reset_accumulators()
        return stats

    def drop_step(self) -> None:
        """Forget the accumulated micro-batches (the dispatcher refused the step)."""
        for p in self.params:  # what the optimizer's zero_grad(set_to_none=True) does, without building it
            p.grad = None
        self._reset_accumulators()

    # -- training state (a subclass names what must match for a state to load: ``shape_keys``) ----
    def _state(self, **shape_keys) -> dict:
        """Draft tensors, optimizer, scheduler and step, plus the settings a reload must match. The
        tensors are the live ones, as the optimizer's state is: a caller that keeps them past the next
        step copies them (a checkpoint's host copies: :class:`common.dataplane.host_staging.HostStaging`), and
        no clone of the weights takes their size again on the device first."""
        return {"model": {k: v.detach() for k, v in self.model.draft_state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, **shape_keys}

    def _load_state(self, state: dict, **shape_keys) -> None:
        """The inverse of :meth:`_state`; a state saved for other ``shape_keys`` is refused."""
        names = tuple(shape_keys)
        mine = tuple(shape_keys[n] for n in names)
        theirs = tuple(state[n] for n in names)
        if mine != theirs:
            raise ValueError(f"training state was saved for ({', '.join(names)}) = {theirs}, this trainer has {mine}")
        self.model.load_draft_state_dict({k: v.to(self.device) for k, v in state["model"].items()})
        if self._optimizer is None:
            self._loaded = (state["optimizer"], state["scheduler"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.drop_step()
