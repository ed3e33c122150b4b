"""A prepared dataset directory (written by ``hsd prepare``), read through memory maps.

Layout of DATA_DIR (all binary files little-endian, samples in input order):

- ``tokens.u32``   every sample's token ids, concatenated (uint32)
- ``loss_mask.u8`` one byte per token: 1 on assistant tokens, 0 elsewhere
- ``offsets.u64``  ``num_samples + 1`` offsets (uint64): sample i is ``[offsets[i], offsets[i+1])``
- ``lengths.txt``  one sample length per line (what the dispatcher's schedule reads)
- ``manifest.json`` counts, length histogram, skipped rows by reason, source, and the tokenizer
  fingerprint; written last, so a directory without it is not a finished dataset.

Nothing is loaded into memory on open: a sample is a view into the mapped files. The tokenizer
fingerprint ties the token ids to the tokenizer that produced them; the target worker refuses a
dataset prepared with another tokenizer (:func:`check_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

FORMAT = "hsd-prepared-v1"
TOKENS_FILE = "tokens.u32"
LOSS_MASK_FILE = "loss_mask.u8"
OFFSETS_FILE = "offsets.u64"
LENGTHS_FILE = "lengths.txt"
MANIFEST_FILE = "manifest.json"
TOKEN_DTYPE, MASK_DTYPE, OFFSET_DTYPE = np.dtype("<u4"), np.dtype("u1"), np.dtype("<u8")


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class PreparedDataset:
    """``len(ds)``, ``ds.lengths``, ``ds.sample(i) -> (input_ids, loss_mask)`` (memory-mapped views)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise ValueError(f"{self.path} is not a prepared dataset (no {MANIFEST_FILE}; run hsd prepare)")
        self.manifest: dict = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path}: unknown dataset format {self.manifest.get('format')!r} "
                             f"(this version reads {FORMAT})")
        self.tokens = _map(self.path / TOKENS_FILE, TOKEN_DTYPE)
        self.loss_mask = _map(self.path / LOSS_MASK_FILE, MASK_DTYPE)
        self.offsets = _map(self.path / OFFSETS_FILE, OFFSET_DTYPE)
        num_samples = self.manifest["num_samples"]
        if (len(self.offsets) != num_samples + 1 or int(self.offsets[-1]) != len(self.tokens)
                or len(self.loss_mask) != len(self.tokens)):
            raise ValueError(f"{self.path}: token, mask and offset files do not match the manifest "
                             "(an interrupted or mixed-up prepare? run hsd prepare again)")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64)

    @property
    def fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)} samples")
        index %= len(self)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.loss_mask[start:end]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over what decides the token ids: the tokenizer's full definition (vocab, merges,
    normalizer, added tokens) and its chat template. Runtime padding/truncation settings are left
    out, so the same tokenizer hashes the same however it was last called."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("padding", None)
        definition.pop("truncation", None)
    else:
        definition = {"vocab": sorted(tokenizer.get_vocab().items())}
    digest.update(json.dumps(definition, sort_keys=True).encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return digest.hexdigest()


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(f"tokenizer directory {tokenizer_dir} does not exist")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def check_tokenizer(dataset: PreparedDataset | str | os.PathLike, tokenizer_dir: str | os.PathLike) -> None:
    """Raise ValueError when ``dataset`` was prepared with a tokenizer other than ``tokenizer_dir``'s."""
    if not isinstance(dataset, PreparedDataset):
        dataset = PreparedDataset(dataset)
    actual = tokenizer_fingerprint(load_tokenizer(tokenizer_dir))
    if actual != dataset.fingerprint:
        prepared_with = dataset.manifest["tokenizer"].get("path", "?")
        raise ValueError(f"dataset {dataset.path} was prepared with another tokenizer: its fingerprint is "
                         f"{dataset.fingerprint} ({prepared_with}), the tokenizer in {tokenizer_dir} has "
                         f"{actual}; prepare the dataset again with this tokenizer")
