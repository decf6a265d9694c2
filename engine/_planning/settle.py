"""Movement-aware plans: keep a balanced layout's samples where they were read.

Ranks of a layout are interchangeable for its balance, and so are the bins of a rank, so a
layout found by any algorithm can be relabelled to keep as much as possible where it came
from; under the makespan objective, samples can then go back to their source rank wherever
that keeps every rank at or below the plan's makespan. The planner settles every accepted
candidate this way (:func:`settle`), so exchange traffic pays only for balance. The work runs
in the compiled core (``_settle.c``: an exact assignment up to 128 ranks, a greedy one above,
then homecoming passes); the makespan is re-checked here and a homecoming that would raise it
by rounding is dropped. ``tests/oracles/settle.py`` specifies the core's settle in plain Python,
and tests hold the two to identical layouts.

Why an exact assignment only up to 128 ranks: the Hungarian method is O(R^3), ~2 ms at 128
ranks and ~1 s at 1,024. Above, overlaps are sparse (a rank's samples come from a few source
ranks), and taking them greedily in descending order keeps at least half the optimal overlap
and in practice nearly all of it, in O(n log n); homecoming then recovers much of the rest.
An auction algorithm would be exact there too, but its run time depends on the overlap
values, and a plan's time should not.

Movement weights are one per sample: every sample moved costs one message entry, and the
planner reports samples moved. Settling is a pure function of the step, like the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.objectives import lockstep, makespan
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout

__all__ = ["Settler", "home_bins", "settle"]

# Homecoming keeps every rank at or below the makespan less this relative margin: the core
# adds loads in another order than the planner's scoring does.
_MARGIN = 1e-11


def home_bins(source_flat: np.ndarray, source_sizes: np.ndarray, num_samples: int) -> np.ndarray:
    """The source bin of every sample (canonical index order)."""
    home = np.empty(num_samples, dtype=np.int64)
    home[source_flat] = np.repeat(np.arange(source_sizes.size, dtype=np.int64), source_sizes)
    return home


def settle(
    problem: BalanceProblem,
    flat: np.ndarray,
    sizes: np.ndarray,
    home: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    score: Any = None,
    order: np.ndarray | None = None,
    thorough: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The layout ``(flat, sizes)`` relabelled towards ``home`` and, under the makespan
    objective, with samples brought home where no rank then exceeds the makespan.

    ``score(flat, sizes)`` is the planner's objective of a layout; the result never scores
    above the given layout (homecoming is dropped otherwise). ``weights``: per-sample
    movement weights (default one each). ``order``: the samples by (cost, index), from
    :func:`~evenflow.engine._planning.native.cost_order`, when settling several layouts of
    one step (else sorted here). ``thorough``: eight homecoming passes of 64 swap partners a
    sample instead of four of eight, then ejections (an away sample makes room for one to
    come home by moving on) and pairs (two samples that belong where the other is come home,
    a third evens their costs; ``_settle.c``), for a plan's final layout (``refine.py``).
    """
    n = problem.num_samples
    w = np.ones(n, dtype=np.int64) if weights is None else np.ascontiguousarray(weights, np.int64)
    homecoming, limit = _limit(problem, flat, sizes)
    out = native.settle(
        problem, flat, sizes, home, weights=w, limit=limit, order=order, thorough=thorough
    )
    if homecoming and score is not None and score(*out) > score(flat, sizes):
        out = native.settle(problem, flat, sizes, home, weights=w, limit=-1.0)
    return out


