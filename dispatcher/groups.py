"""Elastic data-parallel drafter groups: ranks, membership versions and the rendezvous, as pure bookkeeping.

Drafters that register the same model as ranks of a group form one ``torch.distributed`` group.
The dispatcher is the rendezvous: it keeps each group's **membership version** — the ranks that
train together now — and names a store that is fresh for every version (it never imports torch:
the ranks open the store themselves): a ``torch.distributed.FileStore`` path under
``run.dir/groups/<model>/`` on one node, or, when the ranks advertise a TCPStore of their own
(``drafter.rendezvous=tcp``, ranks on nodes that share no directory), rank 0's store under a key
prefix of the version's own.

Invariants this module keeps:

- a registered rank first *waits*: it holds no jobs and takes part in no step until a version
  names it. The first version of a group (or of one whose ranks all died) opens once
  ``drafter.count`` ranks wait; after that the world size is elastic between ``min_ranks`` and
  ``max_ranks`` (0: no bound);
- membership changes only at step boundaries. Waiting ranks join when no member holds a job (the
  step just committed, or nothing is in flight): the next version takes the current members plus
  **every** waiting rank at once (up to ``max_ranks``), so no number of joiners keeps a group
  from training;
- a member that leaves or dies, or reports that a collective of its version failed, ends the
  version at once: the next one opens with the others (and every waiting rank) when they are at
  least ``min_ranks``; below that they wait. Only the jobs held then (the step in flight) go back;
- the state of a version comes from a live rank: its **source** holds the version's step, the
  highest any of its ranks holds. Under commit-then-apply every member holds the ledger's step, so
  a membership change needs no rollback; the ledger rolls back (to the source's step) only when no
  rank holds the committed step any more — the whole group crashed and its ranks came back from a
  checkpoint. A rank whose step differs from the source's receives the state over the new group,
  a joiner's checkpoint ahead of the ledger included (it never is a source: its steps are not the
  ledger's);
- after a dispatcher restart no rank is known to be alive: the live ones register again with the
  step they hold. A group this incarnation never formed rolls back to a checkpoint only once
  ``live_wait_s`` (the dispatcher's ``worker_timeout_s``) from the start passed with no rank
  holding the committed step — a restarted rank that comes first must not roll the live ones back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from common.run.config import ElasticBatch, StepBalance, step_jobs
from common.wire import messages
from common.wire.store_names import tcp_store_name

GROUPS_DIR = "groups"


class GroupChanged(Exception):
    """A request from a rank that is not a member of its group's current version: drop the step, join again."""


@dataclass(frozen=True)
class GroupSpec:
    """The sizes a rank brings at registration (from its config); every rank of a model must agree."""

    size: int  # drafter.count: the ranks a new group waits for before its first step
    min_ranks: int = 1
    max_ranks: int = 0  # 0: no bound
    # drafter.step_balance=cost: the dispatcher shares each step's micro-batches among the ranks by
    # estimated cost (dispatcher.step_balance), out of step_jobs(accum_steps, size, world, elastic_batch)
    balance: str = "count"
    accum_steps: int = 1
    elastic_batch: str = "tokens"

    def check(self) -> None:
        if self.size < 1 or self.min_ranks < 1 or self.max_ranks < 0:
            raise ValueError("a group needs size >= 1, min_ranks >= 1 and max_ranks >= 0")
        # The sizes come in a rank's registration: its config checked them, this dispatcher did not.
        balances, batches = get_args(StepBalance), get_args(ElasticBatch)
        if self.balance not in balances or self.elastic_batch not in batches or self.accum_steps < 1:
            raise ValueError(f"a group needs balance {' or '.join(balances)}, elastic_batch {' or '.join(batches)}, "
                             f"and accum_steps >= 1")
        if self.max_ranks and not self.min_ranks <= self.size <= self.max_ranks:
            raise ValueError(f"a group needs min_ranks <= size <= max_ranks, got {self.min_ranks}, {self.size}, "
                             f"{self.max_ranks}")

    def describe(self) -> str:
        """The drafter config keys this spec comes from, as a user would set them."""
        return (f"drafter.count={self.size}, min_ranks={self.min_ranks}, max_ranks={self.max_ranks}, "
                f"accum_steps={self.accum_steps}, elastic_batch={self.elastic_batch}, step_balance={self.balance}")


