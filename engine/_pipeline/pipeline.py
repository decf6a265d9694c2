"""The staged pipeline: the wiring of one pass's stages, and the caller's side of it.

::

    read ──► gather ──► plan ──► exchange ──► pack ──► world ──► h2d ──► (out) ──► caller
    (source   (collective) (CPU,   (collective,  (CPU: pack, (collective (copy to the
     executor)             replicated only if     collate,    across      device when a
                           or leader) samples     pin, H2D    groups,     device slot is
                                      move)       staging)    if any)     free)

Each stage has a module of its own, whose docstring says what it needs from a step, what it
adds and what it reports: ``read_stage`` (over ``source``), ``gather``, ``plan_stage`` (with
the balance window's variant), ``exchange`` (or, in shared-dataset mode, ``read_assigned``: no
collective, each rank reads its planned samples by dataset index on the read pool),
``pack_stage``, ``world_round`` and ``h2d_stage``. A source's transform runs inside the read.
This module connects them: one task per stage, bounded channels between them, the shared
:class:`~evenflow.engine._pipeline.progress.Progress`, and the handling of the failures that
end a pass.

Each stage but read (and the balance window's plan, which holds a window's steps) is one
coroutine driven by :meth:`Pipeline._stage`; it receives a :class:`StepState`, does its work
inside a trace span, and forwards the state. A failure inside a stage is recorded on the step
(``state.fail``) and the step keeps flowing, so the collectives of later stages still take
their turns and the failure is announced to the group in the next metadata round — the
fail-together channel. A failure of the group itself (timeout, dead peer) ends the pipeline:
the sequencer fails and every waiting stage and caller is released.

Step ``s`` is handed to the caller only when the metadata round of ``s + 1`` (or the final
``end`` round) has confirmed that every rank finished ``s``. At most ``prefetch_depth + 1``
steps are read and not yet delivered (a balance window raises that, as below), and at most
``device_prefetch_depth`` of them are staged on the device (see ``h2d_stage``). The ``world``
stage completes each step's loss-token totals across balance groups.

With a balance window of ``W = balance_window > 1`` steps the plan stage holds the gathered
steps of a window until its last one arrives, plans them together, and lets them flow on one by
one (see :class:`WindowSequencer` for the order of collectives). A step's samples may come from
any step of its window, so the reading rank keeps each sample (in the window's shared
:class:`~evenflow.engine._pipeline.records.WindowShare`) until the step that trains it has sent
or packed it. The round that follows a window's last settle (the next window's first gather)
confirms all of its steps at once, so the window's first step is delivered only after its last
is read and settled, and at most ``W + prefetch_depth`` steps are read and not yet delivered:
the read stage takes one of that many slots per step and delivery returns it. A pass that ends
in the middle of a window (a source's end or error, or ``drain()``) plans and delivers the
steps read before the end, then a ``final`` round confirms them; a pass limited by
``max_steps`` ends its last window there. A restored pass starts reading at its window's first
step (``read_from``) and skips the steps delivered before the save (``first_step`` is the first
one delivered): they are gathered and planned again, identically, but never exchanged or
delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.calibration import GroupCalibration
from evenflow.engine._pipeline.exchange import ExchangeStage
from evenflow.engine._pipeline.gather import GatherStage
from evenflow.engine._pipeline.h2d_stage import DeviceSlots, H2DStage
from evenflow.engine._pipeline.pack_stage import PackStage
from evenflow.engine._pipeline.plan_stage import PlanStage, WindowPlanStage
from evenflow.engine._pipeline.progress import Hooks, Progress
from evenflow.engine._pipeline.read_assigned import AssignedReader, AssignedStage
from evenflow.engine._pipeline.read_stage import ReadStage
from evenflow.engine._pipeline.sequencer import Sequencer, WindowSequencer
from evenflow.engine._pipeline.source import SourceReader
from evenflow.engine._pipeline.step import StepState
from evenflow.engine._pipeline.world_round import WorldRound, WorldStage
from evenflow.engine.errors import LoaderStateError, StallTimeoutError
from evenflow.transports import Transport
from evenflow.transports.internal import unwrap

__all__ = ["Pipeline"]


class Pipeline:
    """One pass over the source. Created and owned by :class:`BalancedLoader`."""

    def __init__(
        self,
        *,
        source: Any,
        config: LoaderConfig,
        transport: Transport,
        planner: Any,
        metadata_fn: Callable[[Any], Any],
        pack_fn: Callable[[list[Any], int], Any],
        collate_fn: Callable[[list[Any]], Any],
        stager: Any,
        tracer: Any,
        first_step: int,
        cpu_executor: concurrent.futures.Executor,
        source_executor: concurrent.futures.Executor,
        initial_iter: Iterator[Any] | None = None,
        read_from: int | None = None,
        initial_source_state: Any = None,
        world: WorldRound | None = None,
        assigned: AssignedReader | None = None,
        dataset: dict[str, Any] | None = None,
        calibration: GroupCalibration | None = None,
    ) -> None:
        self._config = config
        self._transport = transport
        self._stager = stager
        self._tracer = tracer
        self.first_step = first_step
        read_from = first_step if read_from is None else read_from
        self._window = window = config.balance_window
        self._progress = progress = Progress(first_step=first_step, read_from=read_from)
        self._hooks = hooks = Hooks(self._group_failed, self._abort_after_local_failure)
        self._sequencer = sequencer = (
            Sequencer(read_from)
            if window == 1
            else WindowSequencer(read_from, window, config.max_steps)
        )
        depth = config.prefetch_depth + window
        self._slots = asyncio.Semaphore(depth)
        self._world = world if world is not None else WorldRound(None, on_uneven_end="stop")
        # Undelivered steps on the device; without a bound every undelivered step may be.
        device_depth = config.device_prefetch_depth
        self._device_slots = DeviceSlots(stager, depth if device_depth is None else device_depth)
        self._reader = SourceReader(
            source=source,
            metadata_fn=metadata_fn,
            bins_per_rank=config.bins_per_rank,
            cpu_executor=cpu_executor,
            source_executor=source_executor,
            initial_iter=initial_iter,
            prepare_payloads=assigned is None and transport.num_ranks > 1,
            constraints=planner.constraints,
            close_timeout=config.close_timeout,
        )
        self._read = ReadStage(
            reader=self._reader,
            slots=self._slots,
            tracer=tracer,
            read_from=read_from,
            window=window,
            max_steps=config.max_steps,
            initial_source_state=initial_source_state,
        )
        budget_names = tuple(sorted(config.constraints.budgets))
        self._gather = GatherStage(
            transport=transport,
            sequencer=sequencer,
            progress=progress,
            hooks=hooks,
            first_step=first_step,
            read_from=read_from,
            window=window,
            budget_names=budget_names,
            on_uneven_end=config.on_uneven_end,
            shared=assigned is not None,
            dataset=dataset,
            calibration=calibration,
        )
        self._plan_stage = PlanStage(
            planner=planner,
            transport=transport,
            sequencer=sequencer,
            leader=config.planning == "leader",
            budget_names=budget_names,
            cpu_executor=cpu_executor,
            on_group_failure=hooks.group_failed,
            on_local_failure=hooks.local_failure,
            calibration=calibration,
        )
        self._window_plan = (
            None
            if not isinstance(sequencer, WindowSequencer)
            else WindowPlanStage(
                plan=self._plan_stage,
                sequencer=sequencer,
                progress=progress,
                tracer=tracer,
                first_step=first_step,
                rank=transport.rank,
            )
        )
        self._exchange: ExchangeStage | AssignedStage = (
            ExchangeStage(transport=transport, sequencer=sequencer, progress=progress, hooks=hooks)
            if assigned is None
            else AssignedStage(reader=assigned, sequencer=sequencer, progress=progress)
        )
        self._pack = PackStage(
            sequencer=sequencer,
            gather=self._gather,
            device_slots=self._device_slots,
            stager=stager,
            pack_fn=pack_fn,
            collate_fn=collate_fn,
            seq_len=config.seq_len,
            oversized_policy=config.oversized_policy,
            shared=assigned is not None,
            rank=transport.rank,
            global_ranks=transport.global_ranks,
            cpu_executor=cpu_executor,
        )
        self._world_stage = WorldStage(self._world, progress)
        self._h2d = H2DStage(
            stager=stager, slots=self._device_slots, cpu_executor=cpu_executor, hooks=hooks
        )
        self._out_send, self._out_recv = anyio.create_memory_object_stream[StepState](depth)
        self._task: asyncio.Task[None] | None = None
        self._pending: StepState | None = None  # received, awaiting confirmation
        self._failure: BaseException | None = None  # the error already raised to the caller
        self._closed = False
        self._recv_task: asyncio.Future[StepState] | None = None
        self.num_discarded_samples = 0  # samples of steps prepared here but never delivered

    # -- progress, as the loader reads it ----------------------------------------------------

    @property
    def gathered_step(self) -> int:
        return self._progress.gathered_step

    @property
    def exchanged_step(self) -> int:
        return self._progress.exchanged_step

    @property
    def exchange_launched_step(self) -> int:
        return self._progress.exchange_launched_step

    @property
    def world_step(self) -> int:
        return self._progress.world_step

    @property
    def final_round(self) -> StepState | None:
        """The final metadata round of the pass's end (``None`` before it)."""
        return self._progress.final_round

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the supervisor task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="evenflow-pipeline")

    async def _run(self) -> None:
        read_s, read_r = anyio.create_memory_object_stream[StepState](1)
        gath_s, gath_r = anyio.create_memory_object_stream[StepState](1)
        plan_s, plan_r = anyio.create_memory_object_stream[StepState](1)
        exch_s, exch_r = anyio.create_memory_object_stream[StepState](1)
        # In a balance window the copy of a step may wait (device_prefetch_depth) for the
        # delivery of an earlier step of its window, which waits for the window's last step
        # to settle: the channels after pack must hold a window's steps, or pack would stall
        # behind that copy. (Never more than the read-ahead slots exist.)
        after_pack = 1 if self._window == 1 else self._config.prefetch_depth + self._window
        pack_s, pack_r = anyio.create_memory_object_stream[StepState](after_pack)
        world_s, world_r = anyio.create_memory_object_stream[StepState](after_pack)
        exchange = "exchange" if isinstance(self._exchange, ExchangeStage) else "read_assigned"
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read.run(read_s))
                tg.create_task(self._stage("gather", read_r, gath_s, self._gather.run))
                if self._window_plan is None:
                    tg.create_task(self._stage("plan", gath_r, plan_s, self._plan_stage.run))
                else:
                    tg.create_task(self._window_plan.run(gath_r, plan_s))
                tg.create_task(self._stage(exchange, plan_r, exch_s, self._exchange.run))
                tg.create_task(self._stage("pack", exch_r, pack_s, self._pack.run))
                # Traced only where they do work: a world of several groups, a device.
                world_traced = self._world.spans_groups
                h2d_traced = self._stager.active
                tg.create_task(
                    self._stage(
                        "world", pack_r, world_s, self._world_stage.run, traced=world_traced
                    )
                )
                tg.create_task(
                    self._stage("h2d", world_r, self._out_send, self._h2d.run, traced=h2d_traced)
                )
        except BaseException as exc:  # a stage crashed, the group failed, or close() cancelled
            progress = self._progress
            progress.gather_done = True
            progress.notify()
            if progress.fatal is None:
                progress.fatal = _first_error(exc)
            await self._sequencer.fail(_Aborted("the pipeline stopped"))
            self._gather.confirm_all_pending(progress.fatal)
            if self._world.spans_groups and not self._closed:
                # Alive, whatever stopped the pipeline: answer the world's roll call.
                with contextlib.suppress(Exception):
                    await self._world.answer_roll_call()
            if not isinstance(exc, (Exception, BaseExceptionGroup)):
                raise

    async def aclose(self) -> None:
        """Cancel every stage and wait for them; in-flight executor work is abandoned."""
        self._closed = True
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._out_recv.close()
        await self._reader.aclose()
        # The stages call back into this pipeline: a cycle that would keep a closed pass (its
        # samples, frames and transport) alive until a garbage collection.
        self._hooks.detach()

    # -- caller side --------------------------------------------------------------------------

    async def next_state(self) -> StepState | None:
        """The next deliverable step; raises its error; ``None`` at the end of the pass.

        Cancellation-safe: a step taken off the channel but not yet confirmed is kept and
        returned by the next call. After an error has been raised, every later call raises
        ``LoaderStateError`` (the pass is over; ``set_epoch()`` starts a new one).
        """
        if self._closed:
            raise LoaderStateError("This pass was closed; no more steps will be delivered.")
        if self._failure is not None:
            raise LoaderStateError(
                f"This pass already failed with {type(unwrap(self._failure)).__name__}: "
                f"{self._failure}. Call set_epoch() to start a new pass, or close()."
            ) from self._failure
        state = self._pending
        if state is None:
            # The receive runs in its own task: a cancelled caller must not lose a step that
            # the channel already handed over.
            if self._recv_task is None:
                self._recv_task = asyncio.ensure_future(self._out_recv.receive())
            try:
                state = await asyncio.shield(self._recv_task)
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._recv_task = None
                await self._end_of_stream()
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self.closed and (current is None or current.cancelling() == 0):
                    raise LoaderStateError(
                        "The loader was closed while this call waited for a step."
                    ) from None
                raise
            self._recv_task = None
            self._pending = state
        try:
            if state.terminal:
                self._pending = None
                self._raise_for(state)
                return None
            assert state.confirmed is not None
            await asyncio.shield(state.confirmed)
            # Like the metadata round, the next step's world round precedes delivery; when
            # its collective failed, this step fails on every surviving rank alike.
            await self._wait_world_round(state.step + 1)
            world_failure = self._world.failure_before(state.step + 1)
            if (
                world_failure is None
                and self._world.spans_groups
                and self.world_step < state.step + 1
                and not self._world.stopped
            ):
                # The pipeline stopped before the next world round ran: no rank of the world
                # can have completed that round, so no rank delivers this step either.
                world_failure = self._progress.fatal
            if world_failure is not None and state.error is None and state.remote is None:
                state.remote = world_failure
            self._pending = None
            self._slots.release()
            self._device_slots.release(state)
            self._raise_for(state)
            if state.world_end is not None and not self._read.stopped:
                # Another balance group ended at this step: end here too, draining this
                # group's steps in flight so its ranks stop at one shared metadata round.
                state.uneven, state.end_reason = state.world_end, "exhausted"
                await self.drain(self._config.timeout)
                self._progress.final_round = state
                return None
        except (asyncio.CancelledError, LoaderStateError):
            raise
        except BaseException as exc:
            self._failure = exc
            raise
        return state

    async def next_state_bounded(self) -> StepState | None:
        """:meth:`next_state` within the stall limit, else a ``StallTimeoutError`` that says
        where the pipeline is. Every collective is bounded by the timeout on its own. A step
        needs its exchange and the next metadata round; in a balance window of W steps its
        first step also waits for the window's other W - 1 rounds: (W + 1) timeouts in all."""
        config = self._config
        deadline = asyncio.timeout((config.balance_window + 1) * config.timeout)
        try:
            async with deadline:
                return await self.next_state()
        except TimeoutError:
            # Only this wait's own deadline is a stall: a TimeoutError raised by a step (a
            # transport's, or one from user code) reaches the caller as it is.
            if not deadline.expired():
                raise
            raise StallTimeoutError(
                f"No step arrived within {config.balance_window + 1} x "
                f"timeout={config.timeout:g} s on rank "
                f"{self._transport.rank}; the pipeline is at {self.position()}. A source "
                "or callback may be blocked; raise LoaderConfig.timeout if steps are slower."
            ) from None

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (it may happen while a caller waits)."""
        return self._closed

    async def _end_of_stream(self) -> NoReturn:
        """The output channel ended without a final round: report why."""
        if self._task is not None and not self._task.done() and not self._closed:
            await asyncio.wait([self._task])
        if self._closed:
            raise LoaderStateError("The loader was closed while this call waited for a step.")
        error = self._progress.fatal or LoaderStateError(
            "The pipeline ended without a final metadata round; this is a bug in evenflow."
        )
        self._failure = error
        raise error

    async def drain(self, timeout: float) -> None:
        """End the pass early on every rank of the group without breaking collective order.

        Stops reading: the next read announces ``end`` (reason ``restart``) in its metadata
        round, which ends the pass on every rank at that step. Steps already in flight (a
        balance window's steps read before the stop included) are finished and discarded;
        ``num_discarded_samples`` counts the samples this rank would have trained in them.
        Peers must keep iterating or drain too.
        """
        self._read.stop()
        self._progress.notify()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                while not self._closed and self._failure is None:
                    state = await self.next_state()
                    if state is None:
                        break
                    if state.routes is not None:
                        self.num_discarded_samples += sum(map(len, state.routes.bins))

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds or the pipeline can make no more progress."""
        while not predicate() and not self.finished:
            await self._progress.changed()

    def position(self) -> str:
        step, phase = self._sequencer.position
        return f"collective turn ({step}, {phase!r}), last gathered step {self.gathered_step}"

    def planned(self, step: int) -> bool:
        """Whether ``step``'s plan is under way: its window's last metadata round is done."""
        last = step
        if isinstance(self._sequencer, WindowSequencer):
            last = self._sequencer.window_last(step)
        return self.gathered_step >= last

    @property
    def finished(self) -> bool:
        return self._progress.gather_done or (self._task is not None and self._task.done())

    def exchange_launched(self) -> None:
        """Called (on the loop) when the final launch of the current exchange has run."""
        progress = self._progress
        progress.exchange_launched_step = max(progress.exchange_launched_step, progress.exchanging)
        progress.notify()

    def _raise_for(self, state: StepState) -> None:
        if state.error is not None:
            raise state.error
        if state.remote is not None:
            raise state.remote

    async def _wait_world_round(self, step: int) -> None:
        """Wait for the world round of ``step`` (or for rounds to stop, or the pipeline)."""
        if not self._world.spans_groups:
            return
        while not (
            self._progress.world_step >= step
            or self._world.stopped
            or (self._task is not None and self._task.done())
        ):
            await self._progress.changed()

    # -- stage driver -------------------------------------------------------------------------

    async def _stage(
        self,
        name: str,
        recv: MemoryObjectReceiveStream[StepState],
        send: MemoryObjectSendStream[StepState],
        work: Callable[[StepState], Any],
        *,
        traced: bool = True,
    ) -> None:
        async with recv, send:
            async for state in recv:
                if traced:
                    depth = recv.statistics().current_buffer_used
                    with self._tracer.span(name, state.step, queue_depth=depth):
                        await work(state)
                else:
                    await work(state)
                if state.skip and send is self._out_send:
                    self._slots.release()  # delivered before the restore: never again
                    continue
                await send.send(state)

    # -- failures that end the pass -----------------------------------------------------------

    async def _group_failed(self, state: StepState, exc: BaseException, stage: str) -> None:
        """A collective failed: the group is unusable; release everything with ``exc``."""
        state.fail(stage, exc)
        state.terminal = True
        progress = self._progress
        if progress.fatal is None:
            progress.fatal = exc
        progress.gather_done = True
        progress.notify()
        await self._sequencer.fail(exc)
        self._gather.confirm_all_pending(exc)
        if self._world.spans_groups:
            with contextlib.suppress(Exception):
                await self._world.answer_roll_call()

    async def _abort_after_local_failure(self, state: StepState, exc: BaseException) -> None:
        """Replicated planning (or a device copy after the step was announced) failed here.
        Peers decide from their own plans whether this step exchanges payloads, which this rank
        cannot know without a plan, so no later collective could be paired safely. Close the
        transport instead: peers fail promptly with a peer-failure error (a deterministic
        planning error fails every rank the same way, each raising its own exception) rather
        than waiting for a timeout."""
        state.terminal = True
        progress = self._progress
        if progress.fatal is None:
            progress.fatal = exc
        progress.gather_done = True
        progress.notify()
        with contextlib.suppress(Exception):
            await self._transport.aclose()
        await self._sequencer.fail(_Aborted("planning failed on this rank"))


class _Aborted(Exception):
    """Raised in stages waiting for a turn after the pipeline stopped."""


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside a (possibly nested) exception group that is not a cancellation."""
    if isinstance(exc, BaseExceptionGroup):
        found = [_first_error(e) for e in exc.exceptions]
        real = [e for e in found if not isinstance(e, (asyncio.CancelledError, _Aborted))]
        return (real or found)[0]
    return exc
