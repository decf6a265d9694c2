"""Objectives, the balancing problem, the reference greedy (LPT) and the default algorithm."""

from __future__ import annotations

import importlib
import itertools
import math
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.problems import FAST, assert_valid_layout, make_problem, problems

from evenflow.engine._planning import native
from evenflow.engine._planning.lpt import lpt_assign
from evenflow.engine._planning.objectives import (
    balance,
    makespan,
    objective_name,
    resolve_objective,
)
from evenflow.engine._planning.problem import _flatten, first_infeasible_bin
from evenflow.engine._planning.registry import resolve_algorithm
from evenflow.engine._planning.search import search
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import (
    BalanceProblem,
    FlatLayout,
    LPTAlgorithm,
    PackingConstraints,
    RefineAlgorithm,
    SampleKey,
)

# ---------------------------------------------------------------------------- helpers


def reference_lpt(problem: BalanceProblem) -> list[list[int]] | None:
    """The reference rule written out directly: O(n * bins), no heaps, for comparison."""
    per = problem.bins_per_rank
    num_bins = problem.num_bins
    seq_len = problem.constraints.seq_len
    limits = list(problem.constraints.budgets.values())
    order = sorted(
        range(problem.num_samples),
        key=lambda i: (-problem.costs[i], -problem.tokens[i], problem.keys[i]),
    )
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    fill = [0] * num_bins
    spent = [[0.0] * len(limits) for _ in range(num_bins)]
    load = [0.0] * problem.num_ranks
    rank_tokens = [0] * problem.num_ranks
    for position, i in enumerate(order):
        t = int(problem.tokens[i])
        best: tuple[tuple[float, int, int, int, int], int] | None = None
        for b in range(num_bins):
            if position < num_bins and bins[b]:
                continue
            if t > seq_len:
                if fill[b] != 0 or problem.constraints.oversized_policy != "single":
                    continue
            elif fill[b] + t > seq_len:
                continue
            row = problem.budget_costs[i]
            if any(spent[b][k] + float(row[k]) > limits[k] for k in range(len(limits))):
                continue
            r = b // per
            key = (load[r], seq_len - min(seq_len, fill[b] + t), rank_tokens[r], r, b % per)
            if best is None or key < best[0]:
                best = (key, b)
        if best is None:
            return None
        b = best[1]
        r = b // per
        bins[b].append(i)
        fill[b] += t
        for k in range(len(limits)):
            spent[b][k] += float(problem.budget_costs[i][k])
        load[r] += float(problem.costs[i])
        rank_tokens[r] += min(t, seq_len)
    return bins


# ---------------------------------------------------------------------------- objectives


def test_makespan_is_the_largest_rank_cost() -> None:
    assert makespan(np.array([3.0, 9.0, 1.0])) == 9.0
    assert makespan(np.array([])) == 0.0


def test_balance_is_the_squared_coefficient_of_variation() -> None:
    costs = np.array([1.0, 3.0])
    mean = 2.0
    expected = ((1 / mean - 1) ** 2 + (3 / mean - 1) ** 2) / 2
    assert balance(costs) == pytest.approx(expected)
    assert balance(np.array([5.0, 5.0, 5.0])) == 0.0
    assert balance(np.zeros(4)) == 0.0
    assert balance(np.array([])) == 0.0


def test_balance_does_not_overflow_on_flops_sized_costs() -> None:
    value = balance(np.array([1e300, 3e300]))
    assert math.isfinite(value)
    assert value == pytest.approx(balance(np.array([1.0, 3.0])))


def test_resolve_objective_lists_the_names() -> None:
    assert resolve_objective("makespan") is makespan
    assert objective_name(balance) == "balance"
    with pytest.raises(ConfigError, match=r"objective must be one of 'makespan', 'balance'"):
        resolve_objective("latency")


# ---------------------------------------------------------------------------- problem


def test_problem_arrays_are_read_only_and_shapes_checked() -> None:
    problem = make_problem([[1, 2], [3]], num_ranks=2, seq_len=10)
    with pytest.raises(ValueError, match="read-only"):
        problem.costs[0] = 1.0
    assert problem.rank_costs([[0, 1], [2]]).tolist() == [5.0, 9.0]
    with pytest.raises(ConfigError, match=r"costs and \.tokens must have shape \(3,\)"):
        BalanceProblem(
            keys=problem.keys,
            costs=np.zeros(2),
            tokens=problem.tokens,
            budget_costs=problem.budget_costs,
            source_bins=problem.source_bins,
            num_ranks=2,
            bins_per_rank=1,
            constraints=problem.constraints,
        )
    with pytest.raises(ConfigError, match="source_bins must hold num_ranks"):
        BalanceProblem(
            keys=problem.keys,
            costs=problem.costs,
            tokens=problem.tokens,
            budget_costs=problem.budget_costs,
            source_bins=problem.source_bins,
            num_ranks=3,
            bins_per_rank=1,
            constraints=problem.constraints,
        )


