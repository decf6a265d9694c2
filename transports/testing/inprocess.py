"""Running in-process groups: every rank on one event loop, or one thread and loop per rank.

:func:`run_inprocess` runs a coroutine function for every rank of an
:class:`~evenflow.transports.InProcessGroup` on the current event loop;
:func:`run_inprocess_threads` does the same with one thread and event loop per rank.
:func:`check_inprocess_conformance` runs the conformance suite on fresh in-process groups in
either arrangement.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from evenflow.transports._inprocess import InProcessGroup, InProcessTransport
from evenflow.transports.testing.conformance import check_transport

__all__ = ["check_inprocess_conformance", "run_inprocess", "run_inprocess_threads"]

T = TypeVar("T")


def _pick_result(outcomes: list[Any], failures: list[tuple[int, BaseException]]) -> list[Any]:
    """Raise the failure that happened first (usually the cause of the others)."""
    if failures:
        raise min(failures, key=lambda pair: pair[0])[1]
    return outcomes


async def run_inprocess(
    num_ranks: int,
    fn: Callable[[InProcessTransport], Awaitable[T]],
    *,
    return_exceptions: bool = False,
    **group_kwargs: Any,
) -> list[Any]:
    """Run ``fn(transport)`` for every rank of a new in-process group on the current loop.

    ``group_kwargs`` go to :class:`InProcessGroup` (``timeout``, ``delay_fn``, ...). Each
    rank's transport is closed when its ``fn`` ends, so peers of a failed rank fail fast
    instead of waiting for the timeout. Returns the results by rank; on failure raises the
    exception that occurred first, or with ``return_exceptions=True`` returns exceptions in
    place of results.
    """
    group = InProcessGroup(num_ranks, **group_kwargs)
    order = itertools.count()
    failures: list[tuple[int, BaseException]] = []

    async def member(rank: int) -> Any:
        transport = group.transport(rank)
        try:
            return await fn(transport)
        except Exception as exc:
            failures.append((next(order), exc))
            return exc
        finally:
            await transport.aclose()

    outcomes = list(await asyncio.gather(*(member(r) for r in range(num_ranks))))
    return outcomes if return_exceptions else _pick_result(outcomes, failures)


def run_inprocess_threads(
    num_ranks: int,
    fn: Callable[[InProcessTransport], Awaitable[T]],
    *,
    deadline: float = 120.0,
    return_exceptions: bool = False,
    debug: bool = False,
    **group_kwargs: Any,
) -> list[Any]:
    """Like :func:`run_inprocess`, but each rank runs in its own thread and event loop.

    Blocks the calling thread. ``debug`` runs every rank's loop in asyncio debug mode, which
    also rejects loop calls made from the wrong thread. Raises ``TimeoutError`` if the ranks
    are not all done after ``deadline`` seconds (their threads are daemons, left behind).
    """
    group = InProcessGroup(num_ranks, **group_kwargs)

    async def member(rank: int) -> Any:
        transport = group.transport(rank)
        try:
            return await fn(transport)
        finally:
            await transport.aclose()

    return _run_threads(num_ranks, member, deadline, return_exceptions, debug)


def _run_threads(
    num_ranks: int,
    body: Callable[[int], Awaitable[Any]],
    deadline: float,
    return_exceptions: bool,
    debug: bool,
) -> list[Any]:
    """``body(rank)`` on one new thread and event loop per rank; the results by rank."""
    outcomes: list[Any] = [None] * num_ranks
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    order = itertools.count()

    async def main(rank: int) -> Any:
        return await body(rank)

    def run(rank: int) -> None:
        try:
            outcomes[rank] = asyncio.run(main(rank), debug=debug)
        except Exception as exc:
            with lock:
                failures.append((next(order), exc))
            outcomes[rank] = exc

    threads = [
        threading.Thread(target=run, args=(r,), name=f"evenflow-inprocess-rank{r}", daemon=True)
        for r in range(num_ranks)
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        raise TimeoutError(
            f"In-process ranks {stuck} were still running after the deadline of {deadline:g} s."
        )
    return outcomes if return_exceptions else _pick_result(outcomes, failures)


class _GroupSeries:
    """Fresh in-process groups for ranks that run the suite in threads of their own: the
    *k*-th call of rank *r*'s maker gives member *r* of the *k*-th group."""

    def __init__(self, num_ranks: int, timeout: float) -> None:
        self._num_ranks = num_ranks
        self._timeout = timeout
        self._groups: list[InProcessGroup] = []
        self._lock = threading.Lock()

    def maker(self, rank: int) -> Callable[[], InProcessTransport]:
        calls = itertools.count()

        def make() -> InProcessTransport:
            index = next(calls)
            with self._lock:
                while len(self._groups) <= index:
                    self._groups.append(InProcessGroup(self._num_ranks, timeout=self._timeout))
                group = self._groups[index]
            return group.transport(rank)

        return make


def check_inprocess_conformance(
    num_ranks: int,
    *,
    threads: bool = False,
    large_bytes: int = 1 << 20,
    check_timeout: bool = False,
    timeout: float = 30.0,
    debug: bool = False,
) -> None:
    """Run :func:`check_transport` on fresh in-process groups of ``num_ranks`` ranks.

    With ``threads=True`` every rank gets its own thread and event loop (and calls the suite
    itself, with a maker of its member of each fresh group); otherwise one call on a new
    event loop drives every member of each group. ``debug`` runs the loops in asyncio debug
    mode (slow for many ranks). Blocks until done; raises the first rank's failures.
    """
    if threads:
        series = _GroupSeries(num_ranks, timeout)

        async def rank_suite(rank: int) -> None:
            await check_transport(
                series.maker(rank), large_bytes=large_bytes, check_timeout=check_timeout
            )

        _run_threads(num_ranks, rank_suite, 120.0, False, debug)
        return

    def make_group() -> list[InProcessTransport]:
        group = InProcessGroup(num_ranks, timeout=timeout)
        return [group.transport(rank) for rank in range(num_ranks)]

    suite = check_transport(make_group, large_bytes=large_bytes, check_timeout=check_timeout)
    asyncio.run(suite, debug=debug)
