"""A source's per-sample transform: in process, or in worker processes that read ahead.

:class:`SampleTransforms` is what ``DatasetSource`` and ``IterableSource`` hold for their
``transform`` and ``transform_workers``: it reads samples (``dataset[i]``) and transforms
them with the random state of ``(seed, epoch, index)`` (for a stream: transforms the raw
samples of a packed step with that of ``(seed, epoch, step, slot)``), on the calling thread
or in a :class:`TransformPool`; it submits the steps a source will read next before they are
collected (``read_ahead``), keeps the time the transforms took and the reads waited
(``report``), and warns when the transforms set the pace of a pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from evenflow.engine._sources.transform_pool import (
    StepTransform,
    Ticket,
    TransformPool,
    TransformReport,
)
from evenflow.engine._sources.workers import (
    check_transform,
    read_samples,
    transform_samples,
    transform_stream,
)
from evenflow.engine.errors import TransformWorkerError
from evenflow.transports.internal import NOTE_PREFIX

__all__ = ["SampleTransforms", "TransformWorkers"]

logger = logging.getLogger("evenflow")


class TransformWorkers:
    """The transform members both step sources show the user and the loader, over the
    source's ``_transforms`` (a :class:`SampleTransforms`)."""

    _transforms: SampleTransforms

    @property
    def transform_workers(self) -> int:
        """Worker processes that transform samples (``0``: the loader's threads)."""
        return self._transforms.workers

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running transform workers (empty before the first read, after
        ``close_workers()`` and with ``transform_workers=0``)."""
        return self._transforms.pids

    @property
    def transform_report(self) -> TransformReport | None:
        """The transform time of the current pass on this rank (from its first read), or
        ``None`` without a transform or before the pass's first read."""
        return self._transforms.report

    def last_read_transform(self) -> StepTransform | None:
        """Called by the loader right after a read, on the thread that read: that read's
        transform work (``None`` without a transform)."""
        return self._transforms.last_read()

    def bind_workers(self, *, timeout: float) -> None:
        """Called by the loader: a transform worker that does not answer within ``timeout``
        seconds (``LoaderConfig.timeout``) counts as hung."""
        self._transforms.timeout = float(timeout)

    def trace_workers(self, tracer: Any) -> None:
        """Called by the loader: the workers' spans go to its tracer, one track per worker
        (``transform.w0``, ...; the step is the source's, ``-1`` for shared-mode reads)."""
        self._transforms.trace(tracer)

    def close_workers(self, timeout: float = 5.0) -> list[int]:
        """Stop and reap the transform workers within about ``timeout`` seconds (the loader's
        ``close()`` calls this); returns their pids. The next read starts fresh ones."""
        return self._transforms.close(timeout)


