"""``evenflow bench pipeline``: argument checks and a quick run on real Gloo ranks."""

from __future__ import annotations

import json

import pytest

from evenflow.engine._tools.bench.pipeline import main


def test_bad_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--ranks", "1"]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert main(["--compute-ms", "0"]) == 2
    assert main(["--window", "0"]) == 2
    assert "--window" in capsys.readouterr().err
    assert main(["--window", "4", "--window-steps", "6"]) == 2


@pytest.mark.multiprocess
def test_quick_json_reports_every_case_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    # A quick run on a loaded machine may miss its targets: report them without judging.
    assert main(["--quick", "--json", "--report-only"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "pipeline"
    (world,) = doc["worlds"]
    assert world["num_ranks"] == 2
    for mode in ("sync", "async"):
        for config in ("balanced", "balanced+trace", "off", "sync-ref"):
            case = world["cases"][f"{mode}-{config}-2"]
            assert case["steps"] == doc["config"]["steps"]
            assert case["step_time_s"] > 0
            assert 0.0 <= case["data_stall_fraction"] <= 1.0
        traced = world["cases"][f"{mode}-balanced+trace-2"]
        assert traced["pipeline_work_s"] > 0
        assert world["cases"][f"{mode}-balanced-2"]["ideal_ratio"] >= 1.0
    window = world["window"]
    assert window["window"] == doc["config"]["window"] == 4
    for key in ("1", "4"):
        assert window["cases"][key]["steps"] == doc["config"]["window_steps"]
        assert window["cases"][key]["steps_per_s"] > 0
    assert window["planned_ratio"] > 0 and window["measured_ratio"] > 0
    assert len(doc["targets"]) == 9
    assert {t["status"] for t in doc["targets"]} <= {"PASS", "MISS", "N/A"}


def test_a_missed_target_is_a_failing_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from evenflow.engine._tools.bench._verdict import targets_status

    targets = [
        {"name": "data stall, 2 ranks", "status": "PASS"},
        {"name": "balanced vs off, 4 ranks", "status": "MISS"},
        {"name": "tracing overhead", "status": "N/A"},
    ]
    assert targets_status(targets, report_only=False, prog="bench") == 1
    err = capsys.readouterr().err
    assert "1 target(s) missed: balanced vs off, 4 ranks" in err and "--report-only" in err
    assert targets_status(targets, report_only=True, prog="bench") == 0
    assert targets_status(targets[:1], report_only=False, prog="bench") == 0