@dataclass(frozen=True)
class Membership:
    """A rank's place in one membership version (the answer to ``join_group``)."""

    rank: int
    world_size: int
    version: int
    store: str  # torch.distributed's rendezvous of this version: a FileStore path, or tcp://HOST:PORT/PREFIX
    step: int  # the model step of the version: what the source holds and every rank holds once it starts
    source: int  # the rank whose state the others take when ``transfer``
    transfer: bool  # some rank of the version holds another step: the source sends its state to all

    def to_wire(self) -> messages.Membership:
        return messages.Membership(rank=self.rank, world_size=self.world_size, membership=self.version,
                                   store=self.store, step=self.step, source=self.source, transfer=self.transfer)


@dataclass
class DrafterGroup:
    model: str
    spec: GroupSpec
    version: int = 0
    step: int = 0  # the model step of the current version
    members: dict[str, int] = field(default_factory=dict)  # worker id -> rank, current version only
    waiting: dict[str, int] = field(default_factory=dict)  # worker id -> model step it holds, in arrival order
    memberships: dict[str, Membership] = field(default_factory=dict)  # worker id -> its place, current version
    entry_steps: dict[str, int] = field(default_factory=dict)  # member -> the step it held when the version opened
    survivors: set[str] = field(default_factory=set)  # waiting ranks that were members of the last version
    unconfirmed: set[str] = field(default_factory=set)  # waiting ranks whose step is a guess until they report it
    opened_at_steps: int = 0  # the ledger's step for the model when this version opened
    window_avail: int | None = None  # buckets eligible when the group's step window opened
    window_mixed: bool = True  # every pull of the step took a new bucket when one was eligible
    full: set[str] = field(default_factory=set)  # members told they hold their share of the step in flight

    @property
    def formed(self) -> bool:
        return bool(self.members)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def step_jobs(self) -> int:
        """Micro-batches of one step of the current version."""
        return step_jobs(self.spec.accum_steps, self.spec.size, self.world_size, self.spec.elastic_batch)


@dataclass(frozen=True)
class Opened:
    """A version that just opened: who left it (their held jobs go back) and the step the ledger
    must roll back to (None: the version's step is the ledger's — the usual case)."""

    version: int
    previous_members: list[str]
    rollback_to: int | None


def source_step(steps: Iterable[int], ledger_step: int) -> int | None:
    """The step a version can start from: the highest held that the ledger has (None: none)."""
    return max((s for s in steps if s <= ledger_step), default=None)


