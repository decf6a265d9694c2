"""Grouped balancing: feasible units, grouped so that the sum of the groups' maxima is small.

Two objectives have this shape. Under ``lockstep`` a step costs ``Σ_b max_r cost(r, b)``: the
units are the step's ``R·B`` bins and a group is one microbatch position (``R`` bins, one per
rank). Under a balance window of ``W`` steps the objective is the sum of the steps' costs: the
units are ``W·R`` rank-steps of ``B`` bins each (makespan; a group is a step) or ``W·R·B`` bins
(lockstep; a group is a position of a step). In every case any unit may serve any member of
its group, so a layout is a multiset of feasible units plus a grouping, and for a fixed
multiset the grouping that minimises the sum of group maxima is known: sort the units by cost,
descending, and cut the list into consecutive groups (the ``k``-th largest group maximum can
be no smaller than the unit ranked ``(k - 1)·G + 1``; sorted groups meet that bound).

:func:`grouped_search` improves a unit layout under that objective, in the compiled core
(``_grouped.c``, on the driver loop of ``_drive.h``; its oracle is ``tests/oracles/grouped.py``).
The group maxima stand for the ranks' loads: each attempt works the group of highest maximum
that is not stuck, through its most costly unit ``x``, and takes the best change over a table
of two families (``_group_move.c``: one sample of ``x`` into any bin of another unit;
``_group_exchange.c``: one sample of ``x`` for a cheaper one of the ``PARTNER_UNITS`` units with
the most room). A change is accepted only when the receiving unit stays strictly below the
maximum of its own group (below ``x``'s cost when it is in ``x``'s group), so ``x``'s group's
maximum falls (or, at a tie, the number of units at it) and no other group's maximum rises. An
attempt that finds nothing marks its group stuck; a change unsticks the groups it touches.
Groups are always the sorted runs of the units at hand (the units are re-sorted after every
change, which can only lower the objective). Every change respects ``seq_len``, the packing
budgets, the oversized rule and non-empty bins. The search counts attempts, never time, and
breaks ties by index, so it is a pure function of its input. It reads scalar sample costs; the
caller scores the result in its own units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evenflow.engine._model import PackingConstraints
from evenflow.engine._planning import native
from evenflow.engine._planning.schedule import PARTNER_UNITS

__all__ = [
    "UnitState",
    "group_cost",
    "grouped_search",
    "match_ranks",
    "permute_bins",
    "sorted_units",
]


def sorted_units(unit_costs: np.ndarray) -> np.ndarray:
    """Unit indices by cost, descending, ties by index: cut into groups of ``G`` in turn."""
    costs = np.asarray(unit_costs, dtype=np.float64)
    return np.lexsort((np.arange(costs.size), -costs))


def group_cost(unit_costs: np.ndarray, group_size: int) -> float:
    """Sum of group maxima of units already in group order (consecutive runs of G)."""
    return float(np.asarray(unit_costs).reshape(-1, group_size).max(axis=1).sum())


@dataclass(slots=True)
class UnitState:
    """A layout of samples into units of ``bins_per_unit`` bins, with its running sums."""

    costs: np.ndarray
    tokens: np.ndarray
    budget_costs: np.ndarray
    bin_of: np.ndarray
    bin_cnt: np.ndarray
    bin_tok: np.ndarray
    bin_bud: np.ndarray
    unit_cost: np.ndarray
    bins_per_unit: int

    @classmethod
    def of(
        cls,
        costs: np.ndarray,
        tokens: np.ndarray,
        budget_costs: np.ndarray,
        *,
        flat: np.ndarray,
        sizes: np.ndarray,
        bins_per_unit: int,
    ) -> UnitState:
        nb = int(sizes.size)
        bin_ids = np.repeat(np.arange(nb, dtype=np.int64), sizes)
        bin_of = np.empty(costs.size, dtype=np.int64)
        bin_of[flat] = bin_ids
        k = budget_costs.shape[1]
        bin_bud = np.zeros((nb, k), dtype=np.float64)
        for j in range(k):
            bin_bud[:, j] = np.bincount(bin_of, weights=budget_costs[:, j], minlength=nb)
        bin_cost = np.bincount(bin_of, weights=costs, minlength=nb)
        return cls(
            costs=costs,
            tokens=tokens,
            budget_costs=budget_costs,
            bin_of=bin_of,
            bin_cnt=np.bincount(bin_of, minlength=nb).astype(np.int64),
            bin_tok=np.bincount(bin_of, weights=tokens, minlength=nb).astype(np.int64),
            bin_bud=bin_bud,
            unit_cost=bin_cost.reshape(-1, bins_per_unit).sum(axis=1),
            bins_per_unit=bins_per_unit,
        )

    @property
    def num_units(self) -> int:
        return int(self.unit_cost.size)

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """``(flat, sizes)``: bins in unit order, samples of a bin in index order."""
        flat = np.argsort(self.bin_of, kind="stable")
        return flat, self.bin_cnt.copy()

    def regroup(self, order: np.ndarray | None = None) -> None:
        """Renumber the units by ``order`` (by default by cost, descending, ties by index):
        unit ``k`` becomes unit ``order[k]``, so groups become sorted runs."""
        if order is None:
            order = sorted_units(self.unit_cost)
        per = self.bins_per_unit
        bins = (order[:, None] * per + np.arange(per)).reshape(-1)  # new bin -> old bin
        new_of_old = np.empty_like(bins)
        new_of_old[bins] = np.arange(bins.size, dtype=np.int64)
        self.bin_of = new_of_old[self.bin_of]
        self.bin_cnt = self.bin_cnt[bins]
        self.bin_tok = self.bin_tok[bins]
        self.bin_bud = self.bin_bud[bins]
        self.unit_cost = self.unit_cost[order]


def grouped_search(
    state: UnitState,
    constraints: PackingConstraints,
    group_size: int,
    budget: int,
    *,
    families: int = native.ALL_FAMILIES,
) -> int:
    """Improve ``state`` in place for at most ``budget`` attempts; the attempts used.

    On return the units are renumbered in group order (cost descending, ties by index).
    ``families``: the entries of the table in use (tests hold each to its oracle alone).
    """
    num_units = state.num_units
    if group_size < 2 or num_units % group_size:
        return 0
    for name in ("bin_of", "bin_cnt", "bin_tok"):
        setattr(state, name, np.ascontiguousarray(getattr(state, name), dtype=np.int64))
    for name in ("bin_bud", "unit_cost"):
        setattr(state, name, np.ascontiguousarray(getattr(state, name), dtype=np.float64))
    order = sorted_units(state.unit_cost)
    attempts, _ = native.grouped_search(
        state,
        limits=np.array(list(constraints.budgets.values()), dtype=np.float64),
        order=order,
        group_size=group_size,
        seq_len=constraints.seq_len,
        single=constraints.oversized_policy == "single",
        budget=budget,
        partner_units=PARTNER_UNITS,
        families=families,
    )
    state.regroup(order)
    return attempts


def match_ranks(
    unit_of: np.ndarray,
    home: np.ndarray,
    weights: np.ndarray,
    units: np.ndarray,
    num_ranks: int,
) -> np.ndarray:
    """A rank for each of ``units`` (one group: ``len(units) == num_ranks``), moving little.

    ``unit_of[i]`` is sample ``i``'s unit, ``home[i]`` the rank that read it and
    ``weights[i]`` what moving it costs (its tokens). Pairs (unit, rank) are taken greedily by
    the weight that would stay home, heaviest first, ties by index; units left over get the
    ranks left over in order. Any assignment costs the same under the objective (members of a
    group are interchangeable), so this only decides how much data moves.
    """
    k = int(units.size)
    local = np.full(int(unit_of.max(initial=0)) + 1, -1, dtype=np.int64)
    local[units] = np.arange(k, dtype=np.int64)
    position = local[unit_of]
    sel = np.flatnonzero(position >= 0)
    code = position[sel] * num_ranks + home[sel]
    stay = np.bincount(code, weights=weights[sel], minlength=k * num_ranks)
    nonzero = np.flatnonzero(stay > 0)
    order = nonzero[np.lexsort((nonzero, -stay[nonzero]))]
    rank_of = np.full(k, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    left = k
    for c in order.tolist():
        u, r = divmod(c, num_ranks)
        if rank_of[u] < 0 and not taken[r]:
            rank_of[u] = r
            taken[r] = True
            left -= 1
            if left == 0:
                break
    if left:
        rank_of[rank_of < 0] = np.flatnonzero(~taken)[:left]
    return rank_of


def permute_bins(
    flat: np.ndarray, sizes: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The layout whose bin ``k`` is bin ``order[k]`` of ``(flat, sizes)`` (samples keep order)."""
    starts = np.cumsum(sizes) - sizes
    new_sizes = sizes[order]
    bin_ids = np.repeat(np.arange(order.size, dtype=np.int64), new_sizes)
    offsets = np.arange(int(new_sizes.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(new_sizes) - new_sizes, new_sizes
    )
    return flat[starts[order][bin_ids] + offsets], new_sizes
