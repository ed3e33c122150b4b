"""Small tokenizers for tests: the tiny target's tokenizer builder, trained on a little synthetic text."""

from __future__ import annotations

from pathlib import Path

from target_worker.synthetic_language import make_splits
from target_worker.tiny_tokenizer import build_tokenizer


def save_tiny_tokenizer(out_dir: Path, *, seed: int = 0, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer with the ChatML template on 200 synthetic conversations."""
    train, _ = make_splits(seed, num_train=200, num_heldout=0)
    texts = [text for c in train for turn in c.turns for text in turn] + ["system user assistant"]
    build_tokenizer(texts, vocab_size=vocab_size).save_pretrained(str(out_dir))
    return out_dir


def save_word_tokenizer(out_dir: Path, words: list[str], *, special_tokens: list[str]) -> Path:
    """A whitespace word-level tokenizer: ``special_tokens`` first (ids 0, 1, ...), then ``words``.
    Only the special tokens given are special: no mask token unless one is named like one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*special_tokens, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=special_tokens[0],
                                        additional_special_tokens=special_tokens[1:])
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
