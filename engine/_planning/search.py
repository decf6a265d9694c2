"""The default algorithm's local search: its start state and its stopping bound.

The search itself (the move families, their candidates and tie order) runs in the compiled
core; ``refine.py`` describes the method and ``OracleSearch`` in ``tests/oracles/planning.py``
specifies it as whole-array numpy expressions. This module builds what the core starts from:
per-sample bins and per-bin token counts, costs and budget sums, computed with numpy sums
whose rounding the oracle shares, and the load at which the search may stop early.
"""

from __future__ import annotations

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.objectives import balance
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout
from evenflow.engine._planning.schedule import NEAR_OPTIMAL

__all__ = ["search", "search_state"]

# Below this many bins per rank the core builds the search state: numpy sums a rank's bins one
# after the other up to seven of them and pairwise from eight, which the core does not copy.
_COMPILED_STATE_BINS = 8


def search_state(problem: BalanceProblem, start: FlatLayout) -> dict[str, np.ndarray]:
    """The search state of layout ``start`` (fresh, writable arrays)."""
    if problem.bins_per_rank < _COMPILED_STATE_BINS:
        return _compiled_state(problem, start)
    return _numpy_state(problem, start)


def _numpy_state(problem: BalanceProblem, start: FlatLayout) -> dict[str, np.ndarray]:
    """:func:`search_state` as numpy expressions (the definition the core follows)."""
    nb = len(start)
    flat = start.flat
    sizes = np.array(start.sizes, dtype=np.int64)  # a copy: the search changes it
    bin_ids = np.repeat(np.arange(nb, dtype=np.int64), sizes)
    bin_of = np.empty(problem.num_samples, dtype=np.int64)
    bin_of[flat] = bin_ids
    num_budgets = len(problem.constraints.budgets)
    bin_bud = np.zeros((nb, num_budgets), dtype=np.float64)
    for k in range(num_budgets):
        bin_bud[:, k] = np.bincount(bin_ids, weights=problem.budget_costs[flat, k], minlength=nb)
    bin_cost = np.bincount(bin_ids, weights=problem.costs[flat], minlength=nb)
    return {
        "bin_of": bin_of,
        "bin_cnt": sizes,
        "bin_tok": np.bincount(bin_ids, weights=problem.tokens[flat], minlength=nb).astype(
            np.int64
        ),
        "bin_cost": bin_cost,
        "bin_bud": bin_bud,
        "load": bin_cost.reshape(problem.num_ranks, problem.bins_per_rank).sum(axis=1),
    }


def _compiled_state(problem: BalanceProblem, start: FlatLayout) -> dict[str, np.ndarray]:
    """:func:`search_state` by the core: the same sums in the same order, in one pass (the
    numpy expressions cost ~8 array operations per search call, several calls per plan)."""
    nb = int(start.sizes.size)
    n = problem.num_samples
    state = {
        "bin_of": np.empty(n, dtype=np.int64),
        "bin_cnt": np.empty(nb, dtype=np.int64),
        "bin_tok": np.empty(nb, dtype=np.int64),
        "bin_cost": np.empty(nb, dtype=np.float64),
        "bin_bud": np.empty((nb, len(problem.constraints.budgets)), dtype=np.float64),
        "load": np.empty(problem.num_ranks, dtype=np.float64),
    }
    native.search_state(problem, start.flat, start.sizes, state)
    return state


def good_enough(problem: BalanceProblem, load: np.ndarray) -> float:
    """The makespan below which searching further is not worth the planning time.

    No layout beats the larger of the mean rank load and the costliest sample; within
    ``schedule.NEAR_OPTIMAL`` of it the remaining gain is small.
    """
    bound = max(float(load.sum()) / problem.num_ranks, float(problem.costs.max(initial=0.0)))
    return bound * (1.0 + NEAR_OPTIMAL)


def search(
    problem: BalanceProblem, start: FlatLayout, budget: int, *, stop_at: float | None = None
) -> tuple[FlatLayout, np.ndarray]:
    """Search from ``start`` for at most ``budget`` attempts: the layout and its sample ranks.

    ``stop_at``: stop once the most loaded rank is at or below this load (default
    :func:`good_enough`), e.g. the makespan of a layout already found elsewhere.
    """
    state = search_state(problem, start)
    stop = good_enough(problem, state["load"]) if stop_at is None else stop_at
    flat, sizes = native.refine_search(
        problem,
        (start.flat, start.sizes),
        state,
        budget=budget,
        good_enough=stop,
        sumsq=problem.objective is balance,
    )
    rank_of: np.ndarray = state["bin_of"] // problem.bins_per_rank
    return FlatLayout(flat, sizes), rank_of