def test_first_infeasible_bin_checks_tokens_budgets_and_oversized() -> None:
    problem = make_problem(
        [[4, 4], [3], [12]],
        num_ranks=3,
        seq_len=10,
        budgets={"v": 2.0},
        budget_costs=[[1.0], [1.0], [2.0], [0.0]],
        policy="single",
    )
    assert first_infeasible_bin(problem, [[0, 1], [2], [3]]) == -1
    assert first_infeasible_bin(problem, [[0], [1, 2], [3]]) == 1  # budget 3 > 2
    assert first_infeasible_bin(problem, [[0], [2], [1, 3]]) == 2  # oversized not alone


# ---------------------------------------------------------------------------- LPT


# The greedy runs compiled; the oracle (tests/oracles/planning.py) is its specification. Both
# must follow the reference rule, so the rule tests run against each.
IMPLEMENTATIONS = ["compiled", "oracle"]


def greedy(implementation: str, oracle: ModuleType) -> Any:
    return lpt_assign if implementation == "compiled" else oracle.lpt_assign


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@FAST
@given(problem=problems())
def test_lpt_matches_the_reference_rule(
    implementation: str, planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    assert greedy(implementation, planning_oracle)(problem) == reference_lpt(problem)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@FAST
@given(problem=problems(full=True, with_budgets=True))
def test_lpt_matches_the_reference_rule_with_budgets(
    implementation: str, planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    assert greedy(implementation, planning_oracle)(problem) == reference_lpt(problem)


@st.composite
def tied_problems(draw: st.DrawFn) -> BalanceProblem:
    """Many ranks, few distinct costs and lengths: loads tie all the time."""
    num_ranks = draw(st.integers(2, 24))
    per = draw(st.integers(1, 4))
    seq_len = draw(st.integers(6, 16))
    sizes = draw(st.lists(st.integers(1, 3), min_size=num_ranks * per, max_size=num_ranks * per))
    bins = [[draw(st.integers(1, seq_len // 3)) for _ in range(k)] for k in sizes]
    n = sum(sizes)
    costs = draw(st.lists(st.sampled_from([1.0, 2.0, 0.5]), min_size=n, max_size=n))
    return make_problem(bins, num_ranks=num_ranks, seq_len=seq_len, costs=costs)


@FAST
@given(tied_problems())
def test_compiled_greedy_and_oracle_agree_on_tied_loads(
    planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    expected = planning_oracle.lpt_assign(problem)
    assert lpt_assign(problem) == expected
    assert expected == reference_lpt(problem)


def test_compiled_greedy_and_oracle_agree_on_a_large_step(planning_oracle: ModuleType) -> None:
    rng = np.random.default_rng(7)
    num_ranks, per, seq_len = 64, 4, 4096
    bins = [
        rng.integers(1, 700, size=int(rng.integers(1, 6))).tolist() for _ in range(num_ranks * per)
    ]
    problem = make_problem(bins, num_ranks=num_ranks, seq_len=seq_len)
    expected = planning_oracle.lpt_assign(problem)
    assert expected is not None
    assert lpt_assign(problem) == expected


def test_a_missing_compiled_core_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # There is no fallback: without the extension, importing the planner must say what to do.
    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"_native.*C compiler.*pip install") as info:
        native._load()
    assert isinstance(info.value.__cause__, ImportError)


def test_lpt_balances_18_2_into_10_10() -> None:
    problem = make_problem([[9, 9], [1, 1]], num_ranks=2, seq_len=100, costs=[9, 9, 1, 1])
    bins = LPTAlgorithm().assign(problem)
    assert bins is not None
    assert problem.rank_costs(bins).tolist() == [10.0, 10.0]


def test_lpt_ties_on_load_prefer_the_best_fit() -> None:
    # Equal rank loads: the bin left with less capacity wins even on a later rank.
    problem = make_problem([[5], [2], [3], [1]], num_ranks=2, seq_len=8, costs=[4.0, 4.0, 4.0, 4.0])
    assert lpt_assign(problem) == reference_lpt(problem)


def test_lpt_dead_end_returns_none() -> None:
    # One rank, two bins of 10: the two 5s (most expensive) open both bins, then the 6 fits
    # nowhere although the source (5+5 | 6+4) is feasible.
    problem = make_problem([[5, 5], [6, 4]], num_ranks=1, seq_len=10, costs=[10, 10, 1, 1])
    assert lpt_assign(problem) is None
    assert reference_lpt(problem) is None


def test_lpt_oversized_sample_takes_an_empty_bin_under_single() -> None:
    problem = make_problem([[12], [3, 3]], num_ranks=2, seq_len=10, policy="single")
    bins = lpt_assign(problem)
    assert bins is not None
    assert [0] in bins
    assert_valid_layout(problem, bins)


# ---------------------------------------------------------------------------- resolve


def test_resolve_algorithm_names_and_objects() -> None:
    assert isinstance(resolve_algorithm("default"), RefineAlgorithm)
    assert isinstance(resolve_algorithm("refine"), RefineAlgorithm)
    assert isinstance(resolve_algorithm("lpt"), LPTAlgorithm)
    custom = LPTAlgorithm()
    assert resolve_algorithm(custom) is custom
    with pytest.raises(ConfigError, match=r"'default', 'refine', 'lpt'.*but got 'greedy'"):
        resolve_algorithm("greedy")
    with pytest.raises(TypeError, match="assign"):
        resolve_algorithm(42)


def test_refine_rejects_a_bad_iteration_budget() -> None:
    with pytest.raises(ConfigError, match="max_iterations"):
        RefineAlgorithm(max_iterations=-1)


# ---------------------------------------------------------------------------- refine


def _score_or_source(problem: BalanceProblem, bins: list[list[int]] | None) -> float:
    return problem.score(problem.source_bins if bins is None else bins)


@FAST
@given(problems())
def test_refine_never_worse_than_source_or_lpt(problem: BalanceProblem) -> None:
    bins = RefineAlgorithm().assign(problem)
    if bins is not None:
        assert_valid_layout(problem, bins)
    lpt = lpt_assign(problem)
    bound = min(problem.score(problem.source_bins), _score_or_source(problem, lpt))
    assert _score_or_source(problem, bins) <= bound


@FAST
@given(problems(full=True, with_budgets=True))
def test_refine_respects_budgets_on_nearly_full_bins(problem: BalanceProblem) -> None:
    bins = RefineAlgorithm().assign(problem)
    if bins is not None:
        assert_valid_layout(problem, bins)
    lpt = lpt_assign(problem)
    bound = min(problem.score(problem.source_bins), _score_or_source(problem, lpt))
    assert _score_or_source(problem, bins) <= bound


def test_refine_improves_where_lpt_dead_ends() -> None:
    # Full bins: rank 0 holds the long sample and two mid ones (150), rank 1 only short ones
    # (40). LPT runs out of room for the last short sample; swapping whole bins still helps.
    problem = make_problem(
        [[10], [5, 5], [2, 2, 2, 2, 2], [2, 2, 2, 2, 2]],
        num_ranks=2,
        seq_len=10,
    )
    assert lpt_assign(problem) is None
    bins = RefineAlgorithm().assign(problem)
    assert bins is not None
    assert_valid_layout(problem, bins)
    assert problem.score(bins) < problem.score(problem.source_bins)


def test_refine_keeps_oversized_samples_alone() -> None:
    problem = make_problem([[14], [1, 1], [2, 2], [3, 3]], num_ranks=2, seq_len=10, policy="single")
    bins = RefineAlgorithm().assign(problem)
    layout = problem.source_bins if bins is None else bins
    assert [0] in [list(b) for b in layout]
    if bins is not None:
        assert_valid_layout(problem, bins)


def test_refine_is_deterministic_and_leaves_the_problem_alone() -> None:
    rng = np.random.default_rng(3)
    bins = [list(rng.integers(1, 9, size=4)) for _ in range(12)]
    problem = make_problem([[int(t) for t in b] for b in bins], num_ranks=4, seq_len=40)
    before = (problem.costs.copy(), problem.tokens.copy(), problem.source_bins)
    first = RefineAlgorithm().assign(problem)
    second = RefineAlgorithm().assign(problem)
    assert first == second
    assert np.array_equal(problem.costs, before[0])
    assert np.array_equal(problem.tokens, before[1])
    assert problem.source_bins == before[2]


def test_refine_reaches_the_optimum_on_a_small_instance() -> None:
    # 4 samples of cost 4, 3, 3, 2 over 2 ranks: the optimum is 6 (4+2 | 3+3).
    problem = make_problem([[4, 3], [3, 2]], num_ranks=2, seq_len=100, costs=[4.0, 3.0, 3.0, 2.0])
    bins = RefineAlgorithm().assign(problem)
    assert bins is not None
    assert problem.score(bins) == 6.0


def test_refine_with_a_zero_budget_stays_at_the_best_start() -> None:
    problem = make_problem([[9, 9], [1, 1]], num_ranks=2, seq_len=100, costs=[9, 9, 1, 1])
    bins = RefineAlgorithm(max_iterations=0).assign(problem)
    assert bins is not None
    assert problem.score(bins) == 10.0  # the LPT start


def test_refine_budget_grows_with_the_step_within_its_bounds() -> None:
    from evenflow.engine._planning.schedule import default_budget as _default_budget

    def sized(num_samples: int) -> BalanceProblem:
        per_bin = num_samples // 8
        return make_problem([[1] * per_bin for _ in range(8)], num_ranks=4, seq_len=10**6)

    assert _default_budget(sized(40)) == 256  # tiny: searched to convergence
    assert _default_budget(sized(200)) == 6  # a 4-rank step: bounded like any other
    small, mid, large = (_default_budget(sized(n)) for n in (800, 4000, 16_000))
    assert 6 <= small < mid < large <= 512


def test_refine_budget_counts_ranks_where_they_hold_few_samples() -> None:
    from evenflow.engine._planning.schedule import default_budget as _default_budget

    # 256 ranks of 2 bins with 4 samples a rank: 8 attempts by samples, 128 by ranks.
    problem = make_problem([[1, 1]] * 512, num_ranks=256, seq_len=10)
    assert _default_budget(problem) == 128


def test_the_first_phase_exchanges_with_ranks_past_the_four_lightest() -> None:
    # Rank 0 (7 + 3 tokens, cost 58) can improve only by trading its 7 for the run 3 + 4 of
    # rank 5, the fifth lightest (27); the four lightest are full of 2s, where no move, swap
    # or run fits (their runs hold even token totals, and 7 or 3 would need exactly 7 or 3).
    full = [2, 2, 2, 2, 2]
    problem = make_problem([[7, 3], full, full, full, full, [4, 3, 1, 1]], num_ranks=6, seq_len=10)
    layout, rank_of = search(problem, FlatLayout(*_flatten(problem.source_bins)), 16)
    assert_valid_layout(problem, layout.bins)
    loads = np.bincount(rank_of, weights=problem.costs, minlength=6)
    assert loads.max() == 51.0  # 3 + 3 + 4 on rank 0 (34), 7 + 1 + 1 on rank 5 (51)
    assert sorted(problem.tokens[i] for i in layout.bins[0]) == [3, 3, 4]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_search_moves_to_a_rank_past_the_wide_partners(
    implementation: str, planning_oracle: ModuleType
) -> None:
    # 48 ranks of one 10-token bin. Rank 0 holds 2, 2, 6 tokens (costs 30, 30, 10: 70). The
    # 39 lightest ranks are full of 5-token samples (10): no move, swap or run fits there
    # (rank 0's bin is full too, so only equal-token exchanges could, and none improves).
    # The only room is on ranks 40-47 (two 4-token samples, 10.4), past the 36 ranks the
    # search tried before giving up: its last family moves a 2-token sample to rank 40.
    bins = [[2, 2, 6]] + [[5, 5] for _ in range(39)] + [[4, 4] for _ in range(8)]
    costs = [30.0, 30.0, 10.0] + [5.0] * 78 + [5.2] * 16
    problem = make_problem(bins, num_ranks=48, seq_len=10, costs=costs)
    if implementation == "compiled":
        layout = search(problem, _source_layout(problem), 256)[0].bins
    else:
        layout = planning_oracle.OracleSearch(problem, _source_layout(problem)).run(256).bins
    assert_valid_layout(problem, layout)
    assert problem.score(layout) == pytest.approx(40.4)  # was 70: the search stopped there
    assert 0 in layout[40]  # the first 2-token sample, on the lowest of the tied ranks


@pytest.mark.parametrize("seed", range(4))
def test_compiled_search_matches_past_the_wide_partners(
    planning_oracle: ModuleType, seed: int
) -> None:
    # Shuffled variants of the case above: 40 full light ranks, a few roomy ones heavier
    # than them and a few heavy full ones (each seed reaches the last family 3-7 times).
    rng = np.random.default_rng(seed)
    kinds = [0] * 40 + [1] * int(rng.integers(6, 12)) + [2] * int(rng.integers(3, 8))
    shapes = [[[5, 5]], [[4, 4], [3, 4]], [[2, 2, 6], [3, 7], [1, 9], [1, 2, 7]]]
    bins, costs = [], []
    for k in rng.permutation(kinds).tolist():
        shape = shapes[k][int(rng.integers(0, len(shapes[k])))]
        bins.append(list(shape))
        scale, jitter = [(2.5, 0.0), (4.0, 0.1), (10.0, 1.0)][k]
        costs += [scale * t + int(rng.integers(0, 3)) * jitter for t in shape]
    problem = make_problem(bins, num_ranks=len(bins), seq_len=10, costs=costs)
    source = _source_layout(problem)
    expected = planning_oracle.OracleSearch(problem, source).run(300)
    got = search(problem, source, 300)[0]
    assert got.bins == expected.bins
    assert problem.score(got.bins) < problem.score(source.bins)


def test_lpt_sentinels_report_a_dead_end_when_every_rank_is_full() -> None:
    # Two ranks, one bin each: the two expensive 5s open both bins, then the 6 fits neither,
    # so every rank is parked and the run ends (the source 5+5 | 6+4 is feasible).
    problem = make_problem([[5, 5], [6, 4]], num_ranks=2, seq_len=10, costs=[10, 10, 1, 1])
    assert lpt_assign(problem) is None
    assert reference_lpt(problem) is None


@pytest.mark.parametrize("seed", range(6))
def test_lpt_matches_the_reference_with_many_tied_loads(seed: int) -> None:
    # Few distinct costs over many ranks: loads collide all the time, ranks fill up and
    # are parked and released, which drives every branch of the float-heap placement.
    rng = np.random.default_rng(seed)
    num_ranks, per = int(rng.integers(6, 14)), int(rng.integers(1, 4))
    seq_len = 24
    bins = [[int(t) for t in rng.integers(1, 7, size=3)] for _ in range(num_ranks * per)]
    tokens = [t for b in bins for t in b]
    costs = [float(t // 2) for t in tokens]  # equal costs for different lengths too
    problem = make_problem(bins, num_ranks=num_ranks, seq_len=seq_len, costs=costs)
    expected = reference_lpt(problem)
    assert lpt_assign(problem) == expected
    assert expected is not None


def _source_layout(problem: BalanceProblem) -> FlatLayout:
    return FlatLayout(*_flatten([list(b) for b in problem.source_bins]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_refine_shifts_within_a_rank_when_nothing_else_improves(
    implementation: str, planning_oracle: ModuleType
) -> None:
    # Rank 0 (load 71) can only give the cost-1 sample of 5 tokens; rank 1 (load 68) has 5
    # tokens of room only once a 1-token sample moves from its first bin to its second.
    # Moves, swaps and exchanges all fail, so the search must reach the shift.
    problem = make_problem(
        [[5, 1, 4], [1, 5, 2], [1, 4, 1], [3, 3, 3]],
        num_ranks=2,
        seq_len=10,
        costs=[13, 12, 13, 14, 1, 18, 19, 19, 6, 5, 10, 9],
    )
    if implementation == "compiled":
        layout, _ = search(problem, _source_layout(problem), 1)
    else:
        layout = planning_oracle.OracleSearch(problem, _source_layout(problem)).run(1)
    assert_valid_layout(problem, layout)
    assert problem.rank_costs(layout).tolist() == [70.0, 69.0]
    assert 4 in layout[2]  # the moved sample took the room the shift made


def test_refine_search_caches_follow_every_change(planning_oracle: ModuleType) -> None:
    # Ranks of ~70 samples make the swap family use its cost-sorted windows; after many
    # changes the cached per-rank arrays must still describe the current layout.
    # One full bin per rank (no room for moves, no bin swaps), few distinct lengths and
    # costs unrelated to length: swaps of equal-length samples do the work.
    rng = np.random.default_rng(5)
    bins = [[int(t) for t in rng.integers(1, 4, size=70)] for _ in range(8)]
    costs = [float(c) for c in rng.integers(1, 100, size=8 * 70)]
    problem = make_problem(bins, num_ranks=8, seq_len=max(sum(b) for b in bins), costs=costs)
    oracle_search = planning_oracle.OracleSearch(problem, _source_layout(problem))
    layout = oracle_search.run(40)  # the caches belong to the oracle's search
    assert_valid_layout(problem, layout)
    assert problem.score(layout) < problem.score(problem.source_bins)
    assert oracle_search._sorted_cache  # the windows were used, so stale entries would show
    for r in range(problem.num_ranks):
        members = layout[r]
        assert oracle_search._rank_samples(r).tolist() == members
        expected = sorted(members, key=lambda i: (float(problem.costs[i]), i))
        assert oracle_search._sorted_samples(r).tolist() == expected


# ---------------------------------------------------------------------------- compiled search


def _assign_both(
    oracle: ModuleType, problem: BalanceProblem, **kwargs: int
) -> tuple[object, object]:
    expected = oracle.OracleRefine(**kwargs).assign(problem)
    got = RefineAlgorithm(**kwargs).assign(problem)
    return expected, got


@FAST
@given(problems(), st.sampled_from(["makespan", "balance"]))
def test_compiled_search_matches_the_oracle(
    planning_oracle: ModuleType, problem: BalanceProblem, objective: str
) -> None:
    problem = BalanceProblem(
        keys=problem.keys,
        costs=problem.costs,
        tokens=problem.tokens,
        budget_costs=problem.budget_costs,
        source_bins=problem.source_bins,
        num_ranks=problem.num_ranks,
        bins_per_rank=problem.bins_per_rank,
        constraints=problem.constraints,
        objective=resolve_objective(objective),
    )
    expected, got = _assign_both(planning_oracle, problem)
    assert got == expected


@FAST
@given(problems(full=True))
def test_compiled_search_matches_on_nearly_full_bins(
    planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    expected, got = _assign_both(planning_oracle, problem)
    assert got == expected


@pytest.mark.parametrize("seed", range(4))
def test_compiled_search_matches_on_large_ranks(planning_oracle: ModuleType, seed: int) -> None:
    # ~70 samples per rank: the swap family uses its cost-sorted windows, the exchange family
    # its top candidates, and the search runs for many attempts on tied, unrelated costs.
    rng = np.random.default_rng(seed)
    per = int(rng.integers(1, 4))
    bins = [
        [int(t) for t in rng.integers(1, 6, size=int(rng.integers(20, 70)))] for _ in range(6 * per)
    ]
    costs = [float(c) for c in rng.integers(1, 60, size=sum(map(len, bins)))]
    problem = make_problem(bins, num_ranks=6, seq_len=max(sum(b) for b in bins) + 3, costs=costs)
    expected, got = _assign_both(planning_oracle, problem, max_iterations=60)
    assert expected is not None
    assert got == expected


def test_compiled_search_matches_on_many_ranks(planning_oracle: ModuleType) -> None:
    # More ranks than the search examines at once: the lightest-rank selection and its ties.
    rng = np.random.default_rng(11)
    bins = [[int(t) for t in rng.integers(1, 9, size=int(rng.integers(1, 6)))] for _ in range(96)]
    costs = [float(c) for c in rng.integers(1, 8, size=sum(map(len, bins)))]
    problem = make_problem(bins, num_ranks=48, seq_len=40, costs=costs)
    expected, got = _assign_both(planning_oracle, problem, max_iterations=200)
    assert got == expected


def test_compiled_core_rejects_inconsistent_arrays() -> None:
    # The compiled entry points index arrays with the values they are given: bad input must
    # be a ValueError, never a read outside the arrays.
    core = native._core
    costs = np.ones(4)
    tokens = np.ones(4, dtype=np.int64)
    none = np.zeros(0)  # no packing budgets: empty footprints and limits
    flat, sizes = np.empty(4, dtype=np.int64), np.empty(2, dtype=np.int64)

    def greedy(order: list[int], bud: np.ndarray = none, limits: np.ndarray = none) -> bool:
        return bool(core.lpt(costs, tokens, bud, limits, np.array(order), flat, sizes, 2, 1, 10))

    assert greedy([0, 1, 2, 3]) in (True, False)  # valid: each case below breaks one thing
    with pytest.raises(ValueError, match="order"):
        greedy([0, 1, 2, 9])
    with pytest.raises(ValueError, match="order has"):
        greedy([0, 1])
    with pytest.raises(ValueError, match="budget_costs has"):
        greedy([0, 1, 2, 3], np.zeros(3), np.ones(1))  # one budget needs 4 footprints
    # A consistent state: samples 0, 1 in bin 0 and 2, 3 in bin 1 (two ranks of one bin).
    state = [
        np.array([0, 0, 1, 1]),  # bin_of
        np.array([2, 2]),  # bin_cnt
        np.array([2, 2]),  # bin_tok
        np.array([2.0, 2.0]),  # bin_cost
        np.zeros((2, 0)),  # bin_bud
        np.array([2.0, 2.0]),  # load
    ]

    def run(
        order: list[int],
        bins: list[int],
        *given: np.ndarray,
        per_rank: int = 1,
        bud: np.ndarray = none,
        limits: np.ndarray = none,
    ) -> int:
        arrays = [array.copy() for array in given or state]  # the search writes its state
        return int(
            core.refine_search(
                costs,
                tokens,
                bud,
                limits,
                np.array(order),
                np.array(bins),
                *arrays,
                flat,
                sizes,
                per_rank,
                10,
                5,
                0.0,
                False,
            )
        )

    assert run([0, 1, 2, 3], [2, 2]) >= 0  # the state is valid: each case breaks one thing
    with pytest.raises(ValueError, match="every sample index once"):
        run([0, 1, 2, 7], [2, 2])  # an index past the samples
    with pytest.raises(ValueError, match="every sample index once"):
        run([0, 1, 2, 3], [3, 3])  # sizes that list more samples than there are
    # bin_of must describe the same layout as (flat, sizes): a sample listed in bin 0 but
    # recorded in bin 1 would be removed from the wrong bin and overrun the output.
    with pytest.raises(ValueError, match="same layout"):
        run([0, 1, 2, 3], [2, 2], np.array([1, 1, 0, 0]), *state[1:])
    with pytest.raises(ValueError, match="every sample index once"):
        run([0, 0, 2, 3], [2, 2])  # sample 0 twice, 1 never
    # Budget arrays must match the number of budgets: footprints per sample, sums per bin.
    with pytest.raises(ValueError, match="bud has"):
        run([0, 1, 2, 3], [2, 2], bud=np.zeros(3), limits=np.ones(1))
    with pytest.raises(ValueError, match="bin_bud has"):
        run([0, 1, 2, 3], [2, 2], bud=np.zeros(4), limits=np.ones(1))  # bin_bud has 0 columns
    # ranks * per_rank must not wrap around.
    empty = np.empty(0, dtype=np.int64)
    with pytest.raises(ValueError, match="a sample per bin"):
        core.lpt(np.ones(0), empty, none, none, empty, empty, empty, 2**61, 8, 10)
    with pytest.raises(ValueError, match="inconsistent ranks and bins"):
        run([0, 1, 2, 3], [2, 2], *state[:5], np.zeros(4), per_rank=2**62)


# ---------------------------------------------------------------------------- budgets, compiled


@st.composite
def budget_problems(draw: st.DrawFn) -> BalanceProblem:
    """One to three budgets with inexact footprints, bins of up to 20 samples, tight limits.

    Footprints are multiples of 0.1 (not exact in binary), so sums round and the order in
    which a bin's footprints are added decides checks at the edge of a budget; bins of eight
    and more samples reach the blocked summation numpy uses for a single budget.
    """
    num_ranks = draw(st.integers(2, 6))
    per = draw(st.integers(1, 3))
    num_budgets = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 20)) for _ in range(num_ranks * per)]
    seq_len = draw(st.integers(max(sizes) * 3, max(sizes) * 6))
    bins = [[draw(st.integers(1, 3)) for _ in range(k)] for k in sizes]
    n = sum(sizes)
    footprints = [[draw(st.integers(0, 9)) / 10 for _ in range(num_budgets)] for _ in range(n)]
    sums = np.zeros((len(bins), num_budgets))
    start = 0
    for b, k in enumerate(sizes):
        for row in footprints[start : start + k]:
            sums[b] += row  # the planner's own replay adds sample by sample
        start += k
    slack = draw(st.sampled_from([0.0, 0.1, 0.5]))
    budgets = {f"b{k}": float(sums[:, k].max()) + slack for k in range(num_budgets)}
    distinct = draw(st.sampled_from([2, 5, 50]))  # few distinct costs: ties everywhere
    costs = [float(draw(st.integers(1, distinct))) for _ in range(n)]
    return make_problem(
        bins,
        num_ranks=num_ranks,
        seq_len=seq_len,
        costs=costs,
        budgets=budgets,
        budget_costs=footprints,
        objective=draw(st.sampled_from(["makespan", "balance"])),
    )


@FAST
@given(budget_problems())
def test_compiled_greedy_with_budgets_matches_the_oracle(
    planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    expected = planning_oracle.lpt_assign(problem)
    assert lpt_assign(problem) == expected


@FAST
@given(problems(full=True, with_budgets=True))
def test_compiled_search_with_budgets_matches_on_nearly_full_bins(
    planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    expected, got = _assign_both(planning_oracle, problem)
    assert got == expected


@FAST
@given(budget_problems())
def test_compiled_search_with_budgets_matches_the_oracle(
    planning_oracle: ModuleType, problem: BalanceProblem
) -> None:
    expected, got = _assign_both(planning_oracle, problem)
    assert got == expected
    if got is not None:
        assert_valid_layout(problem, got)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_compiled_search_with_budgets_matches_on_large_ranks(
    planning_oracle: ModuleType, seed: int
) -> None:
    # Bins of 10-40 samples under one or two budgets: swap windows, exchange runs and
    # budget refreshes over more than 8 (and, summed per rank, 128) footprints.
    rng = np.random.default_rng(100 + seed)
    per, num_ranks = int(rng.integers(1, 3)), 6
    bins = [
        [int(t) for t in rng.integers(1, 6, size=int(rng.integers(10, 40)))]
        for _ in range(num_ranks * per)
    ]
    n = sum(map(len, bins))
    num_budgets = 1 + seed % 2
    footprints = (rng.integers(0, 10, size=(n, num_budgets)) / 10).tolist()
    sums = np.zeros((len(bins), num_budgets))
    start = 0
    for b, members in enumerate(bins):
        for row in footprints[start : start + len(members)]:
            sums[b] += row
        start += len(members)
    budgets = {f"b{k}": float(sums[:, k].max()) for k in range(num_budgets)}
    costs = [float(c) for c in rng.integers(1, 60, size=n)]
    problem = make_problem(
        bins,
        num_ranks=num_ranks,
        seq_len=max(sum(b) for b in bins) + 3,
        costs=costs,
        budgets=budgets,
        budget_costs=footprints,
    )
    expected, got = _assign_both(planning_oracle, problem, max_iterations=60)
    assert got == expected
    expected_lpt = planning_oracle.lpt_assign(problem)
    assert lpt_assign(problem) == expected_lpt


def _edge_of_budget_problem(seed: int) -> BalanceProblem:
    """Two ranks of one bin of 8-15 samples; footprints 0.1-0.7 against a one-decimal limit.

    Sums of such footprints land within an ulp of the limit, so the order in which a bin's
    sums are added decides whether a move fits: these seeds are steps whose plan depends on
    adding them as numpy does when it refreshes a bin (blocked, for a single budget).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, 16, size=2).tolist()
    n = sum(sizes)
    footprints = rng.choice([0.1, 0.2, 0.3, 0.7], size=(n, 1))
    bins = [[1] * k for k in sizes]
    bounds = np.cumsum([0, *sizes]).tolist()
    sums = [sum(footprints[a:b, 0].tolist()) for a, b in itertools.pairwise(bounds)]
    limit = float(np.ceil(max(sums) * 10 - 1e-9) / 10) + float(rng.choice([0.0, 0.1]))
    return make_problem(
        bins,
        num_ranks=2,
        seq_len=10**6,
        costs=rng.integers(1, 20, size=n).astype(float).tolist(),
        budgets={"v": limit},
        budget_costs=footprints.tolist(),
    )


@pytest.mark.parametrize("seed", [60, 100, 129])
def test_compiled_search_adds_budget_sums_as_the_oracle_does(
    planning_oracle: ModuleType, seed: int
) -> None:
    problem = _edge_of_budget_problem(seed)
    assert first_infeasible_bin(problem, problem.source_bins) == -1
    expected, got = _assign_both(planning_oracle, problem)
    assert got == expected


def test_the_compiled_search_state_is_numpys_to_the_last_bit() -> None:
    # The search's start state decides every later comparison, so the core must build the
    # very floats the numpy definition gives: costs of mixed magnitudes make any other
    # summation order show in the last bits.
    from evenflow.engine._planning import search as search_module

    rng = np.random.default_rng(7)
    for _ in range(300):
        ranks, per = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        n = int(rng.integers(ranks * per, ranks * per * 5))
        num_budgets = int(rng.integers(0, 3))
        tokens = rng.integers(1, 300, size=n)
        costs = rng.random(n) * rng.choice([1.0, 1e3, 1e9], size=n)
        perm = rng.permutation(n).astype(np.int64)
        cuts = np.sort(rng.choice(np.arange(1, n), size=ranks * per - 1, replace=False))
        problem = BalanceProblem(
            keys=tuple(SampleKey(0, 0, i) for i in range(n)),
            costs=costs,
            tokens=tokens,
            budget_costs=rng.random((n, num_budgets)) * 10,
            source_bins=tuple(tuple(part.tolist()) for part in np.split(perm, cuts)),
            num_ranks=ranks,
            bins_per_rank=per,
            constraints=PackingConstraints(
                10**6, packing_budgets={f"b{k}": 1e9 for k in range(num_budgets)} or None
            ),
        )
        start = FlatLayout(perm, np.diff(np.concatenate([[0], cuts, [n]])).astype(np.int64))
        compiled = search_module._compiled_state(problem, start)
        reference = search_module._numpy_state(problem, start)
        assert compiled.keys() == reference.keys()
        for name, value in reference.items():
            assert compiled[name].dtype == value.dtype and compiled[name].shape == value.shape
            assert np.array_equal(compiled[name], value), name
