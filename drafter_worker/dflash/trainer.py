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

The host reads the device once per optimizer step. ``micro_batch`` draws its anchors on the device,
keeps every shape fixed (no selection by a mask, whose size would have to be read) and adds its
loss, weight and accuracy counts to tensors on the device; ``apply_step`` divides and clips the
gradients with tensors as well, then reads the step's figures in one transfer (for the log line and
the commit) before the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from drafter_worker.dflash.anchors import check_anchors, block_labels, sample_anchors
from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.loss import position_weights, weighted_ce_chunked
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter


@dataclass
class MicroStats:
    """One micro-batch's figures, tensors on the trainer's device: nothing here is read back to the host
    unless a caller reads it (the training loop does not)."""
    weighted_sum: torch.Tensor   # sum of w_k * CE over its supervised positions
    weight: torch.Tensor         # total position weight of its supervised positions (float64)
    num_blocks: torch.Tensor     # anchors (blocks) drawn
    num_positions: torch.Tensor  # supervised block positions
    num_tokens: torch.Tensor     # real tokens of its sequences
    correct_K: torch.Tensor      # top-1 hits per block position k (index 0 unused)
    count_K: torch.Tensor        # supervised positions per block position k

    @property
    def loss(self) -> float:
        """Weighted CE of this micro-batch alone (nan when nothing was supervised); a host read."""
        weight = float(self.weight)
        return float(self.weighted_sum) / weight if weight > 0 else math.nan


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
        # Fused: one kernel for all tensors, its step counts on the device (the unfused versions read
        # each one on the host).
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=tuple(config.betas),
                                           weight_decay=config.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(config.total_steps, config.warmup_ratio, config.min_lr_ratio))
        # Anchors are drawn on the device from a generator of the trainer's own: checkpointed, and
        # independent of whatever else uses the global RNG in the process.
        self.anchor_generator = torch.Generator(device=self.device).manual_seed(seed)
        # On the device once: a blocking copy of it into every micro-batch would wait for the queued work.
        self.weights_K = position_weights(self.model_config.block_size, self.model_config.gamma).to(self.device)
        self.step = 0
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float64, device=self.device)
        block = self.model_config.block_size
        self._weighted_sum, self._weight_total = zeros(), zeros()
        self._correct_K, self._count_K = zeros(block), zeros(block)  # integers, exact in float64
        self._num_micro_batches = 0

    @property
    def local_weight_total(self) -> float:
        """Total position weight of this rank's micro-batches since the last step (a host read)."""
        return float(self._weight_total)

    def step_sums(self) -> torch.Tensor:
        """What a data-parallel group sums besides the gradients, float64 on the trainer's device:
        ``[weight total, weighted CE sum, top-1 hits per block position..., counts per block position...]``
        of this rank's micro-batches since the last step."""
        return torch.cat([self._weight_total.view(1), self._weighted_sum.view(1), self._correct_K, self._count_K])

    def adopt_group_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Take :meth:`step_sums` summed over the group as this step's own: the gradients are divided
        by the group's weight, and the step's loss and accuracy are the group's, not this rank's
        share of them. Returns the group's weight total (a tensor on the device: nothing is read)."""
        block = self.model_config.block_size
        if sums.numel() != 2 + 2 * block:
            raise ValueError(f"group sums of {sums.numel()} values, expected {2 + 2 * block}")
        sums = sums.detach().to(self.device, torch.float64)
        self._weight_total, self._weighted_sum = sums[0], sums[1]
        self._correct_K, self._count_K = sums[2:2 + block], sums[2 + block:]
        return self._weight_total

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def micro_batch(self, hs, input_ids, loss_mask, seq_lens, *, anchors=None) -> MicroStats:
        """Forward + backward of one micro-batch; gradients and the step's figures accumulate on the device.

        ``hs [B, S, K*H]`` (padded to S), ``input_ids``/``loss_mask [B, S]``, ``seq_lens [B]``;
        ``anchors [B, N]`` (``-1`` = unused) pins the blocks instead of drawing them (checked on the host).
        """
        num_fused = self.model_config.num_context_layers * self.model_config.hidden_size
        if hs.dim() != 3 or hs.shape[-1] != num_fused or hs.shape[:2] != input_ids.shape:
            raise ValueError(f"hidden states {tuple(hs.shape)} do not match input_ids {tuple(input_ids.shape)} "
                             f"and K*H = {num_fused}")
        device = self.device
        hs, input_ids = hs.to(device, non_blocking=True), input_ids.to(device, non_blocking=True).long()
        loss_mask = loss_mask.to(device, non_blocking=True).bool()
        seq_lens = seq_lens.to(device, non_blocking=True).long()
        if anchors is None:
            anchors = sample_anchors(loss_mask, seq_lens, num_anchors=self.model_config.num_anchors,
                                     generator=self.anchor_generator)
        else:
            anchors = torch.as_tensor(anchors, dtype=torch.long)
            check_anchors(anchors, loss_mask, seq_lens)
            anchors = anchors.to(device)
        block = self.model_config.block_size
        labels = block_labels(input_ids, loss_mask, seq_lens, anchors, block)
        # Position 0 of a block is its anchor, never supervised; every other position goes to the
        # loss, weighing 0 where it is unsupervised: the shapes stay fixed, where selecting the
        # supervised positions would have to read how many there are.
        labels_P = labels[:, :, 1:].flatten()
        block_pos_P = torch.arange(1, block, device=device).repeat(anchors.numel())
        with self._autocast():
            hidden = self.model(hs, input_ids, anchors)
            # The LM head in chunks: the vocabulary projection dominates the memory of a step.
            result = weighted_ce_chunked(hidden[:, :, 1:].flatten(0, 2), self.model.lm_head.weight, labels_P,
                                         block_pos_P, self.weights_K, chunk_size=self.config.loss_chunk_size)
        result.weighted_sum.backward()  # all zeros when nothing was supervised, no need to ask
        weighted_sum = result.weighted_sum.detach()
        self._weighted_sum = self._weighted_sum + weighted_sum.double()
        self._weight_total = self._weight_total + result.weight_total
        self._correct_K = self._correct_K + result.correct_K
        self._count_K = self._count_K + result.count_K
        self._num_micro_batches += 1
        return MicroStats(weighted_sum=weighted_sum, weight=result.weight_total, num_blocks=(anchors >= 0).sum(),
                          num_positions=result.count_K.sum(), num_tokens=seq_lens.sum(),
                          correct_K=result.correct_K, count_K=result.count_K)

    def scale_gradients(self, total_weight: torch.Tensor) -> None:
        """Divide the accumulated gradients by the step's total position weight (all ranks summed)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:  # nothing supervised: the gradients are zero, and stay so divided by 1
            torch._foreach_div_(grads, torch.where(total_weight > 0, total_weight, 1.0))

    def apply_step(self, *, total_weight: float | torch.Tensor | None = None) -> StepStats:
        """Scale, clip, optimizer and scheduler step, zero the gradients; ``step += 1``.

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
        figures = torch.cat([total.view(1), self._weighted_sum.view(1),
                             grad_norm.to(self.device, torch.float64).view(1), self._correct_K[1:], self._count_K[1:]])
        weight, weighted_sum, grad_norm, *counts = figures.tolist()  # the step's one read
        if weight > 0:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        block = self.model_config.block_size
        correct, count = counts[:block - 1], counts[block - 1:]
        stats = StepStats(step=self.step, loss=weighted_sum / weight if weight > 0 else math.nan,
                          grad_norm=grad_norm, lr=lr, weight=weight, num_micro_batches=self._num_micro_batches,
                          accuracy=[c / max(n, 1.0) for c, n in zip(correct, count)])
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
