"""Slow reference of the grouped search (``engine/_planning/_grouped.c``; tests only).

The specification of the compiled grouped search that lockstep plans and balance windows
run (``grouped.py`` describes the method; ``_grouped.h`` its acceptance rule): the driver
loop of ``_drive.h`` in rounds over the groups' maxima, a table of two families of which an
attempt takes the best candidate, and the units re-sorted after every change. Plain Python
over the same doubles in the same order, so the core must agree with it bit for bit
(``GroupedOracle.run`` updates a ``UnitState`` exactly as ``grouped_search`` does, and
leaves its order).

The tolerance ``1e-12 * |top| + 1e-300`` is ``attempt_tolerance`` of ``_drive.h``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from evenflow.engine._model import PackingConstraints
from evenflow.engine._planning.grouped import UnitState, sorted_units
from evenflow.engine._planning.schedule import PARTNER_UNITS

__all__ = ["GROUPED", "GroupedOracle"]

# A candidate: (gain, d, kind, sample, target); kind 1 a move (target a bin), 2 an exchange
# (target a sample).
Candidate = tuple[float, float, int, int, int]


class GroupedOracle:
    """The grouped search on a copy-free ``UnitState`` (updated in place, as by the core)."""

    def __init__(self, state: UnitState, constraints: PackingConstraints, group_size: int) -> None:
        self.s = state
        self.group = group_size
        self.per = state.bins_per_unit
        self.units = state.num_units
        self.groups = self.units // group_size
        self.seq_len = constraints.seq_len
        self.single = constraints.oversized_policy == "single"
        self.limits = [float(v) for v in constraints.budgets.values()]
        self.cost = [float(c) for c in state.costs]
        self.tok = [int(t) for t in state.tokens]
        self.bud = [[float(v) for v in row] for row in np.asarray(state.budget_costs)]
        nb = self.units * self.per
        self.members: list[list[int]] = [[] for _ in range(nb)]
        for i, b in enumerate(state.bin_of.tolist()):
            self.members[b].append(i)
        self.order = sorted_units(state.unit_cost).tolist()
        self.families = (1 << len(GROUPED)) - 1
        self.stuck = [False] * self.groups
        self.changes = 0

    # ---------------------------------------------------------------- the driver (_drive.h)

    def run(self, budget: int) -> int:
        """The driver in rounds, ``sumsq`` on: each attempt takes the group of highest
        maximum (ties to the lower) neither stuck nor worked in this round; a round without a
        change, or the budget, ends it."""
        self._regroup()
        self.stuck = [False] * self.groups
        seen = [False] * self.groups
        changed = False
        attempts = 0
        while attempts < budget:
            gmax = self.gmax
            free = [g for g in range(self.groups) if not self.stuck[g] and not seen[g]]
            if not free:
                if not changed:
                    break
                seen = [False] * self.groups
                changed = False
                continue
            a = max(free, key=lambda g: (gmax[g], -g))
            partner = self._improve(a)
            attempts += 1
            seen[a] = True
            if partner < 0:
                self.stuck[a] = True
            else:
                self.changes += 1
                changed = True
                self.stuck[a] = self.stuck[partner] = False
        return attempts

    @property
    def gmax(self) -> list[float]:
        return [float(self.s.unit_cost[self.order[g * self.group]]) for g in range(self.groups)]

    def _regroup(self) -> None:
        """``order`` re-sorted by (cost descending, unit ascending); the groups whose members
        moved unstuck (those spanning the first to the last position that changed)."""
        old = list(self.order)
        cost = self.s.unit_cost
        self.order.sort(key=lambda u: (-float(cost[u]), u))
        moved = [k for k in range(self.units) if old[k] != self.order[k]]
        if moved:
            for g in range(moved[0] // self.group, moved[-1] // self.group + 1):
                self.stuck[g] = False

    # ---------------------------------------------------------------- one attempt

    def _improve(self, g: int) -> int:
        size, cost = self.group, self.s.unit_cost
        x = self.order[g * size]
        top = float(cost[x])
        room = top - float(cost[self.order[g * size + 1]])
        tol = 1e-12 * abs(top) + 1e-300
        position = {u: k for k, u in enumerate(self.order)}
        gmax = self.gmax
        slack = [gmax[position[u] // size] - float(cost[u]) for u in range(self.units)]
        slack[x] = -math.inf
        best: Candidate | None = None
        for e, family in enumerate(GROUPED):
            if not (self.families >> e) & 1:
                continue
            found = family(self, x, room, tol, slack)
            if found is not None and (best is None or (found[0], -found[1]) > (best[0], -best[1])):
                best = found
        if best is None:
            return -1
        y = self._apply(best)
        self._regroup()
        return self.order.index(y) // size

    def _accepts(self, d: float, slack: float, tol: float) -> bool:
        return d > tol and d < slack - tol

    def _budgets_hold(self, base: list[float], diff: list[float], sign: int) -> bool:
        return all(
            (b + v if sign > 0 else b - v) <= lim
            for b, v, lim in zip(base, diff, self.limits, strict=True)
        )

    def _bin_bud(self, b: int) -> list[float]:
        return [float(v) for v in self.s.bin_bud[b]]

    def _x_samples(self, x: int) -> list[tuple[int, int]]:
        return [(p, i) for p in range(x * self.per, (x + 1) * self.per) for i in self.members[p]]

    def _apply(self, c: Candidate) -> int:
        s, per = self.s, self.per
        _, _, kind, i, target = c
        p = int(s.bin_of[i])
        if kind == 1:
            q = target
            self.members[p].remove(i)
            self.members[q].append(i)
            s.bin_of[i] = q
            s.bin_cnt[p] -= 1
            s.bin_cnt[q] += 1
            s.bin_tok[p] -= self.tok[i]
            s.bin_tok[q] += self.tok[i]
            for k in range(len(self.limits)):
                s.bin_bud[p, k] = float(s.bin_bud[p, k]) - self.bud[i][k]
                s.bin_bud[q, k] = float(s.bin_bud[q, k]) + self.bud[i][k]
            s.unit_cost[p // per] = float(s.unit_cost[p // per]) - self.cost[i]
            s.unit_cost[q // per] = float(s.unit_cost[q // per]) + self.cost[i]
            return q // per
        j = target
        q = int(s.bin_of[j])
        self.members[p][self.members[p].index(i)] = j
        self.members[q][self.members[q].index(j)] = i
        dt = self.tok[i] - self.tok[j]
        dc = self.cost[i] - self.cost[j]
        s.bin_of[i], s.bin_of[j] = q, p
        s.bin_tok[p] -= dt
        s.bin_tok[q] += dt
        for k in range(len(self.limits)):
            db = self.bud[i][k] - self.bud[j][k]
            s.bin_bud[p, k] = float(s.bin_bud[p, k]) - db
            s.bin_bud[q, k] = float(s.bin_bud[q, k]) + db
        s.unit_cost[p // per] = float(s.unit_cost[p // per]) - dc
        s.unit_cost[q // per] = float(s.unit_cost[q // per]) + dc
        return q // per


def _moves(
    o: GroupedOracle, x: int, room: float, tol: float, slack: list[float]
) -> Candidate | None:
    """Sample i of x (its bin keeping a sample) into bin q of another unit with token room
    and budget: the most gain, then the least cost moved, then the most room left below the
    receiving group's maximum, then the lowest (i, q)."""
    s, per = o.s, o.per
    keys: list[tuple[float, float, float, int, int]] = []
    for p, i in o._x_samples(x):
        if s.bin_cnt[p] < 2:
            continue
        d = o.cost[i]
        for u in range(o.units):
            if u == x or not o._accepts(d, slack[u], tol):
                continue
            for q in range(u * per, (u + 1) * per):
                if int(s.bin_tok[q]) + o.tok[i] > o.seq_len:
                    continue
                if o.limits and not o._budgets_hold(o._bin_bud(q), o.bud[i], 1):
                    continue
                keys.append((-min(d, room), d, -(slack[u] - d), i, q))
    if not keys:
        return None
    gain, d, _, i, q = min(keys)
    return (-gain, d, 1, i, q)


