"""CalibratedCost and its calibrator: the fit, the guard, determinism and state."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from evenflow.engine import SampleMetadata
from evenflow.engine._pipeline.calibration import GroupCalibration
from evenflow.engine._planning.calibration import Calibrator, fit_coefficients
from evenflow.engine._planning.cost import evaluate_costs, resolve_cost_model
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import (
    CalibratedCost,
    ComponentCost,
    FlopsCost,
    QuadraticCost,
    TokenCost,
)

TRUE = np.array([2e-3, 1e-4, 7e-6, 1e-8])


def _rows(n: int, coef: np.ndarray, *, noise: float = 0.05, seed: int = 0) -> np.ndarray:
    """Rows ``[step, rank, bin, seconds, bins, samples, ΣL, ΣL²]`` measured by ``coef``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        lengths = rng.integers(10, 2000, size=int(rng.integers(1, 6))).astype(float)
        x = np.array([1.0, len(lengths), lengths.sum(), (lengths * lengths).sum()])
        y = float(x @ coef) * (1.0 + noise * rng.standard_normal())
        rows.append([i, 0, 0, y, *x])
    return np.array(rows)


def _predict(model: CalibratedCost, rows: np.ndarray) -> np.ndarray:
    return rows[:, 4:] @ np.asarray(model.coefficients)


def _model(**kwargs: Any) -> CalibratedCost:
    return CalibratedCost(QuadraticCost(linear=200.0), min_rows=16, **kwargs).for_planner()


# -- the fit ------------------------------------------------------------------------------------


def test_converges_to_known_coefficients_despite_noise_and_outliers() -> None:
    rows = _rows(400, TRUE, noise=0.05)
    rows[::50, 3] *= 30.0  # 2% of the rows are wild outliers
    model = _model()
    calibrator = Calibrator(model)
    calibrator.add_rows(rows)
    decision = calibrator.refit(10)
    assert decision is not None and decision.accepted
    # The L² / L ratio is what steers balancing: recovered within 10%, against 3.5x before.
    coef = model.coefficients
    assert coef[3] / coef[2] == pytest.approx(TRUE[3] / TRUE[2], rel=0.10)
    fresh = _rows(200, TRUE, noise=0.0, seed=1)
    errors = np.abs(_predict(model, fresh) - fresh[:, 3]) / fresh[:, 3]
    assert np.median(errors) < 0.03


def test_fit_without_noise_is_exact_and_non_negative() -> None:
    rows = _rows(100, TRUE, noise=0.0)
    fit = fit_coefficients(rows[:, 4:], rows[:, 3])
    assert fit is not None
    assert np.allclose(fit.coefficients, TRUE, rtol=1e-4)
    assert fit.median_error < 1e-6
    negative = _rows(100, np.array([0.0, 0.0, 1e-5, 0.0]), noise=0.0)
    negative[:, 3] -= 1e-5 * negative[:, 4]  # a clock that would need a negative bin constant
    assert all(c >= 0 for c in fit_coefficients(negative[:, 4:], negative[:, 3]).coefficients)


def test_fit_is_deterministic_and_order_of_equal_inputs_free() -> None:
    rows = _rows(300, TRUE, noise=0.1)
    first = fit_coefficients(rows[:, 4:], rows[:, 3])
    again = fit_coefficients(rows[:, 4:].copy(), rows[:, 3].copy())
    assert first == again  # bit for bit


# -- the guard ----------------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [math.nan, math.inf, 0.0, -1.0])
def test_garbage_seconds_are_refused_and_counted(garbage: float) -> None:
    model = _model()
    calibrator = Calibrator(model)
    rows = _rows(64, TRUE)
    rows[:, 3] = garbage
    assert calibrator.add_rows(rows) == 64
    assert calibrator.num_refused == 64
    assert calibrator.refit(10) is None  # nothing to fit
    assert model.coefficients == model.initial


def test_one_huge_outlier_does_not_move_a_right_model() -> None:
    model = _model()
    model.set_coefficients(tuple(TRUE))
    calibrator = Calibrator(model)
    rows = _rows(64, TRUE, noise=0.0)
    rows[5, 3] *= 1e6
    calibrator.add_rows(rows)
    calibrator.refit(10)
    clean = _rows(64, TRUE, noise=0.0, seed=3)
    assert np.allclose(_predict(model, clean), clean[:, 3], rtol=1e-6)


def test_guard_keeps_coefficients_that_predict_held_out_rows_better() -> None:
    # Held-out rows (every fourth) follow the model in force; the rows a candidate is fitted
    # to follow another clock. The candidate predicts held-out rows worse: it is refused.
    model = _model()
    calibrator = Calibrator(model)
    held_clock = np.array([0.0, 0.0, 200.0, 1.0]) * 1e-8
    other_clock = np.array([0.0, 0.0, 1.0, 0.0]) * 1e-5
    rows = _rows(64, other_clock, noise=0.0)
    held = np.arange(64) % 4 == 3
    rows[held] = _rows(64, held_clock, noise=0.0)[held]
    calibrator.add_rows(rows)
    decision = calibrator.refit(10)
    assert decision is not None and not decision.accepted
    assert decision.candidate_error > decision.current_error
    assert model.coefficients == model.initial
    assert calibrator.num_fits == 1 and calibrator.num_accepted == 0


