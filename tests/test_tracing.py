from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from evenflow.engine import NullTracer, Tracer, merge_chrome_traces
from evenflow.engine._tracing import Span, StallMeter, resolve_tracer
from evenflow.engine._tracing import chrome as _chrome
from evenflow.engine._tracing import stall as _stall
from evenflow.engine._tracing import tracer as _tracing
from evenflow.engine.errors import ConfigError, LoaderStateError


class _Clock:
    """A perf_counter stand-in that moves only when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(_tracing, "perf_counter", fake)
    monkeypatch.setattr(_stall, "perf_counter", fake)
    return fake


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- spans and summary -----------------------------------------------------------------------


def test_span_records_rank_step_stage_depth_and_attrs(clock: _Clock) -> None:
    tracer = Tracer()
    tracer.bind(3)
    with tracer.span("pack", 7, queue_depth=2, bins=4) as span:
        clock.advance(0.25)
        span.set(bytes=128)
    [recorded] = tracer.spans()
    assert recorded == Span(3, 7, "pack", 100.0, 100.25, 2, {"bins": 4, "bytes": 128})
    assert recorded.duration == pytest.approx(0.25)


def test_span_records_failures_and_lets_the_exception_through(clock: _Clock) -> None:
    tracer = Tracer()

    def failing_stage() -> None:
        with tracer.span("plan", 1):
            clock.advance(0.5)
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        failing_stage()
    [recorded] = tracer.spans()
    assert recorded.attrs == {"error": "KeyError"}
    assert recorded.duration == pytest.approx(0.5)
    assert tracer.summary()["stages"]["plan"]["count"] == 1


def test_summary_is_exact_for_counts_totals_max_and_depth() -> None:
    tracer = Tracer(keep_spans=3)
    durations = [0.1, 0.4, 0.2, 0.3, 0.9]
    for step, duration in enumerate(durations):
        tracer.add("exchange", step, 10.0, 10.0 + duration, queue_depth=step)
    tracer.add("wait", 0, 0.0, 1.0)
    tracer.add("compute", 0, 1.0, 4.0)
    summary = tracer.summary()
    stage = summary["stages"]["exchange"]
    assert stage["count"] == 5
    assert stage["total"] == pytest.approx(sum(durations))
    assert stage["max"] == pytest.approx(0.9)
    assert stage["p50"] == pytest.approx(0.3)
    assert stage["p99"] == pytest.approx(0.9)
    assert stage["mean_queue_depth"] == pytest.approx(2.0)
    assert summary["wait"] == pytest.approx(1.0)
    assert summary["compute"] == pytest.approx(3.0)
    assert summary["data_stall_fraction"] == pytest.approx(0.25)
    assert summary["num_spans"] == 7
    # The ring buffer keeps only the latest spans; the summary above still saw all of them.
    assert [(s.stage, s.step) for s in tracer.spans()] == [
        ("exchange", 4),
        ("wait", 0),
        ("compute", 0),
    ]


def test_stall_fraction_is_zero_before_any_caller_span() -> None:
    tracer = Tracer()
    tracer.add("plan", 0, 0.0, 1.0)
    assert tracer.summary()["data_stall_fraction"] == 0.0


def test_percentiles_are_close_beyond_the_reservoir_size() -> None:
    tracer = Tracer(keep_spans=0)
    n = 20_000  # five times the reservoir; values shuffled so the order is not sorted
    values = [((i * 7919) % n) / n for i in range(n)]
    for value in values:
        tracer.add("decode", 0, 0.0, value)
    stage = tracer.summary()["stages"]["decode"]
    assert stage["count"] == n
    assert stage["p50"] == pytest.approx(0.5, abs=0.03)
    assert stage["p99"] == pytest.approx(0.99, abs=0.01)
    assert stage["max"] == pytest.approx(max(values))
    assert tracer.spans() == []


def test_concurrent_recording_loses_nothing() -> None:
    tracer = Tracer(keep_spans=100)
    barrier = threading.Barrier(4)

    def work(worker: int) -> None:
        barrier.wait()
        for step in range(500):
            with tracer.span(f"stage{worker % 2}", step):
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    stages = tracer.summary()["stages"]
    assert stages["stage0"]["count"] == 1000
    assert stages["stage1"]["count"] == 1000
    assert len(tracer.spans()) == 100


def test_recording_cost_stays_small() -> None:
    # A generous bound (the cost is a few microseconds): catches accidental I/O or sorting
    # per span, not regressions of a few percent.
    tracer = Tracer(jsonl=None)
    n = 5_000
    started = time.perf_counter()
    for step in range(n):
        with tracer.span("pack", step, queue_depth=1):
            pass
    per_span = (time.perf_counter() - started) / n
    assert per_span < 100e-6


# -- bind and lifecycle ------------------------------------------------------------------------


def test_bind_rejects_a_second_rank_and_bad_values() -> None:
    tracer = Tracer()
    tracer.bind(2)
    tracer.bind(2)
    assert tracer.rank == 2
    with pytest.raises(LoaderStateError, match="already bound to rank 2"):
        tracer.bind(3)
    with pytest.raises(ConfigError, match="rank"):
        Tracer().bind(-1)
    early = Tracer()
    early.add("plan", 0, 0.0, 1.0)
    with pytest.raises(LoaderStateError, match="already recorded spans"):
        early.bind(1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep_spans": -1}, ConfigError, "keep_spans"),
        ({"logging": 1}, ConfigError, "logging"),
        ({"torch_profiler": "yes"}, ConfigError, "torch_profiler"),
        ({"jsonl": 5}, TypeError, "jsonl"),
        ({"chrome": ""}, ConfigError, "chrome"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Tracer(**kwargs)


def test_close_is_idempotent_and_later_spans_only_count(tmp_path: Path) -> None:
    tracer = Tracer(jsonl=tmp_path)
    tracer.add("plan", 0, 0.0, 1.0)
    tracer.close()
    tracer.close()
    tracer.add("plan", 1, 1.0, 2.0)
    tracer.close()
    assert tracer.summary()["stages"]["plan"]["count"] == 2
    assert [r["step"] for r in _read_jsonl(tmp_path / "trace-rank0.jsonl")] == [0]


# -- sinks -------------------------------------------------------------------------------------


def test_jsonl_per_rank_from_a_template(tmp_path: Path) -> None:
    tracer = Tracer(jsonl=str(tmp_path / "out" / "spans-{rank}.jsonl"))
    tracer.bind(5)
    for step in range(_tracing._JSONL_BATCH + 3):
        tracer.add("exchange", step, float(step), step + 0.5, queue_depth=1, nbytes=step)
    path = tmp_path / "out" / "spans-5.jsonl"
    # One full batch is on disk before close; the rest arrives at close.
    assert len(_read_jsonl(path)) == _tracing._JSONL_BATCH
    tracer.close()
    records = _read_jsonl(path)
    assert tracer.jsonl_path == path
    assert len(records) == _tracing._JSONL_BATCH + 3
    assert records[2] == {
        "rank": 5,
        "step": 2,
        "stage": "exchange",
        "start": 2.0,
        "end": 2.5,
        "dur": 0.5,
        "queue_depth": 1,
        "attrs": {"nbytes": 2},
    }


def test_jsonl_flush_writes_pending_records(tmp_path: Path) -> None:
    tracer = Tracer(jsonl=tmp_path)
    tracer.add("plan", 0, 0.0, 1.0, note=object())  # non-JSON attrs fall back to repr
    tracer.flush()
    [record] = _read_jsonl(tmp_path / "trace-rank0.jsonl")
    assert record["attrs"]["note"].startswith("<object object")
    tracer.close()


def test_chrome_trace_has_one_track_per_stage(tmp_path: Path) -> None:
    tracer = Tracer(chrome=tmp_path)
    tracer.bind(1)
    base = _chrome._EPOCH_PERF
    tracer.add("plan", 0, base + 1.0, base + 1.5, queue_depth=2)
    tracer.add("pack", 0, base + 2.0, base + 2.25)
    tracer.add("plan", 1, base + 3.0, base + 3.001, err="x")
    assert not (tmp_path / "trace-rank1.json").exists()  # written at close
    tracer.close()
    assert tracer.chrome_path == tmp_path / "trace-rank1.json"
    document = json.loads((tmp_path / "trace-rank1.json").read_text())
    assert document["displayTimeUnit"] == "ms"
    events = document["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(names) == {"plan", "pack"}
    assert names["plan"] != names["pack"]
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["plan", "pack", "plan"]
    assert all(e["pid"] == 1 for e in events)
    assert [e["tid"] for e in complete] == [names["plan"], names["pack"], names["plan"]]
    assert complete[0]["ts"] == pytest.approx(1e6)
    assert complete[0]["dur"] == pytest.approx(5e5)
    assert complete[0]["args"] == {"step": 0, "queue_depth": 2}
    assert complete[2]["args"] == {"step": 1, "queue_depth": 0, "err": "x"}


def test_logging_sink_writes_one_debug_line_per_span(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="evenflow.trace")
    tracer = Tracer(logging=True)
    tracer.bind(4)
    tracer.add("gather", 9, 0.0, 0.002, queue_depth=3)
    tracer.add("gather", 10, 0.0, 0.002)
    lines = [r.getMessage() for r in caplog.records if r.name == "evenflow.trace"]
    assert len(lines) == 2
    assert "rank=4 step=9 stage=gather dur_ms=2.000 queue_depth=3" in lines[0]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_no_logging_without_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="evenflow.trace")
    Tracer().add("gather", 0, 0.0, 1.0)
    assert not [r for r in caplog.records if r.name == "evenflow.trace"]


def test_torch_profiler_sees_stage_ranges() -> None:
    import torch.autograd.profiler

    tracer = Tracer(torch_profiler=True)
    # The legacy profiler sees the same record_function ranges and starts in milliseconds
    # (the Kineto one takes seconds on CPU).
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        with tracer.span("collate", 0):
            pass
        with pytest.raises(RuntimeError), tracer.span("pack", 0):
            raise RuntimeError("inside a range")
    names = {event.name for event in prof.function_events}
    assert {"evenflow/collate", "evenflow/pack"} <= names


def test_merge_chrome_traces_aligns_ranks(tmp_path: Path) -> None:
    for rank in range(2):
        tracer = Tracer(chrome=tmp_path / "ranks")
        tracer.bind(rank)
        tracer.add("plan", 0, _chrome._EPOCH_PERF + rank, _chrome._EPOCH_PERF + rank + 1)
        tracer.close()
    out = merge_chrome_traces(
        sorted((tmp_path / "ranks").glob("*.json")), tmp_path / "merged" / "all.json"
    )
    document = json.loads(out.read_text())
    complete = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["pid"] for e in complete) == [0, 1]
    assert sorted(e["ts"] for e in complete) == pytest.approx([0.0, 1e6])
    assert document["displayTimeUnit"] == "ms"


def test_merge_shifts_onto_the_earliest_epoch_and_keeps_foreign_files(tmp_path: Path) -> None:
    event = {"name": "plan", "ph": "X", "pid": 0, "tid": 1, "ts": 10.0, "dur": 1.0}
    early = {"traceEvents": [event], "otherData": {"evenflow_epoch_unix": 1000.0}}
    late = {"traceEvents": [{**event, "pid": 1}], "otherData": {"evenflow_epoch_unix": 1002.5}}
    foreign = [{**event, "pid": 7}]
    paths = []
    for name, document in (("a", early), ("b", late), ("c", foreign)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        paths.append(path)
    merged = json.loads(merge_chrome_traces(paths, tmp_path / "m.json").read_text())
    ts = {e["pid"]: e["ts"] for e in merged["traceEvents"]}
    assert ts == {0: 10.0, 1: pytest.approx(10.0 + 2.5e6), 7: 10.0}


def test_merge_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one"):
        merge_chrome_traces([], tmp_path / "m.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ConfigError, match="traceEvents"):
        merge_chrome_traces([bad], tmp_path / "m.json")


# -- null tracer -------------------------------------------------------------------------------


def test_null_tracer_does_nothing_and_shares_one_context() -> None:
    tracer = NullTracer()
    tracer.bind(3)
    first = tracer.span("pack", 0, queue_depth=1, x=1)
    assert first is tracer.span("plan", 1)

    def failing_stage() -> None:
        with tracer.span("pack", 0) as span:
            span.set(y=2)
            raise ValueError("kept")

    with pytest.raises(ValueError, match="kept"):
        failing_stage()
    tracer.add("wait", 0, 0.0, 1.0)
    assert tracer.spans() == []
    assert tracer.summary() == {
        "rank": 0,
        "num_spans": 0,
        "stages": {},
        "wait": 0.0,
        "compute": 0.0,
        "data_stall_fraction": 0.0,
    }
    assert set(tracer.summary()) == set(Tracer().summary())
    tracer.close()
    assert not tracer.enabled
    assert Tracer().enabled


def test_resolve_tracer() -> None:
    assert isinstance(resolve_tracer(None), NullTracer)
    tracer = Tracer()
    assert resolve_tracer(tracer) is tracer
    null = NullTracer()
    assert resolve_tracer(null) is null
    with pytest.raises(TypeError, match="tracer must be None or an evenflow Tracer"):
        resolve_tracer("chrome")


# -- stall meter -------------------------------------------------------------------------------


def test_stall_meter_splits_wait_and_compute(clock: _Clock) -> None:
    meter = StallMeter()
    assert meter.data_stall_fraction == 0.0
    for wait, compute in [(0.1, 0.9), (0.3, 0.7), (0.2, 0.8)]:
        started = meter.start_wait()
        clock.advance(wait)
        ended = meter.end_wait()
        assert ended - started == pytest.approx(wait)
        clock.advance(compute)
    # The compute after the last next() is still open, so it is not counted yet.
    assert meter.wait_total == pytest.approx(0.6)
    assert meter.compute_total == pytest.approx(1.6)
    meter.start_wait()
    interval = meter.compute_interval
    assert interval is not None
    assert interval[0] == pytest.approx(clock.now - 0.8)
    assert interval[1] == clock.now
    meter.end_wait()
    summary = meter.summary()
    assert summary["compute"]["count"] == 3
    assert summary["wait"]["count"] == 4
    assert summary["compute"]["total"] == pytest.approx(2.4)
    assert summary["wait"]["max"] == pytest.approx(0.3)
    assert summary["data_stall_fraction"] == pytest.approx(0.6 / 3.0)


def test_stall_meter_pause_drops_the_open_gap(clock: _Clock) -> None:
    meter = StallMeter()
    meter.start_wait()
    clock.advance(1.0)
    meter.end_wait()
    clock.advance(50.0)  # e.g. evaluation between epochs
    meter.pause()
    meter.start_wait()
    assert meter.compute_interval is None
    assert meter.compute_total == 0.0
    with pytest.raises(LoaderStateError, match="without start_wait"):
        StallMeter().end_wait()
