"""Running coroutines from synchronous code: a loader's own loop thread, and a one-off runner."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "run_coroutine"]

T = TypeVar("T")


class LoopThread:
    """An event loop in a background thread, for sync iteration.

    A sync-iterated loader runs its pipeline here for its whole life, so the pipeline's tasks,
    futures and executors stay bound to one loop however the caller's thread blocks.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="evenflow-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
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
