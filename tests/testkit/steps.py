"""Random small windows of gathered steps for the planner's property tests, and their checks.

A *step* is per rank, per bin, per sample ``(tokens, patches)``; :func:`windows` draws planner
options and one to four such steps (packing budgets, oversized samples under
``oversized_policy="single"``, both window objectives); :func:`check_window` verifies a
:class:`WindowPlan` against them independently of the planner (conservation, feasibility,
delays, step costs recomputed from tokens, lockstep positions aligned).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from evenflow.engine._planning.columns import StepColumns
from evenflow.engine._planning.objectives import lockstep
from evenflow.engine._planning.window import WindowPlan

__all__ = [
    "Step",
    "check_window",
    "cost",
    "quadratic",
    "step_columns",
    "window_columns",
    "windows",
]

# One step: per rank, per bin, per sample (tokens, patches).
Step = list[list[list[tuple[int, int]]]]


def cost(tokens: np.ndarray) -> np.ndarray:
    return 16.0 * tokens + tokens.astype(np.float64) ** 2


def quadratic(meta: Any) -> float:
    return float(cost(np.array([meta.tokens]))[0])


@st.composite
def windows(draw: st.DrawFn) -> tuple[dict[str, Any], list[Step]]:
    num_ranks = draw(st.integers(1, 4))
    per = draw(st.integers(1, 3))
    seq_len = draw(st.integers(6, 40))
    budget = draw(st.booleans())
    single = draw(st.booleans())
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, 4))):
        ranks: Step = []
        for _ in range(num_ranks):
            bins = []
            for _ in range(per):
                if single and draw(st.integers(0, 9)) == 0:
                    bins.append([(draw(st.integers(seq_len + 1, 2 * seq_len)), 0)])
                    continue
                room, items = seq_len, []
                for _ in range(draw(st.integers(1, 4))):
                    if room == 0:
                        break
                    t = draw(st.integers(1, room))
                    items.append((t, draw(st.integers(0, 2)) if budget else 0))
                    room -= t
                bins.append(items)
            ranks.append(bins)
        steps.append(ranks)
    most = max(sum(p for _, p in b) for s in steps for r in s for b in r)
    options = {
        "num_ranks": num_ranks,
        "bins_per_rank": per,
        "seq_len": seq_len,
        "cost_model": quadratic,
        "oversized_policy": "single" if single else "error",
        "packing_budgets": {"patches": float(max(most, 2))} if budget else None,
        "objective": draw(st.sampled_from(["makespan", "lockstep"])),
        "algorithm": draw(st.sampled_from(["default", "lpt"])),
        "min_balance_gain": draw(st.sampled_from([0.0, 0.2])),
    }
    return options, steps


def step_columns(step: Step, budgets: bool) -> StepColumns:
    sizes, source_rank, index, tokens, patches = [], [], [], [], []
    for r, bins in enumerate(step):
        i = 0
        for b in bins:
            sizes.append(len(b))
            for t, p in b:
                source_rank.append(r)
                index.append(i)
                tokens.append(t)
                patches.append(p)
                i += 1
    return StepColumns(
        sizes=np.array(sizes),
        source_rank=np.array(source_rank),
        index=np.array(index),
        tokens=np.array(tokens),
        packing_costs=np.array(patches, dtype=np.float64)[:, None] if budgets else None,
        budget_names=("patches",) if budgets else (),
    )


def window_columns(options: dict[str, Any], steps: list[Step]) -> list[StepColumns]:
    return [step_columns(s, options["packing_budgets"] is not None) for s in steps]


def _samples(
    columns: list[StepColumns], first: int
) -> dict[tuple[int, int, int], tuple[int, float]]:
    out = {}
    for i, c in enumerate(columns):
        patches = c.packing_costs
        for j in range(c.num_samples):
            key = (int(c.source_rank[j]), first + i, int(c.index[j]))
            out[key] = (int(c.tokens[j]), 0.0 if patches is None else float(patches[j, 0]))
    return out


def check_window(
    options: dict[str, Any], columns: list[StepColumns], result: WindowPlan, first: int
) -> None:
    num_ranks, per, seq_len = options["num_ranks"], options["bins_per_rank"], options["seq_len"]
    samples = _samples(columns, first)
    seen: list[tuple[int, int, int]] = []
    assert len(result.plans) == len(columns)
    for s, plan in enumerate(result.plans):
        assert plan.step == first + s
        layout = plan.layout
        assert layout.sizes.size == num_ranks * per and layout.sizes.min() >= 1
        keys = [tuple(k) for k in layout.key_fields.tolist()]
        seen.extend(keys)
        # Delay: delivered minus read step, within the window.
        read = layout.key_fields[:, 1]
        assert np.array_equal(result.delays[s], (first + s) - read)
        assert np.all(np.abs(result.delays[s]) < len(columns))
        ends = np.cumsum(layout.sizes)
        bin_costs = np.zeros(layout.sizes.size)
        for b in range(layout.sizes.size):
            members = keys[ends[b] - layout.sizes[b] : ends[b]]
            tokens = sum(samples[k][0] for k in members)
            assert int(layout.tokens[b]) == tokens
            if tokens > seq_len:
                assert options["oversized_policy"] == "single" and len(members) == 1
            if options["packing_budgets"]:
                assert sum(samples[k][1] for k in members) <= options["packing_budgets"]["patches"]
            bin_costs[b] = float(cost(np.array([samples[k][0] for k in members])).sum())
        matrix = bin_costs.reshape(num_ranks, per)
        if options["objective"] == "lockstep":
            # Positions aligned: every rank's bins costliest first.
            assert np.all(np.diff(matrix, axis=1) <= 1e-9 * max(1.0, matrix.max()))
            expected = lockstep(matrix)
        else:
            expected = float(matrix.sum(axis=1).max())
        assert result.step_costs[s] == pytest.approx(expected, rel=1e-9)
        assert plan.rank_costs == pytest.approx(tuple(matrix.sum(axis=1)), rel=1e-9)
    assert sorted(seen) == sorted(samples)  # each sample exactly once, within its window
