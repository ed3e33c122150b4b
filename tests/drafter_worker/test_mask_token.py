"""The default mask token: the tokenizer's mask token, else a reserved special token absent from
the training data, else an error naming dflash.mask_token_id — never a token of the data."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.run.config import ConfigError, write_resolved
from common.run.prepared import load_tokenizer
from common.run.witness import latest_checkpoint, servable_dir
from dflash_testing import backend_config, make_target
from drafter_worker.dflash.mask_token import CHOICE_FILE, resolve_mask_token_id
from drafter_worker.dflash_backend import DFlashBackend
from drafter_worker.factory import trainer_backend
from tiny_tokenizers import save_tiny_tokenizer, save_word_tokenizer

RESERVED = ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]


def _config(target_dir, tmp_path, data_tokens: list[list[int]] | None = None, *extra: str):
    extra = ("dflash.mask_token_id=-1", *extra)
    if data_tokens is not None:
        data = _dataset(tmp_path / "data", data_tokens, target_dir)
        extra = (f"data.path={data}", *extra)
    return backend_config(target_dir, tmp_path / "run", *extra)


def _dataset(out, sequences: list[list[int]], tokenizer_dir):
    """A prepared dataset holding exactly ``sequences``."""
    from common.run.prepared import FORMAT, MANIFEST_FILE, tokenizer_fingerprint
    from target_worker.prepare import DatasetWriter
    out.mkdir(parents=True)
    writer = DatasetWriter(out)
    for ids in sequences:
        writer.add(ids, [1] * len(ids))
    writer.finish()
    fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer_dir))
    (out / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "num_samples": len(sequences),
                                                 "num_tokens": sum(map(len, sequences)),
                                                 "tokenizer": {"fingerprint": fingerprint}}))
    return out


def _resolve(config, *, vocab_size: int) -> int:
    """The mask token id a DFlash drafter of ``config`` trains with."""
    return resolve_mask_token_id(config.dflash, target=config.target, data=config.data, run_dir=config.run_dir,
                                 vocab_size=vocab_size)


def test_the_tokenizers_mask_token_is_the_default_and_goes_into_the_export(tmp_path):
    target = tmp_path / "target"
    make_target(target)
    save_tiny_tokenizer(target, vocab_size=300)  # its <|mask|> is the tokenizer's mask token
    tokenizer = load_tokenizer(target)
    mask_id = tokenizer.mask_token_id
    assert tokenizer.mask_token == "<|mask|>"
    config = _config(target, tmp_path, [tokenizer("user assistant system")["input_ids"]])
    backend = trainer_backend(config, "drafter-0", backend_class=DFlashBackend, schedule_jobs=4)
    assert backend.trainer.model_config.mask_token_id == mask_id
    backend.save_checkpoint(config.run_dir)
    exported = json.loads((servable_dir(latest_checkpoint(config.run_dir, "drafter-0")) / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == mask_id  # what a serving engine will use
    # The old default, the embedding's last row, is a real token of this vocabulary.
    assert tokenizer.convert_ids_to_tokens(299) not in tokenizer.all_special_tokens


def test_a_reserved_special_token_absent_from_the_data_is_the_default(tmp_path):
    target = tmp_path / "target"
    make_target(target)
    save_word_tokenizer(target, ["hello", "world"], special_tokens=["<|endoftext|>", *RESERVED])
    first, second = (load_tokenizer(target).convert_tokens_to_ids(t) for t in RESERVED)
    assert _resolve(_config(target, tmp_path / "a", [[3, 4, 3]]), vocab_size=300) == first
    # The first reserved token occurs in the data (a text quoting it): the next one is chosen.
    assert _resolve(_config(target, tmp_path / "b", [[3, first, 4]]), vocab_size=300) == second
    with pytest.raises(ConfigError, match="dflash.mask_token_id.*occurs in the training data"):
        _resolve(_config(target, tmp_path / "c", [[first], [4, second]]), vocab_size=300)
    assert _resolve(_config(target, tmp_path / "d", [[first]], "dflash.mask_token_id=7"),
                    vocab_size=300) == 7  # an explicit id is used as given


def test_no_mask_token_and_no_reserved_token_fails_at_start(tmp_path):
    target = tmp_path / "target"
    make_target(target)
    save_word_tokenizer(target, ["hello", "world"], special_tokens=["<|endoftext|>", "<|im_start|>"])
    with pytest.raises(ConfigError, match="dflash.mask_token_id: the target's tokenizer has no mask token"):
        trainer_backend(_config(target, tmp_path, [[2, 3]]), "drafter-0", backend_class=DFlashBackend,
                        schedule_jobs=4)


AGAIN = """
import sys
from common.run.config import load_config
from drafter_worker.dflash.mask_token import resolve_mask_token_id
config = load_config(sys.argv[1])
print(resolve_mask_token_id(config.dflash, target=config.target, data=config.data, run_dir=config.run_dir,
                            vocab_size=300), "transformers" in sys.modules)
"""


def test_the_choice_is_kept_in_the_run_directory_and_made_again_when_the_tokenizer_changes(tmp_path):
    target = tmp_path / "target"
    make_target(target)
    save_word_tokenizer(target, ["hello", "world"], special_tokens=["<|endoftext|>", *RESERVED])
    first = load_tokenizer(target).convert_tokens_to_ids(RESERVED[0])
    config = _config(target, tmp_path, [[3, 4, 3]])
    assert _resolve(config, vocab_size=300) == first
    kept = json.loads((config.run_dir / CHOICE_FILE).read_text())
    assert (kept["token_id"], kept["token"]) == (first, RESERVED[0])
    path = write_resolved(config)

    def again() -> tuple[int, bool]:
        proc = subprocess.run([sys.executable, "-c", AGAIN, str(path)], capture_output=True, text=True, timeout=120,
                              check=True)
        token_id, loaded = proc.stdout.split()
        return int(token_id), loaded == "True"
    # A drafter starting again: the kept choice, no tokenizer loaded (transformers never imported).
    assert again() == (first, False)
    # The tokenizer changed under the run: its reserved tokens moved, the choice is made again.
    save_word_tokenizer(target, ["hello", "world"], special_tokens=["<|endoftext|>", "<|im_start|>", *RESERVED])
    moved = load_tokenizer(target).convert_tokens_to_ids(RESERVED[0])
    assert moved != first and again() == (moved, True)
