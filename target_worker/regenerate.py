"""``hsd regenerate``: rewrite every assistant turn of a conversation file with the target's own answer.

A drafter learns to predict the target, so its training answers should be the target's: each
assistant turn is replaced by the target's greedy (or sampled) answer to the conversation so far,
where the earlier assistant turns are already the regenerated ones. Rows are processed in groups of
``batch_size``; within a group, turn k of every row is generated in one left-padded batch. The
output keeps each row's format and other fields; unusable rows are logged and left out.

Each turn's prompt is the conversation so far as the target's chat template renders it (system
and tool turns included, the target's own earlier answers as the template shows them: a Qwen3-style
template drops their reasoning). The target's whole output becomes the turn's ``content``, its
reasoning included (``<think>…</think>`` then the answer, as Qwen3 writes it; when the generation
prompt itself opens the reasoning, as DeepSeek-R1's does, that opening is written at the start of the
content), and the turn's old ``reasoning_content`` and ``tool_calls`` are dropped: that is where
``hsd prepare`` reads reasoning back, and the template decides what of it each sample shows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from common.run.config import Config, ConfigError
from common.run.durable import publish
from target_worker.chat_rows import RowError, parse_json_line, row_messages, with_assistant_texts
from target_worker.loss_mask import assistant_header

THINK_OPEN = "<think>"

log = logging.getLogger("hsd.regenerate")


def load_target(model_dir: str):
    """(model, tokenizer, device) of a local Hugging Face model directory, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not model_dir:
        raise ConfigError("target.model: set it to the local Hugging Face model directory of the target")
    if not Path(model_dir).is_dir():
        raise ConfigError(f"target.model: {model_dir} is not a directory")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, tokenizer, device


def reasoning_opening(tokenizer) -> str:
    """The opening of the reasoning block that the template's generation prompt writes itself (e.g.
    ``<think>\n``), which the target's output then lacks; empty for most templates."""
    header = assistant_header(tokenizer)
    at = header.rfind(THINK_OPEN)
    return header[at:] if at >= 0 and not header[at + len(THINK_OPEN):].strip() else ""


def generate_answers(model, tokenizer, prompts: list[list[dict]], *, device: str, max_new_tokens: int,
                     sample: bool, temperature: float) -> list[str]:
    """The target's output for each conversation prefix (ending with a user or tool turn), as text,
    with the reasoning it holds."""
    import torch

    texts = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
             for messages in prompts]
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):  # left padding: every prompt ends where generation starts
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    options = {"do_sample": True, "temperature": temperature} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, **options)
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) | {pad_id}
    opening = reasoning_opening(tokenizer)
    answers = []
    for generated in out[:, width:].tolist():
        end = next((i for i, token in enumerate(generated) if token in stops), len(generated))
        # Reasoning tags are plain tokens in Qwen3's and DeepSeek-R1's vocabularies: decoding keeps them.
        answers.append(opening + tokenizer.decode(generated[:end], skip_special_tokens=True))
    return answers


def regenerate_rows(model, tokenizer, rows: list[dict], *, device: str, max_new_tokens: int, sample: bool = False,
                    temperature: float = 1.0) -> list[dict]:
    """``rows`` (each holding at least one assistant turn) with every assistant turn regenerated."""
    conversations = [row_messages(row) for row in rows]
    answers: list[list[str]] = [[] for _ in rows]
    num_turns = max(sum(m["role"] == "assistant" for m in messages) for messages in conversations)
    for turn in range(num_turns):
        prompts, owners = [], []
        for i, messages in enumerate(conversations):
            positions = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            if turn < len(positions):
                prefix = messages[:positions[turn]]
                for k, j in enumerate(positions[:turn]):  # the history holds the regenerated answers
                    prefix[j] = {"role": "assistant", "content": answers[i][k]}
                prompts.append(prefix)
                owners.append(i)
        new = generate_answers(model, tokenizer, prompts, device=device, max_new_tokens=max_new_tokens,
                               sample=sample, temperature=temperature)
        for i, text in zip(owners, new):
            answers[i].append(text)
    return [with_assistant_texts(row, texts) for row, texts in zip(rows, answers)]


def regenerate_file(config: Config, input_path: str | os.PathLike, out_path: str | os.PathLike, *,
                    max_new_tokens: int = 512, batch_size: int = 8, sample: bool = False,
                    temperature: float = 1.0) -> dict:
    """Regenerate every row of a JSONL file into ``out_path``; returns counts."""
    import torch
    from tqdm import tqdm

    if max_new_tokens <= 0 or batch_size <= 0:
        raise ValueError("--max-new-tokens and --batch-size must be positive")
    if sample and temperature <= 0:
        raise ValueError(f"--temperature must be positive when sampling, got {temperature}")
    input_path, out_path = Path(input_path), Path(out_path)
    if not input_path.is_file():
        raise ValueError(f"input {input_path} does not exist")
    model, tokenizer, device = load_target(config.target.model)
    torch.manual_seed(config.run.seed)
    with open(input_path, encoding="utf-8", errors="replace") as lines:
        num_lines = sum(1 for _ in lines)
    counts = {"rows": 0, "written": 0, "skipped": 0}
    tmp = out_path.with_name(out_path.name + ".partial")
    with open(input_path, encoding="utf-8", errors="replace") as lines, open(tmp, "w") as out, \
            tqdm(total=num_lines, desc="regenerate", unit=" rows", mininterval=1.0) as bar:
        group: list[dict] = []

        def flush() -> None:
            if group:
                for row in regenerate_rows(model, tokenizer, group, device=device, max_new_tokens=max_new_tokens,
                                           sample=sample, temperature=temperature):
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                bar.update(len(group))
                counts["written"] += len(group)
                group.clear()

        for number, line in enumerate(lines, start=1):
            if not line.strip():
                bar.update(1)
                continue
            counts["rows"] += 1
            try:
                row = parse_json_line(line)
                row_messages(row)
            except RowError as exc:
                log.warning("%s:%d: skipped (%s): %s", input_path.name, number, exc.reason, exc)
                counts["skipped"] += 1
                bar.update(1)
                continue
            group.append(row)
            if len(group) >= batch_size:
                flush()
        flush()
    publish(tmp, out_path)
    log.info("regenerated %d rows into %s (%d skipped)", counts["written"], out_path, counts["skipped"])
    return counts
