"""The seeded fault plan of ``hsd bench chaos``, and the journal figures it is judged by. Pure code.

A plan is a list of events, each ``(at_s, at_progress, action, role, pick)``: at ``at_s`` seconds
into the run, once ``at_progress`` of its jobs are committed, ``kill`` (SIGKILL) a process of
``role``, ``detach`` a drafter (SIGTERM: it finishes its step and leaves) or ``attach`` one more
drafter. The progress marks spread the events over the first PROGRESS_SPAN of the run's work, so
they all fall inside it however fast the machine is (the bench holds the targets while the clock
is behind the work). ``pick`` in [0, 1) names the victim among the live
processes of the role sorted by name, resolved when the event fires: the same seed gives the same
plan, and the same choices as far as the run's timing lets the same processes be alive.

Every kind of event has a floor of its share of the plan, so a plan of N events always holds
about ``N x share`` of each: a short run still hits every role.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

KILL, ATTACH, DETACH = "kill", "attach", "detach"
ROLES = ("dispatcher", "target", "drafter")

# Share of the events of each kind: drafters (ranks) are hit most, the dispatcher least (each of its
# restarts makes every worker register again, which takes seconds of the run).
SHARES: dict[tuple[str, str], float] = {
    (KILL, "dispatcher"): 0.15,
    (KILL, "target"): 0.20,
    (KILL, "drafter"): 0.30,
    (ATTACH, "drafter"): 0.175,
    (DETACH, "drafter"): 0.175,
}


PROGRESS_SPAN = 0.75  # the last event is due by 75 % of the run's jobs: the rest of the work follows it


@dataclass(frozen=True)
class ChaosEvent:
    at_s: float
    at_progress: float         # share of the run's jobs committed before it fires
    action: str
    role: str
    pick: float                # which live process of the role: index int(pick * count) in name order
    restart_after_s: float     # a killed process is started again this long after the kill


def build_plan(*, seed: int, duration_s: float, mean_gap_s: float, paired_attach: bool = False) -> list[ChaosEvent]:
    """Events spread over ``duration_s``, about ``mean_gap_s`` apart (jittered by +-50 %).

    ``paired_attach``: every detach is followed by an attach, and attaches come only that way (a
    group whose size is fixed can take a new rank only where one left)."""
    if duration_s <= 0 or mean_gap_s <= 0:
        raise ValueError("the chaos window and the gap between events must be positive")
    rng = random.Random(seed)
    num_events = max(len(SHARES), int(duration_s / mean_gap_s))
    kinds = [kind for kind, share in SHARES.items() for _ in range(max(1, int(num_events * share)))]
    weights = list(SHARES.values())
    while len(kinds) < num_events:
        kinds.append(rng.choices(list(SHARES), weights=weights)[0])
    rng.shuffle(kinds)
    if paired_attach:
        kinds = _pair_attaches(kinds)
    gap = duration_s / (len(kinds) + 1)
    events = []
    for i, (action, role) in enumerate(kinds):
        at_s = gap * (i + 1) + rng.uniform(-0.5, 0.5) * gap
        events.append(ChaosEvent(round(at_s, 2), round(PROGRESS_SPAN * at_s / duration_s, 4), action, role,
                                 rng.random(), round(rng.uniform(0.5, 2.5), 2)))
    return events


def _pair_attaches(kinds: list[tuple[str, str]]) -> list[tuple[str, str]]:
    detach, attach = (DETACH, "drafter"), (ATTACH, "drafter")
    out = []
    for kind in kinds:
        if kind == attach:
            continue
        out.append(kind)
        if kind == detach:
            out.append(attach)
    return out


def count_events(events: Iterable[ChaosEvent]) -> Counter:
    return Counter((e.action, e.role) for e in events)
