"""The plan stage: from a step's gathered metadata messages to its plan, statistics and routes.

In ``replicated`` planning every rank plans the step itself (plans are pure functions of the
gathered step, so every rank holds the same one; the next metadata round compares digests). In
``leader`` planning rank 0 plans and broadcasts the plan (or its planning error), and the other
ranks decode it. Planning runs on the CPU executor, never on the event loop. The broadcast
turn is taken in both modes, so the collective order does not depend on the mode's data.

With a balance window (``LoaderConfig.balance_window > 1``) :class:`WindowPlanStage` holds the
gathered steps of a window until its last one arrives, and :meth:`PlanStage.run_window` plans
them together (:func:`evenflow.engine._planning.window.plan_window`); the leader broadcasts the
window's plans in one message.

Needs from the step: ``messages`` (every rank's metadata message). Adds ``plan``, ``stats`` and
``routes``; in a window, the window's :class:`~evenflow.engine._pipeline.records.WindowShare`,
and a :class:`~evenflow.engine._pipeline.records.PassEdge` (``skip``) on the steps delivered
before a restore. A planning failure is recorded on the step (stage ``plan``); in replicated
mode it is also reported to the pipeline (``Hooks.local_failure``, the peers cannot pair their
later collectives with this rank's), as is a failed broadcast (``Hooks.group_failed``). Nothing
is raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from evenflow.engine._pipeline.calibration import GroupCalibration
from evenflow.engine._pipeline.progress import Progress
from evenflow.engine._pipeline.records import PassEdge, WindowShare
from evenflow.engine._pipeline.routes import RankRoutes
from evenflow.engine._pipeline.sequencer import Sequencer, WindowSequencer
from evenflow.engine._pipeline.stats import StepStats
from evenflow.engine._pipeline.step import (
    StepState,
    error_info,
    peer_columns,
    plan_step,
    remote_error,
    with_routes,
)
from evenflow.engine._plan import Plan, plan_from_wire, plan_to_wire
from evenflow.engine._planning.window import plan_window
from evenflow.engine.errors import PlanningError
from evenflow.transports import Transport

__all__ = ["PlanStage", "WindowPlanStage"]

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
        calibration: GroupCalibration | None = None,
    ) -> None:
        self._planner = planner
        # Online calibration: every rank feeds each step's rows in before the step is planned
        # and notes its own bins once the plan is known (see _pipeline/calibration.py).
        self._calibration = calibration
        self._transport = transport
        self._sequencer = sequencer
        self._leader = leader
        self._budget_names = budget_names
        self._cpu = cpu_executor
        self._rank = transport.rank
        self._global_ranks = transport.global_ranks
        # A failed broadcast means the group is unusable (the pipeline releases everything);
        # a failed local plan in replicated mode must abort this rank (see the pipeline). The
        # pipeline passes its Hooks' methods, which it detaches when the pass is closed.
        self._on_group_failure = on_group_failure
        self._on_local_failure = on_local_failure

    async def run(self, state: StepState) -> None:
        if state.terminal:
            return
        messages = state.messages
        if self._calibration is not None and messages is not None:
            await self._ingest([state])
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
        self._note_plans([state])

    async def _ingest(self, states: list[StepState]) -> None:
        calibration = self._calibration
        assert calibration is not None
        loop = asyncio.get_running_loop()
        for state in states:
            if state.messages is not None:
                await loop.run_in_executor(
                    self._cpu, calibration.ingest, state.step, state.messages
                )

    def _note_plans(self, states: list[StepState]) -> None:
        if self._calibration is None:
            return
        for state in states:
            if state.routes is not None and state.error is None and state.remote is None:
                self._calibration.note_plan(state.step, state.routes, state.step_messages())

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

    # -- balance windows ---------------------------------------------------------------------

    async def run_window(self, states: list[StepState]) -> None:
        """Plan the window of ``states`` (consecutive gathered steps, none terminal) together.

        A local planning failure fails every step of the window (the first one raises); in
        replicated mode it aborts this rank as :meth:`run` does, and marks the window's steps
        terminal so that no later stage issues a collective for them.
        """
        first = states[0].step
        messages = [s.messages for s in states]
        if self._calibration is not None:
            await self._ingest(states)
        if all(m is not None for m in messages) and (not self._leader or self._rank == 0):
            loop = asyncio.get_running_loop()
            try:
                planned = await loop.run_in_executor(
                    self._cpu, self._plan_window_sync, first, messages
                )
            except Exception as exc:
                for state in states:
                    state.fail("plan", exc)
                if not self._leader and self._transport.num_ranks > 1:
                    for state in states:
                        state.terminal = True
                    await self._on_local_failure(states[0], exc)
                    return
            else:
                for state, (plan, stats, routes) in zip(states, planned, strict=True):
                    state.plan, state.stats, state.routes = plan, stats, routes
        await self._sequencer.turn(first, "broadcast")
        if self._leader:
            await self._broadcast_window(states)
        await self._sequencer.advance(first, "broadcast")
        self._note_plans(states)

    def _plan_window_sync(self, first: int, messages: list[Any]) -> list[_Planned]:
        columns = [peer_columns(m, self._budget_names) for m in messages]
        plans = plan_window(self._planner, columns, first).plans
        if len(plans) != len(columns) or any(p.step != first + i for i, p in enumerate(plans)):
            raise PlanningError(
                f"The window planner returned plans of steps {[p.step for p in plans]} for "
                f"the window of steps {first}..{first + len(columns) - 1}; it must return one "
                "plan per step of the window, in order."
            )
        return [with_routes(p, self._rank, self._global_ranks) for p in plans]

    async def _broadcast_window(self, states: list[StepState]) -> None:
        first = states[0]
        payload: dict[str, Any] | None = None
        if self._rank == 0:
            if first.error is not None:
                payload = {"error": error_info(0, first.error_stage, first.step, first.error)}
            else:
                payload = {"plans": [plan_to_wire(s.plan) for s in states if s.plan is not None]}
        try:
            received = await self._transport.broadcast(payload, src=0)
        except BaseException as exc:
            await self._on_group_failure(first, exc, "plan")
            return
        if self._rank == 0:
            return
        if received.get("error") is not None:
            error = remote_error(received["error"], self._global_ranks, sender=0)
            for state in states:
                state.remote = state.error = error
                state.error_stage = "plan"
            return
        wires = received.get("plans")
        if not isinstance(wires, list) or len(wires) != len(states):
            error = PlanningError(
                f"The leader broadcast {len(wires) if isinstance(wires, list) else 'no'} plans "
                f"for the window of {len(states)} steps starting at step {first.step}; every "
                "rank must run the same evenflow with the same balance_window."
            )
            for state in states:
                state.fail("plan", error)
            return
        loop = asyncio.get_running_loop()
        planned = await loop.run_in_executor(self._cpu, self._received_window, wires, first.step)
        for state, (plan, stats, routes) in zip(states, planned, strict=True):
            state.plan, state.stats, state.routes = plan, stats, routes

    def _received_window(self, wires: list[dict[str, Any]], first: int) -> list[_Planned]:
        return [self._received_plan(data, first + i) for i, data in enumerate(wires)]


class WindowPlanStage:
    """The plan stage of a balance window: hold gathered steps until the window's last one
    (or the round that ends the pass) arrives, plan them together, pass them on."""

    def __init__(
        self,
        *,
        plan: PlanStage,
        sequencer: WindowSequencer,
        progress: Progress,
        tracer: Any,
        first_step: int,
        rank: int,
    ) -> None:
        self._plan = plan
        self._sequencer = sequencer
        self._progress = progress
        self._tracer = tracer
        self._first_step = first_step
        self._rank = rank

    async def run(
        self, recv: MemoryObjectReceiveStream[StepState], send: MemoryObjectSendStream[StepState]
    ) -> None:
        async with recv, send:
            window: list[StepState] = []
            async for state in recv:
                if not state.terminal:
                    window.append(state)
                    if state.step < self._sequencer.window_last(state.step):
                        continue
                if window and self._progress.fatal is None:
                    depth = recv.statistics().current_buffer_used
                    with self._tracer.span("plan", window[0].step, queue_depth=depth):
                        await self._plan_window(window)
                for planned in window:
                    await send.send(planned)
                window = []
                if state.terminal:
                    await send.send(state)

    async def _plan_window(self, window: list[StepState]) -> None:
        prepared = {s.step: s.prepared for s in window if s.prepared is not None}
        share = WindowShare(
            samples={s.step: s.samples for s in window if s.samples is not None},
            prepared=prepared or None,
            messages={s.step: s.messages for s in window if s.messages is not None},
        )
        for state in window:
            state.window = share
        await self._plan.run_window(window)
        for state in window:
            if state.step < self._first_step and not state.terminal:
                state.edge = PassEdge(skip=True)
                routes = state.routes
                if routes is not None:  # its samples trained before the restore
                    share.forget((*routes.send.values(), *routes.bins), self._rank)
