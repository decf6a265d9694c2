"""The balance window: plan ``W`` consecutive steps together, with bounded delay.

A step whose costliest sample costs more than the mean rank cannot be balanced alone: that
sample's rank is the step's critical path whatever the plan. Planning ``W`` steps together
lets such samples meet in one step, side by side on different ranks. :func:`plan_window`
assigns the samples read in steps ``first_step .. first_step + W - 1`` to those same ``W``
steps, minimising the sum over the window's steps of the step cost under the planner's
objective (``makespan`` or ``lockstep``).

The method reuses the one planner: the window is planned as ``W·R`` ranks of ``B`` bins
(``makespan``: each pseudo-rank is one rank's step) or ``W·R·B`` ranks of one bin
(``lockstep``: each pseudo-rank is one bin), i.e. a single balanced plan of many units. For a
fixed set of units, sorting them by cost and cutting the list into groups of ``R`` minimises
the sum of group maxima; :func:`~evenflow.engine._planning.grouped.grouped_search` then moves
load from each group's costliest unit into units that stay below their own group's maximum.
Groups (``makespan``: a step; ``lockstep``: a position, ``B`` per step) are then given to steps
to keep delays small (which group goes where does not change the cost), and each group's units
to the ranks that read most of their tokens (which decides only how much data moves).

Guarantees: every bin is feasible; every sample of the window is delivered exactly once, in
one of the window's steps, so ``|delivered - read| < W``; the result is a pure function of the
window's columns (canonical key order, no randomness, search budgets counted in attempts);
and it is never worse than the per-step plans: the window's joint layout is used only when its
total cost is strictly below both the per-step plans' total and, by more than
``min_balance_gain``, the per-step source layouts' total; otherwise each step gets its own
per-step plan (each gated against its own source). With ``W = 1`` the result is
``planner.plan_arrays(columns[0], first_step)`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._plan import BalanceDecision, Plan, PlanLayout
from evenflow.engine._planning.bounds import (
    lockstep_lower_bound,
    makespan_lower_bound,
    outlier_bound,
    window_lower_bound,
)
from evenflow.engine._planning.columns import StepColumns
from evenflow.engine._planning.grouped import (
    UnitState,
    grouped_search,
    match_ranks,
    permute_bins,
)
from evenflow.engine._planning.lockstep import order_bins, search_budget
from evenflow.engine._planning.objectives import lockstep
from evenflow.engine._planning.planner import PlannedStep, Planner, _canonical_order
from evenflow.engine._planning.schedule import WINDOW_PASSES
from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError

__all__ = ["WindowPlan", "plan_window"]


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """The plans of a window's steps: ``plans[i]`` is delivered as step ``first_step + i``.

    Each plan's layout names samples by ``(source_rank, read_step, index)``; ``read_step`` is
    any step of the window. ``delays[i][j]`` is ``delivered - read`` (in steps, ``|·| < W``)
    of row ``j`` of ``plans[i].layout``. ``step_lower_bounds[i]`` bounds the cost of the
    samples read in step ``first_step + i`` planned alone (what ``W = 1`` can reach at best);
    ``lower_bound`` bounds the whole window. ``step_costs[i]`` is the delivered step's cost
    under the objective and ``source_costs[i]`` the read step's source cost (under
    ``lockstep``, with its bins sorted, which moves nothing). ``outlier_bound[i]``: the
    delivered step's costliest sample costs more than its mean rank. ``decision`` is the
    window's gate: ``original_objective`` the sum of the source costs, ``candidate_objective``
    the sum of the joint layout's step costs, ``accepted`` whether the joint layout is used.
    """

    first_step: int
    plans: tuple[Plan, ...]
    decision: BalanceDecision
    delays: tuple[np.ndarray, ...]
    step_costs: tuple[float, ...]
    source_costs: tuple[float, ...]
    step_lower_bounds: tuple[float, ...]
    lower_bound: float
    outlier_bound: tuple[bool, ...]

    @property
    def num_steps(self) -> int:
        return len(self.plans)

    @property
    def mean_delay(self) -> float:
        """Mean ``|delivered - read|`` over the window's samples, in steps."""
        total = sum(int(np.abs(d).sum()) for d in self.delays)
        count = sum(int(d.size) for d in self.delays)
        return total / count if count else 0.0

    @property
    def max_delay(self) -> int:
        """Largest ``|delivered - read|`` over the window's samples (always ``< W``)."""
        return max((int(np.abs(d).max(initial=0)) for d in self.delays), default=0)


