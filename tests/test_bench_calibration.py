"""``evenflow bench calibration``: argument checks and a tiny run on real Gloo ranks."""

from __future__ import annotations

import json

import pytest

from evenflow.engine._tools.bench.calibration import ARMS, main


def test_bad_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "3"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["--seq-len", "8"]) == 2
    assert "--seq-len" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_tiny_run_reports_every_arm_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    # Too short to judge calibration: report the figures without judging them.
    assert main(["--quick", "--steps", "12", "--seq-len", "64", "--json", "--report-only"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "calibration"
    (repeat,) = doc["repeats"]
    assert set(repeat["arms"]) == set(ARMS)
    for name in ARMS:
        arm = repeat["arms"][name]
        assert arm["steps"] == 12
        assert arm["max_over_mean"] >= 1.0
        assert arm["step_time_vs_off"] > 0
    assert repeat["arms"]["off"]["max_compute_vs_off_late"] == 1.0
    assert repeat["arms"]["off"]["imbalance_vs_off_late"] == 1.0
    calibrating = repeat["arms"]["calibrating"]
    assert calibrating["fits"] >= 1 and calibrating["late"] == 0
    assert len(calibrating["coefficients"]) == 4
    assert [t["status"] for t in doc["targets"]] and len(doc["targets"]) == 3
    assert {t["status"] for t in doc["targets"]} <= {"PASS", "MISS"}
