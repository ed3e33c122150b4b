"""The capture contract: which target layers a run captures, and the shape and dtype they have.

A target and a drafter that disagree on it would train on the wrong features without any error
(the bytes still fit a slot when only the layer ids differ), so the contract is derived once from
the target model's ``config.json`` (read by :mod:`common.run.target_config`, as the drafters read it) and
compared wherever two sides meet. Deriving it needs no torch and no weights: the dispatcher, which
imports no model code, sizes its slots from it.

Layer ``i`` is the raw output of decoder layer ``i`` (0-based): the residual stream before any
final norm, which is what vLLM and SGLang feed a drafter (``capture_point`` ``layer_output``). It
equals ``hidden_states[i + 1]`` of a Hugging Face forward with ``output_hidden_states=True`` for
every layer but the last, whose ``hidden_states[N]`` is the final norm's output instead. The
captured layers sit side by side on the feature axis: ``[tokens, K × hidden_size]``; an EAGLE-3
contract (``final_norm``) adds the last decoder state after the final norm as one more block.

A contract without ``capture_point`` predates it (``hidden_states``: the last layer was taken after
the final norm), so states or a drafter from such a run never pass as the current ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import msgspec

from common.run.config.sections import CaptureDtype
from common.run.drafter_family import DEFAULT_OBJECTIVE, family_of
from common.run.target_config import model_shape, read_model_config

CAPTURE_DTYPES = get_args(CaptureDtype)
CAPTURE_POINT = "layer_output"  # every layer's raw output, before any final norm (the engines')
LEGACY_CAPTURE_POINT = "hidden_states"  # a contract that names none: the last layer after the final norm


class CaptureContract(msgspec.Struct, frozen=True):
    """Sent as a msgpack map of its fields (a target's and a drafter's register, the reply)."""
    architecture: str
    num_layers: int  # decoder layers of the target
    hidden_size: int
    layer_ids: tuple[int, ...]  # captured decoder layers, ascending
    dtype: str  # dtype of the captured states (and of the target's forward)
    # The last decoder state after the final norm, one more H-wide block after the layers: an
    # EAGLE-3 drafter turns it into the target's logits with the frozen LM head on its own device,
    # so the slot carries H values a token instead of a vocabulary's worth.
    final_norm: bool = False
    # where a layer's state is taken (see the module docstring); a contract that names none predates it
    capture_point: str = LEGACY_CAPTURE_POINT

    def __post_init__(self) -> None:
        ids = list(self.layer_ids)
        if not ids:
            raise ValueError("a capture contract needs at least one layer")
        if ids != sorted(set(ids)):
            raise ValueError(f"capture layer ids must be distinct and ascending, got {ids}")
        if ids[0] < 0 or ids[-1] >= self.num_layers:
            raise ValueError(f"capture layer ids {ids} are outside the target's layers 0..{self.num_layers - 1}")
        if self.dtype not in CAPTURE_DTYPES:
            raise ValueError(f"capture dtype {self.dtype!r} is not one of {', '.join(CAPTURE_DTYPES)}")

    @property
    def num_capture_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_blocks(self) -> int:
        """H-wide column blocks of a token row: the captured layers, then the final-norm state if any."""
        return self.num_capture_layers + int(self.final_norm)

    @property
    def row_width(self) -> int:
        """Features per token: the captured layers side by side (then the final-norm state)."""
        return self.num_blocks * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack, JSON), as it travels."""
        return {**msgspec.structs.asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> CaptureContract:
        """:meth:`to_dict`'s values as a contract; ValueError naming the field that is missing or wrong."""
        try:
            return msgspec.convert(doc, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"capture contract: {exc}") from None


def build_contract(doc: Mapping[str, Any], *, layer_ids: Sequence[int] = (), num_capture_layers: int = 5,
                   dtype: str, objective: str = DEFAULT_OBJECTIVE) -> CaptureContract:
    """The contract for a parsed ``config.json``: ``layer_ids``, or the default of the drafter family of
    ``objective`` (DFlash: K evenly spaced layers; EAGLE-3: three layers), and the final-norm state if
    the family takes it (:mod:`common.run.drafter_family`)."""
    architecture, num_layers, hidden_size = model_shape(doc)
    family = family_of(objective)
    ids = list(layer_ids) if layer_ids else family.default_layer_ids(num_layers, num_capture_layers)
    return CaptureContract(architecture=architecture, num_layers=num_layers, hidden_size=hidden_size,
                           layer_ids=tuple(ids), dtype=dtype, final_norm=family.final_norm, capture_point=CAPTURE_POINT)


def contract_from_model_dir(model_dir: str | Path, *, layer_ids: Sequence[int] = (), num_capture_layers: int = 5,
                            dtype: str) -> CaptureContract:
    return build_contract(read_model_config(model_dir), layer_ids=layer_ids, num_capture_layers=num_capture_layers,
                          dtype=dtype)


def check_same_contract(ours: CaptureContract, theirs: CaptureContract, *, ours_name: str = "target",
                        theirs_name: str = "drafter") -> None:
    """Raise ValueError naming both sides and every field on which they differ."""
    a, b = ours.to_dict(), theirs.to_dict()
    differences = [f"{key}: {ours_name} {a[key]!r} vs {theirs_name} {b[key]!r}" for key in a if a[key] != b[key]]
    if differences:
        hint = ""
        if a["capture_point"] != b["capture_point"]:
            hint = (f" — {capture_point_hint(a['capture_point'], b['capture_point'])}")
        raise ValueError(f"capture contracts differ between {ours_name} and {theirs_name} ("
                         + "; ".join(differences) + f"){hint}; {ours_name}: {a}, {theirs_name}: {b}")


def capture_point_hint(ours: str, theirs: str) -> str:
    """Why two capture points cannot be mixed, and what to do about it."""
    old = LEGACY_CAPTURE_POINT in (ours, theirs)
    return (f"states taken at {ours!r} and at {theirs!r} are different features"
            + (" (a run or drafter from before the capture point was recorded took the last layer after the "
               "final norm): train it again in a new run directory" if old else ""))


def resolve_capture_dtype(config: Any) -> str:
    """``target.dtype`` with ``auto`` resolved from the config alone, so every process agrees on it
    (:func:`capture_dtype` of ``config.target``)."""
    return capture_dtype(config.target)


def capture_dtype(target: Any) -> str:
    """A ``target`` section's ``dtype`` with ``auto`` resolved from the section alone.

    A real target on the CPU (a model and no ``target.gpus``) runs float32: bf16 matmuls there are
    slow and lossy. Everything else, sim targets included, captures bfloat16.
    """
    if target.dtype != "auto":
        return target.dtype
    return "float32" if target.model and not target.sim and not target.gpus else "bfloat16"


def contract_from_config(config: Any, *, model_config: Mapping[str, Any] | None = None) -> CaptureContract:
    """The run's contract (:func:`contract_of` its ``target`` section and ``drafter.objective``)."""
    return contract_of(config.target, config.drafter.objective, model_config=model_config)


def contract_of(target: Any, objective: str, *, model_config: Mapping[str, Any] | None = None) -> CaptureContract:
    """The contract from ``target.model`` (its ``config.json``), ``target.capture_layers`` or the
    default of the drafter's ``objective``, and the resolved ``target.dtype``."""
    if not target.model:
        raise ValueError("target.model is not set: the capture contract comes from the target model's config.json")
    doc = model_config if model_config is not None else read_model_config(target.model)
    return build_contract(doc, layer_ids=target.capture_layers, num_capture_layers=target.num_capture_layers,
                          dtype=capture_dtype(target), objective=objective)


def adopt_contract(current: CaptureContract | None, contract: CaptureContract, *,
                   theirs_name: str) -> CaptureContract:
    """The run's capture contract once a worker brought ``contract``: the first one sets it, every
    later one must equal it (ValueError naming the fields that differ)."""
    if current is None:
        return contract
    check_same_contract(current, contract, ours_name="this run", theirs_name=theirs_name)
    return current
