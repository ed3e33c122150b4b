"""Group steps balanced by cost: when a rank holds its share of the step in flight.

A data-parallel group's step has a fixed number of micro-batches (``drafter.accum_steps`` x
``drafter.count``, or per rank with ``elastic_batch=ranks``), and it ends at the gradient
all-reduce, where every rank waits for the slowest. Counted out evenly, a rank handed long
micro-batches holds all the others there. With ``drafter.step_balance=cost`` the dispatcher keeps
handing a rank micro-batches until it holds its share of the step's *estimated cost*; a rank that
has its share is told so (``step_full``) and goes to the all-reduce, while the others take what is
left of the step.

The estimate is a linear model of a job's cost in its shape — a constant, its sequences (DFlash's
anchor blocks scale with them) and its padded tokens (the attention and the MLPs) — fitted by
least squares on what the ranks measured: rank 0 commits every rank's micro-batches with that
rank's busy seconds. A ridge term pulls the fit toward pricing padded tokens alone, which is also
the estimate before anything was measured, so a few observations cannot make it wild. Pure logic:
no sockets, no clock.
"""

from __future__ import annotations

from collections import deque

import numpy as np

FEATURES = ("jobs", "sequences", "padded_tokens")
WINDOW = 256  # observations (one rank's micro-batches of one step) the fit keeps
PRIOR_ROWS = 2.0  # the prior weighs as much as this many average observations
MIN_COST = 1e-12  # an estimate is never zero or negative: every job costs something


def job_features(lengths: np.ndarray) -> np.ndarray:
    """The cost features of one job of sequences ``lengths``: [1, sequences, padded tokens]."""
    n = int(len(lengths))
    return np.array([1.0, n, n * int(lengths.max(initial=0))], dtype=np.float64)


class CostModel:
    """A job's estimated compute seconds on one rank, from its features (see the module doc)."""

    def __init__(self, *, window: int = WINDOW, prior_rows: float = PRIOR_ROWS):
        self.prior_rows = prior_rows
        self._rows: deque[np.ndarray] = deque(maxlen=window)  # summed features of a rank's micro-batches
        self._busy: deque[float] = deque(maxlen=window)  # that rank's measured busy seconds
        self._weights: np.ndarray | None = None
        self._stale = False

    @property
    def observations(self) -> int:
        return len(self._rows)

    def observe(self, features: np.ndarray, busy_s: float) -> None:
        """One rank computed micro-batches of summed ``features`` in ``busy_s`` seconds."""
        if busy_s > 0 and features[0] > 0:
            self._rows.append(np.asarray(features, dtype=np.float64))
            self._busy.append(float(busy_s))
            self._stale = True

    def weights(self) -> np.ndarray:
        """Seconds per unit of each feature (prior only: per padded token, in arbitrary units)."""
        if self._stale:
            self._weights = self._fit()
            self._stale = False
        if self._weights is None:
            return np.array([0.0, 0.0, 1.0])
        return self._weights

    def estimate(self, features: np.ndarray) -> float:
        return max(float(self.weights() @ features), MIN_COST)

    def _fit(self) -> np.ndarray:
        x = np.stack(self._rows)
        y = np.asarray(self._busy)
        prior = np.array([0.0, 0.0, y.sum() / max(x[:, 2].sum(), 1.0)])
        gram = x.T @ x
        # a ridge toward the prior, scaled per feature like an average observation: it settles a fit
        # of few or alike observations and fades as they accumulate
        penalty = self.prior_rows / len(y) * np.diag(np.maximum(np.diag(gram), 1e-12))
        weights = np.linalg.solve(gram + penalty, x.T @ y + penalty @ prior)
        return np.maximum(weights, 0.0)


def has_its_share(loads: dict[str, float], rank: str, *, remaining: int, job_cost: float, open_ranks: int) -> bool:
    """Whether ``rank`` holds its share of the step in flight and should go to the all-reduce.

    ``loads``: the estimated cost each member holds in this step; ``remaining``: micro-batches of
    the step nobody holds yet, each estimated at ``job_cost``; ``open_ranks``: members not yet told
    they have their share (``rank`` among them). The last of those takes whatever is left, so the
    step always fills. A rank has its share once one more micro-batch would take it further past an
    even share than stopping leaves it short of it."""
    if open_ranks <= 1 or remaining <= 0:
        return remaining <= 0
    total = sum(loads.values()) + remaining * job_cost
    return loads.get(rank, 0.0) + job_cost / 2 >= total / len(loads)
