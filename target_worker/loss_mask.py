"""Token ids and the assistant-only loss mask of a conversation, through the tokenizer's chat template.

Templates do not always render a turn as it was given: Qwen3's and DeepSeek-R1's drop an earlier
assistant turn's reasoning once a later user turn follows, strip or reformat text, and render tool
calls from structured fields. So the mask is not found by searching the rendering for each turn's
text, and not by rendering growing prefixes either (a prefix's rendering of an earlier turn is not
the whole conversation's). Instead the conversation is rendered twice: as it is, and with each
assistant turn replaced by a sentinel text alone. The two renderings agree everywhere but on the
assistant turns, so the text between one sentinel and the next (the turn-end marker, the turns in
between, the next assistant header) fixes, in the real rendering, where each assistant turn starts
and ends: the mask covers each assistant turn *as the rendering shows it* (its reasoning when the
template keeps it, its tool calls), plus the end-of-turn marker after it (the drafter must learn to
predict the end of an answer). System, user and tool turns are never in it.

Two ways to make samples of a conversation (``per_turn``):
- conversation (default): one sample, the whole conversation rendered once, every assistant turn in
  the loss as that rendering shows it;
- per turn: one sample per assistant turn, rendered as the target saw it when it wrote that turn
  (the conversation up to that turn, as the template renders it then, followed by the turn's whole
  output, reasoning included), only that turn in the loss.
"""

from __future__ import annotations

from target_worker.chat_rows import TEMPLATE_ERROR, RowError

_PROBE_QUESTION, _PROBE_ANSWER = "hsd probe question", "hsd probe answer"


def _sentinel(k: int) -> str:
    return f"\u27e6hsd assistant turn {k}\u27e7"  # brackets on both sides: turn 1 is no prefix of turn 10