def _limit(problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray) -> tuple[bool, float]:
    """Whether :func:`settle` brings samples home, and the load no rank may then exceed (-1:
    none come home)."""
    # Under lockstep homecoming keeps every rank's total at or below the makespan but may
    # raise a position's maximum; the score check of the caller then drops it.
    homecoming = problem.objective in (makespan, lockstep) and not problem.constraints.budgets
    if not homecoming:
        return False, -1.0
    rank_of = np.repeat(np.arange(sizes.size, dtype=np.int64) // problem.bins_per_rank, sizes)
    loads = np.bincount(rank_of, weights=problem.costs[flat], minlength=problem.num_ranks)
    peak = float(loads.max(initial=0.0))
    return True, peak - _MARGIN * abs(peak)


class Settler:
    """The settles of one step: every layout of ``problem`` settled towards one source layout.

    ``score(flat, sizes)`` is the objective a settle must not raise (default: the problem's
    objective of the rank costs); the cost order homecoming scans is sorted once, on the first
    settle, and shared by the rest.
    """

    def __init__(
        self,
        problem: BalanceProblem,
        source_flat: np.ndarray,
        source_sizes: np.ndarray,
        score: Callable[[np.ndarray, np.ndarray], float] | None = None,
    ) -> None:
        self.problem = problem
        self.home = home_bins(source_flat, source_sizes, problem.num_samples)
        self.home_rank = self.home // problem.bins_per_rank
        self.score = self._objective if score is None else score
        self._custom = score is not None
        self._order: np.ndarray | None = None
        self._weights: np.ndarray | None = None

    def _objective(self, flat: np.ndarray, sizes: np.ndarray) -> float:
        problem = self.problem
        return float(problem.objective(problem.rank_costs_of(problem._rank_of_flat(flat, sizes))))

    def _settle(
        self, flat: np.ndarray, sizes: np.ndarray, *, thorough: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        if self._order is None:
            self._order = native.cost_order(self.problem)
        return settle(
            self.problem,
            flat,
            sizes,
            self.home,
            score=self.score,
            order=self._order,
            thorough=thorough,
        )

    def plain(self, flat: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Relabelled and, where the objective allows, samples brought home (four passes of
        eight swap partners a sample): what finalists are compared by."""
        return self._settle(flat, sizes, thorough=False)

    def thorough(self, flat: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The wider settle of a layout already settled plainly (:func:`settle`'s
        ``thorough``): keeps its score and moves no more."""
        return self._settle(flat, sizes, thorough=True)

    def moved(self, flat: np.ndarray, sizes: np.ndarray) -> int:
        """Samples of the layout away from their source rank."""
        return int(np.count_nonzero(self.problem._rank_of_flat(flat, sizes) != self.home_rank))

    # The same on FlatLayouts, each layout's sample ranks computed once
    # (``BalanceProblem.ranks_of``): the planner's finish scores, compares and settles a
    # handful of layouts, and repeating that per call was a third of its Python time.

    def score_of(self, layout: FlatLayout) -> float:
        """:attr:`score` of ``layout`` (the problem's objective unless given another)."""
        if self._custom:
            return float(self.score(layout.flat, layout.sizes))
        problem = self.problem
        return float(problem.objective(problem.rank_costs_of(problem.ranks_of(layout))))

    def moved_of(self, layout: FlatLayout) -> int:
        """:meth:`moved` of ``layout``."""
        return int(np.count_nonzero(self.problem.ranks_of(layout) != self.home_rank))

    def settled(self, layout: FlatLayout, *, thorough: bool) -> FlatLayout:
        """:meth:`plain` (or :meth:`thorough`) of ``layout``, as a settled FlatLayout: the
        same layout, with the scores of both layouts computed once."""
        problem = self.problem
        if self._order is None:
            self._order = native.cost_order(problem)
        if self._weights is None:
            self._weights = np.ones(problem.num_samples, dtype=np.int64)
        flat, sizes, w = layout.flat, layout.sizes, self._weights
        homecoming, limit = _limit(problem, flat, sizes)
        out = FlatLayout(
            *native.settle(
                problem,
                flat,
                sizes,
                self.home,
                weights=w,
                limit=limit,
                order=self._order,
                thorough=thorough,
            ),
            settled=True,
        )
        if homecoming and self.score_of(out) > self.score_of(layout):
            again = native.settle(problem, flat, sizes, self.home, weights=w, limit=-1.0)
            out = FlatLayout(*again, settled=True)
        return out
