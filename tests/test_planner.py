"""The planner: exact reference behaviours, the gate, output validation and every input check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from evenflow.engine import SampleMetadata
from evenflow.engine._plan import plan_digest
from evenflow.engine._planning import columns
from evenflow.engine.errors import ConfigError, PlanningError
from evenflow.engine.planning import BalanceProblem, ComponentCost, Planner, SampleKey

Samples = list[tuple[SampleKey, SampleMetadata]]


def token_cost(meta: SampleMetadata) -> float:
    return float(meta.tokens)


def feature_cost(meta: SampleMetadata) -> float:
    return float(meta.features["cost"])


def step_of(
    layout: Sequence[Sequence[int]], *, costs: Sequence[Sequence[float]] | None = None
) -> tuple[Samples, list[list[SampleKey]]]:
    """Samples and source bins from per-bin token lists (one bin per rank: rank = bin)."""
    samples: Samples = []
    bins: list[list[SampleKey]] = []
    for r, tokens in enumerate(layout):
        keys = [SampleKey(r, 0, i) for i in range(len(tokens))]
        for i, t in enumerate(tokens):
            features = {} if costs is None else {"cost": costs[r][i]}
            samples.append((keys[i], SampleMetadata(tokens=t, features=features)))
        bins.append(keys)
    return samples, bins


def keys_of(plan: Any) -> list[list[list[SampleKey]]]:
    return [[list(b.sample_keys) for b in rank] for rank in plan.local_batches]


def planner(**kwargs: Any) -> Planner:
    options: dict[str, Any] = {
        "num_ranks": 2,
        "bins_per_rank": 1,
        "seq_len": 100,
        "cost_model": token_cost,
    }
    options.update(kwargs)
    return Planner(**options)


# ---------------------------------------------------------------------------- reference cases


@pytest.mark.parametrize("algorithm", ["lpt", "default"])
def test_18_2_becomes_10_10(algorithm: str) -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    plan = planner(algorithm=algorithm).plan(samples, bins, step=0)
    assert plan.source_rank_costs == (18.0, 2.0)
    assert plan.rank_costs == (10.0, 10.0)
    assert plan.accepted
    assert plan.decision.relative_gain == pytest.approx(8 / 18)
    assert plan.num_moved == 2
    assert sorted(k for r in range(2) for k in plan.rank_keys(r)) == sorted(k for k, _ in samples)


@pytest.mark.parametrize("algorithm", ["lpt", "default"])
def test_equal_costs_keep_the_source_layout_exactly(algorithm: str) -> None:
    samples, bins = step_of([[5, 5], [5, 5]])
    plan = planner(algorithm=algorithm).plan(samples, bins, step=3)
    assert not plan.accepted
    assert keys_of(plan) == [[bins[0]], [bins[1]]]
    assert plan.num_moved == 0
    assert plan.decision.relative_gain == 0.0


def test_min_balance_gain_keeps_the_source_for_18_2() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    plan = planner(algorithm="lpt", min_balance_gain=0.6).plan(samples, bins, step=0)
    assert not plan.accepted
    assert plan.rank_costs == (18.0, 2.0)
    assert plan.decision.candidate_objective == 10.0
    assert plan.decision.accepted_objective == 18.0


def test_lpt_dead_end_keeps_the_source_bins() -> None:
    # Two full bins on one rank; the two expensive 5s open both bins, then 6 fits nowhere.
    samples = [
        (SampleKey(0, 0, i), SampleMetadata(tokens=t, features={"cost": c}))
        for i, (t, c) in enumerate([(5, 10.0), (5, 10.0), (6, 1.0), (4, 1.0)])
    ]
    bins = [[samples[0][0], samples[1][0]], [samples[2][0], samples[3][0]]]
    lpt = Planner(
        num_ranks=1, bins_per_rank=2, seq_len=10, cost_model=feature_cost, algorithm="lpt"
    )
    plan = lpt.plan(samples, bins, step=0)
    assert not plan.accepted
    assert keys_of(plan) == [bins]
    assert [b.tokens for b in plan.local_batches[0]] == [10, 10]
    assert plan.decision.candidate_objective == plan.decision.original_objective


def test_token_sizes_7_3_7_3_fill_two_bins() -> None:
    samples, bins = step_of([[7, 3], [7, 3]])
    plan = planner(seq_len=10, algorithm="lpt", cost_model=None).plan(samples, bins, step=0)
    for rank in plan.local_batches:
        assert [b.tokens for b in rank] == [10]
        assert [len(b.sample_keys) for b in rank] == [2]
    assert sorted(plan.rank_of()) == sorted(k for k, _ in samples)


def test_oversized_sample_is_rejected_under_error() -> None:
    samples, bins = step_of([[12], [3]])
    with pytest.raises(ConfigError, match="requires 12 tokens, exceeding seq_len=10"):
        planner(seq_len=10).plan(samples, bins, step=0)


@pytest.mark.parametrize("algorithm", ["lpt", "default"])
def test_oversized_sample_sits_alone_under_single(algorithm: str) -> None:
    samples, bins = step_of([[12], [3, 4]])
    big = samples[0][0]
    plan = Planner(
        num_ranks=2,
        bins_per_rank=1,
        seq_len=10,
        cost_model=token_cost,
        algorithm=algorithm,
        oversized_policy="single",
    ).plan(samples, bins, step=0)
    alone = [b for rank in plan.local_batches for b in rank if big in b.sample_keys]
    assert alone[0].sample_keys == (big,)
    assert alone[0].oversized
    assert alone[0].tokens == 12


def test_reversed_gather_order_gives_the_same_plan() -> None:
    rng = np.random.default_rng(7)
    layout = [[int(t) for t in rng.integers(1, 30, size=5)] for _ in range(4)]
    samples, bins = step_of(layout)
    make = lambda: planner(num_ranks=4, seq_len=200, cost_model="quadratic")  # noqa: E731
    forward = make().plan(samples, bins, step=2)
    backward = make().plan(list(reversed(samples)), bins, step=2)
    assert forward == backward
    assert forward.digest == backward.digest


def test_num_moved_uses_the_group_position_not_the_global_rank() -> None:
    # Keys read by global ranks 8 and 9 (positions 0 and 1 of this group).
    samples = [
        (SampleKey(8, 0, 0), SampleMetadata(tokens=9)),
        (SampleKey(8, 0, 1), SampleMetadata(tokens=9)),
        (SampleKey(9, 0, 0), SampleMetadata(tokens=1)),
        (SampleKey(9, 0, 1), SampleMetadata(tokens=1)),
    ]
    bins = [[samples[0][0], samples[1][0]], [samples[2][0], samples[3][0]]]
    plan = planner(algorithm="lpt").plan(samples, bins, step=0)
    assert plan.accepted
    assert plan.num_moved == 2


def test_last_costs_and_identity() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    p = planner(algorithm="lpt", packing_budgets=None)
    p.plan(samples, bins, step=0)
    assert p.last_costs == {k: float(m.tokens) for k, m in samples}
    identity = p.identity()
    assert identity["algorithm"] == "lpt-v1"
    assert identity["objective"] == "makespan"
    assert identity["num_ranks"] == 2
    assert identity["seq_len"] == 100
    assert identity["cost_model"].endswith("token_cost")
    assert planner().identity()["algorithm"] == "refine-v15"


def test_component_cost_with_max_scores_ranks_by_their_slowest_component() -> None:
    model = ComponentCost(
        {"a": lambda m: float(m.features["a"]), "b": lambda m: float(m.features["b"])},
        reduce="max",
    )
    samples = [
        (SampleKey(0, 0, 0), SampleMetadata(tokens=1, features={"a": 4, "b": 0})),
        (SampleKey(0, 0, 1), SampleMetadata(tokens=1, features={"a": 4, "b": 0})),
        (SampleKey(1, 0, 0), SampleMetadata(tokens=1, features={"a": 0, "b": 4})),
        (SampleKey(1, 0, 1), SampleMetadata(tokens=1, features={"a": 0, "b": 4})),
    ]
    bins = [[samples[0][0], samples[1][0]], [samples[2][0], samples[3][0]]]
    plan = planner(cost_model=model).plan(samples, bins, step=0)
    # Source: rank 0 = max(8, 0) = 8. Mixing one of each gives max(4, 4) = 4 per rank.
    assert plan.source_rank_costs == (8.0, 8.0)
    assert plan.rank_costs == (4.0, 4.0)
    assert plan.accepted


def test_balance_objective_is_recorded_and_used() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    plan = planner(objective="balance").plan(samples, bins, step=0)
    assert plan.decision.objective == "balance"
    assert plan.decision.candidate_objective == 0.0
    assert plan.accepted


def test_packing_budgets_are_checked_and_respected() -> None:
    samples = [
        (SampleKey(r, 0, i), SampleMetadata(tokens=t, packing_costs={"patches": p}))
        for r, items in enumerate([[(9, 2.0), (9, 0.0)], [(1, 2.0), (1, 0.0)]])
        for i, (t, p) in enumerate(items)
    ]
    bins = [[samples[0][0], samples[1][0]], [samples[2][0], samples[3][0]]]
    plan = planner(packing_budgets={"patches": 2.0}).plan(samples, bins, step=0)
    costs = {k: m.packing_costs["patches"] for k, m in samples}
    for rank in plan.local_batches:
        for b in rank:
            assert sum(costs[k] for k in b.sample_keys) <= 2.0
    assert plan.rank_costs == (10.0, 10.0)


# ---------------------------------------------------------------------------- algorithm output


class Dropping:
    name = "dropping"
    algorithm_id = "dropping-v0"

    def assign(self, problem: BalanceProblem) -> list[list[int]]:
        bins = [list(b) for b in problem.source_bins]
        bins[0] = bins[0][1:] or bins[0]
        return bins


class Returning:
    name = "returning"
    algorithm_id = "returning-v0"

    def __init__(self, value: object) -> None:
        self.value = value

    def assign(self, problem: BalanceProblem) -> object:
        return self.value


def test_an_algorithm_that_drops_a_key_is_rejected() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    with pytest.raises(PlanningError, match="must conserve every sample key exactly once"):
        planner(algorithm=Dropping()).plan(samples, bins, step=0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([[0, 1, 2, 3]], r"must return num_ranks \* bins_per_rank = 2 bins"),
        ("ab", r"must return num_ranks \* bins_per_rank = 2 bins"),
        ([[0, 1, 2, 3], []], "non-empty sequence of sample indices"),
        ([[0, 1], [2.0, 3.0]], "non-empty sequence of sample indices"),
        ([[0, 1], [2, 7]], r"outside \[0, 4\)"),
        ([[0, 1], [1, 3]], "conserve every sample key exactly once"),
        ([[0, 1, 2], [3]], "infeasible layout: bins\\[0\\].*cannot admit"),
    ],
)
def test_invalid_algorithm_output_is_rejected(value: object, message: str) -> None:
    samples, bins = step_of([[9, 1], [9, 1]])
    with pytest.raises(PlanningError, match=message):
        planner(seq_len=10, algorithm=Returning(value)).plan(samples, bins, step=0)


def test_an_algorithm_returning_none_keeps_the_source() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    plan = planner(algorithm=Returning(None)).plan(samples, bins, step=0)
    assert not plan.accepted
    assert keys_of(plan) == [[bins[0]], [bins[1]]]
    assert plan.decision.algorithm == "returning"


# ---------------------------------------------------------------------------- constructor checks


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_ranks": 0}, ConfigError, "num_ranks must be an integer >= 1"),
        ({"bins_per_rank": True}, ConfigError, "bins_per_rank must be an integer"),
        ({"seq_len": 0}, ConfigError, "seq_len must be an integer >= 1"),
        ({"cost_model": 3}, TypeError, "cost_model"),
        ({"algorithm": "best"}, ConfigError, "algorithm must be one of"),
        ({"algorithm": object()}, TypeError, "assign"),
        ({"objective": "p99"}, ConfigError, "objective must be one of"),
        ({"min_balance_gain": 1.0}, ConfigError, "min_balance_gain must be < 1.0"),
        ({"min_balance_gain": -0.1}, ConfigError, "min_balance_gain must be >= 0.0"),
        ({"min_balance_gain": float("nan")}, ConfigError, "min_balance_gain must be finite"),
        ({"min_balance_gain": True}, ConfigError, "min_balance_gain must be a number"),
        ({"oversized_policy": "split"}, ConfigError, "oversized_policy must be one of"),
        ({"packing_budgets": {"v": -1}}, ConfigError, "packing_budgets"),
    ],
)
def test_constructor_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        planner(**kwargs)


# ---------------------------------------------------------------------------- plan() input checks


def _bad_step(case: str) -> tuple[Any, Any]:
    samples, bins = step_of([[3, 3], [2, 2]])
    k = [key for key, _ in samples]
    if case == "not pairs":
        return [k[0]], bins
    if case == "empty":
        return [], bins
    if case == "duplicate":
        return [*samples, samples[0]], bins
    if case == "bin count":
        return samples, [bins[0] + bins[1]]
    if case == "empty bin":
        return samples, [bins[0] + bins[1], []]
    if case == "unknown key":
        return samples, [bins[0], [k[2], SampleKey(5, 0, 0)]]
    if case == "key twice":
        return samples, [[k[0], k[1], k[2]], [k[2], k[3]]]
    if case == "key missing":
        return samples, [[k[0], k[1]], [k[2]]]
    if case == "not keys":
        return samples, [[k[0], k[1]], [k[2], "k3"]]
    if case == "infeasible source":
        return samples, [[k[0], k[1], k[2]], [k[3]]]
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("not pairs", TypeError, r"\(SampleKey, SampleMetadata\) pairs"),
        ("empty", ConfigError, "samples is empty"),
        ("duplicate", ConfigError, r"lists key SampleKey\(source_rank=0, step=0, index=0\) more"),
        ("bin count", ConfigError, r"reference_bins must hold num_ranks \* bins_per_rank = 2"),
        ("empty bin", ConfigError, r"reference_bins\[1\] \(rank 1, bin 0\) must be a non-empty"),
        ("unknown key", ConfigError, "which is not among samples"),
        ("key twice", ConfigError, "more than once"),
        ("key missing", ConfigError, "does not list key"),
        ("not keys", TypeError, "must contain SampleKey values"),
        ("infeasible source", ConfigError, r"reference_bins\[0\].*cannot admit sample"),
    ],
)
def test_plan_rejects_bad_input(case: str, error: type[Exception], message: str) -> None:
    samples, bins = _bad_step(case)
    with pytest.raises(error, match=message):
        planner(seq_len=7).plan(samples, bins, step=0)


def test_plan_rejects_a_bad_step_and_bad_budgets() -> None:
    samples, bins = step_of([[3], [2]])
    with pytest.raises(ConfigError, match="step must be an integer >= 0"):
        planner().plan(samples, bins, step=-1)
    with pytest.raises(ConfigError, match=r"missing packing_costs\['v'\]"):
        planner(packing_budgets={"v": 1.0}).plan(samples, bins, step=0)
    heavy = [
        (key, SampleMetadata(tokens=meta.tokens, packing_costs={"v": 5.0})) for key, meta in samples
    ]
    with pytest.raises(ConfigError, match=r"exceeding packing_budgets\['v'\]=1.0"):
        planner(packing_budgets={"v": 1.0}).plan(heavy, bins, step=0)


def test_plan_rejects_a_bad_cost() -> None:
    samples, bins = step_of([[3], [2]])
    with pytest.raises(PlanningError, match="cost must be a finite number"):
        planner(cost_model=lambda m: -1.0).plan(samples, bins, step=0)


# ---------------------------------------------------------------------------- fast paths


def _random_step(seed: int, num_ranks: int = 4, per: int = 2) -> tuple[Samples, list[list[Any]]]:
    rng = np.random.default_rng(seed)
    samples: Samples = []
    bins: list[list[SampleKey]] = []
    for r in range(num_ranks):
        index = 0
        for _ in range(per):
            keys = []
            for t in rng.integers(1, 40, size=int(rng.integers(1, 6))).tolist():
                key = SampleKey(r + 3, 7, index)
                index += 1
                samples.append((key, SampleMetadata(tokens=t)))
                keys.append(key)
            bins.append(keys)
    return samples, bins


@pytest.mark.parametrize("algorithm", ["lpt", "default"])
def test_equal_but_distinct_keys_and_any_order_give_the_same_plan(algorithm: str) -> None:
    samples, bins = _random_step(11)
    make = lambda: planner(  # noqa: E731
        num_ranks=4, bins_per_rank=2, seq_len=200, cost_model="quadratic", algorithm=algorithm
    )
    same_objects = make().plan(samples, bins, step=7)
    copies = [[SampleKey(*k.as_tuple()) for k in b] for b in bins]
    shuffled = list(reversed(samples))
    other = make().plan(shuffled, copies, step=7)
    assert other == same_objects
    # The planner hashes arrays; the public digest of the keys must agree with it.
    layout = [list(b.sample_keys) for rank in same_objects.local_batches for b in rank]
    assert same_objects.digest == plan_digest(7, 200, layout, 2)
    assert same_objects.digest != plan_digest(8, 200, layout, 2)


def test_bins_of_the_samples_own_keys_skip_the_key_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bins that list the samples' own key objects in canonical order are the identity layout;
    # the planner then skips reading every key's fields again, and plans the same.
    samples, bins = _random_step(5)
    lookups: list[int] = []
    real = columns._lookup

    def counted(table: np.ndarray, queries: np.ndarray) -> np.ndarray:
        lookups.append(len(queries))
        return real(table, queries)

    monkeypatch.setattr(columns, "_lookup", counted)
    make = lambda: planner(  # noqa: E731
        num_ranks=4, bins_per_rank=2, seq_len=200, cost_model="quadratic", algorithm="default"
    )
    fast = make().plan(samples, bins, step=3)
    assert lookups == []
    copies = [[SampleKey(*k.as_tuple()) for k in b] for b in bins]
    slow = make().plan(samples, copies, step=3)
    assert lookups == [len(samples)]
    assert fast == slow


def test_an_algorithm_returning_numpy_bins_is_accepted() -> None:
    samples, bins = step_of([[9, 9], [1, 1]])
    layout = [np.array([0, 2], dtype=np.int32), np.array([1, 3], dtype=np.int64)]
    plan = planner(algorithm=Returning(layout)).plan(samples, bins, step=0)
    assert plan.rank_costs == (10.0, 10.0)
    assert plan.accepted
    with pytest.raises(PlanningError, match="non-empty sequence of sample indices"):
        planner(algorithm=Returning([[0, 2], [True, True]])).plan(samples, bins, step=0)


def test_key_fields_beyond_int64_are_rejected_by_name() -> None:
    samples = [(SampleKey(0, 0, 2**64), SampleMetadata(tokens=1))]
    samples.append((SampleKey(1, 0, 0), SampleMetadata(tokens=1)))
    bins = [[samples[0][0]], [samples[1][0]]]
    with pytest.raises(ConfigError, match=r"samples holds key .*2\*\*63 - 1"):
        planner().plan(samples, bins, step=0)


def test_plan_restores_the_garbage_collector_state() -> None:
    import gc

    samples, bins = step_of([[18], [2]])
    assert gc.isenabled()
    planner().plan(samples, bins, step=0)
    assert gc.isenabled()
    gc.disable()
    try:
        planner().plan(samples, bins, step=0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ConfigError):
        planner().plan([], bins, step=0)
    assert gc.isenabled()  # also after an error


@pytest.mark.parametrize("algorithm", ["lpt", "default"])
def test_step_stats_from_key_fields_equals_the_explicit_owner_map(algorithm: str) -> None:
    from evenflow.engine._pipeline.stats import step_stats

    samples, bins = step_of([[9, 8, 7], [1, 1], [2, 3], [5]])
    plan = planner(num_ranks=4, algorithm=algorithm).plan(samples, bins, step=0)
    owner = {key: key.source_rank for key, _ in samples}
    explicit = step_stats(plan, owner, (10, 11, 12, 13))
    implied = step_stats(plan, None, (10, 11, 12, 13))
    assert explicit == implied
    assert sum(explicit.sent) == sum(explicit.received) == plan.num_moved > 0
    # Every sample is counted once: a rank sends what it read and no longer trains on.
    for r in range(4):
        kept = sum(1 for key in plan.rank_keys(r) if key.source_rank == r)
        read = sum(1 for key, _ in samples if key.source_rank == r)
        assert explicit.sent[r] == read - kept
        assert explicit.received[r] == len(plan.rank_keys(r)) - kept
    with pytest.raises(ConfigError, match="outside the group"):
        step_stats(plan, {key: 7 for key, _ in samples}, (10, 11, 12, 13))


def test_overlapping_plans_leave_the_collector_enabled() -> None:
    import gc

    from evenflow.engine._planning.planner import _collector_paused

    assert gc.isenabled()
    first, second = _collector_paused(), _collector_paused()
    first.__enter__()
    second.__enter__()  # a plan on another thread starts while the first runs
    first.__exit__(None, None, None)
    assert not gc.isenabled(), "the second plan still runs"
    second.__exit__(None, None, None)
    assert gc.isenabled(), "interleaved plans must not leave the collector disabled"