def turn_end_marker(tokenizer) -> str:
    """What the template writes right after an assistant turn's text (e.g. ``<|im_end|>``), found by
    rendering a probe conversation; empty when the template writes nothing there."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE_QUESTION},
                                          {"role": "assistant", "content": _PROBE_ANSWER}], tokenize=False)
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        raise ValueError("the tokenizer's chat template does not render assistant turns verbatim")
    return text[at + len(_PROBE_ANSWER):].strip()


def assistant_header(tokenizer) -> str:
    """What the template writes to open an assistant turn (its generation prompt, e.g.
    ``<|im_start|>assistant\\n``); empty when it has none."""
    messages = [{"role": "user", "content": _PROBE_QUESTION}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt[len(plain):] if prompt.startswith(plain) else ""


def render(tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # templates raise whatever jinja raises (e.g. "roles must alternate")
        raise RowError(TEMPLATE_ERROR, f"chat template error: {exc}") from None


def _with_sentinels(messages: list[dict]) -> list[dict]:
    turns = iter(range(len(messages)))
    return [{"role": "assistant", "content": _sentinel(next(turns))} if m["role"] == "assistant" else m
            for m in messages]


def _last_header(fragment: str, header: str) -> tuple[int, int] | None:
    """Where the last assistant header in ``fragment`` starts and ends. A generation prompt that also
    opens the reasoning (``<｜Assistant｜><think>\\n``) is looked for by its longest prefix found."""
    for size in range(len(header), 0, -1):
        at = fragment.rfind(header[:size])
        if at >= 0:
            return at, at + size
    return None


def assistant_spans(text: str, sentinel_text: str, num_turns: int, header: str,
                    turn_end: str) -> list[tuple[int, int] | None]:
    """Character span ``[start, end)`` in ``text`` of each assistant turn (None for one that renders
    as whitespace), from the rendering ``sentinel_text`` of the same conversation with each assistant
    turn's content replaced by its sentinel. A span covers the turn without the whitespace around it
    (templates commonly strip it), and the turn-end marker when it follows right after."""
    def unlocated(what: str) -> RowError:
        return RowError(TEMPLATE_ERROR, f"assistant turn {k + 1}: {what} (the chat template renders the "
                                        "conversation in a way the loss mask cannot follow)")
    spans: list[tuple[int, int] | None] = []
    cursor = sentinel_cursor = 0
    for k in range(num_turns):
        at = sentinel_text.find(_sentinel(k), sentinel_cursor)
        if at < 0:
            raise unlocated("its content is not rendered")
        before = sentinel_text[sentinel_cursor:at]  # the turns since the previous one, then this turn's header
        opened = _last_header(before, header)
        opening = before[:opened[1]] if opened else before
        if not text.startswith(opening, cursor):
            raise unlocated("the text before it differs")
        start = cursor + len(opening)
        sentinel_cursor = at + len(_sentinel(k))
        if k + 1 < num_turns:
            after = sentinel_text[sentinel_cursor:sentinel_text.find(_sentinel(k + 1), sentinel_cursor)]
            next_header = _last_header(after, header)
            closing = after[:next_header[0]] if next_header else after
            end = text.find(closing, start)
        else:
            after = sentinel_text[sentinel_cursor:]
            end = len(text) - len(after) if text.endswith(after) and len(text) - len(after) >= start else -1
        if end < 0:
            raise unlocated("the text after it differs")
        cursor = end
        body = text[start:end]
        if not body.strip():
            spans.append(None)
            continue
        first = start + len(body) - len(body.lstrip())
        last = start + len(body.rstrip())
        if turn_end and text.startswith(turn_end, last):
            last += len(turn_end)
        spans.append((first, last))
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


def rendered_spans(tokenizer, messages: list[dict], header: str, turn_end: str,
                   ) -> tuple[str, list[tuple[int, int] | None]]:
    """The conversation rendered by the template, and the span of each assistant turn in it."""
    text = render(tokenizer, messages)
    num_turns = sum(m["role"] == "assistant" for m in messages)
    return text, assistant_spans(text, render(tokenizer, _with_sentinels(messages)), num_turns, header, turn_end)


def conversation_samples(tokenizer, messages: list[dict], header: str, turn_end: str, *,
                         per_turn: bool = False) -> list[tuple[str, list[tuple[int, int]]]]:
    """The samples of one conversation, each as (rendered text, spans in the loss); see the module
    docstring for the two ways. An assistant turn that renders as whitespace trains nothing."""
    if not per_turn:
        text, spans = rendered_spans(tokenizer, messages, header, turn_end)
        return [(text, [span for span in spans if span is not None])]
    samples = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            text, spans = rendered_spans(tokenizer, messages[:i + 1], header, turn_end)
            if spans[-1] is not None:
                samples.append((text, [spans[-1]]))
    return samples


def tokenize_samples(tokenizer, conversations: list[list[dict]], turn_end: str, *, per_turn: bool = False,
                     ) -> list[list[tuple[list[int], list[int]]] | RowError]:
    """Token ids and loss mask of each sample of each conversation (one batched tokenizer call), or
    the RowError of a conversation the template cannot render."""
    header = assistant_header(tokenizer)
    results: list = [None] * len(conversations)
    texts, spans, where = [], [], []
    for i, messages in enumerate(conversations):
        try:
            samples = conversation_samples(tokenizer, messages, header, turn_end, per_turn=per_turn)
        except RowError as exc:
            results[i] = exc
            continue
        results[i] = []
        for text, sample_spans in samples:
            texts.append(text)
            spans.append(sample_spans)
            where.append(i)
    if texts:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for i, ids, offsets, sample_spans in zip(where, encoded["input_ids"], encoded["offset_mapping"], spans):
            results[i].append((list(ids), mask_from_offsets(offsets, sample_spans)))
    return results


def tokenize_conversations(tokenizer, conversations: list[list[dict]], turn_end: str,
                           ) -> list[tuple[list[int], list[int]] | RowError]:
    """Token ids and loss mask of each whole conversation, or the RowError of one the template
    cannot render."""
    return [result if isinstance(result, RowError) else result[0]
            for result in tokenize_samples(tokenizer, conversations, turn_end)]
