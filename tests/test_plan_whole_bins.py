"""The compiled whole-bin starts against their specification (``tests/oracles/whole_bins.py``)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from conftest import load_test_module

from evenflow.engine._planning import native
from evenflow.engine._planning.kk import deal_bins, kk_bins
from evenflow.engine._planning.problem import _flatten
from evenflow.engine.planning import FlatLayout, Planner, QuadraticCost
from evenflow.engine.workloads import DISTRIBUTIONS, make_step


@pytest.fixture(scope="module")
def oracle() -> ModuleType:
    return load_test_module("oracles/whole_bins.py")


def _costs(rng: np.random.Generator, num_bins: int, ties: bool) -> np.ndarray:
    if ties:  # few distinct values: equal loads, equal spreads and equal parts everywhere
        return rng.integers(0, 4, size=num_bins).astype(np.float64)
    return rng.lognormal(0.0, 1.0, size=num_bins) * 1e6


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("per", [1, 2, 4, 7, 16])
def test_the_core_deals_and_differences_bins_as_the_oracle(
    oracle: ModuleType, ranks: int, per: int, ties: bool
) -> None:
    rng = np.random.default_rng(ranks * 100 + per * 2 + ties)
    for _ in range(5):
        costs = _costs(rng, ranks * per, ties)
        order = np.lexsort((np.arange(costs.size), -costs))
        for core, spec in ((native.deal_bins, oracle.deal_bins), (native.kk_bins, oracle.kk_bins)):
            got = core(costs, order, ranks, per).tolist()
            assert got == spec(costs.tolist(), order.tolist(), ranks, per)
            assert sorted(got) == list(range(costs.size))  # every bin once


def test_the_core_refuses_an_order_that_is_not_every_bin_once() -> None:
    costs = np.ones(4)
    with pytest.raises(ValueError, match="every bin once"):
        native.kk_bins(costs, np.array([0, 1, 2, 7]), 2, 2)
    with pytest.raises(ValueError, match="every bin once"):
        native.deal_bins(costs, np.array([0, 1, 2, -1]), 2, 2)
    for core in (native.kk_bins, native.deal_bins):  # a bin twice, another missing
        with pytest.raises(ValueError, match="every bin once"):
            core(costs, np.array([0, 1, 1, 3]), 2, 2)


@pytest.mark.parametrize("distribution", ["sft", "longctx"])
def test_the_starts_move_whole_bins_of_benchmark_steps(
    oracle: ModuleType, distribution: str
) -> None:
    # Through the planner's own problem: each start keeps every source bin whole and in its
    # order, and places the bins where the oracle places them.
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    samples, bins = make_step(
        distribution, "bfd", num_ranks=8, bins_per_rank=4, seq_len=seq_len, seed=0, step=0
    )
    seen = []

    class Capture:
        name = algorithm_id = "capture"

        def assign(self, problem):  # type: ignore[no-untyped-def]
            seen.append(problem)

    Planner(
        num_ranks=8,
        bins_per_rank=4,
        seq_len=seq_len,
        cost_model=QuadraticCost(4096.0),
        algorithm=Capture(),
    ).plan(samples, bins, 0)
    problem = seen[0]
    source = FlatLayout(*_flatten(problem.source_bins))
    source_bins = [list(b) for b in problem.source_bins]
    bin_ids = np.repeat(np.arange(len(source_bins)), source.sizes)
    bin_costs = np.bincount(bin_ids, weights=problem.costs[source.flat])
    order = np.lexsort((np.arange(len(source_bins)), -bin_costs)).tolist()
    for start, spec in ((deal_bins, oracle.deal_bins), (kk_bins, oracle.kk_bins)):
        placed = [list(b) for b in start(problem, source).bins]
        dealt = spec(bin_costs.tolist(), order, 8, 4)
        assert placed == [source_bins[b] for b in dealt]
