"""One lifecycle for every loader: entry points written once, in sync and async form.

A loader is *unopened* until its first iteration call fixes its mode (``sync`` or ``async``),
*open* while it iterates, and *closed* after ``close()``/``aclose()``. Misuse raises one
precise :class:`~evenflow.engine.errors.LoaderStateError`: iterating a closed loader, mixing
the two modes, or calling a blocking form (``close``, ``set_epoch`` mid-pass, the
``prefetch`` hooks) on an async loader, which would block its event loop.

Each entry point is one coroutine, ``_next``/``_prefetch``/``_set_epoch``/``_close``, taking
``blocking``. The async forms await it. The sync forms run the *same* coroutine on the caller's
thread with :func:`drive`: when ``blocking`` is true, every await in it goes through a
:class:`Runner` that blocks instead of suspending, so the coroutine finishes without an event
loop. Work that belongs on the loader's event loop (the pipeline's) goes through
:meth:`Runner.loop`: awaited directly in async mode, submitted to the loader's
:class:`~evenflow.engine._pipeline.loop_thread.LoopThread` in sync mode. Everything else in
an entry point runs on the caller's thread in both modes, which is what design invariant 2
needs: device launches queued by a caller-launch transport run inside
``Runner.loop(..., pump=True)``, on the caller's thread (``CallerLauncher.pump`` between awaits,
``pump_blocking`` while the caller blocks), and batches are delivered (their streams recorded)
there too.

A loader implements four hooks and may override the two pumps::

    async def _produce(run)              # the next batch, or END when the pass is over
    async def _prefetch_until(goal, run) # goal "plan" or "exchange" (launch points)
    async def _restart(epoch, run)       # end the pass, start ``epoch`` (set_epoch)
    async def _release(run)              # close the pass, release every resource
    def _pump(coro) / _pump_blocking(future)   # run caller launches while waiting
    _pass_ended / _current_epoch()       # for the second-iteration rule below

Iterating again. ``iter()`` (a new ``for`` loop, ``list(loader)``) after a pass has ended
starts the next epoch, ``epoch + 1``, at the first ``next()``, as if ``set_epoch(epoch + 1)``
had been called: a ``DataLoader`` goes over its data again on every iteration, and a loop
that never calls ``set_epoch`` must not train one epoch and then silently nothing. So does a
new iteration over a pass an earlier loop consumed to its last step without seeing its end
(``zip(range(len(loader)), loader)``). An explicit ``set_epoch()`` before the loop chooses
the epoch instead. ``next()`` on an ended pass without a new ``iter()`` keeps raising
``StopIteration`` (the iterator protocol). A ``for`` loop left with ``break`` before the
last step has not ended its pass: the next loop continues it.

User code's ``BaseException``. What user code raises on the loader's threads reaches the
pipeline as an ordinary exception (``KeyboardInterrupt``, ``SystemExit`` and a
``CancelledError`` it raised are carried in a ``ThreadInterrupt``, so no event loop dies of
them); the step fails on every rank like any other error, and :meth:`LoaderFacade._next`
raises the original exception on the caller's thread (a ``CancelledError`` as a
``RuntimeError`` from it, since it would read as the cancellation of the caller's task).

A loader that wraps another (``DistributedLoader`` over ``BalancedLoader``) calls the inner
loader's entry-point coroutines with its own ``run.blocking``, so both iterate in one mode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

from evenflow.engine._pipeline.loop_thread import LoopThread, run_coroutine
from evenflow.engine.errors import ConfigError, LoaderStateError
from evenflow.transports.internal import ThreadInterrupt

logger = logging.getLogger("evenflow")

__all__ = ["END", "LoaderFacade", "Runner", "drive"]

T = TypeVar("T")

#: What ``_produce`` returns when the pass is over (StopIteration cannot leave a coroutine).
END: Any = object()

_GOALS = ("plan", "exchange")


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run an entry point's coroutine on this thread; it must finish without suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coro.close()
    raise AssertionError("a blocking entry point awaited outside its Runner")


class Runner:
    """How one entry point reaches its loader's event loop: blocking, or awaiting."""

    __slots__ = ("_facade", "blocking")

    def __init__(self, facade: LoaderFacade, *, blocking: bool) -> None:
        self._facade = facade
        self.blocking = blocking

    async def loop(self, coro: Coroutine[Any, Any, T], *, pump: bool = False) -> T:
        """Run ``coro`` on the loader's event loop; ``pump``: run caller launches meanwhile."""
        facade = self._facade
        if self.blocking:
            future = facade._ensure_thread().submit(coro)
            return facade._pump_blocking(future) if pump else future.result()
        thread = facade._loop_thread
        if thread is not None:  # a sync loader's pass lives on its loop thread
            return await asyncio.wrap_future(thread.submit(coro))
        return await (facade._pump(coro) if pump else coro)

    async def once(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine that needs no particular loop (e.g. closing a transport)."""
        return run_coroutine(coro) if self.blocking else await coro

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run blocking ``fn`` without blocking an event loop (inline when blocking)."""
        if self.blocking:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(None, fn)


class LoaderFacade:
    """The lifecycle and the public sync/async entry points of a loader (see the module)."""

    #: How the "closed" error tells the user to go on.
    _reopen_hint = "create a new one"

    def __init__(self) -> None:
        self._mode: str | None = None  # "sync" | "async", fixed by the first iteration call
        self._advance_epoch = False  # a new iteration began after a finished pass
        self._fresh_iteration = False  # iter() was called and no next() has run since
        self._pass_items = 0  # items this loader delivered in the current pass
        self._closed = False
        self._loop_thread: LoopThread | None = None
        #: The loop thread's lowered priority, None to leave it (subclasses set it).
        self._thread_niceness: int | None = None

    # -- hooks -------------------------------------------------------------------------------

    async def _produce(self, run: Runner) -> Any:
        raise NotImplementedError

    async def _prefetch_until(self, goal: str, run: Runner) -> None:
        return None

    async def _restart(self, epoch: int, run: Runner) -> None:
        raise NotImplementedError

    async def _release(self, run: Runner) -> None:
        return None

    @property
    def _pass_running(self) -> bool:
        return False

    @property
    def _pass_ended(self) -> bool:
        """Whether the current pass has ended (its last ``next()`` returned END)."""
        return False

    def _current_epoch(self) -> int:
        return 0

    def _pump(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        return coro

    def _pump_blocking(self, future: concurrent.futures.Future[T]) -> T:
        return future.result()

    # -- the entry points, once ------------------------------------------------------------------

    async def _next(self, blocking: bool) -> Any:
        self._enter("sync" if blocking else "async")
        run = Runner(self, blocking=blocking)
        try:
            fresh, self._fresh_iteration = self._fresh_iteration, False
            if self._advance_epoch:
                # A new iteration after the end of a pass: the next epoch (module docstring).
                self._advance_epoch = False
                await self._next_epoch(run)
            item = await self._produce(run)
            if item is END and fresh and self._pass_items > 0:
                # A new iteration over a pass an earlier loop of this loader consumed to its
                # last step without seeing its end (``zip(range(len(loader)), loader)``,
                # ``islice``): it would yield nothing. It is a new epoch, as after a seen end.
                await self._next_epoch(run)
                item = await self._produce(run)
            if item is not END:
                self._pass_items += 1
            return item
        except ThreadInterrupt as exc:
            # A KeyboardInterrupt / SystemExit raised by user code on one of the loader's
            # threads: carried as an ordinary error through the pipeline (so it failed the
            # step on every rank), raised here as itself, on the caller's thread. A
            # CancelledError user code raised would read as the cancellation of the caller's
            # own task (a TaskGroup would swallow it): it is raised as a RuntimeError.
            original = exc.original
            if isinstance(original, asyncio.CancelledError):
                raise RuntimeError(
                    "User code (a source, dataset or callback) raised CancelledError; it failed "
                    "the step on every rank. Raise an ordinary exception to stop a read."
                ) from original
            raise original from None

    async def _next_epoch(self, run: Runner) -> None:
        self._pass_items = 0
        epoch = self._current_epoch() + 1
        logger.info(
            "evenflow: a new iteration after the end of epoch %d starts epoch %d (call "
            "set_epoch() before iterating to choose the epoch).",
            epoch - 1,
            epoch,
        )
        await self._restart(epoch, run)

    async def _prefetch(self, goal: str, blocking: bool) -> None:
        assert goal in _GOALS, goal
        if not blocking:
            self._enter("async")
        elif self._mode == "async":
            raise LoaderStateError(
                "This loader is iterated asynchronously; await loader.aprefetch() / "
                "loader.aprefetch_plan() instead of the sync hooks."
            )
        await self._prefetch_until(goal, Runner(self, blocking=blocking))

    async def _set_epoch(self, epoch: object, blocking: bool) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, but got {epoch!r}.")
        self._check_open()
        if blocking and self._mode == "async" and self._pass_running:
            raise LoaderStateError(
                "set_epoch() was called while an async pass is running; await "
                "loader.aset_epoch(epoch) instead."
            )
        self._advance_epoch = False  # an explicit epoch replaces the automatic one
        self._fresh_iteration = False
        self._pass_items = 0
        await self._restart(epoch, Runner(self, blocking=blocking))

    async def _close(self, blocking: bool) -> None:
        if self._closed:
            return
        if blocking and self._mode == "async":
            raise LoaderStateError(
                "This loader is iterated asynchronously; use 'await loader.aclose()' or "
                "'async with loader:'."
            )
        self._closed = True
        run = Runner(self, blocking=blocking)
        try:
            await self._release(run)
        finally:
            thread, self._loop_thread = self._loop_thread, None
            if thread is not None:
                await run.offload(thread.stop)

    # -- public forms ------------------------------------------------------------------------

    def __iter__(self) -> Self:
        self._enter("sync")
        self._begin_iteration()
        return self

    def __next__(self) -> Any:
        item = drive(self._next(blocking=True))
        if item is END:
            raise StopIteration
        return item

    def __aiter__(self) -> Self:
        self._enter("async")
        self._begin_iteration()
        return self

    async def __anext__(self) -> Any:
        item = await self._next(blocking=False)
        if item is END:
            raise StopAsyncIteration
        return item

    def prefetch_plan(self) -> None:
        """Launch point: make sure the next step's metadata gather has been launched.

        Needed only for transports that launch on the caller's thread (NCCL/HCCL); a no-op
        otherwise. Call it on every rank at the same point of the training step, while device
        compute is pending. Repeated calls are harmless; it never advances the source.
        """
        drive(self._prefetch("plan", blocking=True))

    def prefetch(self) -> None:
        """Launch point: finish planning and launch the next step's payload exchange.

        Same rules as :meth:`prefetch_plan` (which it includes).
        """
        drive(self._prefetch("exchange", blocking=True))

    async def aprefetch_plan(self) -> None:
        """Async form of :meth:`prefetch_plan`."""
        await self._prefetch("plan", blocking=False)

    async def aprefetch(self) -> None:
        """Async form of :meth:`prefetch`."""
        await self._prefetch("exchange", blocking=False)

    def set_epoch(self, epoch: int) -> None:
        """Start a new pass at ``epoch``: forwards the epoch to the source's ``set_epoch`` if
        it has one and restarts the step count at 0.

        Called mid-pass, it ends the current pass on every rank of the group at the next
        metadata round (peers see the end of their pass there) and discards the steps in
        flight, finishing their collectives first so the group stays in step. Every rank must
        then either call ``set_epoch`` too or keep iterating to the end of its pass.
        """
        drive(self._set_epoch(epoch, blocking=True))

    async def aset_epoch(self, epoch: int) -> None:
        """Async form of :meth:`set_epoch`."""
        await self._set_epoch(epoch, blocking=False)

    def close(self) -> None:
        """Cancel in-flight work, release every resource, join every thread. Idempotent."""
        drive(self._close(blocking=True))

    async def aclose(self) -> None:
        """Async form of :meth:`close`."""
        await self._close(blocking=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- states --------------------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        """``iter()`` after a pass has ended starts the next epoch at the first ``next()``,
        as a ``DataLoader`` goes over its data again; without it a second ``for`` loop would
        silently yield nothing."""
        if self._pass_ended:
            self._advance_epoch = True
        else:
            self._fresh_iteration = True

    def _enter(self, mode: str) -> None:
        self._check_open()
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise LoaderStateError(
                f"This loader is iterated in {self._mode} mode; it cannot also be iterated in "
                f"{mode} mode. Use one loader per iteration style."
            )

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderStateError(f"This {type(self).__name__} is closed; {self._reopen_hint}.")

    def _ensure_thread(self) -> LoopThread:
        if self._loop_thread is None:
            self._loop_thread = LoopThread(self._thread_niceness)
        return self._loop_thread
