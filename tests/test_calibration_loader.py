"""Online calibration in the loader: agreement across ranks, convergence, resume, errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from testkit.calibration import (
    TRUE,
    IdLengths,
    calibrated,
    gloo_rank,
    lengths_pack,
    seconds,
)
from testkit.loaders import make_loaders, run_in_threads_or_raise

from evenflow.engine.errors import ConfigError, LoaderStateError
from evenflow.transports.launch import RankPool

STEPS = 60


def _loaders(steps: int = STEPS, **overrides: Any) -> list[Any]:
    sources = [IdLengths(r, steps) for r in range(2)]
    options: dict[str, Any] = {"cost_model": calibrated()}
    options.update(overrides)
    return make_loaders(
        2,
        sources,
        seq_len=4096,
        pack_fn=lengths_pack,
        collate_fn=lambda bins: bins,
        **options,
    )


def _train(
    loader: Any, rank: int, *, record: Any = None, stop: int | None = None
) -> dict[str, Any]:
    """Iterate, measuring bins with the synthetic clock; ``record(rank, step)`` may skip."""
    digests, coefficients, state = [], [], None
    with loader:
        for batch in loader:
            step = loader.step - 1
            for b, lengths in enumerate(batch):
                if record is None or record(rank, step):
                    loader.record_compute(seconds(lengths, rank, step, b), bin=b)
            digests.append((step, loader.last_stats.digest))
            coefficients.append((step, loader.calibration_stats.coefficients))
            if stop is not None and step == stop:
                state = loader.state_dict()
        stats = loader.calibration_stats
    return {"digests": digests, "coefficients": coefficients, "stats": stats, "state": state}


def test_every_rank_holds_the_same_coefficients_and_plans_and_they_converge() -> None:
    loaders = _loaders()
    a, b = run_in_threads_or_raise(loaders, lambda r, ld: _train(ld, r))
    assert a["digests"] == b["digests"]
    assert a["coefficients"] == b["coefficients"]
    stats = a["stats"]
    assert stats == b["stats"]
    assert stats.num_late == 0 and stats.num_refused == 0
    assert stats.num_accepted >= 1
    coef = stats.coefficients
    # Misspecified 3.5x at the start; the quadratic-to-linear ratio recovered within 30%.
    assert coef[3] / coef[2] == pytest.approx(TRUE[3] / TRUE[2], rel=0.3)
    first = [e for step, e in stats.errors if step < 10]
    assert np.median(first) > 0.15  # the misspecified model's errors
    assert stats.median_error < 0.10
    assert stats.p90_error >= stats.median_error
    assert stats.imbalance and all(m >= 1.0 and p >= 1.0 for _, m, p in stats.imbalance)
    assert [e for e, _ in stats.errors] == sorted(e for e, _ in stats.errors)


@pytest.mark.parametrize(
    "options", [{"planning": "leader"}, {"balance_window": 2}], ids=["leader", "window"]
)
def test_leader_planning_and_balance_windows_agree_too(options: dict[str, Any]) -> None:
    loaders = _loaders(40, **options)
    a, b = run_in_threads_or_raise(loaders, lambda r, ld: _train(ld, r))
    assert a["digests"] == b["digests"]
    assert a["coefficients"] == b["coefficients"]
    assert a["stats"].num_accepted >= 1 and a["stats"].num_late == 0


def test_missing_measurements_on_one_rank_cannot_make_plans_differ() -> None:
    loaders = _loaders()

    def record(rank: int, step: int) -> bool:
        return rank == 0 or step % 3 == 0  # rank 1 measures one step in three

    a, b = run_in_threads_or_raise(loaders, lambda r, ld: _train(ld, r, record=record))
    assert a["digests"] == b["digests"]
    assert a["coefficients"] == b["coefficients"]
    assert a["stats"].num_accepted >= 1


def test_resume_restores_coefficients_and_plans_bit_for_bit() -> None:
    stop = 27
    first = run_in_threads_or_raise(_loaders(), lambda r, ld: _train(ld, r, stop=stop))
    resumed = _loaders()
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(first[rank]["state"])
    second = run_in_threads_or_raise(resumed, lambda r, ld: _train(ld, r))
    for rank in range(2):
        after = [item for item in first[rank]["digests"] if item[0] > stop]
        assert second[rank]["digests"] == after
        coef_after = [item for item in first[rank]["coefficients"] if item[0] > stop]
        assert second[rank]["coefficients"] == coef_after
    assert first[0]["stats"].num_accepted >= 2  # refits happened on both sides of the stop


def test_a_state_without_calibration_loads_with_the_initial_coefficients() -> None:
    first = run_in_threads_or_raise(_loaders(12), lambda r, ld: _train(ld, r, stop=9))
    resumed = _loaders(12)
    for rank, loader in enumerate(resumed):
        state = dict(first[rank]["state"])
        assert "calibration" in state
        del state["calibration"]  # as an older evenflow wrote it
        loader.load_state_dict(state)
        assert loader.calibration_stats.coefficients == calibrated().initial
    run_in_threads_or_raise(resumed, lambda r, ld: _train(ld, r))


def test_record_compute_errors_name_the_fix() -> None:
    plain = _loaders(4, cost_model="quadratic")
    with plain[0], plain[1], pytest.raises(ConfigError, match="CalibratedCost"):
        plain[0].record_compute(1.0)

    def body(rank: int, loader: Any) -> dict[str, Any]:
        with loader:
            with pytest.raises(LoaderStateError, match="after next"):
                loader.record_compute(1.0)
            next(iter(loader))
            with pytest.raises(ConfigError, match=r"bin=2\) must be None"):
                loader.record_compute(1.0, bin=2)
            with pytest.raises(TypeError, match="number of seconds"):
                loader.record_compute("1s")  # type: ignore[arg-type]
            loader.record_compute(math.nan, bin=0)  # accepted, then refused by every rank
            with pytest.raises(LoaderStateError, match="already holds"):
                loader.record_compute(1.0)
            for _ in loader:
                pass
            return {"refused": loader.calibration_stats.num_refused}

    results = run_in_threads_or_raise(_loaders(8), body)
    assert [r["refused"] for r in results] == [2, 2]


@pytest.mark.multiprocess
def test_two_gloo_processes_agree_on_coefficients_and_plans() -> None:
    with RankPool(2, timeout=10.0, deadline=120.0) as pool:
        a, b = pool.run(gloo_rank, 30, deadline=90.0)
    assert a["digests"] == b["digests"]
    assert a["coefficients"] == b["coefficients"]
    assert a["late"] == b["late"] == 0
    assert a["accepted"] >= 1
