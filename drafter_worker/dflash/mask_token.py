"""The token a DFlash drafter puts at the masked positions of a block, when the config names none.

Every drafted position of a block enters the drafter as this token's embedding, so the token must
mean nothing in the training data: a token that also occurs there (the target embedding's last
row was a frequent word on the project's own tiny target) gives the drafter the same input for
"a masked position" and "this word", and at serving time the engine uses the id the export names.

With ``dflash.mask_token_id`` unset (-1) the default is, in order:

1. the tokenizer's own mask token (``tokenizer.mask_token``, or an added special token named as
   one: ``<mask>``, ``[MASK]``, ``<|mask|>``), when it has one;
2. else a special token the tokenizer reserves for later use — an added special token whose name
   says so (``reserved`` or ``unused``: Llama 3's ``<|reserved_special_token_0|>``, Gemma's
   ``<unused0>``), lowest id first;

skipping any candidate that occurs in the prepared training data (``data.path``) or is not a row
of the target's embedding. With none left the drafter fails at start, naming
``dflash.mask_token_id``. An explicit id is used as given.

The choice is kept in the run directory (``mask_token.json``), under a key made of the target's
tokenizer files, the dataset's manifest and token file, and the embedding's size: a drafter that
starts again, or joins a group, reads it there instead of loading the tokenizer (transformers) and
scanning the data; anything the choice depends on changing makes it choose again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from common.run.config import ConfigError, DataSection, TargetSection
from common.run.durable import atomic_write
from drafter_worker.dflash.section import DFlashSection

log = logging.getLogger("hsd.dflash")

KEY = "dflash.mask_token_id"
UNSET = -1
_RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)
_MASK_NAME = re.compile(r"^(<\|?mask\|?>|\[mask\])$", re.IGNORECASE)
_SCAN_CHUNK = 1 << 24  # tokens compared at once when the data is searched for a candidate
CHOICE_FILE = "mask_token.json"  # in the run directory: {"key": ..., "token_id": ..., "token": ..., "why": ...}
# Files of a model directory a tokenizer is read from (transformers' names, all versions).
_TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|"
                              r"chat_template\..*|.*\.model)$")


@dataclass(frozen=True)
class MaskToken:
    token_id: int
    token: str
    why: str  # which rule chose it, for the log line


def candidate_tokens(tokenizer) -> list[tuple[int, str, str]]:
    """(id, token, rule) in the order the default prefers them: the mask token, then reserved tokens."""
    special = sorted((int(token_id), added.content)
                     for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special)
    candidates: list[tuple[int, str, str]] = []
    if getattr(tokenizer, "mask_token", None):
        candidates.append((int(tokenizer.mask_token_id), str(tokenizer.mask_token), "the tokenizer's mask token"))
    candidates += [(token_id, token, "the tokenizer's mask token") for token_id, token in special
                   if _MASK_NAME.match(token)]
    candidates += [(token_id, token, "a reserved special token of the tokenizer") for token_id, token in special
                   if _RESERVED_NAME.search(token)]
    unique: dict[int, tuple[int, str, str]] = {}
    for candidate in candidates:
        unique.setdefault(candidate[0], candidate)
    return list(unique.values())


def choose_mask_token(tokenizer, *, vocab_size: int, occurs_in_data: Callable[[int], bool]) -> MaskToken:
    """The default mask token (the module's rules), or a ConfigError naming ``dflash.mask_token_id``."""
    rejected = []
    for token_id, token, why in candidate_tokens(tokenizer):
        if not 0 <= token_id < vocab_size:
            rejected.append(f"{token!r} (id {token_id}) is not a row of the target's embedding ({vocab_size} rows)")
        elif occurs_in_data(token_id):
            rejected.append(f"{token!r} (id {token_id}) occurs in the training data")
        else:
            return MaskToken(token_id, token, why)
    tried = f"; tried: {'; '.join(rejected)}" if rejected else ""
    raise ConfigError(f"{KEY}: the target's tokenizer has no mask token and no reserved special token that never "
                      f"occurs in the training data{tried}. Set {KEY} to the id of a token that never occurs in "
                      f"the data (e.g. one added to the tokenizer for this purpose)")


def token_occurs(tokens: np.ndarray, token_id: int) -> bool:
    """Whether ``token_id`` occurs in ``tokens`` (a memory-mapped token file, read in chunks)."""
    for start in range(0, len(tokens), _SCAN_CHUNK):
        if (tokens[start:start + _SCAN_CHUNK] == token_id).any():
            return True
    return False


def choice_key(target: TargetSection, data: DataSection, *, vocab_size: int) -> str:
    """What the default depends on: the tokenizer's files (``target.model``), the dataset's manifest
    and token file (``data.path``; size and modification time: the data is not read), the embedding's
    size."""
    from common.run.prepared import MANIFEST_FILE, TOKENS_FILE
    digest = hashlib.sha256(f"vocab_size={vocab_size}".encode())
    model_dir = Path(target.model)
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and _TOKENIZER_FILES.match(path.name):
            digest.update(f"\0{path.name}\0".encode())
            digest.update(path.read_bytes())
    if data.path:
        data_dir = Path(data.path)
        digest.update((data_dir / MANIFEST_FILE).read_bytes())
        tokens = (data_dir / TOKENS_FILE).stat()
        digest.update(f"\0{tokens.st_size}:{tokens.st_mtime_ns}".encode())
    return digest.hexdigest()


def _read_choice(path: Path, key: str) -> MaskToken | None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return MaskToken(int(doc["token_id"]), str(doc["token"]), str(doc["why"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_choice(path: Path, key: str, chosen: MaskToken) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"key": key, "token_id": chosen.token_id, "token": chosen.token, "why": chosen.why}
        atomic_write(path, json.dumps(doc), tmp_name=f"{path.name}.{os.getpid()}.tmp")
    except OSError as exc:  # the next start chooses again
        log.warning("the mask token choice was not kept in %s: %s", path, exc)


def resolve_mask_token_id(dflash: DFlashSection, *, target: TargetSection, data: DataSection,
                          run_dir: str | os.PathLike, vocab_size: int) -> int:
    """``dflash.mask_token_id``, or its default from ``target.model``'s tokenizer and ``data.path``
    (as chosen before in ``run_dir``, the run directory, when nothing it depends on changed)."""
    if dflash.mask_token_id != UNSET:
        return dflash.mask_token_id
    key = choice_key(target, data, vocab_size=vocab_size) if Path(target.model).is_dir() else None
    kept = Path(run_dir) / CHOICE_FILE
    chosen = _read_choice(kept, key) if key else None
    if chosen is not None:
        log.info("%s unset: the mask token is %r (id %d), %s, absent from the training data (as chosen before, %s)",
                 KEY, chosen.token, chosen.token_id, chosen.why, kept)
        return chosen.token_id
    from common.run.prepared import PreparedDataset, load_tokenizer
    tokenizer = load_tokenizer(target.model)
    tokens = PreparedDataset(data.path).tokens if data.path else np.zeros(0, dtype=np.int32)
    chosen = choose_mask_token(tokenizer, vocab_size=vocab_size, occurs_in_data=lambda i: token_occurs(tokens, i))
    log.info("%s unset: the mask token is %r (id %d), %s, absent from the training data", KEY, chosen.token,
             chosen.token_id, chosen.why)
    if key:
        _write_choice(kept, key, chosen)
    return chosen.token_id


def mask_token_text(target_dir: str, token_id: int) -> str:
    """The text of ``token_id`` in the target's tokenizer ("" when the target has none that names it):
    exported as ``dflash_config.mask_token`` beside the id, for engines that look the id up by text."""
    from common.run.prepared import load_tokenizer
    try:
        token = load_tokenizer(target_dir).convert_ids_to_tokens(int(token_id))
    except (OSError, ValueError, KeyError, IndexError):
        return ""
    return token if isinstance(token, str) else ""
