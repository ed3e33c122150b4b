"""What a worker claims of itself when it registers: a drafter's model (the step it holds, the commit
it got no answer to, the sizes of its data-parallel group) and a tensor-parallel target's ranks.
Parts of :class:`common.wire.messages.Register`, checked as it is decoded."""

from __future__ import annotations

from typing import Annotated

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]


class PendingCommit(msgspec.Struct, kw_only=True):
    """The commit a drafter (or its group's rank 0) sent and got no answer to (its dispatcher died):
    when the ledger holds exactly that commit, the register reply says ``pending_committed``."""
    step: int
    job_ids: list[int]


class GroupClaim(msgspec.Struct, kw_only=True):
    """The sizes a data-parallel rank brings (every rank of a model must agree; dispatcher/groups.py)."""
    size: int  # drafter.count: the ranks a new group waits for before its first step
    min_ranks: int = 1
    max_ranks: int = 0  # 0: no bound
    balance: str = "count"  # drafter.step_balance
    accum_steps: int = 1
    elastic_batch: str = "tokens"
    # drafter.rendezvous=tcp: "HOST:PORT" of the TCPStore the rank hosts; the versions whose rank 0
    # it is meet there (see STORE_SCHEME). Every rank of a model has one, or none.
    store: str | None = None


class ModelClaim(msgspec.Struct, kw_only=True):
    """A drafter's model: its id and the step of the state it holds now (0 = fresh). The ledger rolls
    the model back to exactly that step; a model *ahead* of the ledger (its last commit never became
    durable) must reload its latest checkpoint and register again with that step."""
    id: Annotated[str, msgspec.Meta(min_length=1)]
    step: Count = 0
    # the newest checkpoint it loaded or wrote (<= step): counted durable when it is of the ledger's
    # history, so a checkpoint whose report found no dispatcher still lets the run end
    checkpoint: Count = 0
    pending: PendingCommit | None = None
    group: GroupClaim | None = None  # data-parallel drafters: ranks of one elastic group

    def __post_init__(self) -> None:
        if self.checkpoint > self.step:
            raise ValueError(f"model.checkpoint must be the step of a checkpoint the drafter holds: in [0, "
                             f"step={self.step}]")


class TargetRank(msgspec.Struct, kw_only=True):
    """One process of a tensor-parallel target group (rank 0 is the worker that registers)."""
    rank: int
    pid: int
    gpu: int | None = None
