"""The grouped search (lockstep plans, balance windows) against its oracle, bit for bit.

``_grouped.c`` runs the driver of ``_drive.h`` over the groups' maxima with a table of two
families; ``tests/oracles/grouped.py`` specifies it. Both run on the same ``UnitState`` and
must leave the same layout, the same running sums (every double to the last bit), the same
order of units and the same counts of attempts and changes: on random instances (budgets,
oversized samples, several bins per unit, each family alone) and on benchmark steps shaped
as the lockstep planner and the window planner shape them.
"""

from __future__ import annotations

import copy
from types import ModuleType

import numpy as np
import pytest

from evenflow.engine._model import PackingConstraints
from evenflow.engine._planning import native
from evenflow.engine._planning.grouped import UnitState, group_cost, grouped_search, sorted_units
from evenflow.engine._planning.schedule import PARTNER_UNITS
from evenflow.engine.workloads import DISTRIBUTIONS, make_step


def _state(
    costs: np.ndarray,
    tokens: np.ndarray,
    bins: list[list[int]],
    per: int,
    budget_costs: np.ndarray | None = None,
) -> UnitState:
    flat = np.array([i for b in bins for i in b], dtype=np.int64)
    sizes = np.array([len(b) for b in bins], dtype=np.int64)
    if budget_costs is None:
        budget_costs = np.zeros((costs.size, 0))
    return UnitState.of(costs, tokens, budget_costs, flat=flat, sizes=sizes, bins_per_unit=per)


