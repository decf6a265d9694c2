"""``evenflow demo``: the model, the data, the fitted cost model, the report and real runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from evenflow.engine import SampleMetadata
from evenflow.engine._pipeline.pack import count_loss_tokens, default_pack_fn
from evenflow.engine._tools.demo import run
from evenflow.engine._tools.demo.calibrate import FittedCost, calibration_bins, time_bins
from evenflow.engine._tools.demo.data import documents, stdlib_dataset
from evenflow.engine._tools.demo.model import TinyCausalLM, TinyConfig, packed_loss
from evenflow.engine._tools.demo.report import build_report, format_report
from evenflow.engine._tools.demo.run import core_warning, main
from evenflow.engine.errors import ConfigError


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


def test_packed_loss_sums_and_skips_the_last_token_of_each_sample() -> None:
    vocab = 256
    packed = default_pack_fn([[5, 6, 7], [8, 9]], 8)
    labels = packed["labels"]
    logits = torch.full((5, vocab), -30.0)
    # Perfect next-token predictions inside samples; the boundary rows predict garbage.
    for i, target in ((0, 6), (1, 7), (3, 9)):
        logits[i, target] = 30.0
    logits[2, 0] = 30.0
    logits[4, 0] = 30.0
    loss, count = packed_loss(logits, labels)
    assert count == 3 == count_loss_tokens(packed)
    assert float(loss) < 1e-6
    logits[1, 7] = -30.0
    worse, _ = packed_loss(logits, labels)
    # A sum: the one uniform token of three adds its whole loss ln 256, not a third of it.
    assert float(worse) == pytest.approx(np.log(256), rel=1e-4)


def test_model_trains_and_rejects_positions_beyond_its_table() -> None:
    model = _tiny_model(max_positions=32)
    packed = default_pack_fn([np.arange(20) % 7, np.arange(12) % 5], 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        logits = model(packed["input_ids"], packed["position_ids"], packed["cu_seq_lens_q"])
        loss, count = packed_loss(logits, packed["labels"])
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() / count)
    assert losses[-1] < 0.5 * losses[0]
    too_long = default_pack_fn([np.arange(40) % 7], 40)
    with pytest.raises(ValueError, match="max_positions=32"):
        model(too_long["input_ids"], too_long["position_ids"], too_long["cu_seq_lens_q"])


def test_fitted_cost_recovers_known_coefficients_and_rejects_bad_input() -> None:
    truth = FittedCost(
        per_bin=0.01, per_sample=0.002, per_token=3e-5, per_token_pair=2e-7, per_token_cube=1e-10
    )
    bins = calibration_bins(1024)
    fitted = FittedCost.fit(bins, [truth.bin_seconds(b) for b in bins])
    for got, want in zip(fitted.coefficients(), truth.coefficients(), strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    # The planner's per-sample cost leaves the per-bin term out; bin_seconds adds it once.
    one = SampleMetadata(tokens=100)
    assert fitted(one) == pytest.approx(0.002 + 3e-3 + 2e-3 + 1e-4)
    assert fitted.bin_seconds([100]) == pytest.approx(0.01 + fitted(one))
    assert (
        fitted.model_id != FittedCost.fit(bins, [2 * truth.bin_seconds(b) for b in bins]).model_id
    )
    # A negative least-squares term is dropped, never kept: no sample gets a negative cost.
    noisy = FittedCost.fit(
        bins, [truth.bin_seconds(b) * (1.3 if len(b) > 8 else 0.8) for b in bins]
    )
    assert min(noisy.coefficients()) >= 0.0
    with pytest.raises(ValueError, match="positive and finite"):
        FittedCost.fit(bins, [0.0] * len(bins))
    with pytest.raises(ValueError, match="at least 5 bins"):
        FittedCost.fit(bins[:2], [1.0, 2.0])


def test_calibration_times_every_bin_of_the_training_layout() -> None:
    bins = calibration_bins(64)
    assert all(sum(b) <= 64 for b in bins) and len({len(b) for b in bins}) >= 4
    assert any(sum(b) <= 32 for b in bins), "half-full bins separate per-token from per-bin"
    seconds = time_bins(_tiny_model(max_positions=64), bins, repeats=1)
    assert len(seconds) == len(bins) and all(s > 0 for s in seconds)
    with pytest.raises(ValueError, match="max_positions"):
        time_bins(_tiny_model(max_positions=32), [[40]], repeats=1)


def test_documents_are_functions_cut_to_seq_len() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        tmp_file = Path(folder) / "m.py"
        body = "    x = 1\n" * 30
        tail = "class C:\n    def g(self):\n        return 2\n"
        source = f'"""doc"""\nimport os\n\n\ndef f():\n{body}\n\n{tail}'
        tmp_file.write_text(source)
        docs = list(documents([tmp_file], 64))
    joined = b"".join(bytes(d.astype(np.uint8)) for d in docs)
    # Every byte is kept, except the newline each cut falls on.
    assert joined.replace(b"\n", b"") == source.encode().replace(b"\n", b"")
    assert max(len(d) for d in docs) <= 64
    assert any(bytes(d[:5].astype(np.uint8)) == b"def f" for d in docs)
    assert any(bytes(d[:10].astype(np.uint8)) == b"    def g(" for d in docs)


def test_the_stdlib_dataset_is_deterministic_and_long_tailed() -> None:
    data = stdlib_dataset(seq_len=1024, num_tokens=200_000, seed=0)
    lengths = np.array([len(d["input_ids"]) for d in data])
    assert lengths.sum() >= 200_000 and lengths.max() <= 1024 and lengths.min() >= 2
    assert all(d["input_ids"].dtype == np.int32 and int(d["input_ids"].max()) < 256 for d in data)
    # Long-tailed: most documents are short, a few fill a whole sequence.
    assert np.median(lengths) < 0.4 * lengths.mean() + 200 and np.percentile(lengths, 99) > 512
    again = stdlib_dataset(seq_len=1024, num_tokens=200_000, seed=0)
    assert [len(d["input_ids"]) for d in again] == lengths.tolist()
    with pytest.raises(ConfigError, match="lower --steps"):
        stdlib_dataset(seq_len=1024, num_tokens=10**12, seed=0)


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
    assert main(["--hidden-size", "30", "--out", str(tmp_path)]) == 2
    assert "try 28" in capsys.readouterr().err
    assert main(["--thread-nice", "20", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--thread-nice must be at most 19" in err and "got 20" in err


def test_an_unwritable_out_is_named_as_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"--out '{blocker / 'sub'}' cannot hold the demo's files" in err
    assert "Errno" not in err and "pass --out with a directory you can write to" in err


def test_more_ranks_than_cores_is_warned_about() -> None:
    assert core_warning(2, 2) is None and core_warning(2, 8) is None
    text = core_warning(4, 2)
    assert text is not None and "4 ranks on 2 CPU core(s)" in text and "--ranks 2" in text


def test_the_deadline_message_says_what_the_ranks_were_doing(tmp_path: Path) -> None:
    import argparse
    import time

    args = argparse.Namespace(deadline=5.0)
    phase = tmp_path / ".phase"
    text = run._deadline_message(args, phase, time.perf_counter() - 5.0)
    assert "still starting" in text and "collective" not in text and "--deadline" in text
    phase.write_text(f"{time.time() - 2}\ntraining: step 3 of 24 done\n")
    text = run._deadline_message(args, phase, time.perf_counter() - 5.0)
    assert "rank 0 was last training: step 3 of 24 done" in text
    assert "--steps" in text and "collective" not in text


def _fake_results(ratio: float, share: float) -> tuple[dict[str, object], list[dict[str, object]]]:
    """Two ranks' results as rank_main returns them: compute is ``ratio`` x the model's, and
    the ranks had their cores ``share`` of the wall time."""
    cost = {"per_bin": 0.0, "per_sample": 0.0, "per_token": 1e-3, "per_token_pair": 0.0}
    spec = {
        "arms": ["off", "step"],
        "cores": 2,
        "threads_per_rank": 1,
        "steps": 3,
        "seq_len": 64,
        "bins_per_rank": 1,
        "window": 4,
        "algorithm": "default",
        "hidden_size": 16,
        "layers": 1,
        "heads": 4,
        "lr": 1e-3,
        "seed": 0,
    }

    def steps(rank: int, arm: str) -> list[dict[str, object]]:
        tokens = [[40, 20, 40], [20, 40, 20]][rank] if arm == "off" else [30, 30, 30]
        return [
            {
                "start_unix": 100.0 + s,
                "step_s": 0.05,
                "wait_s": 0.001,
                "compute_s": ratio * t * 1e-3 / share,
                "compute_cpu_s": ratio * t * 1e-3,
                "sync_s": 0.0,
                "optimizer_s": 0.001,
                "loss": 5.5 - s,
                "tokens": t,
                "samples": 2,
                "bins": [[[t // 2, t - t // 2], ratio * t * 1e-3]],
            }
            for s, t in enumerate(tokens)
        ]

    def stats(arm: str) -> list[dict[str, object]]:
        before = [[40e-3, 20e-3], [20e-3, 40e-3], [40e-3, 20e-3]]
        return [
            {
                "cost_before": b,
                "cost_after": b if arm == "off" else [30e-3, 30e-3],
                "num_moved": 0 if arm == "off" else 1,
                "accepted": arm != "off",
            }
            for b in before
        ]

    results = [
        {
            "rank": r,
            "documents": 10,
            "parameters": 1000,
            "cost_model": {"name": "calibrated", "formula": "f", "coefficients": cost},
            "arms": {
                a: {"steps": steps(r, a), "stats": stats(a) if r == 0 else [], "chrome": None}
                for a in ("off", "step")
            },
        }
        for r in range(2)
    ]
    return spec, results


@pytest.mark.parametrize(("ratio", "share"), [(1.05, 1.0), (1.5, 0.6)])
def test_the_report_checks_the_calibration_against_measured_compute(
    ratio: float, share: float
) -> None:
    spec, results = _fake_results(ratio, share)
    report = build_report(spec, 2, results, wall_s=1.0)  # type: ignore[arg-type]
    check = report["calibration_check"]
    assert check["measured_over_predicted"] == pytest.approx(ratio)
    assert check["holds"] is (ratio < 1.2)
    arm = report["arms"]["step"]
    assert arm["predicted_speedup"] == pytest.approx(40 / 30)
    # Re-fitted on the trained sequences (whose time is exactly linear in tokens), the
    # re-prediction from the bins each rank trained is exact, whatever the start-up error.
    assert arm["refit_predicted_speedup"] == pytest.approx(40 / 30, rel=1e-3)
    text = format_report(report)
    assert "balanced per step: steps 1.00x as fast as with balancing off" in text
    assert "(1.33x predicted)" in text
    table = {line[:32].strip(): line[32:].split() for line in text.splitlines()}
    assert table["speedup, predicted"][:2] == ["1.00x", "1.33x"]
    assert table["speedup, re-predicted"][:2] == ["1.00x", "1.33x"]
    assert table["speedup, CPU time"][:2] == ["1.00x", "1.33x"]
    assert arm["core_share"] == pytest.approx(share)
    busy = "the ranks ran only 60% of the time they spent computing"
    assert (busy in text) is (share < 0.9)
    assert "loss: 5.50 -> 3.50 in 3 steps" in text
    if ratio < 1.2:
        assert "calibration holds" in text and "warning" not in text
    else:
        assert "calibration does NOT hold: measured compute was 1.50x" in text
        assert "warning: measured compute was 1.50x what the cost model predicted" in text


_TINY = ["--ranks", "2", "--seq-len", "128", "--bins-per-rank", "2", "--hidden-size", "16"]


@pytest.mark.multiprocess
def test_a_deadline_in_start_up_kills_the_ranks_and_blames_start_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main([*_TINY, "--steps", "3", "--deadline", "0.5", "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "error: the deadline of 0.5 s passed" in err and "still starting" in err
    assert "collective" not in err


@pytest.mark.multiprocess
def test_demo_trains_two_ranks_and_writes_the_report(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code = main([*_TINY, "--steps", "3", "--out", str(out), "--deadline", "120"])
    captured = capfd.readouterr()  # the ranks' own lines too
    assert code == 0, captured.err
    # Not a terminal: one progress line per step, and the phases, never a redrawn bar.
    assert "step 3/3:" in captured.err and "\r" not in captured.err
    assert "calibrate the cost model" in captured.err
    text = captured.out
    for phrase in ("step time (s)", "imbalance, measured", "data stall", "speedup, mea", "loss: "):
        assert phrase in text
    report = json.loads((out / "report.json").read_text())
    arms = report["arms"]
    assert report["config"]["ranks"] == 2 and arms["off"]["label"] == "balancing off"
    assert {"off", "step"} <= set(arms)
    for arm in arms.values():
        assert arm["num_steps"] == 3 and len(arm["compute_per_rank_s"]) == 2
        assert all(v > 0 for v in arm["compute_per_rank_s"])
        assert arm["imbalance"] >= 1.0 and arm["step_time_s"] > 0
        assert 0 <= arm["samples_moved"] <= arm["samples"]
        assert 0.0 <= arm["data_stall_fraction"] <= 1.0
    assert arms["off"]["samples_moved"] == 0
    # The same samples from the same weights: per-step arms see the same first loss (a window
    # may train a sample in another step of its window).
    first = {round(arms[name]["losses"][0], 4) for name in ("off", "step")}
    assert len(first) == 1 and 4.5 < first.pop() < 6.5
    assert report["calibration_check"]["bins"] > 0
    assert report["config"]["cost_model"]["name"] == "calibrated"
    trace = json.loads((out / "trace-step.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {"train/forward+backward", "train/all-reduce"} <= {e["name"] for e in spans}
    assert str(out / "trace-step.json") in text
    assert not (out / ".phase").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report["files"]["plot"] is None and "matplotlib" in text
    else:
        assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
