"""The greedy sample LPT start, and the default never worse than the peers it stands for.

On nearly full 256 x 2 steps a plain greedy over samples (each to the least-loaded rank with
room, best fit within the rank) used to beat the default plan; the default now starts from it
(``schedule.DEFAULT``). These tests hold the compiled start to its oracle and to the
benchmark's independent implementation of the peer, and check on generated nearly full
256 x 2 steps (held-out mixes and seeds) that the default is never worse than that greedy or
than Karmarkar-Karp over the source bins.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from evenflow.engine._model import PackingConstraints, SampleKey
from evenflow.engine._planning import schedule
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.kk import kk_bins
from evenflow.engine._planning.lpt import sample_lpt_layout
from evenflow.engine._planning.planner import Planner
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout, _flatten
from evenflow.engine._planning.refine import RefineAlgorithm
from evenflow.engine._tools.bench.planner_heldout import HELDOUT_MIXES
from evenflow.engine._tools.bench.planner_peers import sample_lpt_bins
from evenflow.engine.workloads import make_step


def _random_problem(
    rng: np.random.Generator, *, full: bool, budgets: bool, ties: bool
) -> BalanceProblem:
    ranks, per = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    seq_len = int(rng.integers(16, 64))
    bins: list[list[int]] = []
    for _ in range(ranks * per):
        room, items = seq_len, []
        for _ in range(int(rng.integers(1, 6))):
            if room <= 0:
                break
            low = max(1, room - 3) if full else 1
            t = int(rng.integers(low, room + 1)) if not ties else min(room, 4)
            items.append(t)
            room -= t
        bins.append(items)
    tokens = [t for b in bins for t in b]
    n = len(tokens)
    source, at = [], 0
    for b in bins:
        source.append(tuple(range(at, at + len(b))))
        at += len(b)
    budget_costs = np.zeros((n, 0))
    limits = None
    if budgets:
        patches = rng.integers(0, 4, size=n).astype(np.float64)
        most = max(float(patches[list(b)].sum()) for b in source)
        limits = {"patches": most + float(rng.integers(0, 3))}
        budget_costs = patches.reshape(n, 1)
    return BalanceProblem(
        keys=tuple(SampleKey(0, 0, i) for i in range(n)),
        costs=np.array([7.0 * t + t * t for t in tokens]),
        tokens=np.array(tokens, dtype=np.int64),
        budget_costs=budget_costs,
        source_bins=tuple(source),
        num_ranks=ranks,
        bins_per_rank=per,
        constraints=PackingConstraints(seq_len, "error", limits),
    )


@pytest.mark.parametrize(
    ("full", "budgets", "ties"),
    [(False, False, False), (True, False, False), (False, True, False), (True, True, True)],
)
def test_the_compiled_start_is_its_oracle(
    planning_oracle: ModuleType, full: bool, budgets: bool, ties: bool
) -> None:
    rng = np.random.default_rng(11)
    outcomes = set()
    for _ in range(60):
        problem = _random_problem(rng, full=full, budgets=budgets, ties=ties)
        got = sample_lpt_layout(problem)
        expected = planning_oracle.sample_lpt_layout(problem)
        outcomes.add(got is None)
        if expected is None:
            assert got is None
            continue
        assert got is not None
        assert [list(b) for b in got.bins] == [list(b) for b in expected.bins]
    assert False in outcomes  # layouts were compared, not only dead ends


class _Capture:
    """The default algorithm, keeping the last problem it was given."""

    name = "refine"
    algorithm_id = "refine-capture"

    def __init__(self) -> None:
        self.inner = RefineAlgorithm()
        self.problem: BalanceProblem | None = None

    def assign(self, problem: BalanceProblem) -> Any:
        self.problem = problem
        return self.inner.assign(problem)


def _steps(mix: str, linear: float, seeds: range) -> Any:
    """Nearly full 256 x 2 steps of ``mix`` (best-fit-decreasing sources): for each, the
    default plan's max rank cost and the problem it planned."""
    mixture = HELDOUT_MIXES[mix]
    capture = _Capture()
    planner = Planner(
        num_ranks=256,
        bins_per_rank=2,
        seq_len=mixture.default_seq_len,
        cost_model=QuadraticCost(linear=linear, quadratic=1.0),
        algorithm=capture,
    )
    for seed in seeds:
        samples, reference = make_step(
            mixture,
            "bfd",
            num_ranks=256,
            bins_per_rank=2,
            seq_len=mixture.default_seq_len,
            seed=seed,
        )
        plan = planner.plan(samples, reference, 0)
        assert capture.problem is not None
        yield max(plan.rank_costs), capture.problem


_CASES = [("sft", 4096.0), ("sft", 24576.0), ("longctx", 4096.0), ("chat", 24576.0)]


def _peer_wins(seeds: range, cases: list[tuple[str, float]]) -> tuple[int, int, int]:
    """Steps on which the greedy sample LPT, or KK over bins, plans a lower max rank cost than
    the default; and the steps on which the greedy found a layout at all."""
    greedy_wins = kk_wins = greedy_layouts = 0
    for mix, linear in cases:
        for default, problem in _steps(mix, linear, seeds):
            greedy = sample_lpt_bins(problem)
            if greedy is not None:
                greedy_layouts += 1
                # The independent peer and the compiled start are the same greedy.
                start = sample_lpt_layout(problem)
                assert start is not None and [list(b) for b in start.bins] == greedy
                beaten = default * (1 - schedule.TIE)
                greedy_wins += float(problem.rank_costs(greedy).max()) < beaten
            kk = kk_bins(problem, FlatLayout(*_flatten(problem.source_bins)))
            kk_wins += float(problem.rank_costs(kk.bins).max()) < default * (1 - schedule.TIE)
    return greedy_wins, kk_wins, greedy_layouts


_SEEDS = range(2000, 2003)


def test_default_is_never_worse_than_sample_lpt_or_kk_on_nearly_full_steps() -> None:
    greedy_wins, kk_wins, greedy_layouts = _peer_wins(_SEEDS, _CASES)
    assert greedy_layouts >= len(_CASES) * len(_SEEDS) // 2  # the greedy is a real peer here
    assert (greedy_wins, kk_wins) == (0, 0)


def test_without_the_start_the_greedy_wins_on_such_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the test above guards: the same steps with the start taken out of the schedule.
    starts = tuple(s for s in schedule.DEFAULT.starts if s.name != "sample lpt")
    assert len(starts) == len(schedule.DEFAULT.starts) - 1
    monkeypatch.setattr(schedule, "DEFAULT", dataclasses.replace(schedule.DEFAULT, starts=starts))
    greedy_wins, _, _ = _peer_wins(_SEEDS[:2], _CASES[:1])
    assert greedy_wins > 0
