"""The read stage: one step after another from the rank's source, ahead of the caller.

Needs: a :class:`~evenflow.engine._pipeline.source.SourceReader` (the reading itself: the
source's ``next()``, ``metadata_fn``, the wire preparation; a source's transform, in process
or in worker processes, runs inside that read) and the read-ahead slots (a semaphore of
``prefetch_depth + balance_window``: one is taken per step read and returned by its delivery).

Adds to each step: what :meth:`SourceReader.read` adds (samples, sizes, metadata, frames,
source state, the source's transform work, or the read's error as ``status="error"``),
and ``resume_source``: the source state a checkpoint taken after the step records, which is
the state at the start of the step's balance window unless the step ends its window.

Sends a last step of ``status="end"`` when ``max_steps`` is reached (``end_reason="limit"``),
when :meth:`ReadStage.stop` (the pipeline's ``drain()``) stops it (``"restart"``; a read still
blocked in the source is abandoned), or after the step at which the source ended or failed.
Raises nothing of its own: a read's failure is recorded on its step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from anyio.streams.memory import MemoryObjectSendStream

from evenflow.engine._pipeline.source import SourceReader
from evenflow.engine._pipeline.step import StepState

__all__ = ["ReadStage"]


class ReadStage:
    """Reads steps ``read_from, read_from + 1, ...`` into a channel (see the module)."""

    def __init__(
        self,
        *,
        reader: SourceReader,
        slots: asyncio.Semaphore,
        tracer: Any,
        read_from: int,
        window: int,
        max_steps: int | None,
        initial_source_state: Any,
    ) -> None:
        self._reader = reader
        self._slots = slots
        self._tracer = tracer
        self._read_from = read_from
        self._window = window
        self._max_steps = max_steps
        self._initial_source_state = initial_source_state
        self._stopped = False  # set by stop(): end the pass at the next read
        self._stop_event = asyncio.Event()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped

    def stop(self) -> None:
        """End the pass at the next read (a read under way is abandoned)."""
        self._stopped = True
        self._stop_event.set()

    async def run(self, send: MemoryObjectSendStream[StepState]) -> None:
        async with send:
            step = self._read_from
            window = self._window
            # The source's position before the step being read, and at its window's start.
            before = window_start = self._initial_source_state
            if window > 1 and step == 0:
                # A checkpoint inside the first window restores the source to its start.
                before = await self._reader.position()
            while True:
                limit = self._max_steps
                if not self._stopped and limit is not None and step >= limit:
                    await send.send(StepState(step, status="end", end_reason="limit"))
                    return
                acquired = await self._unless_stopped(self._slots.acquire())
                state: StepState | None = None
                if acquired is not None:
                    with self._tracer.span("read", step):
                        state = await self._unless_stopped(self._reader.read(step))
                if state is None:
                    # drain(): announce the end of the pass; a read still blocked in the
                    # source is abandoned (its result is discarded when it returns).
                    await send.send(StepState(step, status="end", end_reason="restart"))
                    return
                if step % window == 0:
                    window_start = before
                before = state.source_state
                # A checkpoint after this step restores the source at the window's start and
                # skips what was delivered, unless the step ends its window.
                state.resume_source = (
                    state.source_state if (step + 1) % window == 0 else window_start
                )
                await send.send(state)
                if state.status != "ok":
                    return
                step += 1

    async def _unless_stopped(self, work: Any) -> Any:
        """Await ``work`` unless :meth:`stop` is called first (then ``None``)."""
        if self._stopped:
            work.close()
            return None
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():  # stopped, or this stage itself was cancelled
                task.cancel()
        if task.done() and not task.cancelled():
            result = task.result()
            return True if result is None or result is True else result
        return None