# -- the model ----------------------------------------------------------------------------------


def test_initial_coefficients_reproduce_the_base_model() -> None:
    metas = [SampleMetadata(tokens=n) for n in (1, 17, 300, 4096)]
    for base, expected in [
        (QuadraticCost(linear=700.0), QuadraticCost(linear=700.0)),
        (TokenCost(), TokenCost()),
        (None, QuadraticCost()),
    ]:
        model = CalibratedCost(base)
        assert [model(m) for m in metas] == [expected(m) for m in metas]
    flops = FlopsCost({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 16})
    model = CalibratedCost(flops)
    assert model.feature_names[4:] == ("linear", "attention")
    assert [model(m) for m in metas] == pytest.approx([flops(m) for m in metas], rel=1e-12)
    parts = CalibratedCost(ComponentCost({"a": TokenCost(), "b": QuadraticCost()},
                                         weights={"a": 2.0}))
    assert parts.feature_names[4:] == ("a", "b")
    assert parts(metas[2]) == pytest.approx(2 * 300 + QuadraticCost()(metas[2]))


def test_vectorised_evaluation_equals_per_sample_calls() -> None:
    model = _model()
    model.set_coefficients((0.1, 0.2, 0.3, 0.004))
    metas = [SampleMetadata(tokens=n) for n in (3, 50, 700)]
    assert evaluate_costs(model, metas).tolist() == pytest.approx([model(m) for m in metas])


def test_identity_ignores_coefficients_and_each_planner_owns_a_copy() -> None:
    configured = CalibratedCost(QuadraticCost(linear=200.0), refit_every=7)
    planner_copy = resolve_cost_model(configured)
    assert planner_copy is not configured and isinstance(planner_copy, CalibratedCost)
    planner_copy.set_coefficients((1.0, 1.0, 1.0, 1.0))
    assert configured.coefficients == configured.initial
    assert planner_copy.model_id == configured.model_id
    assert "refit_every=7" in configured.model_id


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"refit_every": 0}, "refit_every"),
        ({"history": 4}, "history"),
        ({"min_rows": 64, "history": 32}, "min_rows=64 exceeds history=32"),
        ({"base": CalibratedCost()}, "calibrate the base model once"),
    ],
)
def test_configuration_is_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CalibratedCost(**kwargs)


@pytest.mark.parametrize(
    "values", [(1.0, 2.0), (0.0, math.nan, 1.0, 1.0), (0.0, -1.0, 1.0, 1.0), (5.0, 0.0, 0.0, 0.0)]
)
def test_coefficients_are_validated(values: tuple[float, ...]) -> None:
    with pytest.raises(ConfigError, match="coefficients"):
        _model().set_coefficients(values)


def test_state_round_trip_is_exact() -> None:
    model = _model()
    calibrator = Calibrator(model)
    calibrator.add_rows(_rows(40, TRUE))
    calibrator.refit(5)
    other = Calibrator(_model())
    other.load_state(calibrator.state())
    assert other.model.coefficients == model.coefficients
    assert np.array_equal(other.rows, calibrator.rows)
    assert (other.num_fits, other.num_accepted) == (calibrator.num_fits, calibrator.num_accepted)


# -- the group's rounds -------------------------------------------------------------------------


def _group(rank: int = 0) -> GroupCalibration:
    return GroupCalibration(_model(refit_every=4), rank=rank, num_ranks=2, bins_per_rank=1, lag=3)


def _wire(rows: np.ndarray) -> np.ndarray:
    """Dataset rows ``[step, rank, bin, seconds, x...]`` as a rank sends them (no rank)."""
    return np.delete(rows, 1, axis=1)


def _messages(rows_by_rank: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    return [
        {} if rows_by_rank.get(r) is None else {"calib": _wire(rows_by_rank[r])} for r in range(2)
    ]


def test_when_a_row_arrives_does_not_change_the_coefficients() -> None:
    rows = _rows(64, TRUE)
    rows[:, 0] = np.arange(64) // 2  # two rows per step: rank 0 and rank 1
    rows[:, 1] = np.arange(64) % 2
    by_step = {s: rows[rows[:, 0] == s] for s in range(32)}
    early, late = _group(), _group(1)
    for round_ in range(1, 40):
        # ``early`` gets each step's rows at the next round, ``late`` two rounds after that
        # (exactly when they fall due): the fits must see the same rows all the same.
        for group, delay in ((early, 1), (late, 3)):
            step = round_ - delay
            sent = by_step.get(step)
            batch = {} if sent is None else {int(r[1]): sent[sent[:, 1] == r[1]] for r in sent}
            group.ingest(round_, _messages(batch))
    assert early.calibrator.num_accepted > 0
    assert early.model.coefficients == late.model.coefficients
    assert np.array_equal(early.calibrator.rows, late.calibrator.rows)
    assert early.num_late == late.num_late == 0


def test_a_late_row_is_dropped_by_every_rank_alike() -> None:
    groups = [_group(0), _group(1)]
    rows = _rows(1, TRUE)
    for group in groups:
        group.ingest(1, [{}, {}])
        group.ingest(10, _messages({1: rows}))  # step 0 was due at round 3
    assert [g.num_late for g in groups] == [1, 1]
    assert [len(g.calibrator.rows) for g in groups] == [0, 0]
