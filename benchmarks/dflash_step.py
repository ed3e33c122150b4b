"""``hsd bench dflash``: the cost of one DFlash micro-batch (forward + backward) by sequence length
and anchor count, on random hidden states.

No target model is needed: the drafter reads only the target's ``config.json`` and its embedding and
LM head, so the benchmark writes such a directory with random tensors of the requested dimensions
(``--hidden 4096 --vocab 151936 ...`` for a Qwen3-8B-sized drafter on a GPU). The figure to look at:
at a fixed anchor count, the time barely grows with the sequence length (the blocks, not the
context, carry the compute). Each row is the median of ``--reps`` timed micro-batches on the same
inputs, anchors drawn by the trainer as in training; on the CPU also the process's CPU time (``cpu_ms``),
the figure that holds when other processes share the cores.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter_worker.dflash.config import DFlashTrainConfig
from drafter_worker.dflash.trainer import DFlashTrainer


def spaced_layer_ids(num_layers: int, num_capture: int) -> list[int]:
    """``num_capture`` layers evenly spaced from 1 to ``num_layers - 3`` (one layer: the middle one)."""
    if num_capture == 1:
        return [num_layers // 2]
    last = max(1, num_layers - 3)
    return [round(1 + i * (last - 1) / (num_capture - 1)) for i in range(num_capture)]


def write_fake_target(out_dir: Path, *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                      vocab: int, num_layers: int) -> Path:
    """A directory with a Qwen3 ``config.json`` and random embedding / LM head tensors only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "vocab_size": vocab, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False}
    (out_dir / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16)
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_dflash_bench(*, hidden: int = 64, intermediate: int = 128, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 16, vocab: int = 512, num_target_layers: int = 8, num_capture: int = 3,
                     num_draft_layers: int = 1, block_size: int = 16, seq_lens: list[int], anchors: list[int],
                     batch_tokens: int, reps: int, device: str, as_json: bool) -> int:
    device_t = torch.device(device)
    layer_ids = spaced_layer_ids(num_target_layers, num_capture)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = write_fake_target(Path(tmp) / "target", hidden=hidden, intermediate=intermediate, heads=heads,
                                   kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, num_layers=num_target_layers)
        for num_anchors in anchors:
            config = DFlashTrainConfig(block_size=block_size, num_draft_layers=num_draft_layers,
                                       num_anchors=num_anchors, gamma=7.0, total_steps=1000)
            trainer = DFlashTrainer(config, target_dir=str(target), layer_ids=layer_ids, device=device_t, seed=0)
            for seq_len in seq_lens:
                batch = max(1, batch_tokens // seq_len)
                g = torch.Generator().manual_seed(seq_len)
                hs = torch.randn(batch, seq_len, len(layer_ids) * hidden, generator=g).to(torch.bfloat16)
                ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
                loss_mask = torch.ones(batch, seq_len, dtype=torch.bool)
                loss_mask[:, :seq_len // 10] = False
                seq_lens_t = torch.full((batch,), seq_len)
                args = (hs.to(device_t), ids.to(device_t), loss_mask.to(device_t), seq_lens_t.to(device_t))
                trainer.micro_batch(*args)  # warmup (and compilation on GPU)
                trainer.drop_step()
                if device_t.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device_t)
                times, cpu_times = [], []
                for _ in range(reps):
                    _sync(device_t)
                    started, cpu_started = time.perf_counter(), time.process_time()
                    stats = trainer.micro_batch(*args)
                    _sync(device_t)
                    times.append(time.perf_counter() - started)
                    cpu_times.append(time.process_time() - cpu_started)
                    trainer.drop_step()
                # The median: on a shared machine a few slow repetitions say more about the neighbours.
                seconds = statistics.median(times)
                num_blocks = int(stats.num_blocks)
                row = {"seq_len": seq_len, "batch": batch, "anchors": num_anchors, "blocks": num_blocks,
                       "ms": round(seconds * 1e3, 2), "tok_s": round(batch * seq_len / seconds),
                       "blocks_s": round(num_blocks / seconds)}
                if device_t.type == "cpu":
                    # The process's CPU time: what the micro-batch cost even while other processes
                    # share the cores (with one thread, the wall time of a quiet machine).
                    row["cpu_ms"] = round(statistics.median(cpu_times) * 1e3, 2)
                if device_t.type == "cuda":
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated(device_t) / 2**30, 2)
                rows.append(row)
    if as_json:
        print(json.dumps({"device": str(device_t), "layer_ids": layer_ids, "rows": rows}))
        return 0
    print(f"DFlash micro-batch (forward + backward) on {device_t}, hidden {hidden}, vocab {vocab}, "
          f"{num_draft_layers} draft layer(s), block {block_size}, capture layers {layer_ids}")
    cpu = device_t.type == "cpu"
    print(f"{'seq_len':>8} {'batch':>6} {'anchors':>8} {'blocks':>7} {'ms':>9} {'tok/s':>10} {'blocks/s':>9}"
          + (f" {'cpu ms':>9}" if cpu else ""))
    for r in rows:
        print(f"{r['seq_len']:>8} {r['batch']:>6} {r['anchors']:>8} {r['blocks']:>7} {r['ms']:>9.2f} "
              f"{r['tok_s']:>10,} {r['blocks_s']:>9,}" + (f" {r['cpu_ms']:>9.2f}" if cpu else ""))
    return 0
