"""The tiny target's tokenizer: byte-level BPE trained locally on the synthetic language.

It is saved as a ``PreTrainedTokenizerFast`` directory, so ``AutoTokenizer.from_pretrained(DIR)``
loads it like any Hugging Face tokenizer, with a ChatML chat template (the one Qwen models use)
that renders system/user/assistant turns and supports ``add_generation_prompt``. Byte-level BPE
means any text can be encoded, even outside the synthetic language.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

IM_START, IM_END, PAD, MASK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"
# The tokenizer's mask token: the row of the embedding a DFlash drafter uses for its masked
# positions (it never occurs in the conversations).
SPECIAL_TOKENS = (PAD, IM_START, IM_END, MASK)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer on ``texts``; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD, mask_token=MASK,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                   padding_side="left")


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
