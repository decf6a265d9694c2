"""The planner's array entry: the same plans as the object entry, and the pipeline's routes.

``Planner.plan_arrays`` (what the pipeline calls on the gathered metadata) and
``Planner.plan`` (the public object-based entry) must give identical plans, digests included;
the pipeline's plan stage (``plan_step``: messages -> plan, statistics, one rank's routes)
must agree with the plan's public ``local_batches``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.engine import SampleMetadata
from evenflow.engine._pipeline.routes import rank_routes
from evenflow.engine._pipeline.stats import step_stats
from evenflow.engine._pipeline.step import StepState, build_message, plan_step
from evenflow.engine._plan import plan_from_wire, plan_to_wire
from evenflow.engine._planning.columns import StepColumns
from evenflow.engine.errors import ConfigError, GroupMismatchError, PlanningError
from evenflow.engine.planning import Plan, Planner, SampleKey

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A gathered step: per rank, per bin, per sample (tokens, patches, features or None).
Sample = tuple[int, int, dict[str, Any] | None]
Gathered = tuple[int, int, int, list[list[list[Sample]]], dict[str, Any]]


@st.composite
def gathered(draw: st.DrawFn) -> Gathered:
    num_ranks = draw(st.integers(1, 5))
    per = draw(st.integers(1, 3))
    seq_len = draw(st.integers(4, 24))
    budget = draw(st.booleans())
    features = draw(st.booleans())
    ranks: list[list[list[Sample]]] = []
    most = 0
    for _ in range(num_ranks):
        bins: list[list[Sample]] = []
        for _ in range(per):
            room, items, patches = seq_len, [], 0
            for _ in range(draw(st.integers(1, 4))):
                if room == 0:
                    break
                t = draw(st.integers(1, room))
                p = draw(st.integers(0, 2)) if budget else 0
                f = {"P": t, "D": 0} if features and draw(st.booleans()) else None
                items.append((t, p, f))
                room, patches = room - t, patches + p
            most = max(most, patches)
            bins.append(items)
        ranks.append(bins)
    options: dict[str, Any] = {
        "packing_budgets": {"patches": float(most)} if budget else None,
        "objective": draw(st.sampled_from(["makespan", "balance"])),
        "cost_model": draw(st.sampled_from(["tokens", "quadratic", None, _feature_cost])),
        "algorithm": draw(st.sampled_from(["default", "lpt"])),
        "min_balance_gain": draw(st.sampled_from([0.0, 0.3])),
    }
    return num_ranks, per, seq_len, ranks, options


def _feature_cost(meta: SampleMetadata) -> float:
    """A per-sample cost model that reads features (so metadata objects must be built)."""
    return float(meta.tokens + 3 * int(meta.features.get("P", 0)))


def _objects(
    step: int, ranks: list[list[list[Sample]]]
) -> tuple[list[tuple[SampleKey, SampleMetadata]], list[list[SampleKey]]]:
    samples: list[tuple[SampleKey, SampleMetadata]] = []
    bins: list[list[SampleKey]] = []
    for r, rank_bins in enumerate(ranks):
        index = 0
        for items in rank_bins:
            keys = []
            for t, p, f in items:
                key = SampleKey(r, step, index)
                index += 1
                costs = {"patches": float(p)}
                samples.append(
                    (key, SampleMetadata(tokens=t, features=f or {}, packing_costs=costs))
                )
                keys.append(key)
            bins.append(keys)
    return samples, bins


def _messages(step: int, ranks: list[list[list[Sample]]], budgets: tuple[str, ...]) -> list[Any]:
    samples, _ = _objects(step, ranks)
    metas = dict(samples)
    out = []
    for r, rank_bins in enumerate(ranks):
        keys = [k for k, _ in samples if k.source_rank == r]
        state = StepState(step, sizes=[len(b) for b in rank_bins], metas=[metas[k] for k in keys])
        out.append(build_message(state, r, 0, budgets, None))
    return out


def _planner(g: Gathered) -> Planner:
    num_ranks, per, seq_len, _, options = g
    return Planner(num_ranks=num_ranks, bins_per_rank=per, seq_len=seq_len, **options)


def _same(a: Plan, b: Plan) -> None:
    assert a.digest == b.digest
    assert a.local_batches == b.local_batches
    assert (a.rank_costs, a.source_rank_costs) == (b.rank_costs, b.source_rank_costs)
    assert (a.decision, a.num_moved, a.step, a.seq_len) == (
        b.decision,
        b.num_moved,
        b.step,
        b.seq_len,
    )
    assert a == b


@SETTINGS
@given(gathered())
def test_plan_step_on_messages_equals_plan_on_objects(g: Gathered) -> None:
    num_ranks, _, _, ranks, options = g
    budgets = ("patches",) if options["packing_budgets"] else ()
    samples, bins = _objects(7, ranks)
    expected = _planner(g).plan(samples, bins, step=7)
    group = tuple(range(10, 10 + num_ranks))
    for rank in range(num_ranks):
        plan, stats, routes = plan_step(
            _planner(g),
            _messages(7, ranks, budgets),
            7,
            budget_names=budgets,
            rank=rank,
            group_ranks=group,
        )
        _same(plan, expected)
        owner = {key: key.source_rank for key, _ in samples}
        assert stats == step_stats(expected, owner, group)
        # Routes agree with the public layout: what this rank packs, and what it sends.
        assert [[SampleKey(*k) for k in b] for b in routes.bins] == [
            list(b.sample_keys) for b in expected.local_batches[rank]
        ]
        send = {
            dest: [k.as_tuple() for k in expected.rank_keys(dest) if k.source_rank == rank]
            for dest in range(num_ranks)
            if dest != rank
        }
        assert routes.send == {d: keys for d, keys in send.items() if keys}


@SETTINGS
@given(gathered(), st.randoms(use_true_random=False))
def test_columns_in_any_key_order_equal_the_object_entry(g: Gathered, rnd: random.Random) -> None:
    """Columns whose rows are not in key order (keys with gaps, a shuffled source order inside
    each bin, global source ranks) plan like the object entry given the same layout."""
    ranks = g[3]
    samples, bins = _objects(3, ranks)
    metas = dict(samples)
    offset = rnd.randint(0, 9)
    rename = {k: SampleKey(k.source_rank + offset, k.step, 2 * k.index + 1) for k, _ in samples}
    bins = [[rename[k] for k in rnd.sample(b, len(b))] for b in bins]
    samples = [(rename[k], m) for k, m in samples]
    rnd.shuffle(samples)
    rows = [key for b in bins for key in b]
    new_metas = {rename[k]: m for k, m in metas.items()}
    columns = StepColumns(
        sizes=np.array([len(b) for b in bins]),
        source_rank=np.array([k.source_rank for k in rows]),
        index=np.array([k.index for k in rows]),
        tokens=np.array([new_metas[k].tokens for k in rows]),
        packing_costs=np.array([[new_metas[k].packing_costs["patches"]] for k in rows]),
        budget_names=("patches",),
        features=[dict(new_metas[k].features) for k in rows],
    )
    _same(_planner(g).plan_arrays(columns, 3), _planner(g).plan(samples, bins, 3))


def _small() -> tuple[Planner, StepColumns]:
    planner = Planner(
        num_ranks=2, bins_per_rank=1, seq_len=10, algorithm="lpt", cost_model="tokens"
    )
    columns = StepColumns(
        sizes=np.array([2, 1]),
        source_rank=np.array([0, 0, 1]),
        index=np.array([0, 1, 0]),
        tokens=np.array([6, 3, 1]),
    )
    return planner, columns


def test_plan_arrays_builds_no_key_objects_until_asked() -> None:
    planner, columns = _small()
    plan = planner.plan_arrays(columns, 4)
    assert "local_batches" not in vars(plan)
    assert plan.num_ranks == 2 and plan.bins_per_rank == 1 and plan.accepted
    stats = step_stats(plan, None, (0, 1))
    assert "local_batches" not in vars(plan) and stats.num_moved == plan.num_moved == 1
    assert plan.local_batches == (
        (BinPlanOf((0, 4, 0)),),
        (BinPlanOf((0, 4, 1), (1, 4, 0)),),
    )
    # Reading it again returns the same objects; replace() copies a plan as usual.
    assert plan.local_batches is plan.local_batches
    copy = dataclasses.replace(plan, num_moved=5)
    assert copy.local_batches == plan.local_batches and copy.num_moved == 5
    assert copy.layout.digest(4, 10) == plan.digest


def BinPlanOf(*keys: tuple[int, int, int]) -> Any:
    from evenflow.engine.planning import BinPlan

    tokens = sum({(0, 4, 0): 6, (0, 4, 1): 3, (1, 4, 0): 1}[k] for k in keys)
    return BinPlan(tuple(SampleKey(*k) for k in keys), tokens, False)


def test_plan_wire_round_trip_and_corruption() -> None:
    planner, columns = _small()
    plan = planner.plan_arrays(columns, 4)
    data = plan_to_wire(plan)
    again = plan_from_wire(data, 4)
    assert again == plan and again.digest == plan.digest
    assert rank_routes(again, 1) == rank_routes(plan, 1)
    data["bins"][0][0] = np.array([[0, 4, 1]])
    with pytest.raises(GroupMismatchError, match="does not match its digest"):
        plan_from_wire(data, 4)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sizes": np.array([3])}, r"columns.sizes must hold num_ranks \* bins_per_rank = 2"),
        ({"sizes": np.array([3, 0])}, r"columns.sizes\[1\] is 0"),
        ({"sizes": np.array([2, 2])}, "sums to 4 samples but columns.tokens has 3 rows"),
        ({"index": np.array([0, -1, 0])}, r"columns.index\[1\] is -1, but must be >= 0"),
        ({"tokens": np.array([6, 0, 1])}, r"columns.tokens\[1\] is 0, but must be >= 1"),
        ({"tokens": np.array([6.0, 3.0, 1.0])}, "columns.tokens must be a 1-D integer array"),
        ({"source_rank": np.array([0, 0])}, "columns.source_rank must be a 1-D integer array"),
        (
            {"packing_costs": np.ones((3, 2))},
            r"columns.packing_costs must be a float array of shape \(3, 0\)",
        ),
        ({"features": [{}]}, r"columns.features must hold one entry per row \(3\)"),
    ],
)
def test_bad_columns_are_named(change: dict[str, Any], match: str) -> None:
    planner, columns = _small()
    with pytest.raises(ConfigError, match=match):
        planner.plan_arrays(dataclasses.replace(columns, **change), 0)


def test_bad_column_values_and_duplicates_are_named() -> None:
    planner, columns = _small()
    budgeted = Planner(num_ranks=2, bins_per_rank=1, seq_len=10, packing_budgets={"v": 1.0})
    costs = np.array([[0.5], [-1.0], [0.0]])
    bad = dataclasses.replace(columns, packing_costs=costs, budget_names=("v",))
    with pytest.raises(ConfigError, match=r"columns.packing_costs\[1, 0\] \('v'\) is -1.0"):
        budgeted.plan_arrays(bad, 0)
    missing = dataclasses.replace(bad, packing_costs=np.array([[0.5], [np.nan], [0.0]]))
    with pytest.raises(ConfigError, match=r"step=0, index=1\) is missing packing_costs\['v'\]"):
        budgeted.plan_arrays(missing, 0)
    twice = dataclasses.replace(columns, index=np.array([0, 0, 0]))
    with pytest.raises(
        ConfigError, match=r"lists key SampleKey\(source_rank=0, step=0, index=0\) more"
    ):
        planner.plan_arrays(twice, 0)
    with pytest.raises(TypeError, match="columns must be a StepColumns"):
        planner.plan_arrays([(SampleKey(0, 0, 0), SampleMetadata(1))], 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"step must be"):
        planner.plan_arrays(columns, -1)


def test_custom_algorithm_reads_keys_and_metadata_objects() -> None:
    seen: dict[str, Any] = {}

    class Reading:
        name = "reading"

        def assign(self, problem: Any) -> None:
            seen["keys"] = list(problem.keys)
            seen["first"] = problem.keys[0]
            seen["len"] = len(problem.keys)

    metas: list[SampleMetadata] = []
    planner = Planner(
        num_ranks=2,
        bins_per_rank=1,
        seq_len=10,
        algorithm=Reading(),
        cost_model=lambda m: metas.append(m) or float(m.tokens),
    )
    _, columns = _small()
    columns = dataclasses.replace(columns, features=[{"P": 6}, None, {"D": 1}])
    plan = planner.plan_arrays(columns, 2)
    assert seen["keys"] == [SampleKey(0, 2, 0), SampleKey(0, 2, 1), SampleKey(1, 2, 0)]
    assert seen["first"] == SampleKey(0, 2, 0) and seen["len"] == 3
    assert metas == [
        SampleMetadata(tokens=6, features={"P": 6}),
        SampleMetadata(tokens=3),
        SampleMetadata(tokens=1, features={"D": 1}),
    ]
    assert not plan.accepted and planner.last_costs[SampleKey(0, 2, 1)] == 3.0


def test_an_invalid_candidate_names_the_key_in_the_array_path() -> None:
    class Dropping:
        name = "dropping"

        def assign(self, problem: Any) -> list[list[int]]:
            return [[0, 1], [1]]

    planner = Planner(num_ranks=2, bins_per_rank=1, seq_len=10, algorithm=Dropping())
    _, columns = _small()
    with pytest.raises(
        PlanningError, match=r"key SampleKey\(source_rank=0, step=1, index=1\) appears 2"
    ):
        planner.plan_arrays(columns, 1)
