"""Evaluation prompts from a ShareGPT-style JSONL file, rendered with the target's chat template.

A row is ``{"conversations": [{"from": "human", "value": ...}, ...]}`` (ShareGPT) or
``{"messages": [{"role": "user", "content": ...}, ...]}``. Each row gives one prompt: its turns up
to and including the first user turn (a system turn before it is kept), rendered with
``add_generation_prompt=True`` so that the target answers next.
"""

from __future__ import annotations

import json
from pathlib import Path

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _turns(row: dict) -> list[dict]:
    if "messages" in row:
        return [{"role": _ROLES.get(t.get("role"), t.get("role")), "content": t.get("content", "")}
                for t in row["messages"]]
    return [{"role": _ROLES.get(t.get("from"), t.get("from")), "content": t.get("value", "")}
            for t in row.get("conversations", [])]


def first_user_prompt(row: dict) -> list[dict] | None:
    """The turns up to the first user turn, or None when the row has no user turn."""
    turns = _turns(row)
    for i, turn in enumerate(turns):
        if turn["role"] == "user":
            return [t for t in turns[:i] if t["role"] == "system"] + [turn]
    return None


def load_chat_prompts(path: str | Path, tokenizer, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` usable rows of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts: list[list[int]] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if len(prompts) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
            messages = first_user_prompt(row)
            if messages is None:
                continue
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer tokenizers return an encoding
                ids = ids["input_ids"]
            prompts.append(list(ids))
    if not prompts:
        raise ValueError(f"{path}: no row with a user turn")
    return prompts
