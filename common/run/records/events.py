"""The run journal's events, one struct per kind (``dispatcher/journal.py`` writes them, ``journal.py`` here
reads them).

A line's JSON is the struct's fields in the order below after its kind (``"ev"``, the tag): the
shape the journal had when its lines were built from keyword arguments, so journals written before
these types decode as they are. A field another version of the dispatcher may not write has a
default, and a default value is left out of the line (a progress event is written per request: a
short line is a cheap one). Numbers keep the type the dispatcher gave them; a float that is not a
number (a drafter's loss can be NaN) is written as ``null``, which is why metrics values may be None.

Every class says ``kw_only=True``: msgspec does not inherit it, and without it the subclass's
required fields would go before ``t`` in the line.
"""

from __future__ import annotations

from typing import Union

import msgspec

Metrics = dict[str, Union[float, None]]  # a step's figures by name ("step", "loss", "tokens_per_s", ...); None: NaN


class Event(msgspec.Struct, kw_only=True, tag_field="ev", omit_defaults=True):
    # wall-clock seconds (to the microsecond) when the event was recorded; 0 until then:
    # Journal.record stamps it unless the event already carries a time
    t: float = 0.0


# -- the dispatcher -----------------------------------------------------------------------------
class DispatcherStarted(Event, kw_only=True, tag="start"):
    resumed: bool = False  # the run directory held a started epoch: a restart, not a fresh run
    committed: int = 0     # jobs committed over the started epochs once the journal was replayed


class DispatcherStopped(Event, kw_only=True, tag="stop"):
    done: bool = False   # every epoch committed and every model's last commit checkpointed
    peak_slots: int = 0  # the most hidden-state slots in use at once
    slot_bytes: int = 0  # the size of one slot


# -- workers ------------------------------------------------------------------------------------
class WorkerJoined(Event, kw_only=True, tag="join"):
    w: str                    # the worker id the dispatcher gave it ("t0.1": role, number, incarnation)
    role: str                 # "target" | "drafter"
    name: str | None = None   # the name it registered with (the launcher's "target-0", ...)
    pid: int | None = None
    host: str | None = None
    node: str | None = None   # the node its slots live on (its host unless it named one)
    queue: int | None = None  # per-target assignment: the schedule queue this target extracts from


class WorkerLeft(Event, kw_only=True, tag="leave"):
    w: str
    reason: str = ""  # "left", "replaced", "lease_expired", ...


class MembershipOpened(Event, kw_only=True, tag="membership"):
    model: str
    version: int           # the group's membership version, one up per change
    step: int              # the model step the version starts from
    ranks: list[str] = []  # the members' worker ids, rank 0 first
    transfer: bool = False  # some rank held another step: rank 0 sends its state to all


# -- epochs -------------------------------------------------------------------------------------
class EpochStarted(Event, kw_only=True, tag="epoch"):
    epoch: int
    jobs: int                # the epoch's job count
    buckets: list[int] = []  # batches per length bucket, in bucket order


class EpochCommitted(Event, kw_only=True, tag="epoch_committed"):
    epoch: int  # every job of it is committed


# -- jobs ---------------------------------------------------------------------------------------
class JobReady(Event, kw_only=True, tag="ready"):
    job: int           # job id (epoch * 10**9 + index)
    w: str             # the target that extracted it
    tokens: int = 0    # its tokens
    busy_s: float = 0.0  # the target's compute time for it


class JobConsumed(Event, kw_only=True, tag="consumed"):
    job: int
    w: str       # the drafter that read its slot
    bucket: int  # its length bucket
    remote: int = 0  # 1: the slot lay on another node than the drafter's (its data crossed the network)


class JobGivenBack(Event, kw_only=True, tag="give_back"):
    job: int
    was: str             # the state it left: "extracting" | "ready" | "training" | "consumed"
    reason: str          # "lease_expired", "left", "target_failed: <why>", ... (the cause before the colon)
    w: str | None = None  # the worker that held it


# -- models -------------------------------------------------------------------------------------
class StepCommitted(Event, kw_only=True, tag="commit"):
    model: str
    step: int              # the model's optimizer step these jobs trained
    jobs: list[int]        # their ids, in the drafter's order
    w: str = ""            # the drafter that committed (a group's rank that sent the commit)
    buckets: list[int] = []  # the distinct length buckets of the jobs, sorted
    avail: int | None = None  # buckets eligible when the step's window opened
    mixed: bool = True     # every pull of the step took a new bucket when one was eligible
    tokens: int = 0
    busy_s: float = 0.0    # the drafter's compute time for the step
    verified: int = 0      # slots whose checksum the drafter checked
    metrics: Metrics | None = None  # the figures of the drafter's previous step ("step" names it)
    # a data-parallel group's step (absent otherwise):
    membership: int | None = None  # the membership version that trained it
    sync_wait_s: float = 0.0       # rank 0's wait at the gradient all-reduce
    step_s: float = 0.0            # rank 0's wall time for the step
    rank_jobs: list[int] = []      # jobs per rank, by rank
    rank_busy_s: list[float] = []  # compute time per rank, by rank


class ModelRolledBack(Event, kw_only=True, tag="rollback"):
    model: str
    step: int                 # the step the model went back to
    jobs: int = 0             # committed jobs that went back to pending
    cause: str | None = None  # "restart" (from a checkpoint); journals before it was named lack it


class Checkpointed(Event, kw_only=True, tag="checkpoint"):
    model: str
    step: int               # the model's state at this step is durable on disk
    w: str | None = None    # the drafter that reported it (None: found in the run directory)
    via: str | None = None  # how it became known when not reported as written: "register" | "disk"
    metrics: Metrics | None = None  # the figures of that step


EVENT_TYPES: tuple[type[Event], ...] = (DispatcherStarted, DispatcherStopped, WorkerJoined, WorkerLeft,
                                        MembershipOpened, EpochStarted, EpochCommitted, JobReady, JobConsumed,
                                        JobGivenBack, StepCommitted, ModelRolledBack, Checkpointed)
AnyEvent = Union[EVENT_TYPES]  # the tagged union a line decodes to
KINDS: dict[str, type[Event]] = {cls.__struct_config__.tag: cls for cls in EVENT_TYPES}


def kind_of(cls: type[Event]) -> str:
    """The ``ev`` of a struct's lines."""
    return cls.__struct_config__.tag


# The kinds the dispatcher records durably (an acknowledgement waits on them) and a restart or the
# report's exactly-once count reads back: a damaged one is never skipped (common/run/records/journal.py).
KINDS_A_RESTART_NEEDS: frozenset[str] = frozenset(kind_of(cls) for cls in (
    DispatcherStarted, EpochStarted, EpochCommitted, StepCommitted, ModelRolledBack, Checkpointed))
