"""``evenflow bench transforms``: argument checks and a quick run on two real Gloo ranks."""

from __future__ import annotations

import json

import pytest

from evenflow.engine._tools.bench.transforms import main


def test_bad_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "2"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["--work-ms", "-1"]) == 2
    assert "--work-ms" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_quick_json_reports_every_arm(capsys: pytest.CaptureFixture[str]) -> None:
    # A quick run on a loaded machine may miss its targets: report them without judging.
    assert main(["--quick", "--stream", "--json", "--report-only"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "transforms"
    arms = {"threads", "dataloader-1", "workers-1", "stream-1"}
    assert set(doc["cases"]) == {f"2ms/{arm}" for arm in arms}
    for case in doc["cases"].values():
        assert case["step_time_s"] > 0 and case["samples_per_s"] > 0
        assert 0.0 <= case["data_stall"] <= 1.0
        assert case["other_cpu_ms"] >= 0.0 and case["gil_ms"] >= 0.0
    # The threads arm runs 2 ms of Python per sample on the loader's threads: its data path
    # holds the GIL for longer than the worker arm's, which only receives the samples.
    cases = doc["cases"]
    assert cases["2ms/threads"]["gil_ms"] > cases["2ms/workers-1"]["gil_ms"]
    assert doc["cases"]["2ms/workers-1"]["vs_dataloader"] > 0
    assert doc["cases"]["2ms/workers-1"]["scaling_vs_1"] == 1.0
    assert doc["cases"]["2ms/stream-1"]["vs_dataloader"] > 0
    assert {t["status"] for t in doc["targets"]} <= {"PASS", "MISS"} and doc["targets"]
