"""Conversation rows in the three accepted formats, normalized to chat messages.

Accepted rows (one JSON object per JSONL line, or one Parquet row):
- ShareGPT: ``{"conversations": [{"from": "human"|"user"|"gpt"|"assistant"|"system", "value": str}, ...]}``
- OpenAI-style: ``{"messages": [{"role": "user"|"assistant"|"system", "content": str | [parts]}, ...]}``
- a single turn: ``{"prompt": str, "response": str}``

Anything else raises :class:`RowError` with a reason code (counted in a dataset's manifest) and a
message for the log line.
"""

from __future__ import annotations

import json
from typing import Any

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

# Reason codes of skipped rows, as counted in a prepared dataset's manifest.
INVALID_JSON = "invalid_json"
MISSING_FIELDS = "missing_fields"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"
TOO_LONG = "too_long"
TEMPLATE_ERROR = "template_error"


class RowError(ValueError):
    """A row that cannot be used; ``reason`` is one of the codes above."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_json_line(line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RowError(INVALID_JSON, f"invalid JSON: {exc}") from None
    if not isinstance(row, dict):
        raise RowError(MISSING_FIELDS, f"expected a JSON object, got {type(row).__name__}")
    return row


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text ones
        parts = [part.get("text") for part in value if isinstance(part, dict) and part.get("type") == "text"]
        if all(isinstance(part, str) for part in parts):
            return "".join(parts)
    raise RowError(MISSING_FIELDS, f"{where}: expected text, got {type(value).__name__}")


def row_format(row: dict) -> str:
    """``sharegpt``, ``messages`` or ``prompt_response``."""
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if "prompt" in row and "response" in row:
        return "prompt_response"
    raise RowError(MISSING_FIELDS, "no conversations, messages or prompt/response field "
                                   f"(keys: {', '.join(sorted(row)) or 'none'})")


def row_messages(row: dict) -> list[dict]:
    """The row as ``[{"role", "content"}, ...]``; raises RowError when it holds no usable conversation."""
    kind = row_format(row)
    if kind == "prompt_response":
        messages = [{"role": "user", "content": _text(row["prompt"], "prompt")},
                    {"role": "assistant", "content": _text(row["response"], "response")}]
    else:
        key, role_key, text_key, roles = (("conversations", "from", "value", SHAREGPT_ROLES) if kind == "sharegpt"
                                          else ("messages", "role", "content", MESSAGE_ROLES))
        turns = row[key]
        if not isinstance(turns, list):
            raise RowError(MISSING_FIELDS, f"{key}: expected a list of turns, got {type(turns).__name__}")
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
                raise RowError(MISSING_FIELDS, f"{key}[{i}]: expected an object with {role_key!r} and {text_key!r}")
            role = roles.get(str(turn[role_key]).lower())
            if role is None:
                raise RowError(MISSING_FIELDS, f"{key}[{i}]: unknown {role_key} {turn[role_key]!r} "
                                               f"(expected one of {', '.join(roles)})")
            messages.append({"role": role, "content": _text(turn[text_key], f"{key}[{i}].{text_key}")})
    if not messages:
        raise RowError(EMPTY_CONVERSATION, "empty conversation")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RowError(NO_ASSISTANT_TURN, "no assistant turn")
    return messages


def with_assistant_texts(row: dict, texts: list[str]) -> dict:
    """A copy of ``row`` in its own format with its assistant turns' texts replaced, in order (every
    other field and turn is kept as it was)."""
    kind = row_format(row)
    out = dict(row)
    if kind == "prompt_response":
        (out["response"],) = texts
        return out
    key, role_key, text_key, roles = (("conversations", "from", "value", SHAREGPT_ROLES) if kind == "sharegpt"
                                      else ("messages", "role", "content", MESSAGE_ROLES))
    pending = iter(texts)
    out[key] = [dict(turn, **{text_key: next(pending)})
                if roles.get(str(turn[role_key]).lower()) == "assistant" else turn for turn in row[key]]
    return out
