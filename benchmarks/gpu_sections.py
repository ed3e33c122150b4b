"""The sections of ``hsd bench gpu``: each measures one GPU path and returns its figures as a dict.

A section takes a :class:`CheckContext` (device, shapes, scratch directory, time left) and returns
plain JSON values. Most of them also run on the CPU at :data:`TINY` shapes, which is how their
logic is tested on machines without a GPU; the figures that need CUDA (pinned pages, overlap,
peak memory, MFU) are left out there. The processes sections (``launch``, ``nccl_group``) live
in :mod:`benchmarks.gpu_launch`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


class Skip(Exception):
    """A section that cannot run on this machine (e.g. it needs two GPUs): reported ``skipped``, not failed."""


@dataclass(frozen=True)
class Shapes:
    """Model and copy sizes of the check; the defaults are 8B-like (Qwen3-8B's layer shapes)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab: int = 151936
    dtype: str = "bfloat16"
    capture_layers: int = 4            # decoder layers of the random target (all captured but the first)
    tokens_per_batch: int = 8192
    buckets: tuple[int, ...] = (1024, 4096)
    dflash_target_layers: int = 36
    dflash_capture: int = 5
    dflash_draft_layers: int = 5       # about 1 B trainable parameters at hidden 4096
    dflash_seq_len: int = 4096
    dflash_batch_tokens: int = 16384
    dflash_anchors: int = 512
    dflash_accum: int = 2
    slot_mb: float = 64.0
    copy_reps: int = 20
    launch_samples: int = 96
    launch_hidden: int = 256


TINY = Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, dtype="float32",
              capture_layers=3, tokens_per_batch=256, buckets=(64, 128), dflash_target_layers=6, dflash_capture=2,
              dflash_draft_layers=1, dflash_seq_len=128, dflash_batch_tokens=256, dflash_anchors=8,
              dflash_accum=2, slot_mb=1.0, copy_reps=3, launch_samples=24, launch_hidden=64)

# Dense bf16 peak of the GPUs the MFU estimate knows (TFLOP/s); the first name the device's contains
# wins, so the PCIe and NVL parts come before the SXM figure of their family; others get no MFU.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0, "H100": 989.0, "B200": 2250.0,
                    "A100": 312.0, "L40S": 362.0}


def peak_bf16_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


@dataclass
class CheckContext:
    device: torch.device
    tmp: Path
    shapes: Shapes = field(default_factory=Shapes)
    deadline: float = float("inf")  # time.monotonic() by which the whole check must end
    progress: Callable[[str], None] = lambda message: None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int = 1) -> float:
    """Seconds per call of ``fn`` (all its device work included)."""
    _sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - started) / reps


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 2)


# -- CUDA IPC handoff ---------------------------------------------------------------------------
def ipc_handoff(ctx: CheckContext) -> dict[str, Any]:
    """A target's slot block opened by a drafter process (with a message per slot) vs a device-to-device copy."""
    if not ctx.cuda:
        raise RuntimeError("needs CUDA")
    from benchmarks.transport import bench_layout, measure_cuda
    from benchmarks.transport_workers import BenchSpec
    spec = BenchSpec(bench_layout(ctx.shapes.slot_mb), seconds=2.0, warmup_s=0.5)
    figures = measure_cuda(torch.multiprocessing.get_context("spawn"), spec, timeout_s=min(120.0, ctx.left_s()))
    if "cuda_ipc_gbps" in figures:
        figures["cuda_ipc_vs_d2d"] = round(figures["cuda_ipc_gbps"] / figures["d2d_gbps"], 3)
    return {"slot_bytes": spec.layout.slot_bytes, **figures}


