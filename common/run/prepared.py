"""A prepared dataset directory (written by ``hsd prepare``), read through memory maps.

Layout of DATA_DIR (all binary files little-endian, samples in input order):

- ``tokens.u32``   every sample's token ids, concatenated (uint32)
- ``loss_mask.u8`` one byte per token: 1 on assistant tokens, 0 elsewhere
- ``offsets.u64``  ``num_samples + 1`` offsets (uint64): sample i is ``[offsets[i], offsets[i+1])``
- ``lengths.txt``  one sample length per line (what the dispatcher's schedule reads)
- ``manifest.json`` counts, length histogram, skipped rows by reason, source, the tokenizer
  fingerprint, and each file's size and block checksums; written last, so a directory without it
  is not a finished dataset.

Nothing is loaded into memory on open: a sample is a view into the mapped files. The tokenizer
fingerprint ties the token ids to the tokenizer that produced them; the target worker refuses a
dataset prepared with another tokenizer (:func:`check_tokenizer`).

:func:`validate_prepared` checks a whole directory in one pass before a run starts (the files
agree with each other, with ``lengths.txt`` and with the manifest's counts and checksums) and
raises :class:`DataError` naming the file and the first bad sample.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "hsd-prepared-v1"
TOKENS_FILE = "tokens.u32"
LOSS_MASK_FILE = "loss_mask.u8"
OFFSETS_FILE = "offsets.u64"
LENGTHS_FILE = "lengths.txt"
MANIFEST_FILE = "manifest.json"
TOKEN_DTYPE, MASK_DTYPE, OFFSET_DTYPE = np.dtype("<u4"), np.dtype("u1"), np.dtype("<u8")
DATA_FILES = (TOKENS_FILE, LOSS_MASK_FILE, OFFSETS_FILE, LENGTHS_FILE)
# crc32 per block of each file: zlib's crc32 reads about 4 GB/s (blake2b 0.8), so checking a dataset
# costs a read of it, and a mismatch is placed within one block (its first sample is named).
CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_BLOCK_BYTES = 16 << 20
PREPARE_AGAIN = "run hsd prepare again"

log = logging.getLogger("hsd.data")


class DataError(ValueError):
    """A prepared dataset (or lengths file) that cannot be used as it is; the message names the
    file, what is wrong with it, the first bad sample and what to do."""


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path} is missing (an interrupted prepare, or a file removed since): {PREPARE_AGAIN}")
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class PreparedDataset:
    """``len(ds)``, ``ds.lengths``, ``ds.sample(i) -> (input_ids, loss_mask)`` (memory-mapped views)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise DataError(f"{self.path} is not a prepared dataset (no {MANIFEST_FILE}; run hsd prepare)")
        self.manifest: dict = read_manifest(self.path)
        self.tokens = _map(self.path / TOKENS_FILE, TOKEN_DTYPE)
        self.loss_mask = _map(self.path / LOSS_MASK_FILE, MASK_DTYPE)
        self.offsets = _map(self.path / OFFSETS_FILE, OFFSET_DTYPE)
        num_samples = self.manifest["num_samples"]
        if (len(self.offsets) != num_samples + 1 or int(self.offsets[-1]) != len(self.tokens)
                or len(self.loss_mask) != len(self.tokens)):
            raise DataError(f"{self.path}: token, mask and offset files do not match the manifest "
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


def read_manifest(path: Path) -> dict:
    """``path``'s manifest, refused (DataError) when missing, unreadable or of another format."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise DataError(f"{path} is not a prepared dataset (no {MANIFEST_FILE}; run hsd prepare)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{manifest_path} cannot be read ({exc}): {PREPARE_AGAIN}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: unknown dataset format {found!r} (this version reads {FORMAT})")
    num_samples = manifest.get("num_samples")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
        raise DataError(f"{manifest_path}: num_samples is {num_samples!r}, not a count: {PREPARE_AGAIN}")
    return manifest


class BlockChecksums:
    """The crc32 of each ``CHECKSUM_BLOCK_BYTES`` block of a byte stream fed in pieces of any size."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.size = 0
        self._crc = 0
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHECKSUM_BLOCK_BYTES - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == CHECKSUM_BLOCK_BYTES:
                self.blocks.append(self._crc)
                self._crc, self._filled = 0, 0

    def record(self) -> dict:
        """What the manifest keeps of a file: its size and its blocks' checksums (hex)."""
        blocks = self.blocks + ([self._crc] if self._filled else [])
        return {"bytes": self.size, CHECKSUM_ALGORITHM: [f"{crc:08x}" for crc in blocks]}


def file_checksums(path: Path) -> dict:
    """:meth:`BlockChecksums.record` of the file at ``path``."""
    checksums = BlockChecksums()
    buffer = bytearray(CHECKSUM_BLOCK_BYTES)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            checksums.update(memoryview(buffer)[:read])
    return checksums.record()


def checksums_section(records: dict[str, dict]) -> dict:
    """The manifest's ``checksums``: file name -> its size and block checksums."""
    return {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": CHECKSUM_BLOCK_BYTES, "files": records}


@dataclass(frozen=True)
class PreparedSummary:
    """What :func:`validate_prepared` found: the samples' lengths (int64) and whether checksums were checked."""
    path: Path
    lengths: np.ndarray
    num_tokens: int
    checksummed: bool

    @property
    def num_samples(self) -> int:
        return len(self.lengths)


def parse_lengths(path: Path) -> np.ndarray:
    """Every line of a prepared ``lengths.txt``: line ``i + 1`` is sample ``i``'s positive length."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    try:
        lengths = np.array(lines, dtype=np.int64) if lines else np.zeros(0, dtype=np.int64)
    except (ValueError, OverflowError):
        lengths = None
    if lengths is not None and (len(lengths) == 0 or lengths.min() > 0):
        return lengths
    values = []
    for number, line in enumerate(lines, start=1):
        text = line.decode(errors="replace").strip()
        if not text.isascii() or not text.isdigit() or int(text) <= 0:
            raise DataError(f"{path}: line {number} (sample {number - 1}) is {text!r}, not a positive length: "
                            f"{PREPARE_AGAIN}")
        values.append(int(text))
    return np.asarray(values, dtype=np.int64)


def _first_sample_at(offsets: np.ndarray, token: int) -> int:
    """The sample that holds token position ``token`` (the last one if it is past the end)."""
    return max(0, min(int(np.searchsorted(offsets, token, side="right")) - 1, len(offsets) - 2))


def _check_structure(path: Path, manifest: dict, lengths: np.ndarray) -> np.ndarray:
    """Sizes against lengths.txt, each other and the manifest's count; returns the offsets."""
    num_samples = manifest["num_samples"]
    lengths_path, offsets_path = path / LENGTHS_FILE, path / OFFSETS_FILE
    if len(lengths) != num_samples:
        if len(lengths) < num_samples:
            raise DataError(f"{lengths_path} holds {len(lengths)} lengths but {MANIFEST_FILE} says {num_samples} "
                            f"samples: sample {len(lengths)} (line {len(lengths) + 1}) and later have none (a cut-short "
                            f"file?): {PREPARE_AGAIN}")
        raise DataError(f"{lengths_path} holds {len(lengths)} lengths but {MANIFEST_FILE} says {num_samples} samples: "
                        f"line {num_samples + 1} and later belong to no sample: {PREPARE_AGAIN}")
    size = offsets_path.stat().st_size
    if size % OFFSET_DTYPE.itemsize or size // OFFSET_DTYPE.itemsize != num_samples + 1:
        whole = size // OFFSET_DTYPE.itemsize
        raise DataError(f"{offsets_path} is {size} bytes, {whole} offsets, where {num_samples} samples need "
                        f"{num_samples + 1}: sample {max(0, min(whole - 1, num_samples))} is the first without both "
                        f"ends: {PREPARE_AGAIN}")
    offsets = np.fromfile(offsets_path, dtype=OFFSET_DTYPE).astype(np.int64)
    if offsets[0] != 0:
        raise DataError(f"{offsets_path}: sample 0 starts at token {offsets[0]}, not 0: {PREPARE_AGAIN}")
    wrong = np.flatnonzero(np.diff(offsets) != lengths)
    if len(wrong):
        i = int(wrong[0])
        raise DataError(f"{lengths_path}: line {i + 1} says sample {i} has {lengths[i]} tokens, {offsets_path.name} "
                        f"gives it {offsets[i + 1] - offsets[i]} ({len(wrong)} sample(s) disagree): {PREPARE_AGAIN}")
    num_tokens = int(offsets[-1])
    for name, dtype in ((TOKENS_FILE, TOKEN_DTYPE), (LOSS_MASK_FILE, MASK_DTYPE)):
        size = (path / name).stat().st_size
        held = size // dtype.itemsize
        if size % dtype.itemsize or held != num_tokens:
            what = (f"sample {_first_sample_at(offsets, held)} is the first cut short" if held < num_tokens
                    else "more than the samples cover" if held > num_tokens else "a token cut in two")
            raise DataError(f"{path / name} is {size} bytes, {held} tokens, where {offsets_path.name} needs "
                            f"{num_tokens}: {what}: {PREPARE_AGAIN}")
    recorded_tokens = manifest.get("num_tokens")
    if recorded_tokens is not None and recorded_tokens != num_tokens:
        raise DataError(f"{path / MANIFEST_FILE} says {recorded_tokens} tokens, the files hold {num_tokens}: "
                        f"{PREPARE_AGAIN}")
    return offsets


def _sample_at_byte(name: str, data_path: Path, offsets: np.ndarray, byte: int) -> int:
    """The first sample whose data lies at or after byte ``byte`` of file ``name``."""
    if name == TOKENS_FILE:
        return _first_sample_at(offsets, byte // TOKEN_DTYPE.itemsize)
    if name == LOSS_MASK_FILE:
        return _first_sample_at(offsets, byte)
    if name == OFFSETS_FILE:
        return max(0, min(byte // OFFSET_DTYPE.itemsize - 1, len(offsets) - 2))
    with open(data_path, "rb") as f:  # lengths.txt: the line the byte is on
        return f.read(byte).count(b"\n")


def _check_checksums(path: Path, recorded: dict, offsets: np.ndarray) -> None:
    if recorded.get("algorithm") != CHECKSUM_ALGORITHM or recorded.get("block_bytes") != CHECKSUM_BLOCK_BYTES:
        raise DataError(f"{path / MANIFEST_FILE}: checksums of an unknown kind ({recorded.get('algorithm')!r}, blocks "
                        f"of {recorded.get('block_bytes')!r} bytes; this version writes {CHECKSUM_ALGORITHM} over "
                        f"{CHECKSUM_BLOCK_BYTES}): {PREPARE_AGAIN}")
    files = recorded.get("files", {})
    for name in DATA_FILES:
        want = files.get(name)
        if want is None:
            raise DataError(f"{path / MANIFEST_FILE} records no checksum of {name}: {PREPARE_AGAIN}")
        data_path = path / name
        got = file_checksums(data_path)
        if got["bytes"] != want["bytes"]:
            raise DataError(f"{data_path} is {got['bytes']} bytes, hsd prepare wrote {want['bytes']}: the file changed "
                            f"after it was prepared: {PREPARE_AGAIN}")
        bad = next((b for b, (g, w) in enumerate(zip(got[CHECKSUM_ALGORITHM], want[CHECKSUM_ALGORITHM])) if g != w),
                   None)
        if bad is not None:
            start = bad * CHECKSUM_BLOCK_BYTES
            end = min(start + CHECKSUM_BLOCK_BYTES, got["bytes"])
            sample = _sample_at_byte(name, data_path, offsets, start)
            raise DataError(f"{data_path}: bytes {start}-{end} differ from what hsd prepare wrote ({CHECKSUM_ALGORITHM} "
                            f"{got[CHECKSUM_ALGORITHM][bad]}, recorded {want[CHECKSUM_ALGORITHM][bad]}), from sample "
                            f"{sample} on: the file changed after it was prepared: {PREPARE_AGAIN}")


def validate_prepared(path: str | os.PathLike) -> PreparedSummary:
    """Check the prepared dataset at ``path`` in one pass before anything reads it: every file is
    there, ``lengths.txt`` parses line by line, its count is the manifest's ``num_samples``, each
    length is its sample's span in ``offsets.u64``, the token and mask files hold exactly those
    tokens, and each file's checksums match the manifest's (a manifest written before checksums
    were recorded is checked by sizes alone, which is logged). Raises DataError naming the file and
    the first bad sample."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"prepared dataset {path} does not exist (run hsd prepare)")
    manifest = read_manifest(path)
    for name in DATA_FILES:
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing (an interrupted prepare, or a file removed since): "
                            f"{PREPARE_AGAIN}")
    lengths = parse_lengths(path / LENGTHS_FILE)
    offsets = _check_structure(path, manifest, lengths)
    recorded = manifest.get("checksums")
    if recorded is None:
        log.info("%s records no checksums (written by an older hsd prepare): %s checked by sizes only",
                 path / MANIFEST_FILE, path)
    else:
        _check_checksums(path, recorded, offsets)
    return PreparedSummary(path=path, lengths=lengths, num_tokens=int(offsets[-1]), checksummed=recorded is not None)


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
