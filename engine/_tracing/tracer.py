"""Stage tracing: spans, the sinks they go to, and the summary of where time went.

A *span* is one execution of one pipeline stage for one step on one rank: when it started and
ended (``time.perf_counter()`` seconds) and how many items were waiting in the stage's input
channel when it began. The loader wraps every stage call in ``tracer.span(...)`` and records
two caller-side spans itself: ``"wait"`` (time the training loop spent blocked inside
``next()``) and ``"compute"`` (time between two ``next()`` calls). Their ratio is the data
stall, the one number that says whether the data engine is on the critical path.

Sinks, all optional and combinable:

* Python ``logging``: one DEBUG line per span on the logger ``"evenflow.trace"``.
* JSONL: one JSON object per span in one file per rank, written in batches.
* Chrome trace / Perfetto: one JSON file per rank written at :meth:`Tracer.close`; every
  stage is its own track; :func:`merge_chrome_traces` joins the ranks' files into one.
* ``torch.profiler``: each span opened with :meth:`Tracer.span` is also a
  ``record_function("evenflow/<stage>")`` range, so stages show up in PyTorch profiler traces.

Memory is bounded: the tracer keeps the most recent ``keep_spans`` spans in a ring buffer (that
is what the Chrome trace shows), while the per-stage counts, totals, maxima and mean queue depths
of the summary are exact over the whole run. Percentiles come from a fixed-size uniform
reservoir sample per stage (:class:`_Reservoir`), so p50/p99 are estimates once a stage has run
more than ``_RESERVOIR_SIZE`` times.

Cost: recording a span is a lock, a few attribute updates and a deque append (a few
microseconds); the ``torch.profiler`` ranges add ~8 µs each on a CPU build. ``NullTracer`` does
nothing at all and is what the loader uses when tracing is off.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Final

from evenflow.engine._tracing.chrome import write_chrome_trace
from evenflow.engine._tracing.stall import _StageStats, _stall_fraction
from evenflow.engine._validate import check_bool, check_int
from evenflow.engine.errors import ConfigError, LoaderStateError

__all__ = [
    "COMPUTE_STAGE",
    "WAIT_STAGE",
    "NullTracer",
    "Span",
    "Tracer",
    "resolve_tracer",
]

_LOGGER: Final = logging.getLogger("evenflow.trace")


# (step, stage, start, end, queue_depth, attrs): a span without its rank.
_Record = tuple[int, str, float, float, int, "dict[str, Any] | None"]
_JSONL_BATCH: Final = 256

# Caller-side stage names the loader records; the summary derives the data stall from them.
WAIT_STAGE: Final = "wait"
COMPUTE_STAGE: Final = "compute"


@dataclass(frozen=True, slots=True)
class Span:
    """One execution of one stage for one step on one rank.

    ``start`` and ``end`` are ``time.perf_counter()`` seconds; ``queue_depth`` is the number of
    items waiting in the stage's input channel when the span began; ``attrs`` holds small,
    JSON-friendly extras (``attrs["error"]`` is the exception type name of a failed span).
    """

    rank: int
    step: int
    stage: str
    start: float
    end: float
    queue_depth: int = 0
    attrs: dict[str, Any] | None = None

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """The span as a JSON-friendly dict (the JSONL record)."""
        record: dict[str, Any] = {
            "rank": self.rank,
            "step": self.step,
            "stage": self.stage,
            "start": self.start,
            "end": self.end,
            "dur": self.end - self.start,
            "queue_depth": self.queue_depth,
        }
        if self.attrs:
            record["attrs"] = self.attrs
        return record


def _check_sink_path(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be None, a path template containing '{{rank}}' or a directory, "
            f"but got {value!r} ({type(value).__name__})."
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise ConfigError(
            f"{name} must be a non-empty path template or directory, but got {value!r}."
        )
    return text


def _resolve_sink_path(template: str, rank: int, suffix: str) -> Path:
    """``template`` with ``{rank}`` filled in, or ``<template>/trace-rank<rank><suffix>``."""
    if "{rank}" in template:
        path = Path(template.replace("{rank}", str(rank)))
    else:
        path = Path(template) / f"trace-rank{rank}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _SpanContext:
    """The context manager :meth:`Tracer.span` returns; records the span on exit."""

    __slots__ = ("_attrs", "_depth", "_range", "_stage", "_start", "_step", "_tracer")

    def __init__(
        self, tracer: Tracer, stage: str, step: int, depth: int, attrs: dict[str, Any] | None
    ) -> None:
        self._tracer = tracer
        self._stage = stage
        self._step = step
        self._depth = depth
        self._attrs = attrs
        self._range: Any = None
        self._start = 0.0

    def set(self, **attrs: Any) -> None:
        """Attach attributes discovered while the span runs (e.g. a byte count)."""
        if self._attrs is None:
            self._attrs = dict(attrs)
        else:
            self._attrs.update(attrs)

    def __enter__(self) -> _SpanContext:
        factory = self._tracer._record_function
        if factory is not None:
            self._range = factory(f"evenflow/{self._stage}")
            self._range.__enter__()
        self._start = perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = perf_counter()
        if self._range is not None:
            self._range.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            self.set(error=exc_type.__name__)
        self._tracer._record(
            self._stage, self._step, self._start, end, self._depth, attrs=self._attrs
        )


class Tracer:
    """Records one span per stage step and exports them to the configured sinks.

    Create one per loader and pass it in; the loader calls :meth:`bind` with its rank once,
    wraps every stage step in :meth:`span` and records the caller's ``"wait"`` and
    ``"compute"`` spans with :meth:`add`. Call :meth:`close` (or use ``with``) at the end: it
    writes the Chrome trace and closes files.

    Args:
        logging: log one DEBUG line per span on the logger ``"evenflow.trace"``.
        jsonl: path template containing ``{rank}`` (e.g. ``"out/r{rank}.jsonl"``) or a directory
            (file ``trace-rank<rank>.jsonl`` inside) for one JSON object per span.
        chrome: the same for the Chrome-trace/Perfetto file (``trace-rank<rank>.json``),
            written at :meth:`close` from the most recent ``keep_spans`` spans.
        torch_profiler: also open a ``torch.profiler.record_function("evenflow/<stage>")``
            range for every :meth:`span` (spans given to :meth:`add` happened in the past and
            cannot be ranges).
        keep_spans: ring-buffer size; bounds memory and the length of the Chrome trace. The
            summary stays exact regardless.

    Thread-safe: spans may be recorded from the event loop and from worker threads.
    """

    enabled: Final = True

    def __init__(
        self,
        *,
        logging: bool = False,
        jsonl: str | os.PathLike[str] | None = None,
        chrome: str | os.PathLike[str] | None = None,
        torch_profiler: bool = False,
        keep_spans: int = 100_000,
    ) -> None:
        self._log = check_bool("logging", logging)
        self._jsonl_template = _check_sink_path("jsonl", jsonl)
        self._chrome_template = _check_sink_path("chrome", chrome)
        check_bool("torch_profiler", torch_profiler)
        self._keep_spans = check_int("keep_spans", keep_spans, minimum=0)
        self._record_function: Any = None
        if torch_profiler:
            import torch.profiler

            self._record_function = torch.profiler.record_function
        self._lock = threading.Lock()
        self._rank = 0
        self._bound = False
        self._closed = False
        # Spans are kept as plain tuples (a frozen dataclass costs ~1.5 µs to build) and become
        # Span objects only when read; the rank is fixed once the first span is recorded.
        self._spans: deque[_Record] = deque(maxlen=self._keep_spans)
        self._num_spans = 0
        self._stats: dict[str, _StageStats] = {}
        self._tracks: dict[str, int] = {}  # stage -> Chrome-trace tid, in order of appearance
        self._pending: list[_Record] = []  # JSONL records not yet written
        self._jsonl_file: Any = None
        self._jsonl_path: Path | None = None
        self._chrome_path: Path | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """The rank spans are recorded for (0 until :meth:`bind`)."""
        return self._rank

    def bind(self, rank: int) -> None:
        """Attach the tracer to ``rank``; the loader calls this once before the first span."""
        check_int("rank", rank)
        with self._lock:
            if self._bound and rank != self._rank:
                raise LoaderStateError(
                    f"This Tracer is already bound to rank {self._rank} and cannot also serve "
                    f"rank {rank!r}; create one Tracer per loader."
                )
            if not self._bound and self._num_spans and rank != self._rank:
                raise LoaderStateError(
                    f"This Tracer already recorded spans for rank {self._rank}, so it cannot be "
                    f"bound to rank {rank!r}; call bind() before recording."
                )
            self._rank = rank
            self._bound = True

    def close(self) -> None:
        """Flush JSONL, write the Chrome trace and close files. Idempotent.

        Spans recorded after ``close()`` still count in :meth:`summary` but reach no file.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._flush_locked()
            finally:
                if self._jsonl_file is not None:
                    self._jsonl_file.close()
                    self._jsonl_file = None
            if self._chrome_template is not None:
                self._chrome_path = _resolve_sink_path(self._chrome_template, self._rank, ".json")
                write_chrome_trace(self._chrome_path, self._rank, self._tracks, self._spans)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- recording -------------------------------------------------------------------------

    def span(self, stage: str, step: int, queue_depth: int = 0, **attrs: Any) -> _SpanContext:
        """A context manager timing one stage step (``with tracer.span(...) as s``, then
        ``s.set(**attrs)`` adds attributes). An exception propagates and the span is still
        recorded with ``attrs["error"]`` set to the exception's type name."""
        return _SpanContext(self, stage, step, queue_depth, attrs or None)

    def add(
        self,
        stage: str,
        step: int,
        start: float,
        end: float,
        queue_depth: int = 0,
        **attrs: Any,
    ) -> None:
        """Record a span measured elsewhere (``start``/``end`` from ``time.perf_counter()``)."""
        self._record(stage, step, start, end, queue_depth, attrs=attrs or None)

    def _record(
        self,
        stage: str,
        step: int,
        start: float,
        end: float,
        queue_depth: int,
        *,
        attrs: dict[str, Any] | None,
    ) -> None:
        with self._lock:
            record = (step, stage, start, end, queue_depth, attrs)
            self._spans.append(record)
            self._num_spans += 1
            stats = self._stats.get(stage)
            if stats is None:
                stats = self._stats[stage] = _StageStats(seed=len(self._stats))
                self._tracks[stage] = len(self._tracks) + 1
            stats.add(end - start, queue_depth)
            if self._jsonl_template is not None and not self._closed:
                self._pending.append(record)
                if len(self._pending) >= _JSONL_BATCH:
                    self._flush_locked()
        if self._log and _LOGGER.isEnabledFor(logging.DEBUG):
            _LOGGER.debug(
                "rank=%d step=%d stage=%s dur_ms=%.3f queue_depth=%d attrs=%s",
                self._rank,
                step,
                stage,
                (end - start) * 1e3,
                queue_depth,
                attrs,
            )

    def flush(self) -> None:
        """Write buffered JSONL records now (they are otherwise written in batches)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self._pending or self._jsonl_template is None:
            return
        if self._jsonl_file is None:
            self._jsonl_path = _resolve_sink_path(self._jsonl_template, self._rank, ".jsonl")
            self._jsonl_file = self._jsonl_path.open("a", encoding="utf-8")
        lines = [
            json.dumps(Span(self._rank, *record).to_dict(), default=repr)
            for record in self._pending
        ]
        self._jsonl_file.write("\n".join(lines) + "\n")
        self._jsonl_file.flush()
        self._pending.clear()

    # -- reading ---------------------------------------------------------------------------

    @property
    def num_spans(self) -> int:
        """Spans recorded so far, including those evicted from the ring buffer."""
        return self._num_spans

    @property
    def jsonl_path(self) -> Path | None:
        """The JSONL file, once the first batch was written."""
        return self._jsonl_path

    @property
    def chrome_path(self) -> Path | None:
        """The Chrome-trace file, once :meth:`close` wrote it."""
        return self._chrome_path

    def spans(self) -> list[Span]:
        """The retained spans (the most recent ``keep_spans``), oldest first."""
        with self._lock:
            return [Span(self._rank, *record) for record in self._spans]

    def summary(self) -> dict[str, Any]:
        """Per-stage statistics and the data stall.

        Returns ``{"rank", "num_spans", "stages", "wait", "compute", "data_stall_fraction"}``
        where ``stages[name]`` holds ``count``, ``total``, ``p50``, ``p99``, ``max`` (seconds)
        and ``mean_queue_depth``; ``wait``/``compute`` are the totals of the caller spans and
        ``data_stall_fraction = wait / (wait + compute)`` (0.0 before any caller span).
        Counts, totals and maxima are exact; p50/p99 are reservoir estimates.
        """
        with self._lock:
            stages = {name: stats.summary() for name, stats in self._stats.items()}
            wait = self._stats[WAIT_STAGE].total if WAIT_STAGE in self._stats else 0.0
            compute = self._stats[COMPUTE_STAGE].total if COMPUTE_STAGE in self._stats else 0.0
            return {
                "rank": self._rank,
                "num_spans": self._num_spans,
                "stages": stages,
                "wait": wait,
                "compute": compute,
                "data_stall_fraction": _stall_fraction(wait, compute),
            }


class _NullSpan:
    """The shared, stateless context manager :meth:`NullTracer.span` returns."""

    __slots__ = ()

    def set(self, **attrs: Any) -> None:
        """Ignored."""

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_NULL_SPAN: Final = _NullSpan()


class NullTracer:
    """The :class:`Tracer` interface doing no work: what the loader uses with tracing off."""

    enabled: Final = False

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def num_spans(self) -> int:
        """Always 0."""
        return 0

    def bind(self, rank: int) -> None:
        """Ignored."""

    def span(self, stage: str, step: int, queue_depth: int = 0, **attrs: Any) -> _NullSpan:
        """A shared no-op context manager."""
        return _NULL_SPAN

    def add(
        self,
        stage: str,
        step: int,
        start: float,
        end: float,
        queue_depth: int = 0,
        **attrs: Any,
    ) -> None:
        """Ignored."""

    def flush(self) -> None:
        """Ignored."""

    def spans(self) -> list[Span]:
        """Always empty."""
        return []

    def summary(self) -> dict[str, Any]:
        """The shape of :meth:`Tracer.summary`, with nothing recorded."""
        return {
            "rank": 0,
            "num_spans": 0,
            "stages": {},
            "wait": 0.0,
            "compute": 0.0,
            "data_stall_fraction": 0.0,
        }

    def close(self) -> None:
        """Ignored."""

    def __enter__(self) -> NullTracer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


def resolve_tracer(value: object) -> Tracer | NullTracer:
    """``None`` → a :class:`NullTracer`; a ``Tracer``/``NullTracer`` → itself."""
    if value is None:
        return NullTracer()
    if isinstance(value, (Tracer, NullTracer)):
        return value
    raise TypeError(
        f"tracer must be None or an evenflow Tracer, but got {value!r} ({type(value).__name__}); "
        "pass Tracer(chrome='traces/') or leave it unset."
    )