# -- pinned shm ---------------------------------------------------------------------------------
def pinned_shm(ctx: CheckContext) -> dict[str, Any]:
    """A target's slot write into the shm pool and a drafter's read out of it, vs plain copies.

    Through the real transports (the pool's pages registered as pinned in each worker on a GPU
    host). The plain copies are what a worker would do without them: ``.cpu()`` of the hidden
    states into fresh pageable memory, and ``.to(device)`` from pageable memory; on a GPU also
    torch's own pinned buffers, the bound. ``copy_overlap``: how much of a slot copy on the
    drafter's copy stream hides under compute queued before it (1 = all of it, 0 = none)."""
    from benchmarks.transport import bench_layout
    from common.dataplane.shm_arena import SlotArena
    from common.dataplane.slots import SlotHeader
    from common.dataplane.transport import open_drafter_transport, open_target_transport, shm_transport_info

    device, reps = ctx.device, ctx.shapes.copy_reps
    layout = bench_layout(ctx.shapes.slot_mb)
    hs = torch.randn(layout.tokens_per_batch, layout.row_width, device=device).to(layout.torch_dtype)
    ids = torch.zeros(layout.tokens_per_batch, dtype=torch.int32, device=device)
    mask = torch.ones(layout.tokens_per_batch, dtype=torch.uint8, device=device)
    lens = torch.full((1,), layout.tokens_per_batch, dtype=torch.int32, device=device)
    generation = iter(range(1, 1 << 30))

    def header(gen: int) -> SlotHeader:
        return SlotHeader(generation=gen, job_id=gen, bucket=0, batch_size=1, seq_len=layout.tokens_per_batch,
                          num_tokens=layout.tokens_per_batch)

    figures: dict[str, Any] = {"slot_bytes": layout.slot_bytes, "hs_bytes": layout.hs_bytes, "device": str(device)}
    with SlotArena.create(f"gpuchk{secrets.token_hex(3)}", layout, 2) as arena:
        info = shm_transport_info(arena)
        target, drafter = open_target_transport(info, device), open_drafter_transport(info, device)
        try:
            figures["pinned"] = drafter.pinned
            state = {"gen": 0}

            def write() -> None:
                state["gen"] = next(generation)
                target.write(0, header(state["gen"]), hs=hs, input_ids=ids, loss_mask=mask, seq_lens=lens)
            figures["shm_write_gbps"] = _gbps(layout.hs_bytes, timed(write, device, reps))
            figures["shm_read_gbps"] = _gbps(layout.hs_bytes, timed(lambda: drafter.read(0, state["gen"]), device,
                                                                   reps))
            host = hs.cpu()
            figures["plain_d2h_gbps"] = _gbps(layout.hs_bytes, timed(lambda: hs.to("cpu", copy=True), device, reps))
            figures["plain_h2d_gbps"] = _gbps(layout.hs_bytes, timed(lambda: host.to(device, copy=True), device,
                                                                     reps))
            if ctx.cuda:
                figures.update(_pinned_bounds(hs, reps))
                figures["copy_overlap"] = _copy_overlap(drafter, state["gen"], device)
        finally:
            target.close()
            drafter.close()
    return figures


def _pinned_bounds(hs: torch.Tensor, reps: int) -> dict[str, float]:
    pinned = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=True)
    d2h = timed(lambda: pinned.copy_(hs, non_blocking=True), hs.device, reps)
    h2d = timed(lambda: hs.copy_(pinned, non_blocking=True), hs.device, reps)
    return {"pinned_d2h_gbps": _gbps(hs.nbytes, d2h), "pinned_h2d_gbps": _gbps(hs.nbytes, h2d)}


def _copy_overlap(drafter: Any, generation: int, device: torch.device) -> float:
    """Compute queued on the current stream, then a slot read: the share of the copy hidden under it."""
    copy_s = timed(lambda: drafter.read(0, generation), device, 3)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ a, device, 5)
    num_matmuls = max(1, round(copy_s / matmul_s))

    def compute() -> None:
        for _ in range(num_matmuls):
            a @ a
    compute_s = timed(compute, device, 3)

    def both() -> None:
        compute()
        drafter.start_read(0, generation).wait()
    both_s = timed(both, device, 3)
    return round(max(0.0, compute_s + copy_s - both_s) / min(compute_s, copy_s), 3)


