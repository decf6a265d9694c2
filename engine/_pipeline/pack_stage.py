"""The pack stage: this rank's planned bins, packed, collated and staged, then settled.

Three things happen to a step here, in order:

1. **loss accounting** (:func:`~evenflow.engine._pipeline.loss_tokens.planned_loss_count`):
   the loss targets of this rank's planned batch, from the samples' metadata, attached as a
   :class:`~evenflow.engine._pipeline.records.LossCount` (with the default pack, counted from
   the packed labels when the metadata holds no count);
2. **device-slot scheduling** (:class:`~evenflow.engine._pipeline.h2d_stage.DeviceSlots`):
   whether the batch goes to the device now or waits on the host, pinned;
3. **the pack** (on the CPU executor): each bin's samples (read here, or received in the
   exchange) through ``pack_fn``, each packed bin held to the metadata it was planned from
   (:mod:`~evenflow.engine._pipeline.pack_check`), the bins through ``collate_fn``, and the
   batch staged (or pinned).

Needs from the step: ``routes``, ``plan``, ``messages`` (or its window's), its samples and
``received``. Adds ``host_batch`` and ``staged``. A failure is recorded on the step with the
part that failed (``pack``, ``collate`` or ``h2d``) and announced in the next metadata round;
nothing is raised. Then the step's payloads are released and it *settles* (its turn in the
collective order), which hands it to the gather stage for the next round's reports. A step
delivered before a restore only settles; the step that ended a pass inside a balance window
runs the window's final round here, after the window's last settle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from evenflow.engine._model import SampleKey
from evenflow.engine._pipeline.gather import GatherStage
from evenflow.engine._pipeline.h2d_stage import DeviceSlots
from evenflow.engine._pipeline.loss_tokens import planned_loss_count
from evenflow.engine._pipeline.pack import count_loss_tokens, default_pack_fn
from evenflow.engine._pipeline.pack_check import (
    Declared,
    check_packed,
    explain_pack_error,
    name_samples,
)
from evenflow.engine._pipeline.records import LossCount
from evenflow.engine._pipeline.sequencer import Sequencer
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import PlanningError

__all__ = ["PackStage"]


class PackStage:
    """Packs and settles each step in step order (see the module)."""

    def __init__(
        self,
        *,
        sequencer: Sequencer,
        gather: GatherStage,
        device_slots: DeviceSlots,
        stager: Any,
        pack_fn: Callable[[list[Any], int], Any],
        collate_fn: Callable[[list[Any]], Any],
        seq_len: int,
        oversized_policy: str,
        shared: bool,
        rank: int,
        global_ranks: tuple[int, ...],
        cpu_executor: concurrent.futures.Executor,
    ) -> None:
        self._sequencer = sequencer
        self._gather = gather
        self._device_slots = device_slots
        self._stager = stager
        self._pack_fn = pack_fn
        self._collate_fn = collate_fn
        self._seq_len = seq_len
        self._oversized_single = oversized_policy == "single"
        self._shared = shared  # shared-dataset mode: every sample of a bin was read here
        self._rank = rank
        self._global_ranks = global_ranks
        self._cpu = cpu_executor

    async def run(self, state: StepState) -> None:
        if state.terminal:
            if state.edge is not None and state.edge.final_round:
                await self._gather.final_round(state)
            return
        if state.skip:
            state.release_payloads()
            await self._sequencer.turn(state.step, "settle")
            await self._sequencer.advance(state.step, "settle")
            return
        messages, plan = state.messages, state.plan
        if messages is not None and plan is not None:
            # From the samples' metadata; the default pack counts its bins below otherwise.
            # A window's plan names samples of any of its steps: each read step's messages.
            by_step = state.window.messages if state.window is not None else {state.step: messages}
            state.loss = planned_loss_count(by_step, plan, self._rank)
        if state.error is None and state.remote is None and state.routes is not None:
            stage_now = await self._device_slots.schedule(state)
            loop = asyncio.get_running_loop()
            try:
                state.host_batch, state.staged = await loop.run_in_executor(
                    self._cpu, self._pack_sync, state, stage_now
                )
            except Exception as exc:
                state.fail("pack", exc)  # unless a part of it (collate, h2d) said so first
                self._device_slots.unschedule(state)
        if state.window is not None and state.routes is not None:
            state.window.forget(state.routes.bins, self._rank)
        state.release_payloads()
        await self._sequencer.turn(state.step, "settle")
        self._gather.settled(state)
        await self._sequencer.advance(state.step, "settle")

    def _pack_sync(self, state: StepState, stage_now: bool) -> tuple[Any, Any]:
        routes = state.routes
        assert routes is not None
        local, received, rank = state.local_samples(), state.received, self._rank
        by_step = state.step_messages()
        declared = Declared(by_step)
        default_pack = self._pack_fn is default_pack_fn
        # Every bin's declared columns in one lookup: this rank's slots, in pack order.
        plan = state.plan
        assert plan is not None
        start, end = plan.layout.rank_slots(rank)
        all_tokens, all_loss = declared.columns(plan.layout.key_fields[start:end])
        at = 0
        packed = []
        for b, keys in enumerate(routes.bins):
            samples = []
            for key in keys:
                if key[0] == rank and not self._shared:
                    samples.append(local[key[1]][key[2]])
                else:
                    try:
                        samples.append(received[key])
                    except KeyError:
                        raise PlanningError(
                            f"Rank {rank} did not receive sample {SampleKey(*key)} planned for "
                            f"it at step {state.step}; the exchange lost data."
                        ) from None
            where = f"Bin {b} of step {state.step} on rank {self._global_ranks[rank]}"
            try:
                bin_packed = self._pack_fn(samples, self._seq_len)
            except Exception as exc:
                # A length other than the declared one is why a planned bin does not fit.
                better = (
                    explain_pack_error(samples, keys, declared, where=where)
                    if default_pack
                    else None
                )
                if better is not None:
                    raise better from exc
                name_samples(exc, by_step, keys, where)
                raise
            columns = (
                all_tokens[at : at + len(keys)],
                None if all_loss is None else all_loss[at : at + len(keys)],
            )
            at += len(keys)
            check_packed(
                bin_packed,
                keys,
                declared,
                columns,
                seq_len=self._seq_len,
                oversized_single=self._oversized_single,
                default_pack=default_pack,
                where=where,
            )
            packed.append(bin_packed)
        if state.loss is None and default_pack:
            # Samples read after planning (shared-dataset mode) carry no count in the
            # metadata: the packed labels say exactly what the rank trains on.
            state.loss = LossCount(sum(map(count_loss_tokens, packed)))
        with state.failing("collate"):
            batch = self._collate_fn(packed)
        with state.failing("h2d"):
            # Waiting for a device slot: the batch waits on the host, pinned.
            staged = self._stager.stage(batch) if stage_now else self._stager.pin(batch)
        return batch, staged
