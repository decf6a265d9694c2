"""Every move family on its own, and the shared driver over any set of them, against the oracle.

Both search phases are one driver loop walking a table of families (``_drive.h``; PHASE1 in
``_native.c``, PHASE2 in ``_polish.c``; ``PHASE1``/``PHASE2`` in ``tests/oracles/planning.py``).
The core runs any subset of a table (``families``, a bit per entry), so each family is held to
its oracle alone, and the driver to its oracle over mixed subsets.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from testkit.problems import make_problem

from evenflow.engine._planning import native
from evenflow.engine._planning.objectives import balance
from evenflow.engine._planning.problem import _flatten
from evenflow.engine._planning.search import good_enough, search_state
from evenflow.engine.planning import BalanceProblem, FlatLayout


def _source(problem: BalanceProblem) -> FlatLayout:
    return FlatLayout(*_flatten([list(b) for b in problem.source_bins]))


def _phase1(problem: BalanceProblem, budget: int, families: int) -> FlatLayout:
    start = _source(problem)
    state = search_state(problem, start)
    flat, sizes = native.refine_search(
        problem,
        (start.flat, start.sizes),
        state,
        budget=budget,
        good_enough=good_enough(problem, state["load"]),
        sumsq=problem.objective is balance,
        families=families,
    )
    return FlatLayout(flat, sizes)


def _phase2(problem: BalanceProblem, budget: int, families: int) -> tuple[FlatLayout, int]:
    start = _source(problem)
    state = search_state(problem, start)
    flat, sizes, changes = native.polish(
        problem,
        (start.flat, start.sizes),
        state,
        budget=budget,
        good_enough=good_enough(problem, state["load"]),
        sumsq=problem.objective is balance,
        cells=10**6,
        families=families,
    )
    return FlatLayout(flat, sizes), changes


def _random_problem(
    rng: np.random.Generator, *, full: bool, budgets: bool, ranks: int = 0
) -> BalanceProblem:
    ranks, per = ranks or int(rng.integers(2, 7)), int(rng.integers(1, 4))
    seq_len = int(rng.integers(16, 40))
    bins = []
    for _ in range(ranks * per):
        items: list[int] = []
        room = seq_len if full else int(rng.integers(seq_len // 3, seq_len + 1))
        for _ in range(int(rng.integers(1, 7))):
            t = int(rng.integers(1, 9))
            if t > room:
                break
            items.append(t)
            room -= t
        if full and room > 0:
            items.append(room)
        bins.append(items or [1])
    n = sum(map(len, bins))
    costs = [float(c) for c in rng.integers(1, 30, size=n)]
    if not budgets:
        return make_problem(bins, num_ranks=ranks, seq_len=seq_len, costs=costs)
    footprints = [[float(v)] for v in rng.integers(0, 4, size=n)]
    most, at = 0.0, 0
    for b in bins:
        most = max(most, sum(f[0] for f in footprints[at : at + len(b)]))
        at += len(b)
    return make_problem(
        bins, num_ranks=ranks, seq_len=seq_len, costs=costs,
        budgets={"v": most + 1.0}, budget_costs=footprints,
    )


def _many_ranks(seed: int) -> BalanceProblem:
    # 40 full light ranks, a few roomy ones heavier than them and a few heavy full ones: the
    # partners past the lightest ranks (the wide and far partner sets).
    rng = np.random.default_rng(seed)
    kinds = [0] * 40 + [1] * int(rng.integers(6, 12)) + [2] * int(rng.integers(3, 8))
    shapes = [[[5, 5]], [[4, 4], [3, 4]], [[2, 2, 6], [3, 7], [1, 9], [1, 2, 7]]]
    bins, costs = [], []
    for k in rng.permutation(kinds).tolist():
        shape = shapes[k][int(rng.integers(0, len(shapes[k])))]
        bins.append(list(shape))
        scale, jitter = [(2.5, 0.0), (4.0, 0.1), (10.0, 1.0)][k]
        costs += [scale * t + int(rng.integers(0, 3)) * jitter for t in shape]
    return make_problem(bins, num_ranks=len(bins), seq_len=10, costs=costs)


def _cases() -> list[BalanceProblem]:
    rng = np.random.default_rng(2024)
    cases = [_random_problem(rng, full=k % 3 == 0, budgets=k % 5 == 4) for k in range(40)]
    cases += [_many_ranks(seed) for seed in range(3)]
    # Past the lightest ranks with several bins per rank (wide partners, shifted moves).
    cases += [_random_problem(rng, full=k % 2 == 0, budgets=False, ranks=12) for k in range(8)]
    # Two bins per rank, the roomy bin of the light rank needing a shift first.
    cases.append(
        make_problem(
            [[5, 1, 4], [1, 5, 2], [1, 4, 1], [3, 3, 3]],
            num_ranks=2,
            seq_len=10,
            costs=[13, 12, 13, 14, 1, 18, 19, 19, 6, 5, 10, 9],
        )
    )
    # The same, with four full lighter ranks first: the shift is found among the wide partners.
    cases.append(
        make_problem(
            [[5, 1, 4], [1, 5, 2]] + [[10], [10]] * 4 + [[1, 4, 1], [3, 3, 3]],
            num_ranks=6,
            seq_len=10,
            costs=[13, 12, 13, 14, 1, 18] + [33.5] * 8 + [19, 19, 6, 5, 10, 9],
        )
    )
    return cases


_CASES = _cases()


@pytest.mark.parametrize("entry", range(7))
def test_each_first_phase_family_alone_matches_its_oracle(
    planning_oracle: ModuleType, entry: int
) -> None:
    assert len(planning_oracle.PHASE1) == 7
    changed = 0
    for problem in _CASES:
        got = _phase1(problem, 40, 1 << entry)
        reference = planning_oracle.OracleSearch(problem, _source(problem))
        reference.families = 1 << entry
        assert got == reference.run(40), planning_oracle.PHASE1[entry]
        changed += got != _source(problem)
    assert changed > 0, f"{planning_oracle.PHASE1[entry]} changed no layout"


@pytest.mark.parametrize("seed", range(4))
def test_the_driver_matches_its_oracle_over_mixed_families(
    planning_oracle: ModuleType, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    masks = [int(m) for m in rng.integers(1, 1 << 7, size=3)]
    for problem in _CASES[seed::4]:
        for mask in masks:
            got = _phase1(problem, 30, mask)
            reference = planning_oracle.OracleSearch(problem, _source(problem))
            reference.families = mask
            assert got == reference.run(30), (mask, problem.num_ranks)


@pytest.mark.parametrize("mask", [1, 2, 3])
def test_each_second_phase_family_matches_its_oracle(
    planning_oracle: ModuleType, mask: int
) -> None:
    assert len(planning_oracle.PHASE2) == 2
    changed = 0
    for problem in _CASES:
        if problem.constraints.budgets:
            continue  # the second phase runs without packing budgets
        got, changes = _phase2(problem, 40, mask)
        reference = planning_oracle.PolishOracle(problem, _source(problem), 10**6)
        reference.families = mask
        state = search_state(problem, _source(problem))
        expected = reference.run(40, good_enough(problem, state["load"]), sumsq=False)
        assert (got, changes) == (expected, reference.changes)
        changed += changes > 0
    assert changed > 0


def test_no_family_changes_nothing() -> None:
    # An empty table: every rank is stuck at once and the layout is the start.
    problem = _CASES[0]
    assert _phase1(problem, 40, 0) == _source(problem)
    assert _phase2(problem, 40, 0) == (_source(problem), 0)
