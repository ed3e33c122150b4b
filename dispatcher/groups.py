"""Data-parallel drafter groups: ranks, membership versions and the rendezvous, as pure bookkeeping.

Drafters that register the same model with ``world_size > 1`` form one group. The dispatcher is
the rendezvous: it gives each joiner a rank and the group's **membership version**, and names a
``torch.distributed.FileStore`` path under ``run.dir/groups/<model>/`` that is fresh for every
version (it never imports torch: the ranks open the store themselves).

Invariants this module keeps:

- a version's members are exactly the ranks ``0 .. world_size-1``, handed out in join order; the
  group is *formed* once all of them joined, and only then do its ranks train;
- a member that leaves (dead, left, replaced) ends its version: the version is bumped, the group
  forms again from scratch, and the members of the old version are *stale*. The core gives their
  jobs back and answers their requests with ``group_changed``, so they drop the step at once,
  reload the latest checkpoint and join again. A stale member leaving changes nothing;
- a joiner whose model step differs from the forming group's, or who joins a formed group, also
  starts a new version: every rank of a version starts from the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

GROUPS_DIR = "groups"


class GroupChanged(Exception):
    """A request from a member of a membership version that ended: drop the step, join again."""


@dataclass
class DrafterGroup:
    model: str
    world_size: int
    version: int = 0
    step: int = 0  # the model step every member of this version registered with
    members: dict[str, int] = field(default_factory=dict)  # worker id -> rank, this version only
    window_avail: int | None = None  # buckets eligible when the group's step window opened
    window_mixed: bool = True  # every pull of the step took a new bucket when one was eligible

    @property
    def formed(self) -> bool:
        return len(self.members) == self.world_size


@dataclass(frozen=True)
class Membership:
    """What a rank learns at registration (the ``group`` field of the register reply)."""

    rank: int
    world_size: int
    version: int
    store: str  # FileStore path for torch.distributed's rendezvous of this version

    def to_wire(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "membership": self.version, "store": self.store}


class DrafterGroups:
    def __init__(self, run_dir: str | Path, incarnation: int):
        self.run_dir = Path(run_dir)
        self.incarnation = incarnation  # in the store path: a restarted dispatcher never reuses a store file
        self.groups: dict[str, DrafterGroup] = {}
        self._joined: dict[str, str] = {}  # worker id -> model, for every member of any version

    def store_path(self, model: str, version: int) -> Path:
        return self.run_dir / GROUPS_DIR / model / f"i{self.incarnation}-v{version}"

    def join(self, model: str, world_size: int, worker_id: str, step: int) -> tuple[Membership, list[str]]:
        """Give ``worker_id`` a rank; returns its membership and the members made stale by it."""
        if world_size < 2:
            raise ValueError("a data-parallel group has at least 2 ranks")
        group = self.groups.get(model)
        stale: list[str] = []
        if group is None:
            group = self.groups[model] = DrafterGroup(model, world_size)
            self._new_version(group)
        elif group.world_size != world_size:
            raise ValueError(f"model {model} trains in a group of {group.world_size} ranks; a drafter asked for "
                             f"{world_size} (drafter.count must be the same for every drafter of the model)")
        elif group.formed or (group.members and step != group.step):
            stale = self._new_version(group)
        if not group.members:
            group.step = step
        rank = min(set(range(world_size)) - set(group.members.values()))
        group.members[worker_id] = rank
        self._joined[worker_id] = model
        return Membership(rank, world_size, group.version, str(self.store_path(model, group.version))), stale

    def leave(self, worker_id: str) -> list[str]:
        """``worker_id`` is gone. When it was a current member, its version ends: returns the members
        made stale (the others of that version)."""
        model = self._joined.pop(worker_id, None)
        if model is None:
            return []
        group = self.groups[model]
        if worker_id not in group.members:
            return []
        del group.members[worker_id]
        return self._new_version(group)

    def _new_version(self, group: DrafterGroup) -> list[str]:
        stale = list(group.members)
        if group.version:  # a dead rank never released the old store: nobody will use it again
            self.store_path(group.model, group.version).unlink(missing_ok=True)
        group.version += 1
        group.members = {}
        group.window_avail, group.window_mixed = None, True
        path = self.store_path(group.model, group.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a store file must start empty
        return stale

    def group_of(self, worker_id: str) -> DrafterGroup | None:
        """The group ``worker_id`` is a current member of (None for a stale member or a lone drafter)."""
        model = self._joined.get(worker_id)
        if model is None:
            return None
        group = self.groups[model]
        return group if worker_id in group.members else None

    def check_current(self, worker_id: str) -> None:
        """Raise GroupChanged for a member of a version that ended."""
        model = self._joined.get(worker_id)
        if model is not None and worker_id not in self.groups[model].members:
            group = self.groups[model]
            raise GroupChanged(f"the group of model {model} changed (membership {group.version}): drop the step, "
                               f"reload the latest checkpoint and register again")

    def versions(self) -> dict[str, int]:
        return {model: group.version for model, group in self.groups.items()}
