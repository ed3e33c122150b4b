"""The synthetic language and the tiny target's tokenizer (no model training here)."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from tiny_tokenizers import save_tiny_tokenizer

from target_worker.synthetic_language import make_splits


def test_splits_are_a_function_of_the_seed():
    first = make_splits(3, num_train=300, num_heldout=20)
    again = make_splits(3, num_train=300, num_heldout=20)
    other = make_splits(4, num_train=300, num_heldout=20)
    assert [c.to_sharegpt() for c in first[0] + first[1]] == [c.to_sharegpt() for c in again[0] + again[1]]
    assert [c.to_sharegpt() for c in first[0]] != [c.to_sharegpt() for c in other[0]]


def test_answers_are_derivable_from_the_conversation():
    train, heldout = make_splits(0, num_train=3000, num_heldout=50)
    answers = defaultdict(set)
    for conversation in train + heldout:
        history = (conversation.system,)
        for question, answer in conversation.turns:
            history += (question,)
            answers[history].add(answer)  # same context, same answer
            history += (answer,)
            if m := re.fullmatch(r"(?:What is (\d) plus (\d)\?|Add (\d) and (\d)\.)", question):
                a, b = (int(x) for x in m.groups() if x is not None)
                assert answer.endswith(f"The answer is {a + b}.")
            if m := re.fullmatch(r"(?:Reverse the list|Say these words backwards): (.*)\.", question):
                assert f"is: {' '.join(m.group(1).split()[::-1])}." in answer
            if m := re.fullmatch(r"(?:Count from|List the numbers from) (\d+) to (\d+)\.", question):
                start, stop = int(m.group(1)), int(m.group(2))
                assert ", ".join(str(n) for n in range(start, stop + 1)) in answer
    assert all(len(options) == 1 for options in answers.values())
    assert not {c.turns[0][0] for c in heldout} & {c.turns[0][0] for c in train}
    assert sum(len(c.turns) > 1 for c in train) > 0.3 * len(train)  # follow-up turns are common
    assert sum(c.system is not None for c in train) > 0.2 * len(train)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_tokenizer_and_chat_template(tokenizer):
    train, _ = make_splits(1, num_train=200, num_heldout=0)
    conversation = next(c for c in train if c.system and len(c.turns) == 2)
    messages = conversation.messages()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<|im_end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # Any text encodes (byte level), and the language's words are mostly single tokens.
    assert tokenizer.decode(tokenizer("zebra ünïcode 123", add_special_tokens=False)["input_ids"]) == "zebra ünïcode 123"
    answer_lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for c in train for _, a in c.turns]
    assert 20 <= min(answer_lengths) and max(answer_lengths) <= 200
