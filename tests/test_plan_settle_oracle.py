"""The compiled settle against its specification (``tests/oracles/settle.py``), bit for bit."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from conftest import load_test_module
from hypothesis import given
from hypothesis import strategies as st
from testkit.problems import FAST, make_problem, shuffled_layouts

from evenflow.engine._planning import native
from evenflow.engine._planning.columns import columns_of_samples
from evenflow.engine._planning.lpt import lpt_layout
from evenflow.engine._planning.problem import _flatten
from evenflow.engine._planning.search import search
from evenflow.engine._planning.settle import home_bins
from evenflow.engine.planning import BalanceProblem, FlatLayout, Planner, QuadraticCost
from evenflow.engine.workloads import DISTRIBUTIONS, make_step


@pytest.fixture(scope="module")
def oracle() -> ModuleType:
    return load_test_module("oracles/settle.py")


def _peak(problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray) -> float:
    return float(problem.rank_costs_of(problem._rank_of_flat(flat, sizes)).max(initial=0.0))


def _assert_same(
    oracle: ModuleType,
    problem: BalanceProblem,
    layout: tuple[np.ndarray, np.ndarray],
    home: np.ndarray,
    weights: np.ndarray,
    limit: float,
    *,
    thorough: bool,
) -> tuple[np.ndarray, np.ndarray]:
    flat, sizes = layout
    got = native.settle(
        problem, flat, sizes, home, weights=weights, limit=limit, thorough=thorough
    )
    expected = oracle.settle(
        problem.costs,
        problem.tokens,
        weights,
        home,
        flat,
        sizes,
        problem.bins_per_rank,
        problem.constraints.seq_len,
        limit,
        thorough=thorough,
    )
    assert np.array_equal(got[1], expected[1])
    assert np.array_equal(got[0], expected[0])
    return got


@FAST
@given(shuffled_layouts(), st.sampled_from([-1.0, 1.0, 1.2]), st.booleans(), st.integers(0, 3))
def test_compiled_settle_matches_the_oracle(
    oracle: ModuleType,
    case: tuple[BalanceProblem, FlatLayout],
    slack: float,
    thorough: bool,
    weight_seed: int,
) -> None:
    problem, layout = case
    source = _flatten([list(b) for b in problem.source_bins])
    home = home_bins(*source, problem.num_samples)
    rng = np.random.default_rng(weight_seed)
    weights = (
        np.ones(problem.num_samples, dtype=np.int64)
        if weight_seed == 0
        else rng.integers(0, 5, size=problem.num_samples).astype(np.int64)
    )
    limit = slack * _peak(problem, layout.flat, layout.sizes) if slack > 0 else -1.0
    _assert_same(oracle, problem, (layout.flat, layout.sizes), home, weights, limit,
                 thorough=thorough)


def _bench_problem(distribution: str, packer: str, ranks: int, bins: int) -> BalanceProblem:
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    planner = Planner(
        num_ranks=ranks, bins_per_rank=bins, seq_len=seq_len,
        cost_model=QuadraticCost(linear=4096.0),
    )
    samples, reference = make_step(
        distribution, packer, num_ranks=ranks, bins_per_rank=bins, seq_len=seq_len, seed=3
    )
    columns, _ = columns_of_samples(
        samples, reference, num_ranks=ranks, bins_per_rank=bins, constraints=planner.constraints
    )
    return planner.plan_step(columns, 0).problem


@pytest.mark.parametrize(
    ("distribution", "packer", "ranks", "bins"),
    [
        ("sft", "firstfit", 8, 4),
        ("sft", "bfd", 8, 4),
        ("pretrain", "firstfit", 8, 1),
        ("longctx", "firstfit", 8, 2),
        ("longctx", "bfd", 64, 1),
        # Past the exact assignment's 128 ranks: the greedy relabelling.
        ("longctx", "firstfit", 160, 1),
    ],
)
def test_compiled_settle_matches_the_oracle_on_benchmark_steps(
    oracle: ModuleType, distribution: str, packer: str, ranks: int, bins: int
) -> None:
    # What the planner settles: LPT's layout and a searched one, from scratch and from the
    # source, plainly at their own makespan and then thoroughly, as the default algorithm does.
    problem = _bench_problem(distribution, packer, ranks, bins)
    source = FlatLayout(*_flatten([list(b) for b in problem.source_bins]))
    home = home_bins(source.flat, source.sizes, problem.num_samples)
    weights = np.ones(problem.num_samples, dtype=np.int64)
    candidates = [search(problem, source, 40)[0]]
    lpt = lpt_layout(problem)
    if lpt is not None:
        candidates.append(lpt)
    changed = 0
    for layout in candidates:
        limit = _peak(problem, layout.flat, layout.sizes)
        plain = _assert_same(oracle, problem, (layout.flat, layout.sizes), home, weights, limit,
                             thorough=False)
        thorough = _assert_same(oracle, problem, plain, home, weights, limit, thorough=True)
        relabelled = _assert_same(oracle, problem, (layout.flat, layout.sizes), home, weights,
                                  -1.0, thorough=False)
        changed += not np.array_equal(plain[0], relabelled[0])
        changed += not np.array_equal(thorough[0], plain[0])
    assert changed > 0  # homecoming ran and did something on these steps


def test_relabelling_keeps_the_identity_when_another_labelling_only_ties(
    oracle: ModuleType,
) -> None:
    # Overlaps (new rank x source rank) [[1, 0, 0], [1, 1, 2], [0, 1, 2]]: the assignment
    # method reaches labels (0, 2, 1), which keep 4 samples, as many as the identity does;
    # the identity stays. Samples: source bin 0 = a, b; 1 = c, d; 2 = e, f, g, h.
    problem = make_problem([[1, 1], [1, 1], [1, 1, 1, 1]], num_ranks=3, seq_len=10)
    a, b, c, d, e, f, g, h = range(8)
    layout = _flatten([[a], [b, c, e, f], [d, g, h]])
    home = home_bins(*_flatten([list(x) for x in problem.source_bins]), problem.num_samples)
    weights = np.ones(problem.num_samples, dtype=np.int64)
    got = _assert_same(oracle, problem, layout, home, weights, -1.0, thorough=False)
    assert np.array_equal(got[0], layout[0]) and np.array_equal(got[1], layout[1])