class SampleTransforms:
    """Reads and transforms samples of ``dataset`` for one source."""

    def __init__(
        self,
        dataset: Any,
        transform: Callable[[Any, np.random.Generator], Any] | None,
        *,
        workers: int,
        seed: int,
    ) -> None:
        check_transform(transform, workers)
        self._dataset = dataset
        self._transform = transform
        self.workers = workers
        self._seed = seed
        self._pool: TransformPool | None = None
        self._inline_busy = 0.0  # seconds of transforms run in this process
        self._clock: tuple[float, float, float] | None = None  # pass start, busy, wait
        #: Seconds a worker may stay silent before it counts as hung (LoaderConfig.timeout).
        self.timeout = 300.0
        self._tracer: Any = None
        self._last = threading.local()  # per thread: the StepTransform of its last read

    @property
    def active(self) -> bool:
        return self._transform is not None or self.workers > 0

    @property
    def pids(self) -> list[int]:
        return [] if self._pool is None else self._pool.pids

    def read(self, indices: Sequence[int], epoch: int) -> list[Any]:
        """The samples at ``indices``, transformed (in the workers when there are any)."""
        wanted = [int(i) for i in indices]
        if self.workers:
            pool = self._workers()
            return self._pooled(pool, pool.run(wanted, epoch, self.timeout))
        started = time.perf_counter()
        samples = read_samples(self._dataset, wanted)
        if self._transform is None:
            return samples
        try:
            return transform_samples(samples, wanted, self._transform, self._seed, epoch)
        finally:
            self._inline(started, len(wanted))

    def read_ahead(
        self, step: int, later: Sequence[list[int]], ahead: dict[int, Ticket], epoch: int
    ) -> list[Any]:
        """Step ``step``'s samples: ``later[k]`` holds the indices of step ``step + k``
        (``later[0]`` this step's); those not yet submitted are sent to the workers before
        this step is collected, so the workers work while the loader plans and packs."""
        pool = self._workers()
        try:
            for k, indices in enumerate(later):
                if step + k not in ahead:
                    ahead[step + k] = pool.submit(indices, epoch, step + k)
        except TransformWorkerError as exc:  # a worker lost while sending: this step fails
            exc.add_note(f"{NOTE_PREFIX}while reading (source step {step}).")
            raise
        return self._pooled(pool, pool.collect(ahead.pop(step), self.timeout))

    def stream_step(self, samples: list[Any], epoch: int, step: int) -> list[Any]:
        """A stream step's raw ``samples`` transformed on the calling thread (no workers)."""
        if self._transform is None:
            return samples
        started = time.perf_counter()
        try:
            return transform_stream(
                samples, self._transform, seed=self._seed, epoch=epoch, step=step
            )
        finally:
            self._inline(started, len(samples))

    def submit_stream(self, samples: list[Any], epoch: int, step: int) -> Ticket:
        """Send a stream step's raw ``samples`` to the workers; :meth:`collect` them later."""
        return self._workers().submit_samples(samples, epoch, step)

    def collect(self, ticket: Ticket) -> list[Any]:
        pool = self._workers()
        return self._pooled(pool, pool.collect(ticket, self.timeout))

    def last_read(self) -> StepTransform | None:
        """The transform work of the calling thread's last read, once (then ``None``)."""
        last = getattr(self._last, "step", None)
        self._last.step = None
        return last

    def _inline(self, started: float, samples: int) -> None:
        """A read transformed on the calling thread: its time is busy time, no wait."""
        busy = time.perf_counter() - started
        self._inline_busy += busy
        self._last.step = StepTransform(0, samples, busy, 0.0)

    def _pooled(self, pool: TransformPool, samples: list[Any]) -> list[Any]:
        """A read the workers did: the busy and wait figures of its collect."""
        busy, wait = getattr(pool.last, "figures", (0.0, 0.0))
        pool.last.figures = (0.0, 0.0)
        self._last.step = StepTransform(self.workers, len(samples), busy, wait)
        return samples

    def drop(self, ahead: dict[int, Ticket]) -> None:
        """Steps read ahead that will not be collected (the pass ended early)."""
        if self._pool is not None:
            for ticket in ahead.values():
                self._pool.drop(ticket)
        ahead.clear()

    def start_pass(self) -> None:
        if self.active:
            self._clock = (time.monotonic(), *self._totals())

    @property
    def report(self) -> TransformReport | None:
        if self._clock is None:
            return None
        started, busy, wait = self._clock
        now_busy, now_wait = self._totals()
        return TransformReport(
            workers=self.workers,
            busy_s=now_busy - busy,
            wait_s=now_wait - wait,
            elapsed_s=time.monotonic() - started,
        )

    def _totals(self) -> tuple[float, float]:
        pool = self._pool
        if pool is None:
            return self._inline_busy, 0.0
        return self._inline_busy + pool.busy_seconds, pool.wait_seconds

    def warn_if_bottleneck(self, epoch: int, rank: int) -> None:
        """A WARNING when the pass's reads waited on busy workers for over 20% of it."""
        report = self.report
        if report is None or not report.bottleneck:
            return
        logger.warning(
            "evenflow: the transforms were the bottleneck of epoch %d on rank %d: its reads "
            "waited %.1f s of %.1f s for %d transform worker(s) (%.0f%% busy). Raise "
            "transform_workers (up to the cores the training leaves free), or make the "
            "transform cheaper; see the how-to 'Heavy transforms'.",
            epoch,
            rank,
            report.wait_s,
            report.elapsed_s,
            report.workers,
            100 * (report.saturation or 0.0),
        )

    def close(self, timeout: float) -> list[int]:
        return [] if self._pool is None else self._pool.close(timeout)

    def trace(self, tracer: Any) -> None:
        """Record the workers' spans on ``tracer`` (``transform.w0``, ``transform.w1``, ...)."""
        self._tracer = tracer
        if self._pool is not None:
            self._pool.tracer = tracer

    def _workers(self) -> TransformPool:
        if self._pool is None:
            self._pool = TransformPool(
                self._dataset, self._transform, seed=self._seed, workers=self.workers
            )
            self._pool.tracer = self._tracer
        return self._pool