def _random_case(rng: np.random.Generator) -> tuple[UnitState, PackingConstraints, int]:
    group = int(rng.integers(2, 6))
    units = group * int(rng.integers(1, 5))
    per = int(rng.integers(1, 4))
    seq_len = int(rng.integers(12, 40))
    single = rng.random() < 0.3
    bins: list[list[int]] = []
    tokens: list[int] = []
    for _ in range(units * per):
        room = int(rng.integers(seq_len // 3, seq_len + 1))
        items: list[int] = []
        if single and rng.random() < 0.15:
            tokens.append(seq_len + int(rng.integers(1, 10)))  # oversized, alone
            items.append(len(tokens) - 1)
        else:
            for _ in range(int(rng.integers(1, 6))):
                t = int(rng.integers(1, 9))
                if t > room:
                    break
                tokens.append(t)
                items.append(len(tokens) - 1)
                room -= t
            if not items:
                tokens.append(1)
                items.append(len(tokens) - 1)
        bins.append(items)
    n = len(tokens)
    tok = np.array(tokens, dtype=np.int64)
    # Integer and fractional costs, with ties.
    costs = rng.integers(1, 30, size=n).astype(np.float64)
    if rng.random() < 0.5:
        costs = costs * 0.37 + tok * 1.1
    budgets: dict[str, float] = {}
    budget_costs = None
    if rng.random() < 0.3:
        budget_costs = rng.integers(0, 4, size=(n, 1)).astype(np.float64) * 0.5
        most = max(float(budget_costs[b, 0].sum()) for b in bins)
        budgets = {"v": most + float(rng.integers(0, 3))}
    constraints = PackingConstraints(
        seq_len=seq_len,
        oversized_policy="single" if single else "error",
        packing_budgets=budgets or None,
    )
    return _state(costs, tok, bins, per, budget_costs), constraints, group


def _benchmark_case(
    distribution: str, ranks: int, per: int, *, window: int, by_bins: bool, seed: int
) -> tuple[UnitState, PackingConstraints, int]:
    """Steps of the benchmark's mixes as lockstep (``by_bins``: units are bins, groups of
    ``ranks``) or a makespan window (units are a rank's step of ``per`` bins) shapes them."""
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    tokens: list[int] = []
    bins: list[list[int]] = []
    for step in range(window):
        samples, reference = make_step(
            distribution,
            "firstfit",
            num_ranks=ranks,
            bins_per_rank=per,
            seq_len=seq_len,
            seed=seed,
            step=step,
        )
        index = {key: len(tokens) + k for k, (key, _) in enumerate(samples)}
        tokens += [meta.tokens for _, meta in samples]
        bins += [[index[key] for key in b] for b in reference]
    tok = np.array(tokens, dtype=np.int64)
    costs = 4096.0 * tok + tok.astype(np.float64) ** 2
    state = _state(costs, tok, bins, 1 if by_bins else per)
    return state, PackingConstraints(seq_len=seq_len), ranks


def _compare(
    oracle: ModuleType,
    state: UnitState,
    *,
    constraints: PackingConstraints,
    group: int,
    budget: int,
    families: int,
) -> int:
    """Run both on copies of ``state``; assert they agree; the changes made."""
    core, slow = copy.deepcopy(state), copy.deepcopy(state)
    order = sorted_units(core.unit_cost)
    attempts, changes = native.grouped_search(
        core,
        limits=np.array(list(constraints.budgets.values()), dtype=np.float64),
        order=order,
        group_size=group,
        seq_len=constraints.seq_len,
        single=constraints.oversized_policy == "single",
        budget=budget,
        partner_units=PARTNER_UNITS,
        families=families,
    )
    reference = oracle.GroupedOracle(slow, constraints, group)
    reference.families = families
    assert (attempts, changes) == (reference.run(budget), reference.changes)
    assert order.tolist() == reference.order
    for name in ("bin_of", "bin_cnt", "bin_tok"):
        np.testing.assert_array_equal(getattr(core, name), getattr(slow, name), err_msg=name)
    for name in ("bin_bud", "unit_cost"):
        # Bit for bit: the same doubles combined in the same order.
        assert getattr(core, name).tobytes() == getattr(slow, name).tobytes(), name
    return changes


@pytest.mark.parametrize("families", [1, 2, 3])
def test_each_family_and_the_table_match_the_oracle_on_random_instances(
    grouped_oracle: ModuleType, families: int
) -> None:
    assert len(grouped_oracle.GROUPED) == 2
    rng = np.random.default_rng(30 + families)
    changed = 0
    for _ in range(60):
        state, constraints, group = _random_case(rng)
        budget = int(rng.integers(1, 40))
        changed += (
            _compare(
                grouped_oracle,
                state,
                constraints=constraints,
                group=group,
                budget=budget,
                families=families,
            )
            > 0
        )
    assert changed > 10, "too few instances changed to test the families"


def test_ties_among_many_units_match_the_oracle(grouped_oracle: ModuleType) -> None:
    # Few distinct costs over many units: slack ties at the exchange's cut of PARTNER_UNITS
    # units, and candidates tie on gain and cost, so every tie-break is exercised.
    rng = np.random.default_rng(11)
    changed = 0
    for _ in range(12):
        group, units = 2, 2 * int(rng.integers(8, 14))
        bins = [[3 * u, 3 * u + 1, 3 * u + 2] for u in range(units)]
        tokens = rng.integers(1, 3, size=3 * units).astype(np.int64)
        costs = rng.choice([1.0, 2.0, 5.0], size=3 * units)
        state = _state(costs, tokens, bins, 1)
        constraints = PackingConstraints(seq_len=8)
        changed += _compare(
            grouped_oracle,
            state,
            constraints=constraints,
            group=group,
            budget=60,
            families=3,
        )
    assert changed > 0


def test_the_exchange_partners_tie_to_the_lower_units(grouped_oracle: ModuleType) -> None:
    # Two groups of 12 units; every unit but the top one has room 4 below its group's
    # maximum, so 22 units tie for the PARTNER_UNITS places: the lower units win them, and
    # the exchange takes a sample of cost 9 from unit 1 (the higher units hold 8.5 or 6).
    pairs = [(12.0, 8.0)] + [(9.0, 7.0)] * 8 + [(8.5, 7.5)] * 3 + [(10.0, 5.0)] + [(6.0, 5.0)] * 11
    costs = np.array([c for pair in pairs for c in pair])
    state = _state(
        costs,
        np.ones(costs.size, dtype=np.int64),
        [[2 * u, 2 * u + 1] for u in range(len(pairs))],
        1,
    )
    core = copy.deepcopy(state)
    assert (
        _compare(
            grouped_oracle,
            state,
            constraints=PackingConstraints(seq_len=8),
            group=12,
            budget=1,
            families=2,
        )
        == 1
    )
    grouped_search(core, PackingConstraints(seq_len=8), 12, 1, families=2)
    assert sorted(core.costs[core.bin_of == core.bin_of[2]].tolist()) == [8.0, 9.0]


@pytest.mark.parametrize(
    "case",
    [
        ("sft", 8, 4, 1, True),  # a lockstep step: positions of 8 bins
        ("longctx", 8, 4, 1, True),
        ("longctx", 8, 2, 2, True),  # a lockstep window: positions of two steps
        ("sft", 8, 2, 4, False),  # a makespan window: each unit a rank's step
    ],
)
def test_the_core_matches_the_oracle_on_benchmark_steps(
    grouped_oracle: ModuleType, case: tuple[str, int, int, int, bool]
) -> None:
    distribution, ranks, per, window, by_bins = case
    state, constraints, group = _benchmark_case(
        distribution, ranks, per, window=window, by_bins=by_bins, seed=7
    )
    groups = state.num_units // group
    changes = _compare(
        grouped_oracle, state, constraints=constraints, group=group, budget=4 * groups, families=3
    )
    assert changes > 0


def test_the_search_lowers_the_sum_of_group_maxima_and_keeps_every_bin_feasible() -> None:
    rng = np.random.default_rng(5)
    for _ in range(40):
        state, constraints, group = _random_case(rng)
        state.regroup()
        before = group_cost(state.unit_cost, group)
        grouped_search(state, constraints, group, 50)
        after = group_cost(state.unit_cost, group)
        assert after <= before
        assert np.all(np.diff(state.unit_cost) <= 0), "units come back in group order"
        per = state.bins_per_unit
        costs = np.bincount(state.bin_of, weights=state.costs, minlength=state.bin_cnt.size)
        np.testing.assert_allclose(costs.reshape(-1, per).sum(axis=1), state.unit_cost)
        assert np.all(state.bin_cnt >= 1)
        fits = state.bin_tok <= constraints.seq_len
        assert np.all(fits | (state.bin_cnt == 1))
        for j, limit in enumerate(constraints.budgets.values()):
            assert np.all(state.bin_bud[:, j] <= limit)


def test_an_inconsistent_state_is_refused() -> None:
    state, constraints, group = _random_case(np.random.default_rng(1))
    order = sorted_units(state.unit_cost)
    order[0] = order[1]  # a unit listed twice
    with pytest.raises(ValueError, match="order must list every unit once"):
        native.grouped_search(
            state,
            limits=np.zeros(len(constraints.budgets)),
            order=order,
            group_size=group,
            seq_len=constraints.seq_len,
            single=False,
            budget=5,
            partner_units=PARTNER_UNITS,
        )
