"""Balancing problems for the planner's tests: a problem from token counts, random feasible
problems (hypothesis), a layout check, the brute-force optimum of a tiny problem, and shuffled
layouts of a problem; ``FAST`` is the hypothesis profile the planner's property tests share."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from evenflow.engine._planning.objectives import resolve_objective
from evenflow.engine._planning.problem import _flatten, first_infeasible_bin
from evenflow.engine.planning import BalanceProblem, FlatLayout, PackingConstraints, SampleKey

__all__ = [
    "FAST",
    "assert_valid_layout",
    "brute_force_optimum",
    "first_bad",
    "make_problem",
    "problems",
    "shuffled_layouts",
]


def make_problem(
    bins: list[list[int]],
    *,
    num_ranks: int,
    seq_len: int,
    costs: list[float] | None = None,
    budgets: dict[str, float] | None = None,
    budget_costs: list[list[float]] | None = None,
    policy: str = "error",
    objective: str = "makespan",
) -> BalanceProblem:
    """A problem whose source bins hold samples with the given token counts, in order."""
    tokens = [t for b in bins for t in b]
    n = len(tokens)
    source: list[tuple[int, ...]] = []
    start = 0
    for b in bins:
        source.append(tuple(range(start, start + len(b))))
        start += len(b)
    constraints = PackingConstraints(seq_len, policy, budgets)  # type: ignore[arg-type]
    return BalanceProblem(
        keys=tuple(SampleKey(0, 0, i) for i in range(n)),
        costs=np.array(costs if costs is not None else [float(t * t) for t in tokens]),
        tokens=np.array(tokens, dtype=np.int64),
        budget_costs=np.array(budget_costs if budget_costs is not None else [[]] * n),
        source_bins=tuple(source),
        num_ranks=num_ranks,
        bins_per_rank=len(bins) // num_ranks,
        constraints=constraints,
        objective=resolve_objective(objective),
    )


def assert_valid_layout(problem: BalanceProblem, bins: list[list[int]]) -> None:
    assert len(bins) == problem.num_bins
    assert all(len(b) > 0 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(problem.num_samples))
    assert first_infeasible_bin(problem, bins) == -1
    for b in bins:  # the exact replay agrees
        tokens = int(problem.tokens[b].sum())
        if tokens > problem.constraints.seq_len:
            assert len(b) == 1
            assert problem.constraints.oversized_policy == "single"


@st.composite
def problems(draw: st.DrawFn, *, full: bool = False, with_budgets: bool = False) -> BalanceProblem:
    """Random feasible problems; ``full`` packs source bins close to seq_len."""
    num_ranks = draw(st.integers(2, 5))
    per = draw(st.integers(1, 3))
    seq_len = draw(st.integers(8, 40))
    bins: list[list[int]] = []
    for _ in range(num_ranks * per):
        room = seq_len
        items: list[int] = []
        count = draw(st.integers(1, 5))
        for _ in range(count):
            if room <= 0:
                break
            low = max(1, room - 2) if full and len(items) == count - 1 else 1
            t = draw(st.integers(low, room))
            items.append(t)
            room -= t
        bins.append(items)
    n = sum(len(b) for b in bins)
    linear = draw(st.sampled_from([0.0, 1.0, 30.0]))
    tokens = [t for b in bins for t in b]
    costs = [linear * t + t * t for t in tokens]
    budgets = None
    budget_costs = None
    if with_budgets:
        # Budgets loose enough for the source (it must be feasible): each bin's sum, padded.
        patches = [draw(st.integers(0, 3)) for _ in range(n)]
        sums = []
        start = 0
        for b in bins:
            sums.append(sum(patches[start : start + len(b)]))
            start += len(b)
        budgets = {"patches": float(max(sums) + draw(st.integers(0, 2)))}
        budget_costs = [[float(p)] for p in patches]
    objective = draw(st.sampled_from(["makespan", "balance"]))
    return make_problem(
        bins,
        num_ranks=num_ranks,
        seq_len=seq_len,
        costs=costs,
        budgets=budgets,
        budget_costs=budget_costs,
        objective=objective,
    )


FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_force_optimum(problem: BalanceProblem) -> float:
    """The least makespan over every feasible layout (tiny problems only)."""
    n, nb, per = problem.num_samples, problem.num_bins, problem.bins_per_rank
    seq_len = problem.constraints.seq_len
    tokens, costs = problem.tokens.tolist(), problem.costs.tolist()
    best = float("inf")
    for assignment in itertools.product(range(nb), repeat=n):
        fill = [0] * nb
        count = [0] * nb
        for i, b in enumerate(assignment):
            fill[b] += tokens[i]
            count[b] += 1
        if min(count) == 0 or max(fill) > seq_len:
            continue
        loads = [0.0] * problem.num_ranks
        for i, b in enumerate(assignment):
            loads[b // per] += costs[i]
        best = min(best, max(loads))
    return best


@st.composite
def shuffled_layouts(draw: st.DrawFn) -> tuple[BalanceProblem, FlatLayout]:
    """A problem and a layout of it with its bins dealt to ranks in a random order."""
    problem = draw(problems())
    bins = [list(b) for b in problem.source_bins]
    order = draw(st.permutations(range(len(bins))))
    shuffled = [list(bins[b]) for b in order]
    # Also move one sample between two bins when both keep one, to break pure permutations.
    if draw(st.booleans()) and len(shuffled) >= 2 and len(shuffled[0]) >= 2:
        shuffled[1].append(shuffled[0].pop())
        if first_bad(problem, shuffled):
            shuffled = [list(bins[b]) for b in order]
    return problem, FlatLayout(*_flatten(shuffled))


def first_bad(problem: BalanceProblem, bins: list[list[int]]) -> bool:
    return first_infeasible_bin(problem, bins) >= 0
