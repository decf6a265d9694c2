"""The balance window's planner: W steps planned together, each sample within its window.

Property-based over random windows (ranks, bins, seq_len, packing budgets, oversized samples,
both objectives): every sample exactly once, every bin feasible, |delay| < W, never worse
than the per-step plans (hence than the per-step sources), deterministic, W = 1 identical to
the per-step planner, lockstep positions aligned; the bounds never exceed brute-force optima.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.steps import Step, check_window, cost, quadratic, step_columns, window_columns, windows

from evenflow.engine._planning.bounds import (
    lockstep_lower_bound,
    makespan_lower_bound,
    outlier_bound,
    window_lower_bound,
)
from evenflow.engine._planning.columns import StepColumns
from evenflow.engine._planning.window import plan_window
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import Planner

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(windows(), st.integers(0, 5))
def test_window_conserves_is_feasible_and_never_worse(
    g: tuple[dict[str, Any], list[Step]], first: int
) -> None:
    options, steps = g
    columns = window_columns(options, steps)
    result = plan_window(Planner(**options), columns, first)
    check_window(options, columns, result, first)
    # Never worse than the per-step plans, hence than the per-step sources.
    per_step = [Planner(**options).plan_arrays(c, first + i) for i, c in enumerate(columns)]
    total = sum(result.step_costs)
    assert total <= sum(p.decision.accepted_objective for p in per_step) * (1 + 1e-12)
    assert total <= sum(result.source_costs) * (1 + 1e-12)
    assert result.source_costs == pytest.approx([p.decision.original_objective for p in per_step])
    if result.decision.accepted:
        assert result.decision.relative_gain > options["min_balance_gain"]
    else:
        assert [p.digest for p in result.plans] == [p.digest for p in per_step]
    # Deterministic: a fresh planner gives the same window, digest for digest.
    again = plan_window(Planner(**options), columns, first)
    assert [p.digest for p in again.plans] == [p.digest for p in result.plans]
    assert again.decision == result.decision
    # Bounds: no layout beats the window's bound, and W = 1's bound per read step.
    costs = np.concatenate([cost(np.asarray(c.tokens)) for c in columns])
    assert result.lower_bound <= total * (1 + 1e-12)
    assert result.lower_bound >= makespan_lower_bound(costs, options["num_ranks"]) * (1 - 1e-12)
    for s, p in enumerate(per_step):
        assert result.step_lower_bounds[s] <= p.decision.accepted_objective * (1 + 1e-12)
    assert len(result.outlier_bound) == len(columns)


@SETTINGS
@given(windows())
def test_a_window_of_one_is_the_per_step_plan_bitwise(g: tuple[dict[str, Any], list[Step]]) -> None:
    options, steps = g
    column = window_columns(options, steps[:1])[0]
    expected = Planner(**options).plan_arrays(column, 9)
    result = plan_window(Planner(**options), [column], 9)
    plan = result.plans[0]
    assert plan == expected
    assert plan.digest == expected.digest
    assert np.array_equal(plan.layout.key_fields, expected.layout.key_fields)
    assert np.array_equal(plan.layout.sizes, expected.layout.sizes)
    assert (plan.rank_costs, plan.decision, plan.num_moved) == (
        expected.rank_costs,
        expected.decision,
        expected.num_moved,
    )
    assert result.max_delay == 0 and result.mean_delay == 0.0


def _long_window(num_steps: int) -> tuple[Planner, list[StepColumns]]:
    """Steps of 4 ranks x 2 bins where one step in two holds one long sample."""
    rng = np.random.default_rng(3)
    steps: list[Step] = []
    for s in range(num_steps):
        step: Step = [
            [[(int(t), 0) for t in rng.integers(5, 20, size=4)] for _ in range(2)] for _ in range(4)
        ]
        if s % 2 == 0:
            step[s % 4][0] = [(95, 0)]
        steps.append(step)
    planner = Planner(num_ranks=4, bins_per_rank=2, seq_len=100, cost_model=quadratic)
    return planner, [step_columns(st_, False) for st_ in steps]


def test_outlier_steps_meet_in_one_step_and_the_window_wins() -> None:
    planner, columns = _long_window(4)
    per_step = [planner.plan_arrays(c, i) for i, c in enumerate(columns)]
    result = plan_window(planner, columns, 0)
    assert result.decision.accepted
    assert sum(result.step_costs) < 0.9 * sum(p.decision.accepted_objective for p in per_step)
    assert sum(result.step_lower_bounds) > sum(result.step_costs) * 0.5
    # Both long samples now train in the same step, on different ranks.
    long_steps = [
        s for s, p in enumerate(result.plans) for b in p.local_batches for x in b if x.tokens >= 95
    ]
    assert len(set(long_steps)) == 1
    assert result.max_delay < 4 and result.mean_delay <= 1.5
    assert any(outlier_bound(cost(np.asarray(c.tokens)), 4) for c in columns)


def test_window_input_errors_are_named() -> None:
    planner, columns = _long_window(2)
    with pytest.raises(ConfigError, match="columns must be a non-empty sequence"):
        plan_window(planner, [], 0)
    with pytest.raises(ConfigError, match="first_step"):
        plan_window(planner, columns, -1)
    balance = Planner(num_ranks=4, bins_per_rank=2, seq_len=100, objective="balance")
    with pytest.raises(ConfigError, match="objective 'makespan' or 'lockstep'"):
        plan_window(balance, columns, 0)
    other = StepColumns(
        sizes=columns[1].sizes,
        source_rank=columns[1].source_rank,
        index=columns[1].index,
        tokens=columns[1].tokens,
        packing_costs=np.zeros((columns[1].num_samples, 1)),
        budget_names=("patches",),
    )
    with pytest.raises(ConfigError, match="budget_names"):
        plan_window(planner, [columns[0], other], 0)
    same_keys = StepColumns(
        sizes=columns[0].sizes,
        source_rank=columns[0].source_rank,
        index=columns[0].index,
        tokens=columns[0].tokens,
        key_step=np.zeros(columns[0].num_samples, dtype=np.int64),
    )
    with pytest.raises(ConfigError, match="more than once"):
        plan_window(planner, [columns[0], same_keys], 0)


# ------------------------------------------------------------------ bounds vs brute force


def _optima(
    tokens: np.ndarray, costs: np.ndarray, shape: tuple[int, int, int], seq_len: int
) -> tuple[float, float]:
    """Brute force over every layout: the least (sum of lockstep costs, sum of makespans)."""
    num_steps, num_ranks, per = shape
    nb = num_steps * num_ranks * per
    where = np.array(list(itertools.product(range(nb), repeat=tokens.size)), dtype=np.int64)
    onehot = where[:, :, None] == np.arange(nb)[None, None, :]
    counts = onehot.sum(axis=1)
    load = (onehot * tokens[None, :, None]).sum(axis=1)
    ok = (counts.min(axis=1) > 0) & (load.max(axis=1) <= seq_len)
    if not ok.any():
        return np.inf, np.inf
    bins = (onehot[ok] * costs[None, :, None]).sum(axis=1).reshape(-1, num_steps, num_ranks, per)
    ordered = -np.sort(-bins, axis=3)
    lock = ordered.max(axis=2).sum(axis=(1, 2))
    make = bins.sum(axis=3).max(axis=2).sum(axis=1)
    return float(lock.min()), float(make.min())


_SHAPES = [
    (w, r, b) for w in (1, 2) for r in (1, 2) for b in (1, 2) if w * r * b <= 4
]  # (steps, ranks, bins per rank), at most 4 bins: 4**6 layouts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=4, max_size=6), st.sampled_from(_SHAPES))
def test_bounds_never_exceed_brute_force_optima(
    lengths: list[int], shape: tuple[int, int, int]
) -> None:
    num_steps, num_ranks, per = shape
    seq_len = 12
    tokens = np.array(lengths)
    costs = cost(tokens)
    best_lock, best_make = _optima(tokens, costs, shape, seq_len)
    if not np.isfinite(best_lock):
        return  # no feasible layout with every bin non-empty
    for objective, best in (("lockstep", best_lock), ("makespan", best_make)):
        bound = window_lower_bound(
            costs,
            tokens,
            num_ranks=num_ranks,
            bins_per_rank=per,
            num_steps=num_steps,
            seq_len=seq_len,
            objective=objective,
        )
        assert bound <= best * (1 + 1e-12)
    if num_steps == 1:
        assert lockstep_lower_bound(costs, tokens, num_ranks, per, seq_len) <= best_lock * (
            1 + 1e-12
        )
        assert makespan_lower_bound(costs, num_ranks) <= best_make * (1 + 1e-12)


def test_the_lockstep_bound_counts_the_tokens_a_full_position_cannot_take() -> None:
    # One long sample fills most of a bin: the first position (two bins) holds at most 24
    # tokens, so the other position's bins take the rest and its maximum cannot be small.
    # The mean and the alone samples say 131.5; the optimum is 157.
    tokens = np.array([11, 6, 6, 6, 4, 3, 3])
    costs = tokens.astype(np.float64) ** 2
    best_lock, _ = _optima(tokens, costs, (1, 2, 2), 12)
    assert best_lock == 157.0
    bound = lockstep_lower_bound(costs, tokens, 2, 2, 12)
    assert 150.0 < bound <= best_lock
    window = window_lower_bound(
        costs, tokens, num_ranks=2, bins_per_rank=1, num_steps=2, seq_len=12, objective="lockstep"
    )
    assert window == pytest.approx(bound)  # two steps of one position each: the same positions