def plan_window(planner: Planner, columns: Sequence[StepColumns], first_step: int) -> WindowPlan:
    """Plan the ``len(columns)`` steps read from ``first_step`` on (see the module docstring).

    ``columns[i]`` is the gathered step read as ``first_step + i`` with its source layout, as
    :meth:`Planner.plan_arrays` takes it. Raises ``ConfigError``/``TypeError`` on bad input
    (named as ``plan_arrays`` names it, or naming the window) and ``PlanningError`` when the
    algorithm returns an invalid layout.
    """
    first_step = check_int("first_step", first_step, minimum=0)
    given: object = columns
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not given:
        raise ConfigError(
            f"columns must be a non-empty sequence of StepColumns (one per step of the "
            f"window), but got {columns!r:.80}."
        )
    if len(columns) == 1:
        return _single(planner, planner.plan_step(columns[0], first_step), first_step)
    if planner.objective_name not in ("makespan", "lockstep"):
        raise ConfigError(
            f"A balance window of {len(columns)} steps needs objective 'makespan' or "
            f"'lockstep' (the step cost it sums), but the planner's objective is "
            f"{planner.objective_name!r}; use one of those or a window of 1."
        )
    per_step = tuple(planner.plan_arrays(c, first_step + i) for i, c in enumerate(columns))
    return _Window(planner, columns, first_step, per_step).plan()


def _single(planner: Planner, planned: PlannedStep, step: int) -> WindowPlan:
    """A window of one step: the per-step plan and its statistics."""
    plan, problem = planned.plan, planned.problem
    costs, tokens = np.asarray(problem.costs), np.asarray(problem.tokens)
    bound = _step_bound(planner, plan, costs, tokens)
    return WindowPlan(
        first_step=step,
        plans=(plan,),
        decision=plan.decision,
        delays=(np.zeros(len(plan.layout.key_fields), dtype=np.int64),),
        step_costs=(plan.decision.accepted_objective,),
        source_costs=(plan.decision.original_objective,),
        step_lower_bounds=(bound,),
        lower_bound=bound,
        outlier_bound=(outlier_bound(costs, planner.num_ranks),),
    )


def _step_bound(planner: Planner, plan: Plan, costs: np.ndarray, tokens: np.ndarray) -> float:
    """The bound of one read step planned alone: the plan's proven makespan bound, and under
    lockstep also the lockstep bound of its samples."""
    proven = max(plan.decision.lower_bound, makespan_lower_bound(costs, planner.num_ranks))
    if planner.objective is lockstep:
        return lockstep_lower_bound(
            costs,
            tokens,
            planner.num_ranks,
            planner.bins_per_rank,
            planner.seq_len,
            makespan_bound=proven,
        )
    return proven


