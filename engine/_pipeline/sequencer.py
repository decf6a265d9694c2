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

A balance window of ``W > 1`` steps (:class:`WindowSequencer`) reorders the same phases: every
step of the window is gathered first, then the window's plan is broadcast once (under the
window's first step), then each step is exchanged and settled in turn; the next window's first
gather follows. A pass that ends in the middle of a window adds one ``final`` round after the
window's last settle, which announces the window's outcome (see the pipeline).
"""

from __future__ import annotations

import asyncio

__all__ = ["PHASES", "Sequencer", "WindowSequencer"]

PHASES: tuple[str, ...] = ("gather", "broadcast", "exchange", "settle")
_INDEX = {name: i for i, name in enumerate(PHASES)}


class Sequencer:
    """Hands out turns in ``(step, phase)`` order, starting at ``(first_step, "gather")``."""

    def __init__(self, first_step: int = 0) -> None:
        self._step = first_step
        self._phase = "gather"
        self._changed = asyncio.Condition()
        self._failed: BaseException | None = None

    @property
    def position(self) -> tuple[int, str]:
        return self._step, self._phase

    def _key(self, step: int, phase: str) -> tuple[int, ...]:
        """The position's rank in the canonical order (smaller comes first)."""
        return (step, _INDEX[phase])

    def _next(self, step: int, phase: str) -> tuple[int, str]:
        i = _INDEX[phase] + 1
        return (step, PHASES[i]) if i < len(PHASES) else (step + 1, PHASES[0])

    async def turn(self, step: int, phase: str) -> None:
        """Wait until ``(step, phase)`` is the next position in the order."""
        target = self._key(step, phase)
        async with self._changed:
            while (self._step, self._phase) != (step, phase):
                if self._failed is not None:
                    raise self._failed
                if self._key(self._step, self._phase) > target:
                    raise RuntimeError(
                        f"Sequencer turn {(step, phase)} requested after it passed; the "
                        f"order is at {self.position}. This is a bug in a stage."
                    )
                await self._changed.wait()

    async def advance(self, step: int, phase: str) -> None:
        """Mark ``(step, phase)`` done (or skipped) and hand the turn to the next position."""
        async with self._changed:
            if (self._step, self._phase) != (step, phase):
                raise RuntimeError(
                    f"Sequencer advance {(step, phase)} out of order; the order is at "
                    f"{self.position}. This is a bug in a stage."
                )
            self._step, self._phase = self._next(step, phase)
            self._changed.notify_all()

    async def fail(self, exc: BaseException) -> None:
        """Release every waiter with ``exc``: no further collective may be issued."""
        async with self._changed:
            self._failed = exc
            self._changed.notify_all()


class WindowSequencer(Sequencer):
    """The order of a pass planned in windows of ``window`` steps (aligned to multiples of
    ``window``; the window that reaches ``limit`` ends there). A pass restored after a window
    that ended early (at an earlier ``max_steps`` or the source's end) may start in the middle
    of an aligned window: its first window is then ``first_step`` to that window's end.

    Within window ``k`` (steps ``f .. l``): ``gather`` of ``f .. l``, ``broadcast`` of ``f``,
    then ``exchange`` and ``settle`` of ``f``, of ``f + 1`` ... of ``l``; then ``gather`` of
    ``l + 1``. When the round of step ``t`` in the middle of a window ends the pass,
    :meth:`end_window` shortens the window to ``f .. t - 1`` and ``final`` of ``t`` follows its
    last settle.
    """

    def __init__(self, first_step: int, window: int, limit: int | None) -> None:
        super().__init__(first_step)
        self._first = first_step
        self._window = window
        self._limit = limit
        self._end: int | None = None

    def window_first(self, step: int) -> int:
        return max(step - step % self._window, self._first)

    def window_last(self, step: int) -> int:
        """The last step of ``step``'s window as planned (before any early end)."""
        end = step - step % self._window + self._window
        if self._limit is not None:
            end = min(end, self._limit)
        return max(end - 1, step)

    def starts_window(self, step: int) -> bool:
        """Whether ``step`` is the first of a window (the round of ``max_steps`` is too)."""
        return self.window_first(step) == step or (self._limit is not None and step >= self._limit)

    def end_window(self, step: int) -> None:
        """The round of ``step`` (not its window's first) ended the pass: the window ends
        before it, and a ``final`` round of ``step`` follows the window's last settle."""
        self._end = step

    def _key(self, step: int, phase: str) -> tuple[int, ...]:
        group = {"gather": 0, "broadcast": 1, "exchange": 2, "settle": 2, "final": 3, "done": 4}[
            phase
        ]
        within = 0 if phase == "broadcast" else step
        index = step // self._window
        if self._limit is not None and step >= self._limit:
            # The round that ends a pass at max_steps follows the (shortened) last window.
            index = (self._limit - 1) // self._window + 1
        return (index, group, within, 1 if phase == "settle" else 0)

    def _next(self, step: int, phase: str) -> tuple[int, str]:
        if phase == "gather":
            if step == self._end or step == self.window_last(step):
                return self.window_first(step), "broadcast"
            return step + 1, "gather"
        if phase == "broadcast":
            return step, "exchange"
        if phase == "exchange":
            return step, "settle"
        if phase == "settle":
            last = self.window_last(step) if self._end is None else self._end - 1
            if step < last:
                return step + 1, "exchange"
            if self._end is not None:
                return self._end, "final"
            return step + 1, "gather"
        return step + self._window, "done"  # after "final": nothing follows
