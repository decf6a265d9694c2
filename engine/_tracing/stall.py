"""Stage statistics and the data-stall meter.

``_StageStats`` keeps exact running aggregates of one stage (count, total, maximum, mean queue
depth) and a fixed-size uniform reservoir for percentiles; the tracer keeps one per stage.
:class:`StallMeter` measures, with two ``perf_counter`` calls per ``next()``, how long the
caller waits for data and how long it computes in between, whether or not tracing is on.
"""

from __future__ import annotations

import math
import random
from time import perf_counter
from typing import Any, Final

from evenflow.engine.errors import LoaderStateError

__all__ = ["StallMeter"]

_RESERVOIR_SIZE: Final = 4096


class _Reservoir:
    """A uniform sample of at most ``size`` values from a stream (Vitter's algorithm R).

    Percentiles of the sample estimate those of the stream; with 4,096 samples the p99 estimate
    rests on ~40 values above it, good to a few percent for the smooth distributions of stage
    times. Seeded, so a given stream always yields the same estimate.
    """

    __slots__ = ("_rng", "_seen", "_size", "values")

    def __init__(self, size: int = _RESERVOIR_SIZE, seed: int = 0) -> None:
        self._size = size
        self._seen = 0
        self._rng = random.Random(seed)
        self.values: list[float] = []

    def add(self, value: float) -> None:
        self._seen += 1
        if len(self.values) < self._size:
            self.values.append(value)
            return
        slot = self._rng.randrange(self._seen)
        if slot < self._size:
            self.values[slot] = value

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile ``q`` in [0, 100] of the sample; 0.0 when empty."""
        if not self.values:
            return 0.0
        ordered = sorted(self.values)
        rank = min(len(ordered), max(1, math.ceil(len(ordered) * q / 100)))
        return ordered[rank - 1]


class _StageStats:
    """Exact running aggregates of one stage, plus a reservoir for percentiles."""

    __slots__ = ("count", "depth_sum", "max", "reservoir", "total")

    def __init__(self, seed: int) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.depth_sum = 0
        self.reservoir = _Reservoir(seed=seed)

    def add(self, duration: float, queue_depth: int) -> None:
        self.count += 1
        self.total += duration
        self.max = max(self.max, duration)
        self.depth_sum += queue_depth
        self.reservoir.add(duration)

    def summary(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "total": self.total,
            "p50": self.reservoir.percentile(50),
            "p99": self.reservoir.percentile(99),
            "max": self.max,
            "mean_queue_depth": self.depth_sum / self.count if self.count else 0.0,
        }


def _stall_fraction(wait: float, compute: float) -> float:
    busy = wait + compute
    return wait / busy if busy > 0 else 0.0


class StallMeter:
    """Measures how long the caller waits for data and how long it computes in between.

    Always on (two ``perf_counter`` calls per ``next()``), independent of tracing::

        start = meter.start_wait()   # entering next(): closes the previous compute interval
        ...                          # wait for the batch
        end = meter.end_wait()       # leaving next(): opens the next compute interval

    :meth:`pause` forgets the open compute interval (e.g. between epochs), so time the caller
    spent away from the loader does not count as compute. Not thread-safe: one consumer.
    """

    __slots__ = ("_compute", "_compute_interval", "_last_end", "_wait", "_wait_start")

    def __init__(self) -> None:
        self._wait = _StageStats(seed=0)
        self._compute = _StageStats(seed=1)
        self._wait_start: float | None = None
        self._last_end: float | None = None
        self._compute_interval: tuple[float, float] | None = None

    def start_wait(self) -> float:
        """Mark entry into ``next()``; returns the ``perf_counter`` time."""
        now = perf_counter()
        if self._last_end is not None:
            self._compute.add(now - self._last_end, 0)
            self._compute_interval = (self._last_end, now)
            self._last_end = None
        else:
            self._compute_interval = None
        self._wait_start = now
        return now

    def end_wait(self) -> float:
        """Mark exit from ``next()`` (with or without a batch); returns the time."""
        now = perf_counter()
        if self._wait_start is None:
            raise LoaderStateError("StallMeter.end_wait() was called without start_wait().")
        self._wait.add(now - self._wait_start, 0)
        self._wait_start = None
        self._last_end = now
        return now

    @property
    def compute_interval(self) -> tuple[float, float] | None:
        """``(start, end)`` of the compute interval the last :meth:`start_wait` closed."""
        return self._compute_interval

    def pause(self) -> None:
        """Stop the open compute interval from counting (the caller went elsewhere)."""
        self._last_end = None

    @property
    def wait_total(self) -> float:
        """Seconds the caller spent inside ``next()``."""
        return self._wait.total

    @property
    def compute_total(self) -> float:
        """Seconds the caller spent between ``next()`` calls."""
        return self._compute.total

    @property
    def data_stall_fraction(self) -> float:
        """``wait / (wait + compute)``; 0.0 before anything was measured."""
        return _stall_fraction(self._wait.total, self._compute.total)

    def summary(self) -> dict[str, Any]:
        """``{"wait": {...}, "compute": {...}, "data_stall_fraction": f}``; the inner dicts
        hold ``count``, ``total``, ``p50``, ``p99``, ``max`` (seconds) as in
        :meth:`Tracer.summary`."""
        wait = self._wait.summary()
        compute = self._compute.summary()
        del wait["mean_queue_depth"], compute["mean_queue_depth"]
        return {
            "wait": wait,
            "compute": compute,
            "data_stall_fraction": self.data_stall_fraction,
        }
