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

:func:`grouped_search` improves a unit layout under that objective. Groups are fixed during a
pass: the most costly unit ``x`` of a group ``g`` gives one sample to a bin of another unit, or
exchanges one of its samples for a cheaper one, only when the receiving unit stays strictly
below the maximum of its own group (below ``x``'s cost when it is in ``g``). Each change
therefore lowers ``g``'s maximum (or, at a tie, the number of units at it) and raises no other
group's maximum, so a pass cannot cycle. Between passes the units are regrouped by sorting,
which can only lower the objective. Every change respects ``seq_len``, the packing budgets, the
oversized rule and non-empty bins. The search counts attempts (one per group examined), never
time, and breaks ties by index, so it is a pure function of its input.

Moves into any bin are examined; exchanges only with the samples of the few units that have
the most room below their group's maximum (``schedule.PARTNER_UNITS``), which bounds an
attempt's work. The two families are a table (``GROUPED_FAMILIES``) walked by one attempt, as
in the per-rank search phases, except that the best candidate over the table wins. The search
reads scalar sample costs; the caller scores the result in its own units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evenflow.engine._model import PackingConstraints
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

    def regroup(self) -> None:
        """Renumber the units by cost, descending (ties by index): groups become sorted runs."""
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
    state: UnitState, constraints: PackingConstraints, group_size: int, budget: int
) -> int:
    """Improve ``state`` in place for at most ``budget`` attempts; the attempts used.

    ``state``'s units must already be in group order (call :meth:`UnitState.regroup` first);
    they are regrouped after every pass and on return.
    """
    num_units = state.num_units
    if group_size < 2 or num_units % group_size:
        return 0
    num_groups = num_units // group_size
    attempts = 0
    while attempts < budget:
        changed = False
        maxima = state.unit_cost.reshape(num_groups, group_size).max(axis=1)
        for g in np.lexsort((np.arange(num_groups), -maxima)).tolist():
            if attempts >= budget:
                break
            attempts += 1
            if _improve(state, constraints, group_size, g):
                changed = True
        state.regroup()
        if not changed:
            break
    return attempts


@dataclass(frozen=True, slots=True)
class _Attempt:
    """What the families read in one attempt on a group: its most costly unit ``x`` (cost
    ``top``), how far ``x`` can drop before another unit is the group's maximum (``room``),
    every unit's room below its own group's maximum (``slack``; none for ``x``), and ``x``'s
    samples (``mine``) with their costs, tokens and bins."""

    x: int
    top: float
    room: float
    slack: np.ndarray
    unit_of: np.ndarray
    mine: np.ndarray
    ci: np.ndarray
    ti: np.ndarray
    bi: np.ndarray
    open_units: np.ndarray
    limits: np.ndarray


# A candidate change: (gain, -d, kind, row of the sample in ``mine``, target bin or sample).
Candidate = tuple[float, float, int, int, int]


