"""``hsd make-tiny``: a small Qwen3 target trained on the synthetic language, for demos and tests.

Writes a directory ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load: the model (safetensors), a byte-level BPE tokenizer with a ChatML template, the train split
(``conversations.jsonl``, ShareGPT) and held-out conversations (``heldout.jsonl``), and
``tiny.json`` with the greedy-answer token match rate on the held-out turns, trained vs untrained.
Everything is a function of the seed (fixed thread count, deterministic algorithms, seeded
sampling); a directory that already holds a finished model (its marker file is written last) is
reused as it is.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common.run.config import opt
from target_worker.loss_mask import tokenize_conversations, turn_end_marker
from target_worker.synthetic_language import make_splits
from target_worker.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer

log = logging.getLogger("hsd.tiny")

MARKER_FILE = "tiny.complete"
REPORT_FILE = "tiny.json"
# One thread whatever the machine has: float sums depend on how work is split between threads, and
# on a busy machine a second thread waits on the first far more than it helps (measured: a step
# took 6x longer with two threads than with one on a loaded 2-core host).
NUM_THREADS = 1


@dataclass
class TinySpec:
    num_train: int = opt(6000, "Synthetic conversations in the train split.")
    num_heldout: int = opt(64, "Held-out conversations (first question never seen in training).")
    vocab_size: int = opt(1024, "Largest tokenizer vocabulary (BPE stops earlier when the language is exhausted).")
    hidden_size: int = opt(128, "Model width.")
    num_layers: int = opt(4, "Decoder layers.")
    num_heads: int = opt(4, "Attention heads.")
    num_kv_heads: int = opt(2, "Key/value heads (grouped-query attention).")
    head_dim: int = opt(32, "Width of one attention head.")
    intermediate_size: int = opt(384, "SwiGLU hidden width.")
    steps: int = opt(400, "Optimizer steps.")
    batch_size: int = opt(16, "Conversations per step.")
    lr: float = opt(6e-3, "Peak AdamW learning rate (linear warmup, cosine decay to a tenth).")
    warmup_steps: int = opt(30, "Warmup steps.")
    eval_batch_size: int = opt(32, "Held-out prompts generated together (left padding).")


def build_model(tokenizer, spec: TinySpec, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    return model


def _lr_factor(step: int, spec: TinySpec) -> float:
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _length_grouped_batches(samples, batch_size: int, generator) -> list[list[int]]:
    """One epoch of batches of similar lengths in random order: little compute goes to padding."""
    import torch

    order = torch.randperm(len(samples), generator=generator).tolist()
    order.sort(key=lambda i: len(samples[i][0]) // 16)  # stable: random order within a length band
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def train(model, samples: list[tuple[list[int], list[int]]], spec: TinySpec, *, seed: int, pad_id: int) -> float:
    """AdamW on the assistant tokens; returns the mean loss of the last tenth of the steps."""
    import torch
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))
    model.train()
    tail = []
    batches: list[list[int]] = []
    bar = tqdm(range(spec.steps), desc="train tiny target", unit=" steps", mininterval=1.0)
    for step in bar:
        if not batches:
            batches = _length_grouped_batches(samples, spec.batch_size, generator)
        picks = batches.pop()
        width = max(len(samples[i][0]) for i in picks)
        input_ids = torch.full((len(picks), width), pad_id)
        labels = torch.full((len(picks), width), -100)
        attention = torch.zeros((len(picks), width), dtype=torch.long)
        for row, i in enumerate(picks):
            ids, mask = (torch.tensor(x) for x in samples[i])
            input_ids[row, :len(ids)] = ids
            attention[row, :len(ids)] = 1
            labels[row, :len(ids)] = torch.where(mask.bool(), ids, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step >= spec.steps - max(1, spec.steps // 10):
            tail.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return sum(tail) / len(tail)


def heldout_turns(samples: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference answer ids) for every assistant turn: the prompt is the conversation up
    to the turn with the reference history, the answer runs to the end-of-turn token included."""
    turns = []
    for ids, mask in samples:
        start = None
        for i, bit in enumerate(mask + [0]):
            if bit and start is None:
                start = i
            elif not bit and start is not None:
                turns.append((ids[:start], ids[start:i]))
                start = None
    return turns


