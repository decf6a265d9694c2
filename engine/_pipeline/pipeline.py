"""The staged pipeline: tasks connected by bounded channels, one step at a time per stage.

::

    read ──► gather ──► plan ──► exchange ──► pack ──► world ──► h2d ──► (out) ──► caller
    (source   (collective) (CPU,   (collective,  (CPU: pack, (collective (copy to the
     executor)             replicated only if     collate,    across      device when a
                           or leader) samples     pin, H2D    groups,     device slot is
                                      move)       staging)    if any)     free)

In shared-dataset mode (:mod:`~evenflow.engine._pipeline.read_assigned`) the exchange stage is
replaced by *read_assigned*: no collective, each rank reads its planned samples by dataset
index on the read pool.

Each stage is one coroutine driven by :meth:`Pipeline._stage`; it receives a
:class:`StepState`, does its work inside a trace span, and forwards the state. A failure inside a
stage is recorded on the step (``state.fail``) and the step keeps flowing, so the collectives of
later stages still take their turns and the failure is announced to the group in the next
metadata round — the fail-together channel. A failure of the group itself (timeout, dead peer)
ends the pipeline: the sequencer fails and every waiting stage and caller is released.

Step ``s`` is handed to the caller only when the metadata round of ``s + 1`` (or the final
``end`` round) has confirmed that every rank finished ``s``. At most ``prefetch_depth + 1``
steps are read and not yet delivered (a balance window raises that, as below), and at most
``device_prefetch_depth`` of them are staged on the device: ``pack`` stages a step at once
while a device slot is free (as it always did without the bound); otherwise the step waits on
the host, pinned, and the ``h2d`` stage copies it when the caller takes an earlier step. The
``world`` stage completes each step's loss-token totals across balance groups
(:mod:`evenflow.engine._pipeline.world`).

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
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from evenflow.engine._config import LoaderConfig
from evenflow.engine._model import SampleKey
from evenflow.engine._pipeline.calibration import GroupCalibration
from evenflow.engine._pipeline.loss_tokens import rank_loss_tokens
from evenflow.engine._pipeline.pack import count_loss_tokens, default_pack_fn
from evenflow.engine._pipeline.pack_check import (
    Declared,
    check_packed,
    explain_pack_error,
    name_samples,
)
from evenflow.engine._pipeline.plan_stage import PlanStage
from evenflow.engine._pipeline.read_assigned import AssignedReader, dataset_mismatch
from evenflow.engine._pipeline.records import DeviceSlot, LossCount, PassEdge, WindowShare
from evenflow.engine._pipeline.sequencer import Sequencer, WindowSequencer
from evenflow.engine._pipeline.source import SourceReader
from evenflow.engine._pipeline.step import (
    StepState,
    build_message,
)
from evenflow.engine._pipeline.verdict import (
    confirm_prev,
    confirm_reports,
    judge_round,
    prev_status,
    window_reports,
)
from evenflow.engine._pipeline.world import WorldRound
from evenflow.engine.errors import (
    LoaderStateError,
    PlanningError,
    RemoteStageError,
)
from evenflow.transports import Prepared, Transport
from evenflow.transports._threads import unwrap
from evenflow.transports.errors import (
    CollectiveMismatchError,
    PeerEncodeError,
    PeerFailureError,
    TransportClosedError,
    TransportTimeoutError,
)

__all__ = ["Pipeline"]

logger = logging.getLogger("evenflow")


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
        self._config = config
        self._transport = transport
        # Shared-dataset mode: the reader of assigned samples, and the dataset identity the
        # first metadata round compares (None in payload mode on every rank).
        self._assigned = assigned
        self._dataset = dataset
        self._planner = planner
        self._pack_fn = pack_fn
        self._collate_fn = collate_fn
        self._stager = stager
        self._tracer = tracer
        self.first_step = first_step
        self._read_from = first_step if read_from is None else read_from
        self._initial_source_state = initial_source_state
        self._window = config.balance_window
        self._cpu = cpu_executor
        self._rank = transport.rank
        self._global_ranks = transport.global_ranks
        self._budget_names = tuple(sorted(config.constraints.budgets))
        self._sequencer = (
            Sequencer(self._read_from)
            if self._window == 1
            else WindowSequencer(self._read_from, self._window, config.max_steps)
        )
        self._plan_stage = PlanStage(
            planner=planner,
            transport=transport,
            sequencer=self._sequencer,
            leader=config.planning == "leader",
            budget_names=self._budget_names,
            cpu_executor=cpu_executor,
            on_group_failure=self._group_failed,
            on_local_failure=self._abort_after_local_planning_failure,
            calibration=calibration,
        )
        self._calibration = calibration
        depth = config.prefetch_depth + self._window
        self._slots = asyncio.Semaphore(depth)
        self._world = world if world is not None else WorldRound(None, on_uneven_end="stop")
        # Undelivered steps on the device; without a bound every undelivered step may be.
        device_depth = config.device_prefetch_depth
        self._device_slots = asyncio.Semaphore(depth if device_depth is None else device_depth)
        self._waiting_h2d = 0  # packed steps waiting on the host for a device slot
        self.world_step = first_step - 1  # the last step whose world round is done
        self._out_send, self._out_recv = anyio.create_memory_object_stream[StepState](depth)
        # Steps settled since the last metadata round (their reports go in the next one),
        # and those whose reports are in the round under way, awaiting its result.
        self._settled: list[StepState] = []
        self._reporting: list[StepState] = []
        self._fatal: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self.gathered_step = self._read_from - 1
        self.exchanged_step = first_step - 1
        self.exchange_launched_step = first_step - 1
        self._exchanging = first_step - 1
        self._gather_done = False
        self._ended = False  # a metadata round ended the pass
        self._progress = asyncio.Event()
        self._pending: StepState | None = None  # received, awaiting confirmation
        self._failure: BaseException | None = None  # the error already raised to the caller
        self._closed = False
        self._stop_reading = False  # set by drain(): end the pass at the next read
        self._stop_event = asyncio.Event()
        self._recv_task: asyncio.Future[StepState] | None = None
        self.final_round: StepState | None = None  # the final metadata round of a pass's end
        self.num_discarded_samples = 0  # samples of steps prepared here but never delivered

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
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read_stage(read_s))
                tg.create_task(self._stage("gather", read_r, gath_s, self._gather))
                if self._window == 1:
                    tg.create_task(self._stage("plan", gath_r, plan_s, self._plan))
                else:
                    tg.create_task(self._window_stage(gath_r, plan_s))
                if self._assigned is None:
                    tg.create_task(self._stage("exchange", plan_r, exch_s, self._exchange))
                else:
                    tg.create_task(
                        self._stage("read_assigned", plan_r, exch_s, self._read_assigned)
                    )
                tg.create_task(self._stage("pack", exch_r, pack_s, self._pack))
                # Traced only where they do work: a world of several groups, a device.
                world_traced = self._world.spans_groups
                h2d_traced = self._stager.active
                tg.create_task(
                    self._stage("world", pack_r, world_s, self._world_round, traced=world_traced)
                )
                tg.create_task(
                    self._stage("h2d", world_r, self._out_send, self._h2d, traced=h2d_traced)
                )
        except BaseException as exc:  # a stage crashed, the group failed, or close() cancelled
            self._gather_done = True
            self.notify()
            if self._fatal is None:
                self._fatal = _first_error(exc)
            await self._sequencer.fail(_Aborted("the pipeline stopped"))
            self._confirm_all_pending(self._fatal)
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
        # The plan stage calls back into this pipeline: a cycle that would keep a closed
        # pass (its samples, frames and transport) alive until a garbage collection.
        self._plan_stage.detach()

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
                world_failure = self._fatal
            if world_failure is not None and state.error is None and state.remote is None:
                state.remote = world_failure
            self._pending = None
            self._slots.release()
            self._release_device_slot(state)
            self._raise_for(state)
            if state.world_end is not None and not self._stop_reading:
                # Another balance group ended at this step: end here too, draining this
                # group's steps in flight so its ranks stop at one shared metadata round.
                state.uneven, state.end_reason = state.world_end, "exhausted"
                await self.drain(self._config.timeout)
                self.final_round = state
                return None
        except (asyncio.CancelledError, LoaderStateError):
            raise
        except BaseException as exc:
            self._failure = exc
            raise
        return state

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
        error = self._fatal or LoaderStateError(
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
        self._stop_reading = True
        self._stop_event.set()
        self.notify()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                while not self._closed and self._failure is None:
                    state = await self.next_state()
                    if state is None:
                        break
                    if state.routes is not None:
                        self.num_discarded_samples += sum(map(len, state.routes.bins))

    def notify(self) -> None:
        """Wake :meth:`wait_until` callers (progress was made)."""
        self._progress.set()
        self._progress = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds or the pipeline can make no more progress."""
        while not predicate() and not self.finished:
            await self._progress.wait()

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
        return self._gather_done or (self._task is not None and self._task.done())

    def exchange_launched(self) -> None:
        """Called (on the loop) when the final launch of the current exchange has run."""
        self.exchange_launched_step = max(self.exchange_launched_step, self._exchanging)
        self.notify()

    def _release_device_slot(self, state: StepState) -> None:
        if state.device is not None and state.device.held:
            state.device.held = False
            self._device_slots.release()

    def _raise_for(self, state: StepState) -> None:
        if state.error is not None:
            raise state.error
        if state.remote is not None:
            raise state.remote

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

    # -- read ---------------------------------------------------------------------------------

    async def _read_stage(self, send: MemoryObjectSendStream[StepState]) -> None:
        async with send:
            step = self._read_from
            window = self._window
            # The source's position before the step being read, and at its window's start.
            before = window_start = self._initial_source_state
            if window > 1 and step == 0:
                # A checkpoint inside the first window restores the source to its start.
                before = await self._reader.position()
            while True:
                limit = self._config.max_steps
                if not self._stop_reading and limit is not None and step >= limit:
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
        """Await ``work`` unless :meth:`drain` stops the reader first (then ``None``)."""
        if self._stop_reading:
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

    # -- gather -------------------------------------------------------------------------------

    async def _gather(self, state: StepState) -> None:
        if self._ended:
            # A step read ahead of the round that ended the pass: it has no turn (a window's
            # steps after that round would come before the window's exchanges). It waits,
            # never announced, until the pass is closed.
            await asyncio.get_running_loop().create_future()
        await self._sequencer.turn(state.step, "gather")
        messages = await self._round(state)
        if messages is None:
            return
        mismatch = None
        if state.step == self._read_from:
            mismatch = dataset_mismatch(
                [m.get("dataset") for m in messages],
                self._global_ranks,
                where=f"Step {state.step}",
            )
        if mismatch is not None:
            state.remote, state.terminal = mismatch, True
        else:
            self._judge_round(state, messages)
        sequencer = self._sequencer
        if (
            state.terminal
            and isinstance(sequencer, WindowSequencer)
            and not sequencer.starts_window(state.step)
            and not self._gather_failed
        ):
            # The pass ends in the middle of a window: the window's earlier steps are planned,
            # delivered and confirmed by a final round first.
            sequencer.end_window(state.step)
            state.edge = PassEdge(final_round=True)
        await self._sequencer.advance(state.step, "gather")
        self.gathered_step = state.step
        self._ended = state.terminal
        if state.terminal and state.status == "end":
            self.final_round = state
            if state.uneven is not None and state.remote is None:
                logger.warning("%s", state.uneven.message("stop"))
        self._gather_done = state.terminal and state.edge is None
        self.notify()
        if not state.terminal:
            state.confirmed = asyncio.get_running_loop().create_future()
            if state.error is None:
                state.messages = messages

    async def _round(self, state: StepState) -> list[dict[str, Any]] | None:
        """One metadata round for ``state`` (its turn taken): announce it with the reports on
        the steps settled since the last round, and confirm those steps with every rank's
        reports. ``None`` when the group failed."""
        self._reporting, self._settled = self._settled, []
        if self._window == 1:
            prev: Any = prev_status(self._reporting[0], self._rank) if self._reporting else None
        else:
            prev = window_reports(self._reporting, self._rank)
        msg = build_message(state, self._rank, self.first_step, self._budget_names, prev)
        if state.step == self._read_from:
            msg["dataset"] = self._dataset
        if self._calibration is not None and state.status == "ok":
            # Measured rows ride the round every rank gathers anyway (no collective of their own).
            rows = self._calibration.outgoing(state.step)
            if rows is not None:
                msg["calib"] = rows
        if state.prepared is not None and state.status == "ok":
            # Frame sizes: every receiver sizes its exchange buffer from them and the plan.
            msg["nbytes"] = np.fromiter(
                (p.nbytes for p in state.prepared), dtype=np.int64, count=len(state.prepared)
            )
        if self._assigned is not None and state.status == "ok" and state.samples is not None:
            msg["indices"] = np.fromiter(
                (s.dataset_index for s in state.samples), dtype=np.int64, count=len(state.samples)
            )
        elif state.indices is not None and state.status == "ok":
            # Payload mode over a source that knows them: errors at the pack name the sample
            # by its dataset index on whichever rank packs it.
            msg["indices"] = state.indices
        try:
            messages = await self._transport.all_gather(msg)
        except BaseException as exc:
            await self._group_failed(state, exc, "gather")
            return None
        reporting, self._reporting = self._reporting, []
        prevs = [m.get("prev") for m in messages]
        if self._window == 1:
            confirm_prev(reporting[0] if reporting else None, prevs, self._rank, self._global_ranks)
        else:
            confirm_reports(reporting, prevs, self._rank, self._global_ranks)
        return messages

    async def _final_round(self, state: StepState) -> None:
        """The round after the last settle of a window the pass ended in: it confirms the
        window's steps (the pass's end was judged in ``state``'s first round)."""
        await self._sequencer.turn(state.step, "final")
        if await self._round(state) is None:
            return
        await self._sequencer.advance(state.step, "final")
        self._gather_done = True
        self.notify()

    @property
    def _gather_failed(self) -> bool:
        return self._fatal is not None

    def _judge_round(self, state: StepState, messages: list[dict[str, Any]]) -> None:
        judge_round(
            state,
            messages,
            first_step=self._read_from,
            global_ranks=self._global_ranks,
            on_uneven_end=self._config.on_uneven_end,
        )

    async def _group_failed(self, state: StepState, exc: BaseException, stage: str) -> None:
        """A collective failed: the group is unusable; release everything with ``exc``."""
        state.fail(stage, exc)
        state.terminal = True
        if self._fatal is None:
            self._fatal = exc
        self._gather_done = True
        self.notify()
        await self._sequencer.fail(exc)
        self._confirm_all_pending(exc)
        if self._world.spans_groups:
            with contextlib.suppress(Exception):
                await self._world.answer_roll_call()

    def _confirm_all_pending(self, exc: BaseException) -> None:
        pending = [*self._reporting, *self._settled]
        self._reporting, self._settled = [], []
        for prev in pending:
            if prev.confirmed is not None and not prev.confirmed.done():
                prev.remote = prev.remote or exc
                prev.confirmed.set_result(None)

    # -- plan ---------------------------------------------------------------------------------

    async def _plan(self, state: StepState) -> None:
        await self._plan_stage.run(state)

    async def _window_stage(
        self, recv: MemoryObjectReceiveStream[StepState], send: MemoryObjectSendStream[StepState]
    ) -> None:
        """The plan stage of a balance window: hold gathered steps until the window's last
        one (or the round that ends the pass) arrives, plan them together, pass them on."""
        sequencer = self._sequencer
        assert isinstance(sequencer, WindowSequencer)
        async with recv, send:
            window: list[StepState] = []
            async for state in recv:
                if not state.terminal:
                    window.append(state)
                    if state.step < sequencer.window_last(state.step):
                        continue
                if window and not self._gather_failed:
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
        await self._plan_stage.run_window(window)
        for state in window:
            if state.step < self.first_step and not state.terminal:
                state.edge = PassEdge(skip=True)
                routes = state.routes
                if routes is not None:  # its samples trained before the restore
                    share.forget((*routes.send.values(), *routes.bins), self._rank)

    async def _abort_after_local_planning_failure(
        self, state: StepState, exc: BaseException
    ) -> None:
        """Replicated planning failed here. Peers decide from their own plans whether this
        step exchanges payloads, which this rank cannot know without a plan, so no later
        collective could be paired safely. Close the transport instead: peers fail promptly
        with a peer-failure error (a deterministic planning error fails every rank the same
        way, each raising its own exception) rather than waiting for a timeout."""
        state.terminal = True
        if self._fatal is None:
            self._fatal = exc
        self._gather_done = True
        self.notify()
        with contextlib.suppress(Exception):
            await self._transport.aclose()
        await self._sequencer.fail(_Aborted("planning failed on this rank"))

    # -- exchange -----------------------------------------------------------------------------

    async def _exchange(self, state: StepState) -> None:
        if state.terminal:
            return
        plan = state.plan
        moves = plan is not None and plan.num_moved > 0 and not state.skip
        await self._sequencer.turn(state.step, "exchange")
        if moves:
            outgoing, incoming = self._sized(state)
            self._exchanging = state.step
            try:
                state.received = await self._transport.exchange_sized(outgoing, incoming)
            except PeerEncodeError as exc:
                # No data moved anywhere; the failing rank announces its own error in the next
                # metadata round, which replaces this summary with its message.
                failed = exc.failed_ranks[0] if exc.failed_ranks else 0
                state.remote = RemoteStageError(
                    failed_rank=self._global_ranks[failed],
                    stage="exchange",
                    step=state.step,
                    error_type="EncodeError",
                    message=str(exc),
                )
            except _GROUP_FAILURES as exc:
                await self._group_failed(state, exc, "exchange")
                return
            except Exception as exc:
                # This rank could not encode its payloads; by the transport contract its peers
                # were told (PeerEncodeError) and the group is still in step.
                state.fail("exchange", exc)
            if state.window is not None and state.routes is not None:
                # Sent: the reading rank no longer needs these samples.
                state.window.forget(state.routes.send.values(), self._rank)
        self.exchanged_step = state.step
        self.notify()
        await self._sequencer.advance(state.step, "exchange")

    # -- read_assigned (shared-dataset mode) ----------------------------------------------

    async def _read_assigned(self, state: StepState) -> None:
        """Take the exchange turn without a collective (every rank is in shared mode), then
        read this rank's planned samples by dataset index (none for a step delivered before
        a restore)."""
        if state.terminal:
            return
        if state.skip:
            await self._sequencer.turn(state.step, "exchange")
            await self._sequencer.advance(state.step, "exchange")
            return
        await self._sequencer.turn(state.step, "exchange")
        self.exchanged_step = state.step
        self.notify()
        await self._sequencer.advance(state.step, "exchange")
        if state.error is not None or state.routes is None or state.messages is None:
            return
        assert self._assigned is not None
        try:
            messages = state.step_messages()
            state.received = await self._assigned.read(state.step, state.routes, messages)
            state.transform = self._assigned.last_transform
        except Exception as exc:
            state.fail("read_assigned", exc)

    def _sized(
        self, state: StepState
    ) -> tuple[dict[int, list[tuple[Any, Prepared]]], dict[int, list[tuple[Any, int]]]]:
        """What this rank sends (its prepared samples, by target) and what it receives (keys
        and frame sizes, by sender), both from the plan and the gathered metadata, which every
        rank shares; so both sides of every pair count the same bytes and the exchange needs
        no sizes collective. Both lists follow the receiver's pack order. A key names the step
        that read it: in a balance window, any step of the window."""
        routes = state.routes
        assert routes is not None
        sizes = {
            step: [np.asarray(m["nbytes"], dtype=np.int64) for m in messages]
            for step, messages in state.step_messages().items()
        }
        if state.window is not None and state.window.prepared is not None:
            prepared = state.window.prepared
        elif state.prepared is not None and state.error is None:
            prepared = {state.step: state.prepared}
        else:
            # Cannot happen while read errors end the step at its gather; kept safe anyway:
            # the announced number of bytes still goes out, as zeros the receivers report.
            own = sizes[state.step][self._rank]
            prepared = {state.step: [Prepared.zeros(int(n)) for n in own]}
        outgoing = {
            dest: [(key, prepared[key[1]][key[2]]) for key in keys]
            for dest, keys in routes.send.items()
        }
        incoming: dict[int, list[tuple[Any, int]]] = {}
        for keys in routes.bins:
            for key in keys:
                if key[0] != self._rank:
                    size = int(sizes[key[1]][key[0]][key[2]])
                    incoming.setdefault(key[0], []).append((key, size))
        return outgoing, incoming

    # -- pack ---------------------------------------------------------------------------------

    async def _pack(self, state: StepState) -> None:
        if state.terminal:
            if state.edge is not None and state.edge.final_round:
                await self._final_round(state)
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
            count = rank_loss_tokens(by_step, plan, self._rank)
            if count is not None:
                state.loss = LossCount(count)
        if state.error is None and state.remote is None and state.routes is not None:
            # A free device slot and no earlier step waiting for one: stage now, so that a
            # failed copy is announced with the step. (Staging past a waiting step would take
            # the slot it waits for, and it is delivered first: a deadlock.)
            stage_now = not self._stager.active or (
                self._waiting_h2d == 0 and not self._device_slots.locked()
            )
            if self._stager.active:
                state.device = DeviceSlot(now=stage_now)
                if stage_now:
                    await self._device_slots.acquire()
                    state.device.held = True
                else:
                    self._waiting_h2d += 1
            loop = asyncio.get_running_loop()
            try:
                state.host_batch, state.staged = await loop.run_in_executor(
                    self._cpu, self._pack_sync, state, stage_now
                )
            except Exception as exc:
                state.fail("pack", exc)  # unless a part of it (collate, h2d) said so first
                self._release_device_slot(state)
                if self._stager.active and not stage_now:
                    self._waiting_h2d -= 1
        if state.window is not None and state.routes is not None:
            state.window.forget(state.routes.bins, self._rank)
        state.release_payloads()
        await self._sequencer.turn(state.step, "settle")
        self._settled.append(state)
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
        single = self._config.oversized_policy == "single"
        packed = []
        for b, keys in enumerate(routes.bins):
            samples = []
            for key in keys:
                if key[0] == rank and self._assigned is None:
                    samples.append(local[key[1]][key[2]])
                else:
                    try:
                        samples.append(received[key])
                    except KeyError:
                        raise PlanningError(
                            f"Rank {rank} did not receive sample {SampleKey(*key)} planned for "
                            f"it at step {state.step}; the exchange lost data."
                        ) from None
            try:
                bin_packed = self._pack_fn(samples, self._config.seq_len)
            except Exception as exc:
                where = f"Bin {b} of step {state.step} on rank {self._global_ranks[rank]}"
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
                seq_len=self._config.seq_len,
                oversized_single=single,
                default_pack=default_pack,
                where=f"Bin {b} of step {state.step} on rank {self._global_ranks[rank]}",
            )
            packed.append(bin_packed)
        if state.loss is None and self._pack_fn is default_pack_fn:
            # Samples read after planning (shared-dataset mode) carry no count in the
            # metadata: the packed labels say exactly what the rank trains on.
            state.loss = LossCount(sum(map(count_loss_tokens, packed)))
        with state.failing("collate"):
            batch = self._collate_fn(packed)
        with state.failing("h2d"):
            # Waiting for a device slot: the batch waits on the host, pinned.
            staged = self._stager.stage(batch) if stage_now else self._stager.pin(batch)
        return batch, staged

    # -- world ------------------------------------------------------------------------------

    async def _world_round(self, state: StepState) -> None:
        if state.skip:
            return  # delivered before the restore, in every group alike: no round
        await self._world.run(state)
        self.world_step = state.step
        self.notify()

    async def _wait_world_round(self, step: int) -> None:
        """Wait for the world round of ``step`` (or for rounds to stop, or the pipeline)."""
        if not self._world.spans_groups:
            return
        while not (
            self.world_step >= step
            or self._world.stopped
            or (self._task is not None and self._task.done())
        ):
            await self._progress.wait()

    # -- h2d ----------------------------------------------------------------------------------

    async def _h2d(self, state: StepState) -> None:
        """Copy a step that waited on the host once a device slot is free (in step order)."""
        slot = state.device
        if state.terminal or slot is None or slot.now or state.staged is None or state.error:
            return
        if state.remote is not None:
            self._waiting_h2d -= 1
            return  # raised at delivery: nothing to copy
        await self._device_slots.acquire()
        slot.held = True
        loop = asyncio.get_running_loop()
        try:
            state.staged = await loop.run_in_executor(self._cpu, self._stager.stage, state.staged)
        except Exception as exc:
            # The step's status was announced before this copy: peers cannot learn of the
            # failure in a metadata round. Close the transport so that they fail promptly
            # with a peer failure, and raise the copy's error here.
            state.fail("h2d", exc)
            self._release_device_slot(state)
            await self._abort_after_local_planning_failure(state, exc)
        finally:
            # Only now may pack stage a later step at once: counted down before the copy, a
            # later step could take a slot freed meanwhile and be copied first (out of order).
            self._waiting_h2d -= 1


class _Aborted(Exception):
    """Raised in stages waiting for a turn after the pipeline stopped."""


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside a (possibly nested) exception group that is not a cancellation."""
    if isinstance(exc, BaseExceptionGroup):
        found = [_first_error(e) for e in exc.exceptions]
        real = [e for e in found if not isinstance(e, (asyncio.CancelledError, _Aborted))]
        return (real or found)[0]
    return exc


_GROUP_FAILURES = (
    TransportTimeoutError,
    PeerFailureError,
    CollectiveMismatchError,
    TransportClosedError,
)