def _moves(state: UnitState, constraints: PackingConstraints, at: _Attempt) -> Candidate | None:
    """Sample i of x into bin q of a unit with room for its cost: the most gain, then the
    least cost moved, then the most room left, then the lowest (row, bin)."""
    if not at.open_units.size:
        return None
    per = state.bins_per_unit
    ci, ti, bi, slack, limits = at.ci, at.ti, at.bi, at.slack, at.limits
    q = (at.open_units[:, None] * per + np.arange(per)).reshape(-1)
    ok = (state.bin_tok[q][None, :] + ti[:, None]) <= constraints.seq_len
    ok &= ci[:, None] < slack[q // per][None, :]
    ok &= (state.bin_cnt[bi] > 1)[:, None] & (ci > 0)[:, None]
    if limits.size:
        bud = state.bin_bud[q][None, :, :] + state.budget_costs[at.mine][:, None, :]
        ok &= np.all(bud <= limits, axis=2)
    if not ok.any():
        return None
    rows, cols = np.nonzero(ok)
    d = ci[rows]
    gain = np.minimum(d, at.room)
    after = slack[q[cols] // per] - d
    pick = np.lexsort((cols, rows, -after, d, -gain))[0]
    return (float(gain[pick]), -float(d[pick]), 1, int(rows[pick]), int(q[cols[pick]]))


def _exchanges(
    state: UnitState, constraints: PackingConstraints, at: _Attempt
) -> Candidate | None:
    """Sample i of x for a cheaper sample j of one of the PARTNER_UNITS units with the most
    room: the most gain, then the least cost exchanged, then the lowest (row, sample)."""
    per = state.bins_per_unit
    ci, ti, bi, slack, limits = at.ci, at.ti, at.bi, at.slack, at.limits
    candidates = at.open_units[np.lexsort((at.open_units, -slack[at.open_units]))][
        :PARTNER_UNITS
    ]
    if not candidates.size:
        return None
    wanted = np.zeros(num_units_of(state), dtype=bool)
    wanted[candidates] = True
    theirs = np.flatnonzero(wanted[at.unit_of])
    costs, tokens, seq_len = state.costs, state.tokens, constraints.seq_len
    cj, tj, bj = costs[theirs], tokens[theirs], state.bin_of[theirs]
    d = ci[:, None] - cj[None, :]
    ok = (d > 0) & (d < slack[bj // per][None, :])
    single = constraints.oversized_policy == "single"
    tok_x = state.bin_tok[bi][:, None] - ti[:, None] + tj[None, :]
    tok_y = state.bin_tok[bj][None, :] - tj[None, :] + ti[:, None]
    ok &= (tok_x <= seq_len) | (single & (state.bin_cnt[bi] == 1))[:, None]
    ok &= (tok_y <= seq_len) | (single & (state.bin_cnt[bj] == 1))[None, :]
    if limits.size and ok.any():
        bi_bud, bj_bud = state.budget_costs[at.mine], state.budget_costs[theirs]
        diff = bj_bud[None, :, :] - bi_bud[:, None, :]
        ok &= np.all(state.bin_bud[bi][:, None, :] + diff <= limits, axis=2)
        ok &= np.all(state.bin_bud[bj][None, :, :] - diff <= limits, axis=2)
    if not ok.any():
        return None
    rows, cols = np.nonzero(ok)
    dd = d[rows, cols]
    gain = np.minimum(dd, at.room)
    pick = np.lexsort((cols, rows, dd, -gain))[0]
    return (float(gain[pick]), -float(dd[pick]), 0, int(rows[pick]), int(theirs[cols[pick]]))


# The grouped search's families. Unlike the per-rank phases, which apply the first family that
# finds a change, an attempt here takes the best candidate over the whole table (the most gain
# for the group, then the least cost changed; ties to the earlier family).
GROUPED_FAMILIES = (_moves, _exchanges)


def _improve(state: UnitState, constraints: PackingConstraints, size: int, g: int) -> bool:
    """One attempt on group ``g``: the best change out of its most costly unit, if any."""
    unit_cost = state.unit_cost
    members = unit_cost[g * size : (g + 1) * size]
    x = g * size + int(np.argmax(members))
    top = float(unit_cost[x])
    others = np.delete(members, x - g * size)
    room = top - float(others.max())  # how far x can drop before another unit is g's maximum
    limit = np.repeat(unit_cost.reshape(-1, size).max(axis=1), size)
    limit[g * size : (g + 1) * size] = top
    slack = limit - unit_cost
    slack[x] = -np.inf
    unit_of = state.bin_of // state.bins_per_unit
    mine = np.flatnonzero(unit_of == x)
    if mine.size == 0:
        return False
    at = _Attempt(
        x=x,
        top=top,
        room=room,
        slack=slack,
        unit_of=unit_of,
        mine=mine,
        ci=state.costs[mine],
        ti=state.tokens[mine],
        bi=state.bin_of[mine],
        open_units=np.flatnonzero(slack > 0),
        limits=np.array(list(constraints.budgets.values()), dtype=np.float64),
    )
    best: Candidate | None = None
    for family in GROUPED_FAMILIES:
        found = family(state, constraints, at)
        if found is not None and (best is None or found[:2] > best[:2]):
            best = found
    if best is None:
        return False
    _, _, kind, row, target = best
    i = int(mine[row])
    if kind == 1:
        _move(state, i, target)
    else:
        _swap(state, i, target)
    return True


def num_units_of(state: UnitState) -> int:
    return int(state.unit_cost.size)


def _move(state: UnitState, i: int, q: int) -> None:
    per = state.bins_per_unit
    p = int(state.bin_of[i])
    c, t, b = state.costs[i], state.tokens[i], state.budget_costs[i]
    state.bin_of[i] = q
    state.bin_cnt[p] -= 1
    state.bin_cnt[q] += 1
    state.bin_tok[p] -= t
    state.bin_tok[q] += t
    state.bin_bud[p] -= b
    state.bin_bud[q] += b
    state.unit_cost[p // per] -= c
    state.unit_cost[q // per] += c


def _swap(state: UnitState, i: int, j: int) -> None:
    per = state.bins_per_unit
    p, q = int(state.bin_of[i]), int(state.bin_of[j])
    dt = state.tokens[i] - state.tokens[j]
    dc = state.costs[i] - state.costs[j]
    db = state.budget_costs[i] - state.budget_costs[j]
    state.bin_of[i], state.bin_of[j] = q, p
    state.bin_tok[p] -= dt
    state.bin_tok[q] += dt
    state.bin_bud[p] -= db
    state.bin_bud[q] += db
    state.unit_cost[p // per] -= dc
    state.unit_cost[q // per] += dc


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
