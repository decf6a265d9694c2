"""Worker threads that never hold a process hostage: bounded shutdown, and no ``BaseException``
from the work can escape into the code that waits for it.

``concurrent.futures.ThreadPoolExecutor`` has two properties a data loader cannot live with:

* its threads are joined at interpreter exit (``threading._register_atexit``), and its
  ``shutdown(wait=True)`` joins them without a deadline, so one user ``read()`` stuck on a
  network filesystem keeps ``close()`` — and the process — from ever finishing;
* a ``KeyboardInterrupt``, ``SystemExit`` or ``asyncio.CancelledError`` raised by the work is
  set on the future as it is, and re-raised inside the event loop that awaits the future,
  where asyncio lets the first two stop the loop (its thread dies, every waiter hangs) and
  the third look like the cancellation of the waiting task.

:class:`WorkerThreads` runs work on daemon threads that nothing joins at exit, shuts down
within a deadline (a thread still inside its work then is *abandoned*: it finishes, or not,
on its own, and :meth:`WorkerThreads.shutdown` says which), and hands such exceptions to the
future wrapped in :class:`ThreadInterrupt`, an ordinary ``Exception`` that carries the
original. Whoever raises errors to the user unwraps it (:func:`unwrap`), so the user sees the
``KeyboardInterrupt`` they raised, on their own thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadInterrupt", "WorkerThreads", "unwrap"]

logger = logging.getLogger("evenflow")


class ThreadInterrupt(Exception):
    """A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``,
    a ``CancelledError`` that user code raised), carried through the pipeline as an ordinary
    exception; ``original`` is the exception itself."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}".rstrip(": "))
        self.original = original

    @property
    def type_name(self) -> str:
        """The carried exception's class name (what peers are told failed)."""
        return type(self.original).__name__


def carry(exc: BaseException) -> Exception:
    """``exc`` itself when it is an ordinary exception, else a :class:`ThreadInterrupt`."""
    return exc if isinstance(exc, Exception) else ThreadInterrupt(exc)


def unwrap(exc: BaseException) -> BaseException:
    """The exception a user should see for ``exc``: a carried one is raised as itself."""
    return exc.original if isinstance(exc, ThreadInterrupt) else exc


class _Item:
    __slots__ = ("args", "fn", "future", "kwargs")

    def __init__(
        self,
        future: concurrent.futures.Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.future, self.fn, self.args, self.kwargs = future, fn, args, kwargs


_counter = itertools.count()


class WorkerThreads(concurrent.futures.Executor):
    """Up to ``max_workers`` daemon threads named ``{name}-{i}``, started on demand.

    ``initializer`` runs once in each thread before its first item (e.g. to lower its
    priority). Work items run in submission order per thread; a raised ``BaseException``
    reaches the future as :func:`carry` makes it. :meth:`shutdown` bounds its wait by
    ``deadline`` seconds.
    """

    def __init__(
        self,
        max_workers: int,
        *,
        name: str,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, but got {max_workers!r}.")
        self._max_workers = max_workers
        self._name = name
        self._initializer = initializer
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._busy: dict[int, str] = {}  # thread ident -> what it runs now
        self._shutdown = False
        self._serial = next(_counter)

    # -- Executor -------------------------------------------------------------------------

    def submit(  # type: ignore[override]
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"cannot submit work to {self._name}: it is shut down")
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._queue.put(_Item(future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work,
                    name=f"{self._name}-{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
            return future

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, deadline: float | None = None
    ) -> None:
        """Stop taking work; ``wait``: join the threads, for at most ``deadline`` seconds
        (``None``: no bound). Threads still running then are abandoned and logged."""
        self.stop(cancel_futures=cancel_futures)
        if wait:
            self.join(deadline)

    # -- bounded shutdown ---------------------------------------------------------------------

    def stop(self, *, cancel_futures: bool = True) -> None:
        """Take no more work; cancel what has not started (``cancel_futures``)."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item.future.cancel()
            for _ in self._threads:
                self._queue.put(None)

    def join(self, deadline: float | None) -> list[str]:
        """Wait up to ``deadline`` seconds for every thread; return what each thread still
        running is doing (it is abandoned: a daemon thread, never joined again)."""
        until = None if deadline is None else time.monotonic() + max(deadline, 0.0)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            remaining = None if until is None else max(until - time.monotonic(), 0.0)
            thread.join(remaining)
        stuck = [
            f"{t.name} in {self._busy.get(t.ident or -1, 'its work')}"
            for t in threads
            if t.is_alive()
        ]
        if stuck:
            logger.warning(
                "evenflow: %d thread(s) did not finish within %.3g s and were abandoned: %s. "
                "They are daemon threads and do not keep the process alive.",
                len(stuck),
                deadline if deadline is not None else float("inf"),
                "; ".join(stuck),
            )
        return stuck

    @property
    def num_threads(self) -> int:
        """Threads started (alive or finished)."""
        return len(self._threads)

    def alive_threads(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    # -- the worker ---------------------------------------------------------------------------

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                logger.warning("evenflow: a worker thread initializer failed", exc_info=True)
        me = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if not item.future.set_running_or_notify_cancel():
                self._idle.release()
                continue
            self._busy[me] = _describe(item.fn)
            try:
                result = item.fn(*item.args, **item.kwargs)
            except BaseException as exc:
                item.future.set_exception(carry(exc))
            else:
                item.future.set_result(result)
            finally:
                self._busy.pop(me, None)
                del item
            self._idle.release()


def _describe(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)
