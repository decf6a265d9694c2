"""``evenflow demo``: the model, the data, the cost table and a real two-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from evenflow.engine._model import SampleMetadata
from evenflow.engine._pipeline.pack import default_pack_fn
from evenflow.engine._tools.demo.model import MeasuredCost, TinyCausalLM, TinyConfig, packed_loss
from evenflow.engine._tools.demo.run import main, scaled_distribution, stdlib_source
from evenflow.engine.workloads import SFT


def _tiny_model(max_positions: int = 64) -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(TinyConfig(hidden_size=16, num_layers=2, max_positions=max_positions))


def test_attention_never_crosses_a_sample_boundary() -> None:
    model = _tiny_model()
    first = np.arange(1, 11, dtype=np.int64)
    packed_a = default_pack_fn([first, np.full(7, 3, dtype=np.int64)], 64)
    packed_b = default_pack_fn([first, np.full(7, 200, dtype=np.int64)], 64)
    with torch.no_grad():
        a = model(packed_a["input_ids"], packed_a["position_ids"], packed_a["cu_seq_lens_q"])
        b = model(packed_b["input_ids"], packed_b["position_ids"], packed_b["cu_seq_lens_q"])
        alone = default_pack_fn([first], 64)
        c = model(alone["input_ids"], alone["position_ids"], alone["cu_seq_lens_q"])
    # The first sample's logits ignore whatever follows it and match the sample alone.
    torch.testing.assert_close(a[:10], b[:10])
    torch.testing.assert_close(a[:10], c)
    assert not torch.allclose(a[10:], b[10:])


def test_attention_is_causal_within_a_sample() -> None:
    model = _tiny_model()
    x = np.arange(1, 13, dtype=np.int64)
    y = x.copy()
    y[8:] = 99
    with torch.no_grad():
        px, py = default_pack_fn([x], 64), default_pack_fn([y], 64)
        lx = model(px["input_ids"], px["position_ids"], px["cu_seq_lens_q"])
        ly = model(py["input_ids"], py["position_ids"], py["cu_seq_lens_q"])
    torch.testing.assert_close(lx[:8], ly[:8])
    assert not torch.allclose(lx[8:], ly[8:])


def test_packed_loss_skips_the_last_token_of_each_sample() -> None:
    vocab = 256
    labels = default_pack_fn([[5, 6, 7], [8, 9]], 8)["labels"]
    logits = torch.full((5, vocab), -30.0)
    # Perfect next-token predictions inside samples; the boundary rows predict garbage.
    for i, target in ((0, 6), (1, 7), (3, 9)):
        logits[i, target] = 30.0
    logits[2, 0] = 30.0
    logits[4, 0] = 30.0
    assert float(packed_loss(logits, labels)) < 1e-6
    logits[1, 7] = -30.0
    assert float(packed_loss(logits, labels)) > 1.0


def test_model_trains_and_rejects_positions_beyond_its_table() -> None:
    model = _tiny_model(max_positions=32)
    packed = default_pack_fn([np.arange(20) % 7, np.arange(12) % 5], 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        logits = model(packed["input_ids"], packed["position_ids"], packed["cu_seq_lens_q"])
        loss = packed_loss(logits, packed["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    too_long = default_pack_fn([np.arange(40) % 7], 40)
    with pytest.raises(ValueError, match="max_positions=32"):
        model(too_long["input_ids"], too_long["position_ids"], too_long["cu_seq_lens_q"])


def test_measured_cost_interpolates_the_table() -> None:
    cost = MeasuredCost([1000, 10], [10.0, 0.1])
    assert cost(SampleMetadata(tokens=10)) == pytest.approx(0.1)
    assert cost(SampleMetadata(tokens=1000)) == pytest.approx(10.0)
    # Log-log: the midpoint in log space of lengths maps to the geometric mean of costs.
    assert cost(SampleMetadata(tokens=100)) == pytest.approx(1.0)
    assert cost(SampleMetadata(tokens=5)) == pytest.approx(0.05)  # linear below the table
    values = [cost(SampleMetadata(tokens=n)) for n in (1, 3, 10, 30, 100, 300, 3000)]
    assert values == sorted(values)
    assert cost.model_id != MeasuredCost([1000, 10], [10.0, 0.2]).model_id
    with pytest.raises(ValueError, match="positive"):
        MeasuredCost([10], [0.0])


def test_scaled_distribution_keeps_the_shape() -> None:
    scaled = scaled_distribution("sft", 1024)
    ratio = 1024 / SFT.default_seq_len
    assert scaled.components[0].median == pytest.approx(SFT.components[0].median * ratio)
    assert scaled.components[1].high == pytest.approx(SFT.components[1].high * ratio)
    assert scaled.default_seq_len == 1024


def test_stdlib_source_yields_byte_tokens_in_full_bins() -> None:
    steps = list(
        stdlib_source(rank=1, num_ranks=2, bins_per_rank=3, seq_len=1024, num_steps=6, seed=0)
    )
    assert len(steps) == 6
    lengths = []
    for bins in steps:
        assert len(bins) == 3
        for b in bins:
            assert b, "every bin holds at least one sample"
            assert sum(len(s["input_ids"]) for s in b) <= 1024
            for s in b:
                assert s["input_ids"].dtype == np.int32
                assert int(s["input_ids"].min()) >= 0 and int(s["input_ids"].max()) < 256
                lengths.append(len(s["input_ids"]))
    assert len(set(lengths)) > 5, "documents should vary in length"
    again = list(
        stdlib_source(rank=1, num_ranks=2, bins_per_rank=3, seq_len=1024, num_steps=6, seed=0)
    )
    assert [[len(b) for b in s] for s in again] == [[len(b) for b in s] for s in steps]


def test_bad_arguments_exit_non_zero_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--seq-len", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--seq-len" in err and "0" in err
    assert main(["--ranks", "1", "--out", str(tmp_path)]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert main(["--cost-model", "nope"]) == 2
    assert "--cost-model" in capsys.readouterr().err


_TINY = ["--ranks", "2", "--seq-len", "128", "--bins-per-rank", "2", "--hidden-size", "16"]


@pytest.mark.multiprocess
def test_a_missed_deadline_kills_the_ranks_and_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main([*_TINY, "--steps", "3", "--deadline", "0.5", "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "error" in err and "deadline" in err


@pytest.mark.multiprocess
def test_demo_trains_two_ranks_and_writes_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code = main([*_TINY, "--steps", "3", "--out", str(out), "--deadline", "120"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    text = captured.out
    for phrase in ("max/mean imbalance", "step time", "data stall", "speedup", "samples moved"):
        assert phrase in text
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert report["config"]["ranks"] == 2
    assert len(summary["compute_per_rank_before_s"]) == 2
    assert all(v > 0 for v in summary["compute_per_rank_after_s"])
    assert summary["imbalance_before"] >= 1.0 and summary["imbalance_after"] >= 1.0
    assert 0 <= summary["samples_moved"] <= summary["samples"]
    assert summary["samples"] > 0
    assert 0.0 <= summary["data_stall_fraction_after"] <= 1.0
    assert summary["step_time_before_s"] > 0 and summary["speedup"] > 0
    assert report["runs"]["balanced"]["num_steps"] == 3
    assert str(out / "trace.json") in text
    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {"train/forward+backward", "train/all-reduce"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 and isinstance(e["ts"], (int, float)) for e in spans)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report["files"]["plot"] is None and "matplotlib" in text
    else:
        assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
