"""Lower bounds and outlier reporting: proven bounds, flags, and what the logs say."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_algorithms import FAST, make_problem

from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._pipeline.stats import BalanceTally, step_stats
from evenflow.engine._plan import BalanceDecision, plan_from_wire, plan_to_wire
from evenflow.engine._planning.bounds import step_bound
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.planner import Planner
from evenflow.engine._planning.problem import BalanceProblem


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
def tiny_problems(draw: st.DrawFn) -> BalanceProblem:
    """Feasible steps of at most 7 samples on 2-3 ranks of 1-2 bins, often nearly full."""
    num_ranks = draw(st.integers(2, 3))
    per = draw(st.integers(1, 2)) if num_ranks == 2 else 1
    nb = num_ranks * per
    seq_len = draw(st.integers(6, 20))
    bins: list[list[int]] = []
    for _ in range(nb):
        room = seq_len
        items: list[int] = []
        for _ in range(draw(st.integers(1, 7 // nb))):
            if room <= 0:
                break
            t = draw(st.integers(max(1, room // 3), room))
            items.append(t)
            room -= t
        bins.append(items)
    tokens = [t for b in bins for t in b]
    linear = draw(st.sampled_from([0.0, 2.0, 50.0]))
    costs = [linear * t + t * t for t in tokens]
    return make_problem(bins, num_ranks=num_ranks, seq_len=seq_len, costs=costs)


@FAST
@given(tiny_problems())
def test_the_lower_bound_never_exceeds_the_optimum(problem: BalanceProblem) -> None:
    bound = step_bound(problem)
    optimum = brute_force_optimum(problem)
    assert bound.lower_bound <= optimum * (1 + 1e-12)
    assert bound.lower_bound >= max(bound.mean_cost, bound.largest_cost)


def test_the_capacity_bound_fills_the_outliers_rank() -> None:
    # Two ranks of one 10-token bin and 20 tokens: every rank holds exactly 10. The rank of
    # the 6-token sample (cost 36 under t^2) must take 4 more tokens, at least 1 per token
    # (the 1-token samples), so no layout beats 40, above the mean (37) and the largest (36).
    problem = make_problem([[6, 4], [1, 1, 1, 1, 3, 3]], num_ranks=2, seq_len=10)
    bound = step_bound(problem)
    assert bound.mean_cost == 37.0
    assert bound.largest_cost == 36.0
    assert bound.lower_bound == pytest.approx(40.0 * (1 - 1e-9))
    assert brute_force_optimum(problem) == 40.0


def test_the_bins_of_the_outliers_rank_must_not_be_empty() -> None:
    # Two ranks of two bins: the rank holding the 100-cost sample holds another sample too.
    problem = make_problem(
        [[1], [1], [1], [1], [1]][:4], num_ranks=2, seq_len=100, costs=[100.0, 5.0, 6.0, 7.0]
    )
    assert step_bound(problem).lower_bound == pytest.approx(105.0 * (1 - 1e-9))


def test_pigeonhole_bound_pairs_the_two_largest_of_r_plus_one() -> None:
    # Three samples of cost 10 on two ranks: one rank holds two of them.
    problem = make_problem([[1, 1], [1]], num_ranks=2, seq_len=100, costs=[10.0, 10.0, 10.0])
    assert step_bound(problem).lower_bound == pytest.approx(20.0 * (1 - 1e-9))


def _samples(tokens_per_bin: list[list[int]]) -> tuple[list, list]:
    samples = []
    bins = []
    index = 0
    for b, lengths in enumerate(tokens_per_bin):
        keys = []
        for t in lengths:
            key = SampleKey(b, 0, index)
            index += 1
            samples.append((key, SampleMetadata(tokens=t)))
            keys.append(key)
        bins.append(keys)
    return samples, bins


def test_an_outlier_step_reports_at_bound_and_outlier_bound() -> None:
    # One 30-token sample (cost 900) against three ranks of small ones: the best layout
    # puts it alone, and the step is outlier-bound at its bound.
    samples, bins = _samples([[30, 2], [2, 2, 2], [2, 2]])
    squared = QuadraticCost(linear=0.0, quadratic=1.0)
    planner = Planner(num_ranks=3, bins_per_rank=1, seq_len=64, cost_model=squared)
    plan = planner.plan(samples, bins, 0)
    d = plan.decision
    assert d.largest_cost == 900.0
    assert d.outlier_bound and d.at_bound and d.gap == 0.0
    stats = step_stats(plan, None, (0, 1, 2))
    assert stats.outlier_bound and stats.at_bound
    line = stats.log_line()
    assert "at bound" in line and "outlier-bound" in line and "spread" not in line
    assert stats.to_dict()["lower_bound"] == d.lower_bound


def test_a_balanced_step_is_not_outlier_bound() -> None:
    samples, bins = _samples([[4, 4, 4, 4], [4], [4]])
    plan = Planner(num_ranks=3, bins_per_rank=1, seq_len=64).plan(samples, bins, 0)
    d = plan.decision
    assert not d.outlier_bound
    assert d.makespan == max(plan.rank_costs)
    assert d.lower_bound == pytest.approx(d.mean_cost)
    assert d.at_bound


def test_a_step_left_above_its_bound_says_how_far() -> None:
    d = BalanceDecision("makespan", "refine", 12.0, 12.0, 0.0, 0.0, False, 12.0, 10.0, 10.0, 4.0)
    assert d.gap == pytest.approx(0.2)
    assert not d.at_bound and not d.outlier_bound
    assert d.verdict() == "20.0% above bound"


def test_decision_bounds_survive_the_wire() -> None:
    samples, bins = _samples([[30, 2], [2, 2, 2], [2, 2]])
    plan = Planner(num_ranks=3, bins_per_rank=1, seq_len=64).plan(samples, bins, 4)
    again = plan_from_wire(plan_to_wire(plan), 4)
    assert again.decision == plan.decision
    assert again.decision.verdict() == plan.decision.verdict()


def test_balance_tally_counts_bounds() -> None:
    tally = BalanceTally()
    for layout in ([[30, 2], [2, 2, 2], [2, 2]], [[4, 4, 4, 4], [4], [4]]):
        samples, bins = _samples(layout)
        plan = Planner(num_ranks=3, bins_per_rank=1, seq_len=64).plan(samples, bins, 0)
        tally.add(step_stats(plan, None, (0, 1, 2)))
    summary = tally.to_dict()
    assert summary["steps"] == 2
    assert summary["outlier_bound"] == 1
    assert summary["at_bound"] == 2
    assert summary["max_gap"] < 1e-6  # at bound up to the bound's rounding margin


def test_component_costs_get_the_generic_bounds() -> None:
    from evenflow.engine._planning.cost import ComponentCost

    def encoder(meta: SampleMetadata) -> float:
        return float(meta.tokens)

    def llm(meta: SampleMetadata) -> float:
        return float(meta.tokens) ** 2

    samples, bins = _samples([[8, 2], [2, 2, 2], [2, 2]])
    model = ComponentCost({"encoder": encoder, "llm": llm}, reduce="max")
    plan = Planner(num_ranks=3, bins_per_rank=1, seq_len=64, cost_model=model).plan(
        samples, bins, 0
    )
    d = plan.decision
    assert d.largest_cost == 64.0
    assert d.mean_cost == pytest.approx((64 + 4 * 6) / 3)
    assert d.lower_bound == max(d.mean_cost, d.largest_cost)
    assert d.makespan >= d.lower_bound


def test_rank_costs_of_every_plan_respect_the_bound() -> None:
    rng = np.random.default_rng(2)
    for step in range(5):
        layout = [[int(t) for t in rng.integers(1, 12, size=3)] for _ in range(8)]
        samples, bins = _samples(layout)
        plan = Planner(num_ranks=4, bins_per_rank=2, seq_len=40).plan(samples, bins, step)
        assert max(plan.rank_costs) >= plan.decision.lower_bound
