"""Properties of whole plans on random steps: conservation, feasibility, determinism, the gate."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.engine import SampleMetadata
from evenflow.engine.planning import Plan, Planner, SampleKey

Step = tuple[
    int, int, int, list[tuple[SampleKey, SampleMetadata]], list[list[SampleKey]], dict[str, Any]
]

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def steps(draw: st.DrawFn) -> Step:
    """A random feasible step: ranks x bins of samples, often packed close to ``seq_len``.

    Keys use a global rank offset so the group position differs from ``key.source_rank``.
    """
    num_ranks = draw(st.integers(1, 4))
    per = draw(st.integers(1, 3))
    seq_len = draw(st.integers(6, 30))
    full = draw(st.booleans())
    single = draw(st.booleans())
    use_budget = draw(st.booleans())
    offset = draw(st.integers(0, 8))
    samples: list[tuple[SampleKey, SampleMetadata]] = []
    bins: list[list[SampleKey]] = []
    bin_patches: list[int] = []
    for r in range(num_ranks):
        index = 0
        for _ in range(per):
            keys: list[SampleKey] = []
            patches = 0
            if single and draw(st.integers(0, 5)) == 0:
                lengths = [seq_len + draw(st.integers(1, 5))]  # one oversized sample alone
            else:
                room = seq_len
                lengths = []
                for _ in range(draw(st.integers(1, 5))):
                    if room == 0:
                        break
                    low = max(1, room - 1) if full else 1
                    t = draw(st.integers(low, room))
                    lengths.append(t)
                    room -= t
            for t in lengths:
                p = draw(st.integers(0, 2)) if use_budget else 0
                patches += p
                key = SampleKey(r + offset, 5, index)
                index += 1
                meta = SampleMetadata(
                    tokens=t,
                    packing_costs={"patches": float(p)} if use_budget else {},
                )
                samples.append((key, meta))
                keys.append(key)
            bins.append(keys)
            bin_patches.append(patches)
    options: dict[str, Any] = {
        "oversized_policy": "single" if single else "error",
        "packing_budgets": (
            {"patches": float(max(bin_patches) + draw(st.integers(0, 1)))} if use_budget else None
        ),
        "objective": draw(st.sampled_from(["makespan", "balance"])),
        "cost_model": draw(st.sampled_from(["tokens", "quadratic", None])),
    }
    return num_ranks, per, seq_len, samples, bins, options


def make(step: Step, **extra: Any) -> Planner:
    num_ranks, per, seq_len, _, _, options = step
    return Planner(num_ranks=num_ranks, bins_per_rank=per, seq_len=seq_len, **{**options, **extra})


def check_plan(step: Step, plan: Plan) -> None:
    _, per, seq_len, samples, _, options = step
    metas = dict(samples)
    planned = [k for rank in plan.local_batches for b in rank for k in b.sample_keys]
    assert sorted(planned) == sorted(metas)  # conservation: every key exactly once
    budget = (options["packing_budgets"] or {}).get("patches")
    for rank in plan.local_batches:
        assert len(rank) == per
        for b in rank:
            assert b.sample_keys
            tokens = sum(metas[k].tokens for k in b.sample_keys)
            assert b.tokens == tokens
            assert b.oversized == (tokens > seq_len)
            if tokens > seq_len:
                assert len(b.sample_keys) == 1
            if budget is not None:
                assert sum(metas[k].packing_costs["patches"] for k in b.sample_keys) <= budget


@SETTINGS
@given(steps(), st.sampled_from(["default", "lpt"]), st.randoms(use_true_random=False))
def test_plans_conserve_fit_and_ignore_gather_order(
    step: Step, algorithm: str, random: Any
) -> None:
    _, _, _, samples, bins, _ = step
    plan = make(step, algorithm=algorithm).plan(samples, bins, step=5)
    check_plan(step, plan)
    shuffled = list(samples)
    random.shuffle(shuffled)
    again = make(step, algorithm=algorithm).plan(shuffled, bins, step=5)
    assert again == plan  # same layout, costs, decision and digest
    # The gate never accepts a layout worse than the source.
    assert plan.decision.accepted_objective <= plan.decision.original_objective
    if plan.accepted:
        assert plan.decision.relative_gain > plan.decision.min_balance_gain


@SETTINGS
@given(steps())
def test_default_is_never_worse_than_source_or_lpt(step: Step) -> None:
    _, _, _, samples, bins, _ = step
    default = make(step).plan(samples, bins, step=0)
    lpt = make(step, algorithm="lpt").plan(samples, bins, step=0)
    assert default.decision.accepted_objective <= lpt.decision.accepted_objective
    assert default.decision.accepted_objective <= default.decision.original_objective


@SETTINGS
@given(steps(), st.floats(0.0, 0.99))
def test_the_gate_is_strict(step: Step, gain: float) -> None:
    _, _, _, samples, bins, _ = step
    plan = make(step, min_balance_gain=gain).plan(samples, bins, step=0)
    decision = plan.decision
    assert decision.accepted == (decision.relative_gain > gain)
    if not decision.accepted:
        assert [[list(b.sample_keys) for b in rank] for rank in plan.local_batches] == [
            bins[r * len(plan.local_batches[0]) : (r + 1) * len(plan.local_batches[0])]
            for r in range(len(plan.local_batches))
        ]
        assert plan.num_moved == 0
