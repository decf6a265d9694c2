"""The second search phase: group-wide moves, subset exchanges, and whole-bin differencing."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.problems import (
    FAST,
    assert_valid_layout,
    brute_force_optimum,
    make_problem,
    problems,
)

from evenflow.engine._planning.kk import kk_bins
from evenflow.engine._planning.polish import polish
from evenflow.engine._planning.problem import _flatten
from evenflow.engine._planning.search import good_enough, search, search_state
from evenflow.engine.planning import BalanceProblem, FlatLayout, RefineAlgorithm


def _source(problem: BalanceProblem) -> FlatLayout:
    return FlatLayout(*_flatten([list(b) for b in problem.source_bins]))


def _both(
    oracle: ModuleType, problem: BalanceProblem, budget: int, cells: int
) -> tuple[FlatLayout, int, FlatLayout, int]:
    start = _source(problem)
    got, _, changes = polish(problem, start, budget, cells)
    reference = oracle.PolishOracle(problem, start, cells)
    state = search_state(problem, start)
    expected = reference.run(
        budget, good_enough(problem, state["load"]), sumsq=problem.objective.__name__ == "balance"
    )
    return got, changes, expected, reference.changes


@FAST
@given(problems(), st.sampled_from([0, 40, 400, 10**6]))
def test_compiled_polish_matches_the_oracle(
    planning_oracle: ModuleType, problem: BalanceProblem, cells: int
) -> None:
    got, changes, expected, expected_changes = _both(planning_oracle, problem, 60, cells)
    assert got == expected
    assert changes == expected_changes
    assert_valid_layout(problem, got.bins)
    assert problem.score(got) <= problem.score(problem.source_bins)


@FAST
@given(problems(full=True), st.sampled_from([40, 10**6]))
def test_compiled_polish_matches_the_oracle_on_nearly_full_bins(
    planning_oracle: ModuleType, problem: BalanceProblem, cells: int
) -> None:
    got, changes, expected, expected_changes = _both(planning_oracle, problem, 60, cells)
    assert got == expected
    assert changes == expected_changes


def test_compiled_polish_matches_on_many_ranks(planning_oracle: ModuleType) -> None:
    # More ranks than the partner lists hold: the room index and the lightest-rank choice.
    rng = np.random.default_rng(7)
    bins = [[int(t) for t in rng.integers(1, 9, size=int(rng.integers(1, 6)))] for _ in range(40)]
    costs = [float(c) for c in rng.integers(1, 30, size=sum(map(len, bins)))]
    problem = make_problem(bins, num_ranks=40, seq_len=30, costs=costs)
    got, changes, expected, expected_changes = _both(planning_oracle, problem, 200, 10**6)
    assert changes > 0
    assert (got, changes) == (expected, expected_changes)


def test_subset_exchange_finds_the_improvement_a_run_cannot() -> None:
    # One full 11-token bin per rank, cost = tokens^2: rank 0 holds 5, 2, 3, 1 (39), rank 1
    # holds 4, 1, 6 (53). Only equal-token exchanges fit. Rank 1's 4 for rank 0's 3 + 1 (cost
    # 10, 4 tokens) gives 47 | 45; those two are not consecutive by length in rank 0's bin
    # (1, 2, 3, 5: runs of 4 tokens do not exist), so the first phase stays at 53.
    problem = make_problem([[5, 2, 3, 1], [4, 1, 6]], num_ranks=2, seq_len=11)
    first_phase, _ = search(problem, _source(problem), 256)
    assert problem.score(first_phase) == 53.0
    layout = RefineAlgorithm().assign(problem)
    assert layout is not None
    assert_valid_layout(problem, layout)
    assert problem.score(layout) == 47.0 == brute_force_optimum(problem)


def test_group_wide_moves_find_room_beyond_the_lightest_ranks() -> None:
    # 48 ranks of one 10-token bin. Rank 0 holds 2, 2, 6 tokens (costs 30, 30, 10: 70). The
    # 39 lightest ranks hold two 5-token samples (10) and are full; the only room (2 tokens)
    # is on ranks 40-47, which hold two 4-token samples each (10.4), heavier than those. No
    # exchange fits; the group-wide move sends a 2-token sample to rank 40: 40 | 40.4. (The
    # first phase finds the same move with its last family, test_algorithms.py.)
    bins = [[2, 2, 6]] + [[5, 5] for _ in range(39)] + [[4, 4] for _ in range(8)]
    costs = [30.0, 30.0, 10.0] + [5.0] * 78 + [5.2] * 16
    problem = make_problem(bins, num_ranks=48, seq_len=10, costs=costs)
    layout, _, changes = polish(problem, _source(problem), 64, 0)
    assert changes == 1
    assert_valid_layout(problem, layout.bins)
    assert problem.score(layout) == pytest.approx(40.4)
    assert 0 in layout[40]  # the first 2-token sample, on the least loaded rank with room


@FAST
@given(problems())
def test_kk_bins_deals_whole_bins_evenly(problem: BalanceProblem) -> None:
    layout = kk_bins(problem, _source(problem))
    assert_valid_layout(problem, layout.bins)
    source_bins = sorted(sorted(b) for b in problem.source_bins)
    assert sorted(sorted(b) for b in layout.bins) == source_bins  # bins move whole


def test_kk_bins_balances_by_differencing() -> None:
    # Bin costs 8, 7, 6, 5, 4, 4 over 3 ranks of 2 bins: differencing pairs 8+4, 7+4, 6+5.
    problem = make_problem([[1]] * 6, num_ranks=3, seq_len=10, costs=[8.0, 7.0, 6.0, 5.0, 4.0, 4.0])
    layout = kk_bins(problem, _source(problem))
    assert sorted(problem.rank_costs(layout).tolist()) == [11.0, 11.0, 12.0]
