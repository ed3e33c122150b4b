"""The byte layout of a hidden-state slot, without torch.

Every process of a run agrees on this layout; the dispatcher needs it only to size the pool and to
check the capture contract, so it lives apart from the torch views (:mod:`common.dataplane.slots`), and a
dispatcher never pays for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one slot; identical in every process of a run (sent in the register reply)."""

    tokens_per_batch: int
    num_layers: int
    hidden_size: int
    dtype: str
    max_seqs: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"slot dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        for name in ("tokens_per_batch", "num_layers", "hidden_size", "max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"slot layout {name} must be a positive integer, got {value!r}")
        if self.max_seqs > self.tokens_per_batch:
            raise ValueError(f"slot layout max_seqs ({self.max_seqs}) exceeds tokens_per_batch ({self.tokens_per_batch})")

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
    def from_contract(cls, contract: CaptureContract | dict[str, Any], schedule: Any) -> SlotLayout:
        """Slots sized for a capture contract and the schedule's token budget (``config.schedule``)."""
        if not isinstance(contract, CaptureContract):
            contract = CaptureContract.from_dict(contract)
        return cls(tokens_per_batch=schedule.tokens_per_batch, num_layers=contract.num_blocks,
                   hidden_size=contract.hidden_size, dtype=contract.dtype, max_seqs=cls._max_seqs(schedule))

    @staticmethod
    def _max_seqs(schedule: Any) -> int:
        return max_seqs_per_batch(schedule.tokens_per_batch, schedule.buckets)

    @property
    def torch_dtype(self) -> "torch.dtype":
        from common.dataplane.slots import DTYPES  # torch only where a process really views slot memory
        return DTYPES[self.dtype]

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

    @property
    def slot_bytes(self) -> int:
        return _align(self.seq_lens_offset + self.seq_lens_bytes, SLOT_ALIGN)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for msgpack; ``slot_bytes`` lets the receiver detect a layout-code mismatch."""
        return {"tokens_per_batch": self.tokens_per_batch, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "dtype": self.dtype, "max_seqs": self.max_seqs,
                "slot_bytes": self.slot_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SlotLayout:
        try:
            layout = cls(tokens_per_batch=data["tokens_per_batch"], num_layers=data["num_layers"],
                         hidden_size=data["hidden_size"], dtype=data["dtype"], max_seqs=data["max_seqs"])
        except KeyError as exc:
            raise ValueError(f"slot layout is missing {exc.args[0]!r}: {data!r}") from None
        if "slot_bytes" in data and data["slot_bytes"] != layout.slot_bytes:
            raise ValueError(f"slot layout says {data['slot_bytes']} bytes per slot but this build computes "
                             f"{layout.slot_bytes}: the processes run different hsdispatch versions")
        return layout

    def describe(self) -> str:
        return (f"slot {format_bytes(self.slot_bytes)} = {self.tokens_per_batch} tok × {self.num_layers} layers × "
                f"{self.hidden_size} hidden × {self.dtype} + ids/mask")