def _merge(columns: Sequence[StepColumns], first_step: int) -> tuple[StepColumns, np.ndarray]:
    """The window as one set of columns (every key's step explicit), and each row's read step
    relative to ``first_step``."""
    names = columns[0].budget_names
    for i, c in enumerate(columns):
        if c.budget_names != names:
            raise ConfigError(
                f"columns[{i}].budget_names is {c.budget_names!r} but columns[0]'s is "
                f"{names!r}; every step of a window must carry the same packing budgets."
            )
    have_meta = [c.metadata is not None for c in columns]
    if any(have_meta) and not all(have_meta):
        raise ConfigError(
            "columns[i].metadata is given for some steps of the window but not for others; "
            "give it for every step or for none."
        )
    rows = [c.num_samples for c in columns]
    read = np.repeat(np.arange(len(columns), dtype=np.int64), rows)
    key_step = np.concatenate(
        [
            np.full(n, first_step + i, dtype=np.int64)
            if c.key_step is None
            else np.asarray(c.key_step, dtype=np.int64)
            for i, (c, n) in enumerate(zip(columns, rows, strict=True))
        ]
    )
    packing: np.ndarray | None = None
    if any(c.packing_costs is not None for c in columns):
        packing = np.concatenate(
            [
                np.full((n, len(names)), np.nan)
                if c.packing_costs is None
                else np.asarray(c.packing_costs, dtype=np.float64)
                for c, n in zip(columns, rows, strict=True)
            ]
        )
    features: list[Any] | None = None
    if any(c.features is not None for c in columns):
        features = []
        for c, n in zip(columns, rows, strict=True):
            features.extend([None] * n if c.features is None else list(c.features))
    metadata: list[Any] | None = None
    if all(have_meta):
        metadata = [m for c in columns for m in c.metadata or ()]
    merged = StepColumns(
        sizes=np.concatenate([np.asarray(c.sizes, dtype=np.int64) for c in columns]),
        source_rank=np.concatenate([np.asarray(c.source_rank, dtype=np.int64) for c in columns]),
        index=np.concatenate([np.asarray(c.index, dtype=np.int64) for c in columns]),
        tokens=np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in columns]),
        key_step=key_step,
        packing_costs=packing,
        budget_names=names,
        features=features,
        metadata=metadata,
    )
    return merged, read