def greedy_match_rate(model, turns, *, pad_id: int, batch_size: int) -> float:
    """Share of reference answer tokens the model's greedy answer has at the same position."""
    import torch

    matched = total = 0
    with torch.no_grad():
        for first in range(0, len(turns), batch_size):
            batch = turns[first:first + batch_size]
            width = max(len(prompt) for prompt, _ in batch)
            input_ids = torch.full((len(batch), width), pad_id)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                input_ids[row, width - len(prompt):] = torch.tensor(prompt)
                attention[row, width - len(prompt):] = 1
            new = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                                 max_new_tokens=max(len(answer) for _, answer in batch))[:, width:].tolist()
            for generated, (_, answer) in zip(new, batch):
                matched += sum(g == a for g, a in zip(generated, answer))
                total += len(answer)
    return matched / total


def _write_jsonl(path: Path, conversations) -> None:
    with open(path, "w") as out:
        for conversation in conversations:
            out.write(json.dumps(conversation.to_sharegpt()) + "\n")


def make_tiny(out_dir: str | Path, *, seed: int = 0, spec: TinySpec | None = None) -> dict:
    """Build (or reuse) the tiny target in ``out_dir``; returns the report written to tiny.json."""
    import torch

    spec = spec or TinySpec()
    out_dir = Path(out_dir)
    if (out_dir / MARKER_FILE).is_file():
        report = json.loads((out_dir / REPORT_FILE).read_text())
        if report["seed"] != seed or report["spec"] != asdict(spec):
            raise ValueError(f"{out_dir} already holds a tiny target made with seed {report['seed']} and other "
                             "settings; choose another --out or remove it")
        log.info("%s already holds the finished tiny target: reusing it", out_dir)
        return report
    started = time.perf_counter()
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_split, heldout = make_splits(seed, num_train=spec.num_train, num_heldout=spec.num_heldout)
    _write_jsonl(out_dir / "conversations.jsonl", train_split)
    _write_jsonl(out_dir / "heldout.jsonl", heldout)
    texts = [text for c in train_split for turn in c.turns for text in turn] + ["system user assistant"]
    tokenizer = build_tokenizer(texts, vocab_size=spec.vocab_size)
    tokenizer.save_pretrained(str(out_dir))
    turn_end = turn_end_marker(tokenizer)
    train_samples = tokenize_conversations(tokenizer, [c.messages() for c in train_split], turn_end)
    eval_turns = heldout_turns(tokenize_conversations(tokenizer, [c.messages() for c in heldout], turn_end))
    tokenized_s = time.perf_counter() - started

    model = build_model(tokenizer, spec, seed)
    untrained = greedy_match_rate(model.eval(), eval_turns, pad_id=tokenizer.pad_token_id,
                                  batch_size=spec.eval_batch_size)
    train_started = time.perf_counter()
    final_loss = train(model, train_samples, spec, seed=seed, pad_id=tokenizer.pad_token_id)
    train_s = time.perf_counter() - train_started
    trained = greedy_match_rate(model, eval_turns, pad_id=tokenizer.pad_token_id, batch_size=spec.eval_batch_size)
    model.save_pretrained(str(out_dir))

    report = {
        "seed": seed, "spec": asdict(spec),
        "match_rate_trained": round(trained, 4), "match_rate_untrained": round(untrained, 4),
        "heldout_turns": len(eval_turns), "heldout_answer_tokens": sum(len(a) for _, a in eval_turns),
        "final_train_loss": round(final_loss, 4), "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "mask_token": SPECIAL_TOKENS[-1], "mask_token_id": tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[-1]),
        "seconds": {"data_and_tokenizer": round(tokenized_s, 1), "train": round(train_s, 1),
                    "total": round(time.perf_counter() - started, 1)},
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / MARKER_FILE).write_text(f"seed {seed}\n")  # last: the directory is finished
    return report
