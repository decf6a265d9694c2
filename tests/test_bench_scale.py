"""Smoke test of ``evenflow bench scale`` (the real figures come from the full run)."""

from __future__ import annotations

import json

import pytest

from evenflow.engine._tools.bench.scale import main


def test_quick_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    groups = report["groups"]
    assert [g["num_ranks"] for g in groups] == [8, 64]
    for group in groups:
        assert group["plan_ms_p50"] > 0 and group["plan_ms_p99"] >= group["plan_ms_p50"]
        assert group["samples_per_rank"] > 1
        # A message is a few bytes per sample plus a fixed header.
        assert 0 < group["meta_bytes_per_sample"] < group["meta_bytes_per_rank"]
        assert group["sent_bytes_per_rank_max"] >= group["sent_bytes_per_rank_mean"] >= 0
        assert group["gather_wall_ms"] is not None and group["gather_wall_ms"] > 0
    two = report["two_level"]
    assert two["nodes"] * two["ranks_per_node"] == 32
    assert two["node_local"]["cross_node_bytes_per_step"] == 0
    assert report["node_local_cross_node_bytes_ok"] is True
    # A global group spreads samples over every node; some of its traffic crosses nodes.
    assert two["global"]["cross_node_bytes_per_step"] > 0
    assert two["global"]["max_over_mean"] <= two["source"]["max_over_mean"]
    assert two["node_local"]["max_over_mean"] <= two["source"]["max_over_mean"]
    # The 1,024-rank targets are not measured by --quick; they say so.
    assert [t["status"] for t in report["targets"]] == ["SKIP", "SKIP"]


def test_table_output_and_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--ranks", "8", "--gather-up-to", "0", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "node-local grouping moves 0 bytes across nodes: PASS" in out
    assert "planning p50 at 1,024 ranks" in out and "SKIP" in out


def test_bad_arguments_exit_with_usage() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--ranks", "0"])
    assert info.value.code == 2