class DrafterGroups:
    def __init__(self, run_dir: str | Path, incarnation: int, *, started_at: float = 0.0, live_wait_s: float = 0.0):
        self.run_dir = Path(run_dir)
        self.incarnation = incarnation  # in the store path: a restarted dispatcher never reuses a store file
        self.live_wait_until = started_at + live_wait_s  # live ranks of the last incarnation are back by then
        self.groups: dict[str, DrafterGroup] = {}
        self._joined: dict[str, str] = {}  # worker id -> model, for every rank (waiting or member)
        self._store_addresses: dict[str, str] = {}  # worker id -> HOST:PORT of the TCPStore it hosts

    def store_path(self, model: str, version: int) -> Path:
        return self.run_dir / GROUPS_DIR / model / f"i{self.incarnation}-v{version}"

    # -- ranks arrive and leave ---------------------------------------------------------------------
    def join(self, model: str, spec: GroupSpec, worker_id: str, step: int, *,
             store_address: str | None = None) -> None:
        """``worker_id`` (holding ``step``) waits for a version of ``model``'s group to name it;
        ``store_address``: the TCPStore it hosts for the versions whose rank 0 it is (None: FileStores)."""
        spec.check()
        peer = next((w for w, m in self._joined.items() if m == model and w != worker_id), None)
        if peer is not None and (peer in self._store_addresses) != (store_address is not None):
            mine, theirs = ("tcp" if tcp else "file" for tcp in (store_address, peer in self._store_addresses))
            raise ValueError(f"model {model}: a drafter registered with drafter.rendezvous={mine}, its group meets "
                             f"over {theirs} (every drafter of the model must agree)")
        group = self.groups.get(model)
        if group is None:
            group = self.groups[model] = DrafterGroup(model, spec)
        elif group.spec != spec:
            raise ValueError(f"model {model} trains in a group of {group.spec.describe()}; a drafter asked for "
                             f"{spec.describe()} (every drafter of the model must agree)")
        group.waiting[worker_id] = step
        self._joined[worker_id] = model
        if store_address is not None:
            self._store_addresses[worker_id] = store_address

    def leave(self, worker_id: str) -> DrafterGroup | None:
        """``worker_id`` is gone; returns its group when it was a member of the current version
        (which then has ended: see :meth:`end_version`)."""
        model = self._joined.pop(worker_id, None)
        self._store_addresses.pop(worker_id, None)
        if model is None:
            return None
        group = self.groups[model]
        group.waiting.pop(worker_id, None)
        group.survivors.discard(worker_id)
        group.unconfirmed.discard(worker_id)
        if worker_id not in group.members:
            return None
        del group.members[worker_id]
        group.memberships.pop(worker_id, None)
        return group

    def report_step(self, worker_id: str, step: int) -> None:
        """A waiting rank tells the step it holds now (a survivor that dropped a step, say)."""
        group = self.group_of_rank(worker_id)
        if group is not None and worker_id in group.waiting:
            group.waiting[worker_id] = step
            group.unconfirmed.discard(worker_id)

    # -- versions -----------------------------------------------------------------------------------
    def end_version(self, group: DrafterGroup, ledger_step: int) -> list[str]:
        """The current version can no longer step (a member left, died or failed a collective): its
        members wait again. Each is taken to hold the ledger's step — or, when the version committed
        nothing yet, the step it held when it opened (a joiner's transfer may not have completed) —
        but that is a guess until it says which: a rank whose rank 0 died inside the commit of the
        last step may not have applied it. No version opens before every one of them said its step
        (or left), so none opens from a guessed state. Returns them."""
        members = sorted(group.members, key=group.members.get)
        stepped = ledger_step > group.opened_at_steps
        for worker_id in members:
            group.waiting[worker_id] = ledger_step if stepped else group.entry_steps.get(worker_id, ledger_step)
        group.unconfirmed = set(members)
        # the survivors first, in their rank order, then the joiners: rank 0 stays rank 0 when it can
        group.waiting = {w: group.waiting[w] for w in members} | {w: s for w, s in group.waiting.items()
                                                                     if w not in group.members}
        group.members, group.memberships = {}, {}
        group.full = set()
        group.survivors = set(members)
        return members

    def may_open(self, group: DrafterGroup, *, busy: bool, ledger_step: int, checkpoint_step: int,
                 now: float) -> bool:
        """Whether the next version opens now. ``busy``: a member holds a job (a step is in flight);
        ``checkpoint_step``: the model's latest durable checkpoint."""
        if not group.waiting:
            return False
        if not group.members:
            if group.unconfirmed:
                return False  # a guessed step: wait for the ranks of the ended version to say theirs
            start = source_step(group.waiting.values(), ledger_step)
            if start is None:
                return False  # every waiting rank is ahead of the ledger: none can be the source
            if start < ledger_step:  # opening now would roll the ledger back
                if not group.version and not group.survivors and now < self.live_wait_until:
                    return False  # after a restart: a rank holding the committed step may still register
                if start < min(checkpoint_step, ledger_step):
                    return False  # a newer checkpoint than any rank holds: they load it first (checkpoint_to_load)
        if group.members:  # joiners wait for the step boundary and for room
            room = group.spec.max_ranks - len(group.members) if group.spec.max_ranks else len(group.waiting)
            return not busy and room > 0
        # Survivors of an ended version hold live state: they wait only for min_ranks. A group
        # none of whose ranks survived is new again: it waits for drafter.count.
        needed = group.spec.min_ranks if group.survivors else group.spec.size
        return len(group.waiting) >= needed

    def checkpoint_to_load(self, worker_id: str, ledger_step: int, checkpoint_step: int) -> int | None:
        """The checkpoint step a waiting rank must load before its group can open (None: none).

        When no live rank holds the committed step (the last one left or died before its state went
        out), a durable checkpoint newer than what the waiting ranks hold is the state to start from:
        going back to an older one would throw away the steps in between."""
        group = self.group_of_rank(worker_id)
        if group is None or group.members or worker_id not in group.waiting or worker_id in group.unconfirmed:
            return None
        target = min(checkpoint_step, ledger_step)
        start = source_step(group.waiting.values(), ledger_step)
        held = group.waiting[worker_id]
        return target if start is not None and start < target and held < target else None

    def open(self, group: DrafterGroup, ledger_step: int) -> Opened:
        """The next version: the current members plus every waiting rank (up to max_ranks)."""
        previous = sorted(group.members, key=group.members.get)
        carried = {w: ledger_step for w in previous}  # members hold the committed step (commit, then apply)
        room = (group.spec.max_ranks - len(carried)) if group.spec.max_ranks else len(group.waiting)
        newcomers = dict(list(group.waiting.items())[:max(0, room)])
        ranks = carried | newcomers
        step = source_step(ranks.values(), ledger_step)  # may_open saw that one rank can be the source
        source = next(w for w, s in ranks.items() if s == step)  # a survivor when one holds the step
        order = [source] + [w for w in ranks if w != source]
        group.version += 1
        store = self._new_store(group.model, group.version, source)
        transfer = any(s != step for s in ranks.values())
        group.members = {w: r for r, w in enumerate(order)}
        group.entry_steps = dict(ranks)
        group.memberships = {w: Membership(r, len(order), group.version, store, step, 0, transfer)
                             for w, r in group.members.items()}
        for worker_id in newcomers:
            del group.waiting[worker_id]
        group.survivors -= set(newcomers)
        group.step = step
        group.opened_at_steps = step
        group.window_avail, group.window_mixed = None, True
        group.full = set()
        return Opened(group.version, previous, step if step < ledger_step else None)

    def _new_store(self, model: str, version: int, source: str) -> str:
        """The empty store of a version whose rank 0 is ``source``."""
        address = self._store_addresses.get(source)
        if address is not None:  # the incarnation in the prefix: a restarted dispatcher never reuses keys
            return tcp_store_name(address, f"{model}/i{self.incarnation}-v{version}")
        # The old store stays: a rank may still be in a wait on it (a FileStore whose file is deleted
        # under a wait never returns); the run's stores go when it is done (remove_stores).
        path = self.store_path(model, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a store file must start empty
        return str(path)

    def remove_stores(self) -> None:
        """The run is done: no rank waits on any store of this incarnation any more."""
        for group in self.groups.values():
            for version in range(1, group.version + 1):
                self.store_path(group.model, version).unlink(missing_ok=True)

    # -- lookups ------------------------------------------------------------------------------------
    def group_of_rank(self, worker_id: str) -> DrafterGroup | None:
        """The group ``worker_id`` belongs to, as a member or waiting (None for a lone drafter)."""
        model = self._joined.get(worker_id)
        return self.groups[model] if model is not None else None

    def group_of(self, worker_id: str) -> DrafterGroup | None:
        """The group ``worker_id`` is a current member of (None for a waiting rank or a lone drafter)."""
        group = self.group_of_rank(worker_id)
        return group if group is not None and worker_id in group.members else None

    def check_current(self, worker_id: str, membership: int | None = None) -> None:
        """Raise GroupChanged for a rank that is not a member of its group's current version (or
        speaks for ``membership``, a version that ended)."""
        group = self.group_of_rank(worker_id)
        if group is None:
            return
        if worker_id not in group.members or (membership is not None and membership != group.version):
            raise GroupChanged(f"the group of model {group.model} is at membership {group.version}: drop the step "
                               f"and join the current membership")

    def versions(self) -> dict[str, int]:
        return {model: group.version for model, group in self.groups.items()}
