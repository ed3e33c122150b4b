"""Conversation rows in the accepted formats, normalized to chat messages.

Accepted rows (one JSON object per JSONL line, or one Parquet row), the format found per row:
- a list of turns under ``conversations`` or ``messages``, each turn either ``{"from", "value"}``
  (ShareGPT) or ``{"role", "content"}`` (OpenAI, and what SpecForge's data scripts write), with the
  role names of :data:`ROLES`; the content may be OpenAI content parts (the text parts are kept);
- a single turn: ``{"prompt": str, "response": str}``.

Any of them may carry a top-level ``system`` text (ShareGPT's), which becomes the first turn. An
assistant turn's ``reasoning_content`` and ``tool_calls`` and a tool turn's ``tool_call_id`` and
``name`` are passed to the chat template as they are; other keys are ignored. Anything else
raises :class:`RowError` with a reason code (counted in a dataset's manifest) and a message for the
log line.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool"}
TURN_LISTS = ("conversations", "messages")
# (list key, role key) -> format name, as counted in a prepared dataset's manifest.
FORMATS = {("conversations", "from"): "sharegpt", ("conversations", "role"): "sharegpt_role_content",
           ("messages", "role"): "messages", ("messages", "from"): "messages_from_value"}
PROMPT_RESPONSE = "prompt_response"
TEXT_KEYS = {"role": "content", "from": "value"}  # the text key that goes with each role key
ASSISTANT_KEYS = ("reasoning_content", "tool_calls")  # passed to the template as they are
TOOL_KEYS = ("tool_call_id", "name")

# Reason codes of skipped rows, as counted in a prepared dataset's manifest.
INVALID_JSON = "invalid_json"
MISSING_FIELDS = "missing_fields"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"
CONFLICTING_SYSTEM = "conflicting_system"
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


def _turn_list_key(row: dict) -> str | None:
    return next((key for key in TURN_LISTS if key in row), None)


def _role_key(turn: Any) -> str | None:
    """``role`` or ``from``: the key naming the speaker of a turn (None when it has neither)."""
    if isinstance(turn, dict):
        return next((key for key in TEXT_KEYS if key in turn), None)
    return None


def row_format(row: dict) -> str:
    """The row's format: one of :data:`FORMATS`' names or ``prompt_response``, found from its keys
    and its first turn's."""
    key = _turn_list_key(row)
    if key is not None:
        turns = row[key]
        first = turns[0] if isinstance(turns, list) and turns else None
        return FORMATS[key, _role_key(first) or ("from" if key == "conversations" else "role")]
    if "prompt" in row and "response" in row:
        return PROMPT_RESPONSE
    raise RowError(MISSING_FIELDS, "no conversations, messages or prompt/response field "
                                   f"(keys: {', '.join(sorted(row)) or 'none'})")


def _turn_message(turn: Any, where: str) -> dict:
    role_key = _role_key(turn)
    if role_key is None:
        raise RowError(MISSING_FIELDS, f"{where}: expected an object with 'role' and 'content' (or 'from' and 'value')")
    role = ROLES.get(str(turn[role_key]).lower())
    if role is None:
        raise RowError(MISSING_FIELDS, f"{where}: unknown {role_key} {turn[role_key]!r} "
                                       f"(expected one of {', '.join(ROLES)})")
    text_key = TEXT_KEYS[role_key]
    value = turn.get(text_key)
    if value is None and role == "assistant" and turn.get("tool_calls"):
        value = ""  # an OpenAI assistant turn that only calls tools has no content
    elif text_key not in turn:
        raise RowError(MISSING_FIELDS, f"{where}: expected an object with {role_key!r} and {text_key!r}")
    message = {"role": role, "content": _text(value, f"{where}.{text_key}")}
    for key in ASSISTANT_KEYS if role == "assistant" else TOOL_KEYS if role == "tool" else ():
        if turn.get(key) is not None:
            message[key] = turn[key]
    if not isinstance(message.get("reasoning_content", ""), str):
        raise RowError(MISSING_FIELDS, f"{where}.reasoning_content: expected text")
    if not isinstance(message.get("tool_calls", []), list):
        raise RowError(MISSING_FIELDS, f"{where}.tool_calls: expected a list")
    return message


def _with_system(row: dict, messages: list[dict]) -> list[dict]:
    """``messages`` behind the row's top-level ``system`` text, when it has one."""
    system = row.get("system")
    if system is None or system == "":
        return messages
    system = _text(system, "system")
    if messages and messages[0]["role"] == "system":
        if messages[0]["content"] != system:
            raise RowError(CONFLICTING_SYSTEM, "the top-level system field and the first turn, a system turn, differ")
        return messages
    return [{"role": "system", "content": system}, *messages]


def row_messages(row: dict) -> list[dict]:
    """The row as ``[{"role", "content", ...}, ...]``; raises RowError when it holds no usable conversation."""
    key = _turn_list_key(row)
    row_format(row)  # raises when the row has no conversation at all
    if key is None:
        messages = [{"role": "user", "content": _text(row["prompt"], "prompt")},
                    {"role": "assistant", "content": _text(row["response"], "response")}]
    else:
        turns = row[key]
        if not isinstance(turns, list):
            raise RowError(MISSING_FIELDS, f"{key}: expected a list of turns, got {type(turns).__name__}")
        messages = [_turn_message(turn, f"{key}[{i}]") for i, turn in enumerate(turns)]
    if not messages:
        raise RowError(EMPTY_CONVERSATION, "empty conversation")
    messages = _with_system(row, messages)
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("reasoning_content") or m.get("tool_calls"))
               for m in messages):
        raise RowError(NO_ASSISTANT_TURN, "no assistant turn")
    return messages


def with_assistant_texts(row: dict, texts: list[str]) -> dict:
    """A copy of ``row`` in its own format with its assistant turns' texts replaced, in order: each
    becomes the new text alone (its ``reasoning_content`` and ``tool_calls`` belonged to the old one).
    Every other field and turn is kept as it was."""
    key = _turn_list_key(row)
    out = dict(row)
    if key is None:
        (out["response"],) = texts
        return out
    pending = iter(texts)
    turns = []
    for turn in row[key]:
        role_key = _role_key(turn)
        if ROLES.get(str(turn[role_key]).lower()) == "assistant":
            turn = {k: v for k, v in turn.items() if k not in ASSISTANT_KEYS}
            turn[TEXT_KEYS[role_key]] = next(pending)
        turns.append(turn)
    out[key] = turns
    return out
