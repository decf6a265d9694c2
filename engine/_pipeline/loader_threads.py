"""The threads a loader starts, and their bounded shutdown.

Every thread runs at the configured lower priority (none by default): the pipeline works ahead
of training and can wait for a core; compute cannot. They are daemon threads with a bounded
shutdown (:class:`~evenflow.transports.internal.WorkerThreads`): user code runs on them, and a
call stuck there must never keep ``close()`` or the process from finishing. The transport's
collective thread is the transport's own.
"""

from __future__ import annotations

import time
from typing import Any

from evenflow.engine._pipeline.loop_thread import nice_initializer
from evenflow.transports.internal import WorkerThreads

__all__ = ["LoaderThreads"]


class LoaderThreads:
    """``cpu``: planning, packing and device copies (two threads); ``source``: the source's
    ``next()`` (one thread, so a sync iterator is only ever advanced from one); ``read``:
    shared-dataset mode's reads of assigned samples (``read_threads`` threads, else ``None``).
    """

    def __init__(self, *, niceness: int | None, read_threads: int | None) -> None:
        nice = nice_initializer(niceness)
        self.cpu = WorkerThreads(2, name="evenflow-cpu", initializer=nice)
        self.source = WorkerThreads(1, name="evenflow-source", initializer=nice)
        self.read = (
            None
            if read_threads is None
            else WorkerThreads(read_threads, name="evenflow-read", initializer=nice)
        )

    def shutdown(self, close_timeout: float, source: Any) -> list[str]:
        """Stop the threads and wait for them together, at most ``close_timeout`` seconds: a
        thread still inside user code then (a source's ``next()`` blocked on storage cannot be
        interrupted) is abandoned, and named in a WARNING; it is a daemon thread and never
        holds the process. Returns what was abandoned. ``source``'s transform workers, if it
        has any, are closed around the wait."""
        pools = [p for p in (self.cpu, self.source, self.read) if p]
        for pool in pools:
            pool.stop(cancel_futures=True)
        until = time.monotonic() + close_timeout
        close_workers = getattr(source, "close_workers", None)
        if callable(close_workers):
            # Before the join: a read waiting on a worker returns once the workers are gone.
            close_workers(close_timeout)
        stuck: list[str] = []
        for pool in pools:
            stuck += pool.join(max(until - time.monotonic(), 0.0))
        if callable(close_workers):  # and after: a read between two steps may have restarted them
            close_workers(1.0)
        return stuck
