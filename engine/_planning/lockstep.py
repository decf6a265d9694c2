"""The ``lockstep`` objective's method: balance every bin, deal them by position, search.

Under FSDP and pipeline schedules ranks synchronise at every microbatch, so a step costs
``Σ_b max_r cost(r, b)`` (see :func:`~evenflow.engine._planning.objectives.lockstep`). Any bin
may sit at any rank of a position, so a layout is a multiset of ``R·B`` feasible bins plus
their grouping into positions, and for a fixed multiset sorting the bins by cost and dealing
``R`` at a time is the best grouping (:mod:`~evenflow.engine._planning.grouped`). The method:

1. **Starts.** The source bins, the makespan plan's bins (the default algorithm on the same
   step under ``makespan``) and ``R·B`` balanced bins (the default algorithm on the step seen
   as ``R·B`` ranks of one bin: every bin close to ``total / (R·B)``).
2. Each start's bins are dealt sorted into positions; the best dealt start is improved by
   :func:`~evenflow.engine._planning.grouped.grouped_search`: a position's costliest bin gives
   load to bins that stay below their own position's maximum (typically the heavy first
   position absorbs load from the others), so the sum of the position maxima falls.
3. Each position's bins go to the ranks that read most of their tokens
   (:func:`~evenflow.engine._planning.grouped.match_ranks`); since positions are dealt from a
   sorted list, every rank's bins come out costliest first, aligned across ranks.

The best result under ``problem.objective`` (scored by the caller's bin costs) is returned when
it beats the source with its bins sorted — the layout the planner keeps otherwise, which moves
no sample. With one bin per rank the objective is the makespan and the makespan plan is
returned. Deterministic: every step is a pure function of the problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from evenflow.engine._planning.grouped import (
    UnitState,
    group_cost,
    grouped_search,
    match_ranks,
    permute_bins,
)
from evenflow.engine._planning.objectives import lockstep, makespan
from evenflow.engine._planning.problem import (
    BalanceProblem,
    FlatLayout,
    _first_infeasible_flat,
    _flatten,
)
from evenflow.engine._planning.schedule import lockstep_budget

__all__ = [
    "bin_cost_matrix",
    "lockstep_assign",
    "order_bins",
    "search_budget",
]

Assign = Callable[[BalanceProblem], "Sequence[Sequence[int]] | None"]


def search_budget(num_groups: int, passes: int) -> int:
    """Attempts for ``passes`` rounds over ``num_groups`` groups (attempts, never time)."""
    return passes * num_groups


def bin_cost_matrix(problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``(R, B)`` costs of the bins of a rank-major layout, in the problem's units."""
    nb = int(sizes.size)
    bin_of = np.empty(problem.num_samples, dtype=np.int64)
    bin_of[flat] = np.repeat(np.arange(nb, dtype=np.int64), sizes)
    costs: np.ndarray
    if problem.rank_cost_fn is not None:
        costs = np.asarray(problem.rank_cost_fn(bin_of, nb), dtype=np.float64)
    else:
        costs = np.bincount(bin_of, weights=problem.costs, minlength=nb)
    return costs[:nb].reshape(problem.num_ranks, problem.bins_per_rank)


def order_bins(
    flat: np.ndarray, sizes: np.ndarray, bin_costs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The layout with every rank's bins by cost, descending (ties keep their order)."""
    num_ranks, per = bin_costs.shape
    within = np.argsort(-bin_costs, axis=1, kind="stable")
    order = (within + (np.arange(num_ranks) * per)[:, None]).reshape(-1)
    if np.array_equal(order, np.arange(order.size)):
        return flat, sizes
    return permute_bins(flat, sizes, order)


def lockstep_assign(problem: BalanceProblem, assign: Assign) -> FlatLayout | None:
    """The lockstep layout of ``problem`` (see the module docstring), or ``None``.

    ``assign`` is the makespan method (the default algorithm), called on the step and on its
    ``R·B`` one-bin view.
    """
    num_ranks, per = problem.num_ranks, problem.bins_per_rank
    if num_ranks < 2:
        return None
    as_makespan = dataclasses.replace(problem, objective=makespan)
    if per == 1:
        # One bin per rank: lockstep is the makespan; its plan (settled, homecoming included,
        # which keeps every rank at or below that makespan) is the lockstep plan.
        found = assign(as_makespan)
        if found is None or isinstance(found, FlatLayout):
            return found
        return FlatLayout(*_flatten(found))
    source = FlatLayout(*_flatten(problem.source_bins))
    home = problem._rank_of_flat(source.flat, source.sizes)
    starts = [source]
    for view in (as_makespan, _one_bin_view(problem)):
        found = assign(view)
        if found is not None:
            starts.append(FlatLayout(*_flatten(found)))
    # Each start dealt into positions by cost; the search improves the best of them only
    # (a start's dealing costs a few array passes, its search up to lockstep_budget attempts).
    states = [_dealt(problem, start) for start in starts]
    dealt = [group_cost(state.unit_cost, num_ranks) for state in states]
    state = states[min(range(len(states)), key=dealt.__getitem__)]
    grouped_search(state, problem.constraints, num_ranks, lockstep_budget(per, num_ranks))
    layout = _to_ranks(problem, state, home)
    if _first_infeasible_flat(problem, layout.flat, layout.sizes) >= 0:
        return None  # rounding at a budget's edge: the exact replay decides
    return layout if _score(problem, layout) < _score(problem, source) else None


def _one_bin_view(problem: BalanceProblem) -> BalanceProblem:
    """The step as ``R·B`` ranks of one bin each (scalar costs: bins are balanced alone)."""
    return dataclasses.replace(
        problem,
        num_ranks=problem.num_bins,
        bins_per_rank=1,
        objective=makespan,
        rank_cost_fn=None,
    )


def _score(problem: BalanceProblem, layout: FlatLayout) -> float:
    return lockstep(bin_cost_matrix(problem, layout.flat, layout.sizes))


def _dealt(problem: BalanceProblem, start: FlatLayout) -> UnitState:
    """``start``'s bins as search state, sorted by cost: position j is bins j*R .. j*R+R-1."""
    state = UnitState.of(
        np.asarray(problem.costs),
        np.asarray(problem.tokens),
        np.asarray(problem.budget_costs),
        flat=start.flat,
        sizes=start.sizes,
        bins_per_unit=1,
    )
    state.regroup()
    return state


def _to_ranks(problem: BalanceProblem, state: UnitState, home: np.ndarray) -> FlatLayout:
    """The sorted bins of ``state`` given to ranks position by position (rank-major)."""
    num_ranks, per = problem.num_ranks, problem.bins_per_rank
    weights = np.asarray(problem.tokens, dtype=np.float64)
    rank_bins = np.empty((num_ranks, per), dtype=np.int64)
    for j in range(per):
        units = np.arange(j * num_ranks, (j + 1) * num_ranks, dtype=np.int64)
        rank_bins[match_ranks(state.bin_of, home, weights, units, num_ranks), j] = units
    flat, sizes = state.layout()
    return FlatLayout(*permute_bins(flat, sizes, rank_bins.reshape(-1)))
