"""``evenflow bench planner --lockstep`` and ``--window``: their documents, tables and verdicts."""

from __future__ import annotations

import json

import pytest

from evenflow.engine._tools.bench import planner_window
from evenflow.engine._tools.bench.planner import main
from evenflow.engine._tools.bench.planner_lockstep import COLUMNS


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_lockstep_table_reports_every_layout_against_the_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--lockstep", "--json", "--steps", "2", "--ranks", "8", "--bins", "1", "4"]
    argv += ["--distributions", "sft", "longctx", "--linear", "4096", "--packers", "firstfit"]
    code, out, _ = _run(capsys, argv)
    doc = json.loads(out)
    assert doc["benchmark"] == "planner --lockstep"
    rows = {(r["distribution"], r["num_ranks"], r["bins_per_rank"]): r for r in doc["rows"]}
    row = rows["sft", 8, 4]
    excess = row["excess"]
    assert set(excess) == set(COLUMNS)
    # Sorting a layout's bins never raises its lockstep cost; every plan is at or above the
    # bound; the lockstep plan is never worse than the source sorted.
    assert excess["src sort"]["p50"] <= excess["source"]["p50"] + 1e-12
    assert excess["mk sort"]["p50"] <= excess["makespan"]["p50"] + 1e-12
    assert excess["lockstep"]["p50"] <= excess["src sort"]["p50"] + 1e-12
    assert min(v["p50"] for v in excess.values()) >= -1e-12
    # The raw cost beside the excess: the lockstep plan against the makespan plan's bins
    # sorted, per step (the lockstep plan starts from those bins dealt by cost).
    raw = row["raw_vs_mk_sort"]
    assert -1.0 < raw["p50"] <= raw["p90"] and raw["p50"] <= 1e-12
    assert [t["status"] for t in doc["targets"]] == [
        "PASS" if code == 0 else t["status"] for t in doc["targets"]
    ]
    assert code == (0 if all(t["status"] == "PASS" for t in doc["targets"]) else 1)


def test_window_table_and_targets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, ["--window", "1", "4", "--quick", "--report-only"])
    assert code == 0
    assert "longctx  makespan quadratic     8    2  4" in out
    assert "target W=4 removes >= 50% of W=1's excess" in out
    assert "NOT RUN" in out  # the 64-rank timing target is outside the quick sweep
    del err
    code, out, _ = _run(capsys, ["--window", "1", "2", "--quick", "--json", "--steps", "4"])
    doc = json.loads(out)
    rows = doc["cases"][0]["windows"]
    assert set(rows) == {"1", "2"}
    assert rows["1"]["mean_delay"] == 0.0 and rows["1"]["max_delay"] == 0
    assert 0.0 <= rows["2"]["mean_delay"] <= 1.0 and rows["2"]["max_delay"] <= 1
    assert rows["2"]["cost_over_bound"] <= rows["1"]["cost_over_bound"] * (1 + 1e-12)
    # Only the quick sweep's case ran: its timing target at 64 ranks is not judged.
    assert [t["status"] for t in doc["targets"]][2] == "NOT RUN"
    del code


def test_window_misses_exit_1_unless_report_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(planner_window, "_TARGET_EXCESS_REMOVED", 10.0)  # unreachable
    code, _, err = _run(capsys, ["--window", "1", "4", "--quick"])
    assert code == 1 and "target(s) missed" in err
    code, _, _ = _run(capsys, ["--window", "1", "4", "--quick", "--report-only"])
    assert code == 0
    code, _, err = _run(capsys, ["--window", "0"])
    assert code == 2 and "--window values must be >= 1" in err


def test_the_stress_mix_is_one_percent_long() -> None:
    weights = [c.weight for c in planner_window.STRESS.components]
    assert weights == [0.99, 0.01]
    assert set(planner_window.WINDOW_MIXES) == {"sft", "longctx", "stress"}


def test_lockstep_skips_huge_shapes_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--lockstep", "--json", "--ranks", "1024", "--bins", "16", "--steps", "1"]
    code, out, _ = _run(capsys, argv)
    doc = json.loads(out)
    assert doc["skipped"] == [{"num_ranks": 1024, "bins_per_rank": 16}]
    assert doc["rows"] == [] and code == 0
    assert {t["status"] for t in doc["targets"]} == {"NOT RUN"}
