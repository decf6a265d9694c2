"""The plan stage: from a step's gathered metadata messages to its plan, statistics and routes.

In ``replicated`` planning every rank plans the step itself (plans are pure functions of the
gathered step, so every rank holds the same one; the next metadata round compares digests). In
``leader`` planning rank 0 plans and broadcasts the plan (or its planning error), and the other
ranks decode it. Planning runs on the CPU executor, never on the event loop. The broadcast
turn is taken in both modes, so the collective order does not depend on the mode's data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any

from evenflow.engine._pipeline.routes import RankRoutes
from evenflow.engine._pipeline.sequencer import Sequencer
from evenflow.engine._pipeline.stats import StepStats
from evenflow.engine._pipeline.step import (
    StepState,
    error_info,
    plan_step,
    remote_error,
    with_routes,
)
from evenflow.engine._plan import Plan, plan_from_wire, plan_to_wire
from evenflow.transports import Transport

__all__ = ["PlanStage"]

_Planned = tuple[Plan, StepStats, RankRoutes]


class PlanStage:
    """Plans one step per call of :meth:`run`, in step order."""

    def __init__(
        self,
        *,
        planner: Any,
        transport: Transport,
        sequencer: Sequencer,
        leader: bool,
        budget_names: tuple[str, ...],
        cpu_executor: concurrent.futures.Executor,
        on_group_failure: Callable[[StepState, BaseException, str], Awaitable[None]],
        on_local_failure: Callable[[StepState, BaseException], Awaitable[None]],
    ) -> None:
        self._planner = planner
        self._transport = transport
        self._sequencer = sequencer
        self._leader = leader
        self._budget_names = budget_names
        self._cpu = cpu_executor
        self._rank = transport.rank
        self._global_ranks = transport.global_ranks
        # A failed broadcast means the group is unusable (the pipeline releases everything);
        # a failed local plan in replicated mode must abort this rank (see the pipeline).
        self._on_group_failure = on_group_failure
        self._on_local_failure = on_local_failure

    async def run(self, state: StepState) -> None:
        if state.terminal:
            return
        messages = state.messages
        if messages is not None and (not self._leader or self._rank == 0):
            loop = asyncio.get_running_loop()
            try:
                state.plan, state.stats, state.routes = await loop.run_in_executor(
                    self._cpu, self._plan_sync, state.step, messages
                )
            except Exception as exc:
                state.fail("plan", exc)
                if not self._leader and self._transport.num_ranks > 1:
                    await self._on_local_failure(state, exc)
                    return
        await self._sequencer.turn(state.step, "broadcast")
        if self._leader:
            await self._broadcast_plan(state)
        await self._sequencer.advance(state.step, "broadcast")

    def _plan_sync(self, step: int, messages: list[dict[str, Any]]) -> _Planned:
        return plan_step(
            self._planner,
            messages,
            step,
            budget_names=self._budget_names,
            rank=self._rank,
            group_ranks=self._global_ranks,
        )

    async def _broadcast_plan(self, state: StepState) -> None:
        payload: dict[str, Any] | None = None
        if self._rank == 0:
            if state.error is not None:
                payload = {"error": error_info(0, state.error_stage, state.step, state.error)}
            else:
                assert state.plan is not None
                payload = {"plan": plan_to_wire(state.plan)}
        try:
            received = await self._transport.broadcast(payload, src=0)
        except BaseException as exc:
            await self._on_group_failure(state, exc, "plan")
            return
        if self._rank == 0:
            return
        if received.get("error") is not None:
            state.remote = remote_error(received["error"], self._global_ranks, sender=0)
            state.error = state.remote
            state.error_stage = "plan"
            return
        loop = asyncio.get_running_loop()
        state.plan, state.stats, state.routes = await loop.run_in_executor(
            self._cpu, self._received_plan, received["plan"], state.step
        )

    def _received_plan(self, data: dict[str, Any], step: int) -> _Planned:
        return with_routes(plan_from_wire(data, step), self._rank, self._global_ranks)