class _Window:
    """One window's joint plan (see the module docstring); :meth:`plan` builds the result."""

    def __init__(
        self,
        planner: Planner,
        columns: Sequence[StepColumns],
        first_step: int,
        per_step: tuple[Plan, ...],
    ) -> None:
        self.planner = planner
        self.first_step = first_step
        self.per_step = per_step
        self.num_steps = len(columns)
        self.lock = planner.objective is lockstep
        self.merged, read_rows = _merge(columns, first_step)
        num_ranks, per = planner.num_ranks, planner.bins_per_rank
        self.bins_per_unit = 1 if self.lock else per
        num_units = self.num_steps * num_ranks * per // self.bins_per_unit
        self.units = Planner(
            num_ranks=num_units,
            bins_per_rank=self.bins_per_unit,
            seq_len=planner.seq_len,
            cost_model=planner.cost_model,
            algorithm=planner.algorithm,
            objective="makespan",
            oversized_policy=planner.constraints.oversized_policy,
            packing_budgets=dict(planner.constraints.budgets) or None,
        )
        units = self.units.plan_step(self.merged, first_step)
        self.problem, self.unit_flat, self.unit_sizes = units.problem, units.flat, units.sizes
        # Canonical index -> merged row, to find each sample's read step and home rank.
        self.fields, order, _ = _canonical_order(self.merged, first_step)
        self.read = read_rows[order]
        source_bin = np.repeat(
            np.arange(self.merged.sizes.size, dtype=np.int64), self.merged.sizes
        )[order]
        self.home = (source_bin // per) % num_ranks

    def plan(self) -> WindowPlan:
        planner = self.planner
        num_ranks, per, num_steps = planner.num_ranks, planner.bins_per_rank, self.num_steps
        problem = self.problem
        costs = np.asarray(problem.costs)
        tokens = np.asarray(problem.tokens)
        state = UnitState.of(
            costs,
            tokens,
            np.asarray(problem.budget_costs),
            flat=self.unit_flat,
            sizes=self.unit_sizes,
            bins_per_unit=self.bins_per_unit,
        )
        state.regroup()
        num_groups = state.num_units // num_ranks
        budget = search_budget(num_groups, WINDOW_PASSES)
        grouped_search(state, planner.constraints, num_ranks, budget)
        unit_of = state.bin_of // self.bins_per_unit
        group_of_sample = unit_of // num_ranks
        step_of_group = _assign_groups(
            group_of_sample, self.read, num_groups, num_steps, num_groups // num_steps
        )
        # Rank-major bins of every step: unit_of_slot[s, r, b] -> searched unit / bin.
        weights = tokens.astype(np.float64)
        flat, sizes = state.layout()
        bins = np.empty((num_steps, num_ranks, per), dtype=np.int64)
        position = np.zeros(num_steps, dtype=np.int64)
        for g in range(num_groups):  # groups in cost order: positions come out costliest first
            s = int(step_of_group[g])
            units = np.arange(g * num_ranks, (g + 1) * num_ranks, dtype=np.int64)
            ranks = match_ranks(unit_of, self.home, weights, units, num_ranks)
            if self.lock:
                bins[s, ranks, position[s]] = units
                position[s] += 1
            else:
                bins[s, ranks, :] = units[:, None] * per + np.arange(per)
        flat, sizes = permute_bins(flat, sizes, bins.reshape(-1))
        return self._result(flat, sizes)

    def _result(self, flat: np.ndarray, sizes: np.ndarray) -> WindowPlan:
        planner = self.planner
        problem = self.problem
        num_ranks, per, num_steps = planner.num_ranks, planner.bins_per_rank, self.num_steps
        costs, tokens = np.asarray(problem.costs), np.asarray(problem.tokens)
        nb = sizes.size
        bin_of = np.empty(costs.size, dtype=np.int64)
        bin_of[flat] = np.repeat(np.arange(nb, dtype=np.int64), sizes)
        bin_costs = _group_costs(problem, bin_of, nb).reshape(num_steps, num_ranks, per)
        steps_per_rank = per * num_ranks
        plans_flat: list[tuple[np.ndarray, np.ndarray]] = []
        step_costs: list[float] = []
        ends = np.cumsum(sizes)
        for s in range(num_steps):
            a = int(ends[s * steps_per_rank - 1]) if s else 0
            b = int(ends[(s + 1) * steps_per_rank - 1])
            f, z = flat[a:b], sizes[s * steps_per_rank : (s + 1) * steps_per_rank]
            if self.lock:
                f, z = order_bins(f, z, bin_costs[s])
                step_costs.append(lockstep(bin_costs[s]))
            else:
                step_costs.append(float(bin_costs[s].sum(axis=1).max()))
            plans_flat.append((f, z))
        source = tuple(p.decision.original_objective for p in self.per_step)
        per_step_total = math.fsum(p.decision.accepted_objective for p in self.per_step)
        original = math.fsum(source)
        candidate = math.fsum(step_costs)
        gain = (original - candidate) / original if original > 0 else 0.0
        accepted = gain > planner.min_balance_gain and candidate < per_step_total
        decision = BalanceDecision(
            objective=planner.objective_name,
            algorithm=planner.algorithm_name,
            original_objective=original,
            candidate_objective=candidate,
            relative_gain=gain,
            min_balance_gain=planner.min_balance_gain,
            accepted=accepted,
        )
        step_of = np.empty(costs.size, dtype=np.int64)
        step_of[flat] = np.repeat(np.arange(nb, dtype=np.int64) // steps_per_rank, sizes)
        read_bounds = tuple(
            _step_bound(planner, self.per_step[s], costs[self.read == s], tokens[self.read == s])
            for s in range(num_steps)
        )
        lower = window_lower_bound(
            costs,
            tokens,
            num_ranks=num_ranks,
            bins_per_rank=per,
            num_steps=num_steps,
            seq_len=planner.seq_len,
            objective=planner.objective_name,
        )
        if not accepted:
            plans = self.per_step
            delays = tuple(np.zeros(len(p.layout.key_fields), dtype=np.int64) for p in plans)
            outliers = tuple(
                outlier_bound(costs[self.read == s], num_ranks) for s in range(num_steps)
            )
            return WindowPlan(
                first_step=self.first_step,
                plans=plans,
                decision=decision,
                delays=delays,
                step_costs=tuple(p.decision.accepted_objective for p in plans),
                source_costs=source,
                step_lower_bounds=read_bounds,
                lower_bound=lower,
                outlier_bound=outliers,
            )
        rank_of = np.empty(costs.size, dtype=np.int64)
        rank_of[flat] = np.repeat(np.arange(nb, dtype=np.int64) // per, sizes)  # step*R + rank
        rank_costs = _group_costs(problem, rank_of, num_steps * num_ranks).reshape(
            num_steps, num_ranks
        )
        plans_out: list[Plan] = []
        delays_out: list[np.ndarray] = []
        for s, (f, z) in enumerate(plans_flat):
            step = self.first_step + s
            z_ends = np.cumsum(z)
            layout = PlanLayout(
                key_fields=self.fields[f],
                sizes=z,
                tokens=np.add.reduceat(tokens[f], z_ends - z),
                bins_per_rank=per,
            )
            dest = np.repeat(np.arange(z.size, dtype=np.int64) // per, z)
            before = self.per_step[s]
            plans_out.append(
                Plan.of_layout(
                    layout,
                    step=step,
                    seq_len=planner.seq_len,
                    rank_costs=tuple(rank_costs[s].tolist()),
                    source_rank_costs=before.source_rank_costs,
                    decision=BalanceDecision(
                        objective=planner.objective_name,
                        algorithm=planner.algorithm_name,
                        original_objective=source[s],
                        candidate_objective=step_costs[s],
                        relative_gain=(source[s] - step_costs[s]) / source[s]
                        if source[s] > 0
                        else 0.0,
                        min_balance_gain=planner.min_balance_gain,
                        accepted=True,
                        makespan=float(rank_costs[s].max(initial=0.0)),
                        lower_bound=makespan_lower_bound(costs[step_of == s], num_ranks),
                        mean_cost=float(costs[step_of == s].sum()) / num_ranks,
                        largest_cost=float(costs[step_of == s].max(initial=0.0)),
                    ),
                    num_moved=int(np.count_nonzero(dest != self.home[f])),
                    digest=layout.digest(step, planner.seq_len),
                )
            )
            delays_out.append(s - self.read[f])
        return WindowPlan(
            first_step=self.first_step,
            plans=tuple(plans_out),
            decision=decision,
            delays=tuple(delays_out),
            step_costs=tuple(step_costs),
            source_costs=source,
            step_lower_bounds=read_bounds,
            lower_bound=lower,
            outlier_bound=tuple(
                outlier_bound(costs[step_of == s], num_ranks) for s in range(num_steps)
            ),
        )


def _group_costs(problem: Any, group_of: np.ndarray, num: int) -> np.ndarray:
    """Cost of each of ``num`` groups of samples, in the planner's units."""
    if problem.rank_cost_fn is not None:
        return np.asarray(problem.rank_cost_fn(group_of, num), dtype=np.float64)[:num]
    return np.bincount(group_of, weights=problem.costs, minlength=num)


def _assign_groups(
    group_of: np.ndarray, read: np.ndarray, num_groups: int, num_steps: int, per_step: int
) -> np.ndarray:
    """The step of each group (``per_step`` groups a step), keeping delays small.

    The cost of group ``g`` in step ``s`` is ``Σ |s - read|`` over its samples. Groups start in
    order of their mean read step (ties by index) and pairs are exchanged while that lowers the
    total; every comparison is exact integer arithmetic, so the result is deterministic.
    """
    counts = np.bincount(group_of * num_steps + read, minlength=num_groups * num_steps).reshape(
        num_groups, num_steps
    )
    steps = np.arange(num_steps, dtype=np.int64)
    cost = counts @ np.abs(steps[:, None] - steps[None, :])  # cost[g, s]
    weighted = counts @ steps
    sizes = np.maximum(counts.sum(axis=1), 1)
    # Mean read step as an exact fraction comparison: sort by weighted / sizes.
    order = sorted(range(num_groups), key=lambda g: (weighted[g] / sizes[g], g))
    step_of = np.empty(num_groups, dtype=np.int64)
    step_of[np.array(order, dtype=np.int64)] = np.repeat(steps, per_step)
    for _ in range(num_groups * num_groups):
        here = cost[np.arange(num_groups), step_of]
        there = cost[:, step_of]  # there[g, h]: g moved to h's step
        delta = there + there.T - here[:, None] - here[None, :]
        delta[step_of[:, None] == step_of[None, :]] = 0
        best = int(np.argmin(delta))
        if delta.flat[best] >= 0:
            break
        g, h = divmod(best, num_groups)
        step_of[g], step_of[h] = step_of[h], step_of[g]
    return step_of
