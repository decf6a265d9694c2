"""Caller-synchronized launches for transports that must launch on the training thread.

NCCL/HCCL collectives share the device with the model. Launched from a background thread at an
arbitrary moment they can interleave with the model's own collectives and deadlock, so such a
transport (``launch_on_caller = True``) hands each launch to a :class:`CallerLauncher` instead of
running it. The launch waits in a queue until the training thread reaches a *launch point*
(``next()``, ``prefetch_plan()``, ``prefetch()``); the launch point runs the queued launches in
the order they were queued — which the sequencer makes canonical — until its goal is reached
(e.g. "the next step's exchange is in flight"). Only launching happens on the caller's thread;
waiting, decoding and packing continue elsewhere.

Two pumping modes share one queue:

* async iteration: the caller's thread *is* the event loop's thread; :meth:`pump` runs queued
  launches inline between awaits;
* sync iteration: the event loop runs in a background thread; :meth:`pump_blocking` runs on the
  caller's thread, blocking on a thread-safe queue until the goal future completes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["CallerLauncher"]

T = TypeVar("T")


@dataclass
class _Launch:
    fn: Callable[[], Any]
    op: str
    final: bool
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop = field(repr=False)
    on_final: Callable[[str], None] | None = field(default=None, repr=False)

    def run(self) -> None:
        """Run the launch on the current thread and hand its result to the waiting stage."""
        if self.future.done():  # the stage stopped waiting (its pass was closed): never launch
            return
        try:
            result = self.fn()
        except BaseException as exc:
            self.loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            self.loop.call_soon_threadsafe(_settle, self.future, result, None)
            if self.final and self.on_final is not None:
                self.loop.call_soon_threadsafe(self.on_final, self.op)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


_WAKE = object()


class CallerLauncher:
    """A :class:`~evenflow.transports.Launcher` that defers launches to launch points."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.num_launched = 0
        #: Called on the event loop with the operation name after each final launch.
        self.on_final: Callable[[str], None] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._changed = asyncio.Event()

    async def launch(self, fn: Callable[[], T], *, op: str, final: bool) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put(_Launch(fn, op, final, future, loop, self.on_final))
        self.notify()
        return await future

    def notify(self) -> None:
        """Wake a pumping launch point (called when a launch is queued or a goal changes)."""
        if self._changed is not None:
            self._changed.set()
        self._queue.put(_WAKE)

    def clear(self) -> None:
        """Drop queued launches (their pass was closed); they will never run."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _WAKE:
                item.loop.call_soon_threadsafe(item.future.cancel)

    def _run_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _WAKE:
                self.num_launched += 1
                item.run()

    async def pump(self, goal: Awaitable[T]) -> T:
        """Run queued launches inline until ``goal`` completes (async iteration)."""
        assert self._changed is not None, "CallerLauncher.bind() was not called"
        task = asyncio.ensure_future(goal)
        task.add_done_callback(lambda _: self.notify())
        try:
            while True:
                self._run_queued()
                if task.done():
                    return task.result()
                self._changed.clear()
                self._run_queued()
                if task.done():
                    return task.result()
                await self._changed.wait()
        finally:
            if not task.done():
                task.cancel()

    def pump_blocking(self, goal: concurrent.futures.Future[T], timeout: float) -> T:
        """Run queued launches on this (caller) thread until ``goal`` completes (sync mode)."""
        goal.add_done_callback(lambda _: self._queue.put(_WAKE))
        while not goal.done():
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                continue
            if item is not _WAKE:
                self.num_launched += 1
                item.run()
        return goal.result()
