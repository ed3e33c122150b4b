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

The host reads the device once per optimizer step (:class:`drafter_worker.recipe.AccumulatingTrainer`
reads the step's figures at its end). ``micro_batch`` draws its anchors on the device, keeps every
shape fixed (no selection by a mask, whose size would have to be read) and adds its loss, weight and
accuracy counts to tensors on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from drafter_worker.dflash.anchors import check_anchors, block_labels, sample_anchors
from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.loss import position_weights, weighted_ce_chunked
from drafter_worker.dflash.model import DFlashDraftModel, build_drafter
from drafter_worker.recipe import AccumulatingTrainer, resolve_dtype
from drafter_worker.recipe import StepStats, warmup_cosine  # noqa: F401  (re-exported: callers import them from here)


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
        # Anchors are drawn on the device from a generator of the trainer's own: checkpointed, and
        # independent of whatever else uses the global RNG in the process.
        self.anchor_generator = torch.Generator(device=self.device).manual_seed(seed)
        # On the device once: a blocking copy of it into every micro-batch would wait for the queued work.
        self.weights_K = position_weights(self.model_config.block_size, self.model_config.gamma).to(self.device)
        self.step = 0
        self._reset_accumulators()

    @property
    def num_positions(self) -> int:
        return self.model_config.block_size

    def micro_batch(self, hs, input_ids, loss_mask, seq_lens, *, anchors=None) -> MicroStats:
        """Forward + backward of one micro-batch; gradients and the step's figures accumulate on the device.

        ``hs [B, S, K*H]`` (padded to S), ``input_ids``/``loss_mask [B, S]``, ``seq_lens [B]``;
        ``anchors [B, N]`` (``-1`` = unused) pins the blocks instead of drawing them (checked on the host).
        """
        num_fused = self.model_config.num_context_layers * self.model_config.target.hidden_size
        hs, input_ids, loss_mask, seq_lens = self._batch_on_device(hs, input_ids, loss_mask, seq_lens, width=num_fused,
                                                                   width_is="K*H")
        device = self.device
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
        self._accumulate(weighted_sum, result.weight_total, result.correct_K, result.count_K)
        return MicroStats(weighted_sum=weighted_sum, weight=result.weight_total, num_blocks=(anchors >= 0).sum(),
                          num_positions=result.count_K.sum(), num_tokens=seq_lens.sum(),
                          correct_K=result.correct_K, count_K=result.count_K)

    def state_dict(self) -> dict:
        """Model (draft tensors only) + optimizer + scheduler + step + the anchor RNG."""
        return {**self._state(block_size=self.model_config.block_size,
                              target_layer_ids=list(self.model_config.target_layer_ids)),
                "anchor_rng": self.anchor_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._load_state(state, block_size=self.model_config.block_size,
                         target_layer_ids=list(self.model_config.target_layer_ids))
        self.anchor_generator.set_state(state["anchor_rng"])
