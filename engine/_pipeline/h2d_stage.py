"""Device slots and the h2d stage: at most ``device_prefetch_depth`` undelivered steps on the
device, copied there in step order.

:class:`DeviceSlots` schedules each packed step (the pack stage asks it first): while a device
slot is free and no earlier step waits for one, the step is staged on the device as part of
its pack, so that a failed copy is announced with the step; otherwise it waits on the host,
pinned. (Staging past a waiting step would take the slot that step waits for, and it is
delivered first: a deadlock.) Each step so scheduled carries a
:class:`~evenflow.engine._pipeline.records.DeviceSlot`; none does without a device.

:class:`H2DStage` copies a step that waited, once the caller's delivery of an earlier step
frees a slot. Needs from the step: ``staged`` (its pinned batch) and its ``device`` record.
Replaces ``staged`` with the device batch. The step's status was announced before this copy,
so its peers cannot learn of a failure in a metadata round: a failed copy fails the step here
(stage ``h2d``) and is reported to the pipeline (``Hooks.local_failure``), which closes the
transport so that the peers fail promptly with a peer failure. Nothing is raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from evenflow.engine._pipeline.progress import Hooks
from evenflow.engine._pipeline.records import DeviceSlot
from evenflow.engine._pipeline.step import StepState

__all__ = ["DeviceSlots", "H2DStage"]


class DeviceSlots:
    """The device-prefetch bound: ``depth`` slots, and the steps waiting on the host."""

    def __init__(self, stager: Any, depth: int) -> None:
        self._stager = stager
        self._free = asyncio.Semaphore(depth)
        self._waiting = 0  # packed steps waiting on the host for a device slot

    async def schedule(self, state: StepState) -> bool:
        """Whether the pack stages ``state`` on the device now (else it pins it); takes the
        slot when it does."""
        stage_now = not self._stager.active or (self._waiting == 0 and not self._free.locked())
        if self._stager.active:
            slot = state.device = DeviceSlot(now=stage_now)
            if stage_now:
                await self._free.acquire()
                slot.held = True
            else:
                self._waiting += 1
        return stage_now

    def unschedule(self, state: StepState) -> None:
        """The pack of ``state`` failed: give back what :meth:`schedule` took."""
        self.release(state)
        if state.device is not None and not state.device.now:
            self._waiting -= 1

    async def take(self, slot: DeviceSlot) -> None:
        """Wait for a free slot for a step that waited on the host."""
        await self._free.acquire()
        slot.held = True

    def done_waiting(self) -> None:
        """A step that waited on the host was copied, failed, or will not be copied."""
        self._waiting -= 1

    def release(self, state: StepState) -> None:
        """``state`` left the device (delivered, or failed): its slot is free."""
        if state.device is not None and state.device.held:
            state.device.held = False
            self._free.release()


class H2DStage:
    """Copies the steps that waited on the host, in step order (see the module)."""

    def __init__(
        self,
        *,
        stager: Any,
        slots: DeviceSlots,
        cpu_executor: concurrent.futures.Executor,
        hooks: Hooks,
    ) -> None:
        self._stager = stager
        self._slots = slots
        self._cpu = cpu_executor
        self._hooks = hooks

    async def run(self, state: StepState) -> None:
        slot = state.device
        if state.terminal or slot is None or slot.now:
            return  # no device, or staged by the pack
        if state.staged is None or state.error is not None:
            return
        if state.remote is not None:
            self._slots.done_waiting()
            return  # raised at delivery: nothing to copy
        await self._slots.take(slot)
        loop = asyncio.get_running_loop()
        try:
            state.staged = await loop.run_in_executor(self._cpu, self._stager.stage, state.staged)
        except Exception as exc:
            state.fail("h2d", exc)
            self._slots.release(state)
            await self._hooks.local_failure(state, exc)
        finally:
            # Only now may pack stage a later step at once: counted down before the copy, a
            # later step could take a slot freed meanwhile and be copied first (out of order).
            self._slots.done_waiting()
