"""The byte layout of a hidden-state slot, without torch.

Every process of a run agrees on this layout; the dispatcher needs it only to size the pool and to
check the capture contract, so it lives apart from the torch views (:mod:`common.dataplane.slots`), and a
dispatcher never pays for importing torch. It travels in the register reply's transport descriptor
(:mod:`common.run.descriptors`) as a msgpack map of its fields and ``slot_bytes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from common.run.capture_contract import CaptureContract, contract_from_config, resolve_capture_dtype
from common.run.records.schedule import max_seqs_per_batch

if TYPE_CHECKING:
    import torch

# Bytes per element of each slot dtype; torch is needed only to view the bytes (common/dataplane/slots.py).
DTYPE_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

HEADER_BYTES = 256
REGION_ALIGN = 64
SLOT_ALIGN = 4096


class StaleSlotError(RuntimeError):
    """The slot no longer holds the generation the reader was given: it was (or is being) rewritten."""

    def __init__(self, expected: int, found: int, when: str):
        super().__init__(f"stale slot: expected generation {expected}, found {found} {when} the copy")
        self.expected = expected
        self.found = found


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def format_bytes(n: int) -> str:
    """Decimal units, one decimal: what a user compares against ``df`` and ``free -h``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class SlotLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Byte layout of one slot; identical in every process of a run (sent in the register reply)."""

    tokens_per_batch: int
    num_layers: int
    hidden_size: int
    dtype: str
    max_seqs: int
    # Bytes per slot, computed here; one received that this build computes otherwise means the
    # sender runs another hsdispatch version (0: compute it).
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"slot dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        for name in ("tokens_per_batch", "num_layers", "hidden_size", "max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"slot layout {name} must be a positive integer, got {value!r}")
        if self.max_seqs > self.tokens_per_batch:
            raise ValueError(f"slot layout max_seqs ({self.max_seqs}) exceeds tokens_per_batch ({self.tokens_per_batch})")
        computed = _align(self.seq_lens_offset + self.seq_lens_bytes, SLOT_ALIGN)
        if self.slot_bytes == 0:
            msgspec.structs.force_setattr(self, "slot_bytes", computed)
        elif self.slot_bytes != computed:
            raise ValueError(f"slot layout says {self.slot_bytes} bytes per slot but this build computes "
                             f"{computed}: the processes run different hsdispatch versions")

    @classmethod
    def from_config(cls, config: Any) -> SlotLayout:
        """The run's layout: from the target model's capture contract when ``target.model`` is set (and
        the targets are real), else from the hand-set ``target.hidden_size``/``num_capture_layers`` (sim)."""
        if config.target.model and not config.target.sim:
            return cls.from_contract(contract_from_config(config), config.schedule)
        target = config.target
        return cls(
            tokens_per_batch=config.schedule.tokens_per_batch,
            num_layers=len(target.capture_layers) or target.num_capture_layers,
            hidden_size=target.hidden_size,
            dtype=resolve_capture_dtype(config),
            max_seqs=cls._max_seqs(config.schedule),
        )

    @classmethod
    def from_contract(cls, contract: CaptureContract, schedule: Any) -> SlotLayout:
        """Slots sized for a capture contract and the schedule's token budget (``config.schedule``)."""
        return cls(tokens_per_batch=schedule.tokens_per_batch, num_layers=contract.num_blocks,
                   hidden_size=contract.hidden_size, dtype=contract.dtype, max_seqs=cls._max_seqs(schedule))

    @staticmethod
    def _max_seqs(schedule: Any) -> int:
        return max_seqs_per_batch(schedule.tokens_per_batch, schedule.buckets)

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch  # only where a process really views slot memory
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def row_width(self) -> int:
        """Elements per token row of the hidden states: K captured layers side by side."""
        return self.num_layers * self.hidden_size

    @property
    def header_bytes(self) -> int:
        return HEADER_BYTES

    @property
    def hs_offset(self) -> int:
        return HEADER_BYTES

    @property
    def hs_bytes(self) -> int:
        return self.tokens_per_batch * self.row_width * self.itemsize

    @property
    def input_ids_offset(self) -> int:
        return _align(self.hs_offset + self.hs_bytes, REGION_ALIGN)

    @property
    def input_ids_bytes(self) -> int:
        return self.tokens_per_batch * 4

    @property
    def loss_mask_offset(self) -> int:
        return _align(self.input_ids_offset + self.input_ids_bytes, REGION_ALIGN)

    @property
    def loss_mask_bytes(self) -> int:
        return self.tokens_per_batch

    @property
    def seq_lens_offset(self) -> int:
        return _align(self.loss_mask_offset + self.loss_mask_bytes, REGION_ALIGN)

    @property
    def seq_lens_bytes(self) -> int:
        return self.max_seqs * 4

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack, JSON), ``slot_bytes`` included."""
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> SlotLayout:
        """:meth:`to_dict`'s values as a layout; ValueError naming the field that is missing or wrong."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"slot layout: {exc}") from None

    def describe(self) -> str:
        return (f"slot {format_bytes(self.slot_bytes)} = {self.tokens_per_batch} tok × {self.num_layers} layers × "
                f"{self.hidden_size} hidden × {self.dtype} + ids/mask")
