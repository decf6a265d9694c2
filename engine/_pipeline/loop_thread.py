"""Running coroutines from synchronous code: a loader's own loop thread, and a one-off runner;
and the scheduling priority of the threads a loader starts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = [
    "LoopThread",
    "SwitchIntervalScope",
    "lowered_niceness",
    "nice_initializer",
    "renice_current_thread",
    "run_coroutine",
]

_log = logging.getLogger("evenflow")

T = TypeVar("T")


def lowered_niceness(increment: int) -> int | None:
    """The niceness ``increment`` steps below the calling thread's priority (at most 19), or
    None when there is nothing to do: 0, off Linux (niceness is per thread only there), or
    when the OS does not say."""
    if not increment or not sys.platform.startswith("linux"):
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + increment)
    except OSError:
        return None


def renice_current_thread(niceness: int | None) -> None:
    """Lower the calling thread's priority to ``niceness`` (None: leave it).

    Absolute, not an increment: Linux threads inherit their creator's niceness, so a pool
    started from an already lowered thread must not be lowered twice. Never raises the
    priority, and a refusal by the OS is logged at DEBUG: a lower priority is a preference,
    never a reason to fail.
    """
    if niceness is None:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError as exc:
        _log.debug("evenflow: could not lower the priority of thread %d: %s", tid, exc)


def nice_initializer(niceness: int | None) -> Callable[[], None] | None:
    """A ``ThreadPoolExecutor`` initializer that lowers each worker's priority, or None."""
    return None if niceness is None else functools.partial(renice_current_thread, niceness)


class SwitchIntervalScope:
    """``sys.setswitchinterval`` lowered while at least one loader holds it, then restored.

    The interval is process-wide, so the scope is too: the first holder saves the process's
    value, each holder may lower it further (never raise it), and when the last one releases,
    the saved value comes back — unless the interval is no longer one a holder set (the
    application changed it meanwhile: its choice wins).
    """

    _lock = threading.Lock()
    _holders = 0
    _saved: float | None = None
    _set: float | None = None

    @classmethod
    def acquire(cls, interval: float) -> None:
        with cls._lock:
            current = sys.getswitchinterval()
            if cls._holders == 0:
                cls._saved, cls._set = current, None
            cls._holders += 1
            if current > interval:
                sys.setswitchinterval(interval)
                cls._set = sys.getswitchinterval()

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders:
                return
            saved, ours = cls._saved, cls._set
            cls._saved = cls._set = None
            if saved is not None and ours is not None and sys.getswitchinterval() == ours:
                sys.setswitchinterval(saved)


class LoopThread:
    """An event loop in a background thread, for sync iteration.

    A sync-iterated loader runs its pipeline here for its whole life, so the pipeline's tasks,
    futures and executors stay bound to one loop however the caller's thread blocks.
    ``niceness``: the thread's lowered priority (``LoaderConfig.thread_nice``), None to leave it.
    """

    def __init__(self, niceness: int | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._niceness = niceness
        self._thread = threading.Thread(target=self._main, name="evenflow-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        renice_current_thread(self._niceness)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        """Cancel what still runs on the loop, then stop and join the thread. Idempotent."""
        if self.loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        self.call(_drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code (in a helper thread if this thread
    already runs an event loop, e.g. the sync API called from async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evenflow-close") as pool:
        return pool.submit(asyncio.run, coro).result()
