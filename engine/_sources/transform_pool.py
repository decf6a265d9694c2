"""The training process's side of the transform workers: submit work ahead, collect in order.

A read is :meth:`TransformPool.submit` (its indices split into chunks, each sent to the least
loaded worker, without waiting) then :meth:`TransformPool.collect` (the chunks' results, in
order); :meth:`TransformPool.submit_samples` sends an ``IterableSource`` step's raw samples
instead of indices. A source submits the steps it will read next before it collects the
current one, so every worker always has queued work (as ``DataLoader`` keeps
``prefetch_factor`` batches per worker in flight) instead of idling while the pipeline plans,
exchanges and packs.

Each worker answers its tasks in the order they were sent. One thread at a time receives
(``_recv_lock``); replies that belong to another caller's task are parked in ``_done`` for it.
A failure that costs the workers (death, hang, ``close()``) stops them all and bumps the
*generation*: every ticket of an older generation then fails with ``TransformWorkerError``
instead of waiting for a reply that will never come, and the next submit starts fresh workers.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.connection
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._sources.workers import start_context, stop_workers, unpack, worker_main
from evenflow.engine.errors import TransformWorkerError
from evenflow.transports.internal import NOTE_PREFIX

__all__ = ["StepTransform", "Ticket", "TransformPool", "TransformReport"]


class _Worker:
    def __init__(
        self, process: Any, conn: multiprocessing.connection.Connection, slot: int
    ) -> None:
        self.process = process
        self.conn = conn
        self.stage = f"transform.w{slot}"  # its trace track
        self.load = 0  # samples sent and not yet answered


@dataclass(frozen=True)
class Ticket:
    """What :meth:`TransformPool.submit` sent: ``(worker, task, indices)`` per chunk."""

    generation: int
    parts: tuple[tuple[_Worker, int, tuple[int, ...]], ...]
    step: int = -1  # the source's step, for trace spans (-1: unknown)
    #: What a part's numbers are, for errors: dataset indices, or a stream step's slots.
    label: str = "dataset indices"


@dataclass(frozen=True, slots=True)
class StepTransform:
    """This rank's transform work for one step (``StepStats.transform``).

    ``busy_s``: seconds spent reading and transforming the step's samples on this rank (in
    the workers, summed over them, or on the loader's threads with ``workers=0``).
    ``wait_s``: seconds the step's reads waited for workers that had not finished (``0.0``
    without workers): how far the transforms were behind the loader on this step.
    ``samples``: samples transformed. In payload mode (and for a stream) these are the
    samples this rank read for the step; in shared-dataset mode, the samples the plan
    assigned to it.
    """

    workers: int
    samples: int
    busy_s: float
    wait_s: float

    def __add__(self, other: StepTransform) -> StepTransform:
        return StepTransform(
            max(self.workers, other.workers),
            self.samples + other.samples,
            self.busy_s + other.busy_s,
            self.wait_s + other.wait_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "samples": self.samples,
            "busy_s": self.busy_s,
            "wait_s": self.wait_s,
        }


@dataclass(frozen=True)
class TransformReport:
    """Where a rank's transform time went during a pass (a source's ``transform_report``).

    ``busy_s``: seconds spent reading and transforming samples (in the workers, or on the
    loader's threads with ``workers=0``). ``wait_s``: seconds the source's reads waited for
    workers that had not finished (``0.0`` without workers): time the transforms were not
    ahead. ``elapsed_s``: seconds since the pass's first read.
    """

    workers: int
    busy_s: float
    wait_s: float
    elapsed_s: float

    @property
    def saturation(self) -> float | None:
        """Share of the workers' time spent working (``None`` without workers)."""
        if not self.workers or self.elapsed_s <= 0:
            return None
        return min(self.busy_s / (self.workers * self.elapsed_s), 1.0)

    @property
    def bottleneck(self) -> bool:
        """Reads waited for the workers for over 20% of the pass (at least a second long)
        while the workers were busy at least half the time: the transforms, not the loader
        or the training step, set the pace. (Waits with idle workers are the round trip of
        cheap transforms, which more workers would not shorten.)"""
        saturation = self.saturation
        return (
            self.elapsed_s >= 1.0
            and self.wait_s > 0.2 * self.elapsed_s
            and saturation is not None
            and saturation >= 0.5
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "busy_s": self.busy_s,
            "wait_s": self.wait_s,
            "elapsed_s": self.elapsed_s,
            "saturation": self.saturation,
        }


class TransformPool:
    """``workers`` processes that read and transform samples of ``dataset``; thread-safe."""

    def __init__(
        self,
        dataset: Any,
        transform: Callable[[Any, np.random.Generator], Any] | None,
        *,
        seed: int,
        workers: int,
    ) -> None:
        self._dataset = dataset
        self._transform = transform
        self._seed = seed
        self._num_workers = workers
        # Starting workers, sending, the generation (re-entered when a send finds a dead worker).
        self._send_lock = threading.RLock()
        self._recv_lock = threading.Lock()  # one receiver at a time
        self._workers: list[_Worker] = []
        self._generation = 0
        self._tasks = itertools.count()
        self._done: dict[int, Any] = {}
        self._dropped: set[int] = set()  # tasks whose results nobody will collect
        self._sizes: dict[int, tuple[_Worker, int]] = {}  # task -> (worker, samples)
        self._finalizer: weakref.finalize | None = None
        self._closing = False
        #: Wall seconds callers waited in :meth:`collect` (time the transforms were not ahead).
        self.wait_seconds = 0.0
        #: Seconds the workers spent reading and transforming the results collected.
        self.busy_seconds = 0.0
        #: The loader's tracer: one span per chunk, on one track per worker.
        self.tracer: Any = None
        #: Per thread: ``(busy, wait)`` seconds of the last :meth:`collect` on that thread.
        self.last = threading.local()

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first read and after close)."""
        return [w.process.pid for w in list(self._workers)]

    # -- submitting ----------------------------------------------------------------------

    def submit(self, indices: Sequence[int], epoch: int, step: int = -1) -> Ticket:
        """Send the work for ``indices`` to the workers (least loaded first); no waiting."""
        wanted = [int(i) for i in indices]
        return self._send(wanted, epoch, step, list, "dataset indices")

    def submit_samples(self, samples: Sequence[Any], epoch: int, step: int) -> Ticket:
        """Send a stream's raw ``samples`` of step ``step`` (pickled through the pipe) to be
        transformed with the random state of ``(seed, epoch, step, slot)``; no waiting."""
        items = list(samples)

        def work(part: tuple[int, ...]) -> Any:
            return ("samples", step, part[0], items[part[0] : part[-1] + 1])

        label = f"the stream's samples of epoch {epoch}, step {step}, slots"
        return self._send(list(range(len(items))), epoch, step, work, label)

    def _send(
        self,
        wanted: list[int],
        epoch: int,
        step: int,
        work: Callable[[tuple[int, ...]], Any],
        label: str,
    ) -> Ticket:
        with self._send_lock:
            self._closing = False
            workers = self._start()
            generation = self._generation
            parts = []
            for chunk in np.array_split(np.asarray(wanted), min(len(workers), len(wanted)) or 1):
                if not chunk.size:
                    continue
                worker = min(workers, key=lambda w: w.load)
                task = next(self._tasks)
                part = tuple(int(i) for i in chunk)
                try:
                    worker.conn.send((task, epoch, work(part)))
                except (OSError, EOFError):
                    what = f"{label} [{_shown(part)}]"
                    raise self._lost(worker, what, "could not be sent work", generation) from None
                worker.load += len(part)
                self._sizes[task] = (worker, len(part))
                parts.append((worker, task, part))
            return Ticket(generation, tuple(parts), step, label)

    def _start(self) -> list[_Worker]:
        if self._workers:
            return self._workers
        context = start_context()
        started: list[_Worker] = []
        try:
            for _ in range(self._num_workers):
                parent_end, child_end = context.Pipe(duplex=True)
                process = context.Process(
                    target=worker_main,
                    args=(child_end, self._dataset, self._transform, self._seed, os.getpid()),
                    name="evenflow-transform",
                    daemon=True,
                )
                process.start()
                child_end.close()
                started.append(_Worker(process, parent_end, len(started)))
        except BaseException as exc:
            stop_workers(started, 1.0)
            exc.add_note(
                f"{NOTE_PREFIX}starting the transform worker processes failed: the dataset and "
                "the transform must be picklable (a module-level function)."
            )
            raise
        self._workers = started
        self._finalizer = weakref.finalize(self, stop_workers, started, 1.0)
        return started

    # -- collecting ----------------------------------------------------------------------

    def collect(self, ticket: Ticket, timeout: float) -> list[Any]:
        """The transformed samples of ``ticket``, in order. A transform's error is raised
        as itself (with notes); a lost worker as :class:`TransformWorkerError`."""
        started = time.monotonic()
        deadline = started + timeout
        out: list[Any] = []
        busy = 0.0
        # The source's step, named in the error of the rank that fails (its peers' error
        # names the step anyway).
        of_step = f" (source step {ticket.step})" if ticket.step >= 0 else ""
        try:
            for i, (worker, task, part) in enumerate(ticket.parts):
                try:
                    reply = self._await(
                        ticket.generation,
                        worker=worker,
                        task=task,
                        what=f"{ticket.label} [{_shown(part)}]",
                        deadline=deadline,
                        timeout=timeout,
                    )
                except TransformWorkerError as exc:
                    if of_step:
                        exc.add_note(f"{NOTE_PREFIX}while reading{of_step}.")
                    raise
                if reply[0] != "ok":
                    self.drop(Ticket(ticket.generation, ticket.parts[i + 1 :], ticket.step))
                    failure = reply[2]
                    pid = worker.process.pid
                    failure.add_note(
                        f"{NOTE_PREFIX}raised in transform worker process {pid}{of_step}."
                    )
                    failure.add_note(
                        f"Traceback in transform worker process {pid}:\n{reply[3].rstrip()}"
                    )
                    raise failure
                out.extend(unpack(reply[2]))
                busy += reply[3]
                tracer = self.tracer
                if tracer is not None:
                    tracer.add(worker.stage, ticket.step, reply[4], reply[5], samples=len(part))
        finally:
            waited = time.monotonic() - started
            self.wait_seconds += waited
            self.busy_seconds += busy
            self.last.figures = (busy, waited)
        return out

    def run(self, indices: Sequence[int], epoch: int, timeout: float) -> list[Any]:
        """Submit and collect at once."""
        if not indices:
            return []
        return self.collect(self.submit(indices, epoch), timeout)

    def drop(self, ticket: Ticket) -> None:
        """Nobody will collect ``ticket``: its results are freed when they arrive."""
        with self._recv_lock:
            if ticket.generation != self._generation:
                return
            for _, task, _ in ticket.parts:
                reply = self._done.pop(task, None)
                if reply is None:
                    self._dropped.add(task)
                elif reply[0] == "ok":
                    _free(reply)

    def _await(
        self,
        generation: int,
        *,
        worker: _Worker,
        task: int,
        what: str,
        deadline: float,
        timeout: float,
    ) -> Any:
        with self._recv_lock:
            while True:
                if generation != self._generation:
                    raise self._stale(what)
                reply = self._done.pop(task, None)
                if reply is not None:
                    return reply
                left = deadline - time.monotonic()
                try:
                    handles = [worker.conn, worker.process.sentinel]
                    ready = multiprocessing.connection.wait(handles, timeout=max(left, 0.0))
                    if not ready:
                        hung = f"did not answer within timeout={timeout:g} s (hung)"
                        raise self._lost(worker, what, hung, generation)
                    got = worker.conn.recv()
                except TransformWorkerError:
                    raise
                except (EOFError, OSError, ValueError):
                    if generation != self._generation:
                        raise self._stale(what) from None
                    raise self._lost(worker, what, "died", generation) from None
                owner, size = self._sizes.pop(got[1], (worker, 0))
                owner.load -= size
                if got[1] in self._dropped:
                    self._dropped.discard(got[1])
                    if got[0] == "ok":
                        _free(got)
                    continue
                self._done[got[1]] = got

    def _stale(self, what: str) -> TransformWorkerError:
        why = "the loader was closed" if self._closing else "another read lost a worker"
        return TransformWorkerError(
            f"The transform workers were stopped ({why}) before {what} were transformed."
        )

    def _lost(self, worker: _Worker, work: str, what: str, generation: int) -> TransformWorkerError:
        """Stop every worker (the next read starts fresh ones) and describe the loss."""
        process = worker.process
        process.join(0.1)
        code = process.exitcode
        how = ""
        if code is not None and code < 0:
            how = f" (killed by signal {-code}, e.g. by the OOM killer)"
        elif code is not None:
            how = f" (exit code {code})"
        if self._closing:
            return self._stale(work)
        self._stop(1.0, generation)
        return TransformWorkerError(
            f"Transform worker process {process.pid} {what}{how} while transforming {work}. "
            "Every worker was stopped; check the transform's memory "
            "use and run time (a transform slower than LoaderConfig.timeout counts as hung)."
        )

    # -- stopping ------------------------------------------------------------------------

    def _stop(self, timeout: float, generation: int | None = None) -> list[int]:
        with self._send_lock:
            if generation is not None and generation != self._generation:
                return []  # another thread already stopped this generation's workers
            workers, self._workers = self._workers, []
            finalizer, self._finalizer = self._finalizer, None
            self._generation += 1
        self._done.clear()
        self._dropped.clear()
        self._sizes.clear()
        if finalizer is not None:
            finalizer.detach()
        return stop_workers(workers, timeout)

    def close(self, timeout: float = 5.0) -> list[int]:
        """Stop and reap every worker within about ``timeout`` seconds (SIGTERM, then
        SIGKILL); returns their pids. Reads waiting on them fail; the next submit starts
        fresh workers."""
        self._closing = True
        return self._stop(timeout)


def _free(reply: Any) -> None:
    """Map and drop a result nobody collects, so its shared-memory segment is unlinked."""
    with contextlib.suppress(Exception):
        unpack(reply[2])


def _shown(part: Sequence[int]) -> str:
    return ", ".join(map(str, part[:16])) + (", ..." if len(part) > 16 else "")
