"""What the stages of one pass share: how far each has come, and where a failure goes.

:class:`Progress` is written by the stages (each step they finish moves a counter) and read by
the caller's side of the pipeline (delivery, ``prefetch_plan()``/``prefetch()``, the stall
report); every change is announced with :meth:`Progress.notify`, which wakes whoever waits in
:meth:`Progress.changed`. :class:`Hooks` is how a stage reports a failure that ends the pass
(a collective that failed, or planning that failed on this rank alone) to the pipeline, which
releases every stage and caller; :meth:`Hooks.detach` drops that way back once the pass is
closed, so that no stage keeps the pipeline (its samples, frames and transport) alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evenflow.engine._pipeline.step import StepState

__all__ = ["Hooks", "Progress"]


class Progress:
    """The pass's progress: the last step each stage finished, and how the pass ends."""

    def __init__(self, *, first_step: int, read_from: int) -> None:
        self.gathered_step = read_from - 1  # the last step whose metadata round is done
        self.exchanged_step = first_step - 1  # the last step whose exchange turn is done
        self.exchange_launched_step = first_step - 1  # ... whose exchange a caller launched
        self.exchanging = first_step - 1  # the step whose exchange is under way
        self.world_step = first_step - 1  # the last step whose world round is done
        self.gather_done = False  # no metadata round will follow
        self.ended = False  # a metadata round ended the pass
        self.fatal: BaseException | None = None  # what stopped the pipeline, if anything did
        self.final_round: StepState | None = None  # the final metadata round of a pass's end
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake :meth:`changed` waiters (progress was made)."""
        self._event.set()
        self._event = asyncio.Event()

    async def changed(self) -> None:
        """Return at the next :meth:`notify`."""
        await self._event.wait()


class Hooks:
    """A stage's way to the pipeline's failure handling (see the module docstring)."""

    def __init__(
        self,
        group_failed: Callable[[StepState, BaseException, str], Awaitable[None]],
        local_failure: Callable[[StepState, BaseException], Awaitable[None]],
    ) -> None:
        self._group_failed = group_failed
        self._local_failure = local_failure

    async def group_failed(self, state: StepState, exc: BaseException, stage: str) -> None:
        """A collective of ``stage`` failed: the group is unusable."""
        await self._group_failed(state, exc, stage)

    async def local_failure(self, state: StepState, exc: BaseException) -> None:
        """Work only this rank did failed where its peers cannot learn of it in a metadata
        round (replicated planning, a device copy after the step was announced)."""
        await self._local_failure(state, exc)

    def detach(self) -> None:
        """Forget the pipeline (the pass is closed): later reports do nothing."""
        self._group_failed = self._local_failure = _closed


async def _closed(*args: Any) -> None:
    """What a detached hook calls: nothing, the pass is closed."""