def _exchanges(
    o: GroupedOracle, x: int, room: float, tol: float, slack: list[float]
) -> Candidate | None:
    """Sample i of x for a cheaper sample j of one of the PARTNER_UNITS units with the most
    slack (ties to the lower unit), both bins within seq_len (or alone under "single") and
    their budgets: the most gain, then the least cost exchanged, then the lowest (i, j)."""
    s, per = o.s, o.per
    roomy = [u for u in range(o.units) if u != x and slack[u] > 0.0]
    partners = sorted(roomy, key=lambda u: (-slack[u], u))[:PARTNER_UNITS]
    keys: list[tuple[float, float, int, int]] = []
    for p, i in o._x_samples(x):
        for u in partners:
            for q in range(u * per, (u + 1) * per):
                for j in o.members[q]:
                    d = o.cost[i] - o.cost[j]
                    if not o._accepts(d, slack[u], tol):
                        continue
                    fits_p = int(s.bin_tok[p]) - o.tok[i] + o.tok[j] <= o.seq_len
                    fits_q = int(s.bin_tok[q]) - o.tok[j] + o.tok[i] <= o.seq_len
                    if not (fits_p or (o.single and s.bin_cnt[p] == 1)):
                        continue
                    if not (fits_q or (o.single and s.bin_cnt[q] == 1)):
                        continue
                    if o.limits:
                        diff = [bj - bi for bi, bj in zip(o.bud[i], o.bud[j], strict=True)]
                        if not o._budgets_hold(o._bin_bud(p), diff, 1):
                            continue
                        if not o._budgets_hold(o._bin_bud(q), diff, -1):
                            continue
                    keys.append((-min(d, room), d, i, j))
    if not keys:
        return None
    gain, d, i, j = min(keys)
    return (-gain, d, 2, i, j)


GROUPED: tuple[Callable[..., Candidate | None], ...] = (_moves, _exchanges)
"""The table, in the core's order (``GROUPED`` of ``_grouped.c``)."""
