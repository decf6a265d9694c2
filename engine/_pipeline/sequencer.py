"""The sequencer: one canonical order of collectives per balance group.

Every rank of a group must issue the same collectives in the same order. Stages run as
independent tasks whose timing differs from rank to rank (a slow source here, a long pack
there), so the order cannot be left to timing. The sequencer makes it a function of
``(step, phase)`` only: a stage that is about to issue a collective awaits its turn, and every
phase of every step is either *done* or explicitly *skipped* (on every rank alike, because the
skip decision is itself a function of data that every rank shares, e.g. the plan).

Phases of one step, in order::

    gather     metadata all-gather (always)
    broadcast  plan broadcast (leader planning only)
    exchange   payload all-to-all (only when the plan moves samples)
    settle     local barrier: the step is packed, so its status can be announced in the next
               gather (not a collective; it orders the next step's gather after this step)
"""

from __future__ import annotations

import asyncio

__all__ = ["PHASES", "Sequencer"]

PHASES: tuple[str, ...] = ("gather", "broadcast", "exchange", "settle")
_INDEX = {name: i for i, name in enumerate(PHASES)}


class Sequencer:
    """Hands out turns in ``(step, phase)`` order, starting at ``(first_step, "gather")``."""

    def __init__(self, first_step: int = 0) -> None:
        self._step = first_step
        self._phase = 0
        self._changed = asyncio.Condition()
        self._failed: BaseException | None = None

    @property
    def position(self) -> tuple[int, str]:
        return self._step, PHASES[self._phase]

    async def turn(self, step: int, phase: str) -> None:
        """Wait until ``(step, phase)`` is the next position in the order."""
        target = (step, _INDEX[phase])
        async with self._changed:
            while (self._step, self._phase) != target:
                if self._failed is not None:
                    raise self._failed
                if (self._step, self._phase) > target:
                    raise RuntimeError(
                        f"Sequencer turn {(step, phase)} requested after it passed; the "
                        f"order is at {self.position}. This is a bug in a stage."
                    )
                await self._changed.wait()

    async def advance(self, step: int, phase: str) -> None:
        """Mark ``(step, phase)`` done (or skipped) and hand the turn to the next position."""
        async with self._changed:
            if (self._step, self._phase) != (step, _INDEX[phase]):
                raise RuntimeError(
                    f"Sequencer advance {(step, phase)} out of order; the order is at "
                    f"{self.position}. This is a bug in a stage."
                )
            self._phase += 1
            if self._phase == len(PHASES):
                self._step, self._phase = self._step + 1, 0
            self._changed.notify_all()

    async def fail(self, exc: BaseException) -> None:
        """Release every waiter with ``exc``: no further collective may be issued."""
        async with self._changed:
            self._failed = exc
            self._changed.notify_all()
