"""A prepared dataset of made-up token ids, written as ``hsd prepare`` writes one (its manifest
with the files' checksums, or without them as older versions wrote it), for the data checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.run.prepared import FORMAT, MANIFEST_FILE
from target_worker.prepare import DatasetWriter


def write_prepared(out_dir: Path, lengths: list[int], *, checksums: bool = True, seed: int = 0) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = DatasetWriter(out_dir)
    for length in lengths:
        writer.add(rng.integers(1, 1000, size=length).tolist(), [0] * (length // 2) + [1] * (length - length // 2))
    writer.finish()
    manifest = {"format": FORMAT, "num_samples": len(lengths), "num_tokens": int(sum(lengths)),
                "tokenizer": {"fingerprint": "made-up-token-ids"}}
    if checksums:
        manifest["checksums"] = writer.checksums_section()
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out_dir