# -- capture ------------------------------------------------------------------------------------
def save_random_qwen3(path: Path, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                      vocab: int, num_layers: int, dtype: str, device: torch.device) -> Path:
    """A Qwen3 causal LM with random weights (built on ``device``, saved in ``dtype``); nothing is downloaded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=40960, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: the CPU would take minutes at 8B-like widths
        model = Qwen3ForCausalLM(config)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def capture(ctx: CheckContext) -> dict[str, Any]:
    """``hsd bench target`` on a random Qwen3 with 8B-like layers: capture vs the plain forward, tok/s."""
    from benchmarks.target_capture import bench_target
    from common.run.config import load_config
    s = ctx.shapes
    model_dir = save_random_qwen3(ctx.tmp / "capture-target", hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads,
                                  head_dim=s.head_dim, intermediate=s.intermediate, vocab=s.vocab,
                                  num_layers=s.capture_layers, dtype=s.dtype, device=ctx.device)
    layers = ",".join(str(i) for i in range(1, s.capture_layers))
    overrides = [f"run.dir={ctx.tmp / 'capture-run'}", f"target.model={model_dir}", f"target.capture_layers=[{layers}]",
                 "target.allow_unservable=true",  # every layer but the first: a throughput figure, never served
                 f"target.dtype={s.dtype}", f"schedule.buckets=[{','.join(map(str, s.buckets))}]",
                 f"schedule.tokens_per_batch={s.tokens_per_batch}"]
    if ctx.cuda:
        overrides.append(f"target.gpus=[{ctx.device.index or 0}]")
    result = bench_target(load_config(None, overrides), warmup=1, reps=3)
    return {"layers": s.capture_layers, "hidden": s.hidden, "dtype": result["dtype"], "buckets": result["buckets"],
            "capture_not_slower": result["capture_not_slower"]}


def tp_target(ctx: CheckContext) -> dict[str, Any]:
    """``hsd bench target --tp-sizes 1 2`` on GPUs 0 and 1 (NCCL): capture tok/s per GPU of one random
    Qwen3 with 8B-like layers, alone on one GPU and as a tensor-parallel group of two."""
    from benchmarks.tp_target import bench_tp_target
    from common.run.config import load_config
    visible = torch.cuda.device_count() if ctx.cuda else 0
    if visible < 2:
        raise Skip(f"a tp_size 2 target group needs two GPUs, this host has {visible}")
    s = ctx.shapes
    model_dir = save_random_qwen3(ctx.tmp / "tp-target", hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads,
                                  head_dim=s.head_dim, intermediate=s.intermediate, vocab=s.vocab,
                                  num_layers=s.capture_layers, dtype=s.dtype, device=ctx.device)
    layers = ",".join(str(i) for i in range(1, s.capture_layers))
    config = load_config(None, [f"run.dir={ctx.tmp / 'tp-target-run'}", f"target.model={model_dir}",
                                f"target.capture_layers=[{layers}]", "target.allow_unservable=true",
                                f"target.dtype={s.dtype}", "target.gpus=[0, 1]", "target.tp_timeout_s=120",
                                f"schedule.buckets=[{','.join(map(str, s.buckets))}]",
                                f"schedule.tokens_per_batch={s.tokens_per_batch}"])
    result = bench_tp_target(config, [1, 2], warmup=1, reps=3, seed=0, num_samples=2000, median=400.0, sigma=0.9)
    one, two = result["sizes"]
    return {"layers": s.capture_layers, "hidden": s.hidden, "dtype": s.dtype, "sizes": result["sizes"],
            "per_gpu_tp2_over_tp1": round(two["tok_s_per_gpu"] / one["tok_s_per_gpu"], 3)}


# -- DFlash step --------------------------------------------------------------------------------
def dflash_step(ctx: CheckContext) -> dict[str, Any]:
    """Optimizer steps of a DFlash drafter at 8B-like shapes (flex attention, compiled, on a GPU):
    tok/s, peak memory and an MFU estimate (:func:`dflash_step_flops`)."""
    from benchmarks.dflash_step import spaced_layer_ids, write_fake_target
    from drafter_worker.dflash.config import DFlashTrainConfig
    from drafter_worker.dflash.trainer import DFlashTrainer
    s, device = ctx.shapes, ctx.device
    target = write_fake_target(ctx.tmp / "dflash-target", hidden=s.hidden, intermediate=s.intermediate,
                               heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, vocab=s.vocab,
                               num_layers=s.dflash_target_layers)
    layer_ids = spaced_layer_ids(s.dflash_target_layers, s.dflash_capture)
    config = DFlashTrainConfig(block_size=16, num_draft_layers=s.dflash_draft_layers, num_anchors=s.dflash_anchors,
                               gamma=7.0, total_steps=1000)
    trainer = DFlashTrainer(config, target_dir=str(target), layer_ids=layer_ids, device=device, seed=0)
    batch = max(1, s.dflash_batch_tokens // s.dflash_seq_len)
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(batch, s.dflash_seq_len, len(layer_ids) * s.hidden, generator=g).to(trainer.compute_dtype)
    ids = torch.randint(0, s.vocab, (batch, s.dflash_seq_len), generator=g)
    loss_mask = torch.ones(batch, s.dflash_seq_len, dtype=torch.bool)
    loss_mask[:, :s.dflash_seq_len // 10] = False
    lens = torch.full((batch,), s.dflash_seq_len)
    args = tuple(t.to(device) for t in (hs, ids, loss_mask, lens))
    micro: list[Any] = []

    def step() -> None:
        micro.clear()
        micro.extend(trainer.micro_batch(*args) for _ in range(s.dflash_accum))
        trainer.apply_step()
    warmup_s = timed(step, device)  # compiles flex attention for this shape
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    reps = 3
    step_s = timed(step, device, reps)
    tokens = s.dflash_accum * batch * s.dflash_seq_len
    # A micro-batch's figures are tensors on the device; read once the timing is over.
    blocks, supervised = sum(int(m.num_blocks) for m in micro), sum(int(m.num_positions) for m in micro)
    flops = dflash_step_flops(trainer, context_tokens=tokens, query_tokens=blocks * config.block_size,
                              supervised=supervised)
    figures: dict[str, Any] = {
        "attention": trainer.model.attention, "dtype": str(trainer.compute_dtype).removeprefix("torch."),
        "trainable_params_m": round(sum(p.numel() for p in trainer.params) / 1e6, 1),
        "micro_batch": [batch, s.dflash_seq_len], "accum": s.dflash_accum, "blocks": blocks,
        "warmup_s": round(warmup_s, 2), "step_ms": round(step_s * 1e3, 1), "tok_s": round(tokens / step_s),
        "tflops_per_step": round(flops / 1e12, 2)}
    if ctx.cuda:
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        peak = peak_bf16_tflops(torch.cuda.get_device_name(device))
        if peak is not None:
            figures["mfu"] = round(flops / step_s / (peak * 1e12), 4)
    return figures


def dflash_step_flops(trainer: Any, *, context_tokens: int, query_tokens: int, supervised: int) -> float:
    """Estimated FLOPs of a step: 6 per trainable weight per token it sees (the fusion projection
    sees every context token, the draft layers the block queries), plus 4 per LM-head weight per
    supervised position (frozen: forward and the input's gradient). Attention scores and the
    context's K/V projections are left out, so it is a lower bound."""
    hidden, vocab = trainer.model_config.target.hidden_size, trainer.model_config.target.vocab_size
    fused = trainer.model_config.num_context_layers * hidden
    fusion = sum(p.numel() for p in trainer.params if p.dim() == 2 and p.shape[1] == fused)
    layers = sum(p.numel() for p in trainer.params) - fusion
    return 6.0 * fusion * context_tokens + 6.0 * layers * query_tokens + 4.0 * hidden * vocab * supervised
