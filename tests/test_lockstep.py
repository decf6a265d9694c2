"""The ``lockstep`` objective: Σ over bin positions of the slowest rank there, positions aligned.

Property-based over random steps: conservation and feasibility (checked independently of the
planner), every rank's bins delivered costliest first, the decision's objective equal to the
delivered layout's lockstep cost, never worse than the source with its bins sorted (the strict
gate's reference) nor than the makespan plan with sorted bins, deterministic; one bin per
rank is the makespan plan; small steps against a brute-force optimum.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from testkit.loaders import IdSource, make_loaders, run_in_threads_or_raise
from testkit.steps import Step, check_window, cost, quadratic, step_columns, windows

from evenflow.engine import LoaderConfig
from evenflow.engine._planning.bounds import lockstep_lower_bound
from evenflow.engine._planning.objectives import lockstep, resolve_objective
from evenflow.engine._planning.window import plan_window
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import Planner

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bin_costs(plan: Any, tokens_of: dict[tuple[int, int, int], int]) -> np.ndarray:
    layout = plan.layout
    keys = [tuple(k) for k in layout.key_fields.tolist()]
    ends = np.cumsum(layout.sizes)
    out = [
        float(cost(np.array([tokens_of[k] for k in keys[e - z : e]])).sum())
        for e, z in zip(ends.tolist(), layout.sizes.tolist(), strict=True)
    ]
    return np.array(out).reshape(plan.num_ranks, plan.bins_per_rank)


def _source_matrix(step: Step) -> np.ndarray:
    return np.array(
        [[float(cost(np.array([t for t, _ in b])).sum()) for b in rank] for rank in step]
    )


@SETTINGS
@given(windows())
def test_lockstep_plans_are_feasible_aligned_and_never_worse(
    g: tuple[dict[str, Any], list[Step]],
) -> None:
    options, steps = g
    options = {**options, "objective": "lockstep"}
    step = steps[0]
    columns = step_columns(step, options["packing_budgets"] is not None)
    plan = Planner(**options).plan_arrays(columns, 4)
    # Conservation, feasibility and aligned positions, checked without the planner.
    check_window(options, [columns], plan_window(Planner(**options), [columns], 4), 4)
    tokens_of = {
        (int(r), 4, int(i)): int(t)
        for r, i, t in zip(columns.source_rank, columns.index, columns.tokens, strict=True)
    }
    matrix = _bin_costs(plan, tokens_of)
    assert np.all(np.diff(matrix, axis=1) <= 1e-9 * max(1.0, matrix.max()))
    assert plan.decision.accepted_objective == pytest.approx(lockstep(matrix), rel=1e-12)
    # The gate's reference is the source with its bins sorted, never more than in source order.
    source = _source_matrix(step)
    assert plan.decision.original_objective == pytest.approx(lockstep(source), rel=1e-12)
    assert lockstep(source) <= float(source.max(axis=0).sum()) * (1 + 1e-12)
    assert lockstep(matrix) <= lockstep(source) * (1 + 1e-12)
    if plan.decision.accepted:
        assert plan.decision.relative_gain > options["min_balance_gain"]
    else:
        assert plan.num_moved == 0
    # Never worse than the makespan plan delivered with its bins sorted (default, no gain).
    if options["algorithm"] == "default" and options["min_balance_gain"] == 0.0:
        makespan = Planner(**{**options, "objective": "makespan"}).plan_arrays(columns, 4)
        assert lockstep(matrix) <= lockstep(_bin_costs(makespan, tokens_of)) * (1 + 1e-9)
    assert lockstep_lower_bound(
        cost(np.asarray(columns.tokens)),
        np.asarray(columns.tokens),
        options["num_ranks"],
        options["bins_per_rank"],
        options["seq_len"],
    ) <= lockstep(matrix) * (1 + 1e-12)
    again = Planner(**options).plan_arrays(columns, 4)
    assert again.digest == plan.digest and again.decision == plan.decision


@SETTINGS
@given(windows())
def test_one_bin_per_rank_is_the_makespan_plan(g: tuple[dict[str, Any], list[Step]]) -> None:
    options, steps = g
    options = {**options, "bins_per_rank": 1}
    step = [[rank[0]] for rank in steps[0]]
    columns = step_columns(step, options["packing_budgets"] is not None)
    lock = Planner(**{**options, "objective": "lockstep"}).plan_arrays(columns, 0)
    make = Planner(**{**options, "objective": "makespan"}).plan_arrays(columns, 0)
    assert lock.digest == make.digest
    assert lock.decision.accepted_objective == pytest.approx(make.decision.accepted_objective)


def test_lockstep_stacks_the_long_bins_at_one_position() -> None:
    # Two ranks x two bins; each rank read one long and one short bin, the long ones at
    # different positions. Makespan is already balanced (every rank 100 + 10); lockstep
    # delivers both long bins first: 100 + 10 instead of 100 + 100.
    step: Step = [[[(10, 0)], [(1, 0)]], [[(1, 0)], [(10, 0)]]]
    columns = step_columns(step, False)
    options: dict[str, Any] = {"num_ranks": 2, "bins_per_rank": 2, "seq_len": 10}
    quad = {"cost_model": quadratic}
    make = Planner(**options, **quad).plan_arrays(columns, 0)
    lock = Planner(**options, **quad, objective="lockstep").plan_arrays(columns, 0)
    assert make.decision.original_objective == make.decision.accepted_objective  # nothing to do
    assert lock.num_moved == 0  # sorting within a rank moves nothing
    assert [b.tokens for rank in lock.local_batches for b in rank] == [10, 1, 10, 1]
    ordered = lock.decision.original_objective
    assert ordered == pytest.approx(lock.decision.accepted_objective)
    assert float(_source_matrix(step).max(axis=0).sum()) > 1.5 * ordered


def test_lockstep_objective_is_configurable_and_checked() -> None:
    assert LoaderConfig(seq_len=8, bins_per_rank=2, objective="lockstep").objective == "lockstep"
    with pytest.raises(ConfigError, match="objective"):
        LoaderConfig(seq_len=8, bins_per_rank=2, objective="lock-step")  # type: ignore[arg-type]
    assert resolve_objective("lockstep") is lockstep
    assert lockstep(np.array([3.0, 5.0])) == 5.0  # one bin per rank: the makespan
    assert lockstep(np.array([[1.0, 4.0], [3.0, 2.0]])) == 4.0 + 2.0
    assert lockstep(np.zeros((0, 2))) == 0.0
    planner = Planner(num_ranks=2, bins_per_rank=2, seq_len=8, objective="lockstep")
    assert planner.identity()["objective"] == "lockstep"


def _skewed(rank: int, step: int, epoch: int) -> list[list[int]]:
    """Rank 0 reads its long sample into bin 0, rank 1 into bin 1 (positions misaligned)."""
    del epoch
    long_bin, short_bin = [40 + step], [3, 4, 5]
    return [long_bin, short_bin] if rank == 0 else [short_bin, long_bin]


def test_the_loader_delivers_lockstep_bins_costliest_first() -> None:
    def body(rank: int, loader: Any) -> list[Any]:
        with loader:
            return list(loader)

    loaders = make_loaders(
        2,
        [IdSource(r, _skewed, num_steps=3) for r in range(2)],
        objective="lockstep",
        seq_len=64,
    )
    per_rank = run_in_threads_or_raise(loaders, body)
    for step in range(3):
        delivered = sorted(i for r in range(2) for b in per_rank[r][step] for i in b)
        assert delivered == sorted((r, step, i) for r in range(2) for i in range(4))
        longs = {(0, step, 0), (1, step, 3)}
        for r in range(2):
            # The bin holding a long sample comes first on every rank: positions line up.
            first, second = per_rank[r][step]
            assert any(k in longs for k in first), (r, step, per_rank[r][step])
            assert not any(k in longs for k in second)
