"""A small synthetic chat language the tiny demo target is trained on.

Every answer is a function of the conversation so far: the same questions (with the same history)
always get the same answer, so a trained model's greedy answers can be scored token by token
against the reference. The answers mix fixed phrasing (easy, a drafter should get it nearly always)
with content that needs the context: copying and reversing word lists, counting ranges, one-digit
sums, multiplication tables, spelling, and follow-up turns that refer to the previous answer. That
spread is what gives a block drafter something to learn at every look-ahead distance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORDS = (
    "red blue green yellow black white orange purple "
    "cat dog bird fish horse cow sheep goat mouse lion "
    "apple banana cherry grape lemon mango peach pear plum melon "
    "book chair table lamp door window cup spoon"
).split()

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You answer briefly and exactly.")
# Share of conversations that open with a system prompt, and that get a follow-up turn.
SYSTEM_SHARE = 0.3
FOLLOW_UP_SHARE = 0.4


@dataclass
class Conversation:
    """One conversation: an optional system prompt and alternating (question, answer) turns."""
    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)

    def to_sharegpt(self) -> dict:
        rows = [{"from": "system", "value": self.system}] if self.system else []
        for question, answer in self.turns:
            rows += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        return {"conversations": rows}

    def messages(self) -> list[dict]:
        rows = [{"role": "system", "content": self.system}] if self.system else []
        for question, answer in self.turns:
            rows += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return rows


def _words(items) -> str:
    return " ".join(str(item) for item in items)


def _numbers(items) -> str:
    return ", ".join(str(item) for item in items)


# Each task returns (question, answer, items): items is what a follow-up turn may refer to.

def _task_repeat(rng: random.Random):
    items = rng.sample(WORDS, rng.randint(4, 12))
    question = rng.choice(("Repeat these words: {}.", "Say these words again: {}.", "Copy this list: {}."))
    answer = (f"Here are the words again: {_words(items)}. That is {len(items)} words, "
              f"starting with {items[0]} and ending with {items[-1]}.")
    return question.format(_words(items)), answer, items


def _task_reverse(rng: random.Random):
    items = rng.sample(WORDS, rng.randint(4, 10))
    question = rng.choice(("Reverse the list: {}.", "Say these words backwards: {}."))
    answer = (f"The list in reverse order is: {_words(items[::-1])}. "
              f"The first word was {items[0]} and the last word was {items[-1]}.")
    return question.format(_words(items)), answer, items


def _task_count(rng: random.Random):
    start = rng.randint(0, 60)
    stop = start + rng.randint(5, 30)
    items = list(range(start, stop + 1))
    question = rng.choice(("Count from {} to {}.", "List the numbers from {} to {}."))
    answer = f"Counting from {start} to {stop}: {_numbers(items)}. Done, I stopped at {stop}."
    return question.format(start, stop), answer, items


def _task_add(rng: random.Random):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    question = rng.choice(("What is {} plus {}?", "Add {} and {}."))
    answer = f"To add {a} and {b}, we sum them: {a} + {b} = {a + b}. The answer is {a + b}."
    return question.format(a, b), answer, [a, b, a + b]


def _task_table(rng: random.Random):
    base, upto = rng.randint(2, 9), rng.randint(5, 12)
    items = [base * k for k in range(1, upto + 1)]
    question = rng.choice(("Give the multiplication table of {} up to {}.", "Multiply {} by 1 to {}."))
    lines = ", ".join(f"{base} x {k} = {base * k}" for k in range(1, upto + 1))
    answer = f"The multiplication table of {base} up to {upto}: {lines}. That is the table of {base}."
    return question.format(base, upto), answer, items


def _task_spell(rng: random.Random):
    word = rng.choice(WORDS)
    question = rng.choice(("Spell the word {}.", "How do you spell {}?"))
    answer = (f"The word {word} is spelled {' - '.join(word)}. "
              f"It has {len(word)} letters, from {word[0]} to {word[-1]}.")
    return question.format(word), answer, list(word)


TASKS = (_task_repeat, _task_reverse, _task_count, _task_add, _task_table, _task_spell)


def _follow_up(rng: random.Random, items: list) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        return "Now say them in reverse.", (f"In reverse: {_words(items[::-1])}. That is all {len(items)} of them "
                                            f"backwards, from {items[-1]} back to {items[0]}.")
    if kind == 1:
        return "How many were there, and which came first and last?", (
            f"There were {len(items)} of them. The first was {items[0]} and the last was {items[-1]}. "
            f"In order they were: {_words(items)}.")
    return "Say the first three again.", (f"The first three were: {_words(items[:3])}. After them came "
                                          f"{len(items) - 3} more, and the last one was {items[-1]}.")


def make_conversation(rng: random.Random) -> Conversation:
    conversation = Conversation(system=rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_SHARE else None)
    question, answer, items = rng.choice(TASKS)(rng)
    conversation.turns.append((question, answer))
    if rng.random() < FOLLOW_UP_SHARE:
        conversation.turns.append(_follow_up(rng, items))
    return conversation


def make_splits(seed: int, *, num_train: int, num_heldout: int) -> tuple[list[Conversation], list[Conversation]]:
    """A train split and held-out conversations whose first questions never occur in the train split."""
    rng = random.Random(seed)
    train = [make_conversation(rng) for _ in range(num_train)]
    seen = {conversation.turns[0][0] for conversation in train}
    heldout: list[Conversation] = []
    while len(heldout) < num_heldout:
        conversation = make_conversation(rng)
        if conversation.turns[0][0] not in seen:
            seen.add(conversation.turns[0][0])
            heldout.append(conversation)
    return train, heldout
