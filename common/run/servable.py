"""``hsd export``: a servable copy of a model's checkpoint, for a serving engine to load.

A run's checkpoint already holds its servable drafter (:func:`common.run.witness.servable_dir`); this
copies that directory out of the run, so that a model can be served (or shipped) while the run
keeps its own checkpoints — which it removes past ``drafter.checkpoint_keep``. The copy is written
beside its destination under a temporary name, fsynced, and renamed: a reader never sees half of
it. The copy holds exactly what the checkpoint's servable part holds, and that must be one set of
weights: engines load every ``*.safetensors`` of a directory without an index.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from common.run.durable import atomic_write
from common.run.witness import (MODELS_DIR, Checkpoint, latest_checkpoint, list_models, model_dir, servable_dir,
                            step_dir_name)

WEIGHTS_SUFFIX = ".safetensors"


class ExportError(ValueError):
    """What a user asked for is not there (run, model, step) or would overwrite something."""


def find_checkpoint(run_dir: str | os.PathLike, *, model: str | None = None, step: int | None = None) -> Checkpoint:
    """The checkpoint of ``model`` (the run's only model when None) at ``step`` (the latest when None)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    models = list_models(run_dir)
    if not models:
        raise ExportError(f"run directory {run_dir} holds no checkpoint ({run_dir / MODELS_DIR} has no model "
                          f"with a latest checkpoint)")
    if model is None:
        if len(models) > 1:
            raise ExportError(f"run directory {run_dir} holds {len(models)} models ({', '.join(models)}): "
                              f"choose one with --model")
        model = models[0]
    elif model not in models:
        raise ExportError(f"model {model!r} has no checkpoint in {run_dir} (models: {', '.join(models)})")
    latest = latest_checkpoint(run_dir, model)
    assert latest is not None  # list_models lists only models with a latest checkpoint
    if step is None or step == latest.step:
        return latest
    path = model_dir(run_dir, model) / step_dir_name(step)
    if not path.is_dir():
        kept = sorted(int(p.name.removeprefix("step-")) for p in model_dir(run_dir, model).glob("step-*"))
        raise ExportError(f"model {model!r} has no checkpoint at step {step} (kept: {', '.join(map(str, kept))})")
    return Checkpoint(model, step, path)


def weights_files(directory: Path) -> list[Path]:
    """Every ``*.safetensors`` under ``directory``, at any depth."""
    return sorted(directory.rglob(f"*{WEIGHTS_SUFFIX}"))


def unnamed_mask_token(config_path: Path) -> str | None:
    """Why a DFlash export would be served with another mask token than the one it trained with, or None.

    SGLang finds the mask id by its text (``dflash_config.mask_token``, default ``<|MASK|>`` when it is
    absent); a drafter whose mask id has no text in the target's tokenizer (an embedding row past the
    tokenizer's tokens) exports no text, so SGLang would feed it another token than it trained on."""
    try:
        doc = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    dflash = doc.get("dflash_config") if isinstance(doc, dict) else None
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash or dflash.get("mask_token"):
        return None
    mask_id = dflash["mask_token_id"]
    return (f"{config_path}: the drafter trained with mask token id {mask_id}, which has no text in the target's "
            f"tokenizer, so dflash_config.mask_token is missing and SGLang would look up its default '<|MASK|>' "
            f"instead of id {mask_id}. Train with dflash.mask_token_id set to a token the tokenizer names (its mask "
            f"token, or a special token added to it for this), or, if the tokenizer you serve with names id "
            f"{mask_id}, add that text as dflash_config.mask_token to {config_path.name} and export again")


def export_servable(checkpoint: Checkpoint, out: str | os.PathLike, *, force: bool = False,
                    mask_token: str | None = None) -> Path:
    """Copy ``checkpoint``'s servable model to ``out``; a non-empty ``out`` is replaced only with ``force``.
    ``mask_token``: the text the serving tokenizer has for the trained mask id, written as
    ``dflash_config.mask_token`` where the target's tokenizer named none (``hsd export --mask-token``)."""
    source = servable_dir(checkpoint)
    if not source.is_dir():
        raise ExportError(f"checkpoint {checkpoint.path} has no servable model ({source} is missing: "
                          f"this backend trains no model a serving engine loads)")
    weights = weights_files(source)
    if len(weights) != 1:
        raise ExportError(f"{source} holds {len(weights)} *{WEIGHTS_SUFFIX} files, not one: "
                          f"{', '.join(str(p.relative_to(source)) for p in weights)}")
    unresolved = unnamed_mask_token(source / "config.json")
    if unresolved is not None and not mask_token:
        raise ExportError(unresolved + " (or give it as hsd export --mask-token TEXT)")
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} is not empty: choose an empty directory, or --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)

    def copy(tmp: Path) -> None:
        shutil.copytree(source, tmp)
        if unresolved is not None:  # the user named the serving tokenizer's text for the trained id
            doc = json.loads((tmp / "config.json").read_text())
            doc["dflash_config"]["mask_token"] = mask_token
            (tmp / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
        for path in [tmp, *tmp.rglob("*")]:  # readable by an engine serving as another user, whatever the source mode
            path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o644))
    return atomic_write(out, copy, durable=True, tmp_name=f".{out.name}.tmp-{os.getpid()}")
