"""Token ids and the assistant-only loss mask of a conversation, through the tokenizer's chat template.

The conversation is rendered once with the template, and every assistant turn's text is located in
the rendered string (turns in order, each searched after the previous one, so an answer that
repeats the question is found in the answer, not the question). The mask covers the tokens that
overlap an assistant turn, plus the template's end-of-turn marker right after it (the drafter must
learn to predict the end of an answer). Locating text is used instead of rendering growing prefixes
and diffing token counts, because templates such as Qwen3's render a turn differently once later
turns follow it (earlier reasoning is dropped), so prefix renderings are not prefixes of the whole.
"""

from __future__ import annotations

from target_worker.chat_rows import TEMPLATE_ERROR, RowError

_PROBE_QUESTION, _PROBE_ANSWER = "hsd probe question", "hsd probe answer"


def turn_end_marker(tokenizer) -> str:
    """What the template writes right after an assistant turn's text (e.g. ``<|im_end|>``), found by
    rendering a probe conversation; empty when the template writes nothing there."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE_QUESTION},
                                          {"role": "assistant", "content": _PROBE_ANSWER}], tokenize=False)
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        raise ValueError("the tokenizer's chat template does not render assistant turns verbatim")
    return text[at + len(_PROBE_ANSWER):].strip()


def render(tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # templates raise whatever jinja raises (e.g. "roles must alternate")
        raise RowError(TEMPLATE_ERROR, f"chat template error: {exc}") from None


def assistant_spans(text: str, messages: list[dict], turn_end: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in the rendered ``text``."""
    spans = []
    cursor = 0
    for message in messages:
        content = message["content"].strip()  # templates commonly strip turn text
        if not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            raise RowError(TEMPLATE_ERROR, f"a {message['role']} turn is not rendered verbatim by the chat template")
        cursor = at + len(content)
        if message["role"] == "assistant":
            end = cursor
            if turn_end and text.startswith(turn_end, end):
                end += len(turn_end)
            spans.append((at, end))
    return spans


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span (both sorted), else 0."""
    mask = [0] * len(offsets)
    s = 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and spans[s][1] <= start:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0] and start < spans[s][1] and end > start:
            mask[i] = 1
    return mask


def tokenize_conversations(tokenizer, conversations: list[list[dict]], turn_end: str,
                           ) -> list[tuple[list[int], list[int]] | RowError]:
    """Token ids and loss mask of each conversation (one batched tokenizer call), or the RowError of
    a conversation the template cannot render."""
    results: list = [None] * len(conversations)
    texts, spans, where = [], [], []
    for i, messages in enumerate(conversations):
        try:
            text = render(tokenizer, messages)
            spans.append(assistant_spans(text, messages, turn_end))
        except RowError as exc:
            results[i] = exc
            continue
        texts.append(text)
        where.append(i)
    if texts:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for i, ids, offsets, row_spans in zip(where, encoded["input_ids"], encoded["offset_mapping"], spans):
            results[i] = (list(ids), mask_from_offsets(offsets, row_spans))
    return results
