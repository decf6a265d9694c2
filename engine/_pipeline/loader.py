"""``BalancedLoader``: the public face of the pipeline, as an async and a sync iterator.

The loader owns one :class:`~evenflow.engine._pipeline.pipeline.Pipeline` per pass and the
parts it is built from: its source and transports as ``binding`` takes them, its threads
(``loader_threads``), its position in its epochs and the checkpoint of it (``position``), and
the sums of the steps it delivered (``pass_report.PassTally``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from evenflow.engine._config import LoaderConfig
from evenflow.engine._logging import show_info_lines
from evenflow.engine._pipeline.binding import (
    bind_source,
    check_source,
    check_world_transport,
    resolve_transport,
    source_metadata_fn,
)
from evenflow.engine._pipeline.calibration import (
    CalibrationStats,
    group_calibration,
)
from evenflow.engine._pipeline.facade import END, LoaderFacade, Runner
from evenflow.engine._pipeline.launchpoints import CallerLauncher
from evenflow.engine._pipeline.loader_threads import LoaderThreads
from evenflow.engine._pipeline.loop_thread import (
    SwitchIntervalScope,
    lowered_niceness,
)
from evenflow.engine._pipeline.loss_tokens import LossTokens, step_loss_tokens
from evenflow.engine._pipeline.one_shot import OneShotSource, guard_one_shot
from evenflow.engine._pipeline.parts import (
    check_callables,
    check_config,
    fingerprint_of,
    loader_identity,
    loader_parts,
    resume_identity,
)
from evenflow.engine._pipeline.pass_report import PassSummary, PassTally, transform_report
from evenflow.engine._pipeline.pipeline import Pipeline
from evenflow.engine._pipeline.position import LoaderPosition
from evenflow.engine._pipeline.read_assigned import AssignedReader, shared_identity, shared_source
from evenflow.engine._pipeline.resume import (
    restore_source,
)
from evenflow.engine._pipeline.stats import StepStats
from evenflow.engine._pipeline.step import StepState
from evenflow.engine._pipeline.world_round import WorldRound
from evenflow.engine._sources._common import SourceReport
from evenflow.engine._tracing import StallMeter
from evenflow.engine.errors import ConfigError, LoaderStateError
from evenflow.transports import Transport

__all__ = ["BalancedLoader"]

logger = logging.getLogger("evenflow")

T = TypeVar("T")


class BalancedLoader(LoaderFacade):
    """Balanced, packed, device-ready training steps from a rank-local source.

    ``source`` yields one *local step* per iteration: ``bins_per_rank`` non-empty bins, each a
    sequence of raw samples. Every rank of the balance group (the ranks of ``transport``) runs
    one loader over its own source; the loaders gather sample metadata, plan a re-assignment
    that equalises predicted compute, move only the samples that change rank, pack each planned
    bin with ``pack_fn(samples, seq_len)``, collate with ``collate_fn(packed_bins)`` and copy
    the batch to ``device`` — ``config.prefetch_depth`` steps ahead of the caller.

    Use it as an async iterator (``async with loader: async for batch in loader``) or a sync
    one (``with loader: for batch in loader``); both overlap the pipeline with the caller.
    Every rank of a group must iterate the same way and call the optional hooks
    (:meth:`prefetch_plan`, :meth:`prefetch`) at the same points.
    """

    def __init__(
        self,
        source: Iterable[Any] | Any,
        *,
        config: LoaderConfig,
        metadata_fn: Callable[[Any], Any] | None = None,
        pack_fn: Callable[[list[Any], int], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        transport: Transport | str | None = None,
        cost_model: Any = None,
        algorithm: Any = "default",
        device: Any = None,
        move_fn: Callable[[Any, Any], Any] | None = None,
        cpu_fields: Sequence[str] = (),
        tracer: Any = None,
        stats_callback: Callable[[StepStats], None] | None = None,
        world_transport: Transport | None = None,
    ) -> None:

        super().__init__()
        check_config(config)
        check_source(source)
        # Cheap checks before a transport may be created from a name.
        check_callables(
            metadata_fn=metadata_fn,
            pack_fn=pack_fn,
            collate_fn=collate_fn,
            move_fn=move_fn,
            stats_callback=stats_callback,
        )
        metadata_fn = source_metadata_fn(source, metadata_fn)
        self._source = guard_one_shot(source)
        self._config = config
        # Computed once, from the thread that builds the loader: threads inherit their
        # creator's niceness, so every thread the loader starts gets this absolute value.
        self._thread_niceness = lowered_niceness(config.thread_nice)
        self._transport, self._owns_transport = resolve_transport(transport, config)
        self._world_transport = check_world_transport(world_transport, self._transport)
        #: A step source's values that disagree with this loader's (``bind_loader``): raised
        #: here when no peer is waiting for this rank, else by the source's first read, so
        #: that the first metadata round refuses the group on every rank with this message.
        self.bind_refusal = bind_source(source, config, self._transport, self._world_transport)
        if self.bind_refusal is not None and self._data_parallel_size == 1:
            raise self.bind_refusal
        parts = loader_parts(
            config,
            num_ranks=self._transport.num_ranks,
            metadata_fn=metadata_fn,
            pack_fn=pack_fn,
            collate_fn=collate_fn,
            cost_model=cost_model,
            algorithm=algorithm,
            device=device,
            move_fn=move_fn,
            cpu_fields=cpu_fields,
            tracer=tracer,
            stats_callback=stats_callback,
        )
        self._metadata_fn = parts.metadata_fn
        self._pack_fn = parts.pack_fn
        self._collate_fn = parts.collate_fn
        self._planner = parts.planner
        self._calibration = group_calibration(
            self._planner,
            rank=self._transport.rank,
            num_ranks=self._transport.num_ranks,
            bins_per_rank=config.bins_per_rank,
            lag=config.prefetch_depth + config.balance_window + 1,
        )
        self._stager = parts.stager
        self._tracer = parts.tracer
        self._tracer.bind(self._transport.global_ranks[self._transport.rank])
        trace_workers = getattr(source, "trace_workers", None)
        if callable(trace_workers):  # a source's transform workers: a trace track each
            trace_workers(self._tracer)
        self._meter = StallMeter()
        self._stats_callback = stats_callback
        self._launcher: CallerLauncher | None = None
        if self._transport.launch_on_caller:
            self._launcher = CallerLauncher()
            self._transport.launcher = self._launcher
        # Shared-dataset mode: a bounded pool reads each step's assigned samples.
        shared = shared_source(source)
        read_threads = None if shared is None else int(getattr(shared, "read_threads", 1))
        self._threads = LoaderThreads(niceness=self._thread_niceness, read_threads=read_threads)
        self._assigned: AssignedReader | None = None
        if shared is not None and self._threads.read is not None:
            self._assigned = AssignedReader(shared, self._threads.read, threads=read_threads or 1)
        self._dataset = shared_identity(source)
        self._pipeline: Pipeline | None = None
        self._pass_finished = False
        self._position = LoaderPosition()
        self._last_stats: StepStats | None = None
        self._tally = PassTally(warn=self._transport.rank == 0)  # the delivered steps' sums
        self._last_loss_tokens: LossTokens | None = None
        self._last_host_batch: Any = None
        self._last_pass: PassSummary | None = None
        self._switch_release: weakref.finalize | None = None  # holds the lowered interval
        #: Threads ``close()`` abandoned inside user code (name and what each ran); empty
        #: when every thread finished within ``config.close_timeout``.
        self.abandoned_threads: list[str] = []

    # -- properties ----------------------------------------------------------------------------

    @property
    def config(self) -> LoaderConfig:
        return self._config

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def step(self) -> int:
        """Number of steps delivered in the current pass (a restored position included)."""
        return self._position.delivered

    @property
    def epoch(self) -> int:
        return self._position.epoch

    @property
    def last_stats(self) -> StepStats | None:
        """Balance statistics of the last *consumed* step (never of a prefetched one)."""
        return self._last_stats

    @property
    def last_loss_tokens(self) -> LossTokens | None:
        """Loss targets of the last delivered step on this rank, its balance group and the
        whole data-parallel world; ``None`` before the first step or when a sample's count is
        unknown (a custom ``pack_fn`` whose ``metadata_fn`` sets no ``loss_tokens``)."""
        return self._last_loss_tokens

    @property
    def world_transport(self) -> Transport | None:
        """The transport of the world round across balance groups (``None``: the balance
        group is the whole world)."""
        return self._world_transport

    @property
    def last_pass(self) -> PassSummary | None:
        """How the last finished pass ended and what it left unread (``None`` until one
        ends: by its sources, ``max_steps`` or ``set_epoch()``)."""
        return self._last_pass

    @property
    def last_host_batch(self) -> Any:
        """The host (CPU) view of the last delivered batch."""
        return self._last_host_batch

    @property
    def group_ranks(self) -> tuple[int, ...]:
        return self._transport.global_ranks

    @property
    def _data_parallel_size(self) -> int:
        world = self._world_transport
        return (world if world is not None else self._transport).num_ranks

    def __len__(self) -> int:
        if self.bind_refusal is not None:
            # A TypeError, which list() and length hints read as "unknown": the refusal must
            # reach the first metadata round, where every rank of the group raises it.
            raise TypeError(
                f"len() of this BalancedLoader is unknown: {self.bind_refusal}"
            ) from self.bind_refusal
        limit = self._config.max_steps
        try:
            size: int | None = len(self._source)
        except TypeError:  # the source has no __len__
            size = None
        if limit is None and size is None:
            raise TypeError(
                "len() of this BalancedLoader is unknown: the source has no len() and "
                "config.max_steps is None."
            )
        return min(v for v in (limit, size) if v is not None)

    def trace_summary(self) -> dict[str, Any]:
        """Per-stage timings (when tracing), the caller's data stall versus compute, and how
        close the delivered steps' plans were to their bounds (``"balance"``: see
        :class:`BalanceTally`)."""
        summary = dict(self._tracer.summary())
        summary["caller"] = self._meter.summary()
        summary["pass"] = None if self._last_pass is None else self._last_pass.to_dict()
        summary["balance"] = self._tally.balance.to_dict()
        return summary

    def fingerprint(self, *, for_resume: bool = False) -> str:
        """Digest of :meth:`identity` (24 hex characters)."""
        return fingerprint_of(self.identity(for_resume=for_resume))

    def identity(self, *, for_resume: bool = False) -> dict[str, Any]:
        """Plain data every rank of a group must agree on: configuration, planner identity
        (cost model and algorithm), group layout, transport and library version.

        ``for_resume=True``: what a restore must match instead, the same on every rank of
        any layout (the configuration without run-length and runtime settings such as
        ``max_steps``, prefetch depths, timeout, logging and planning mode; the planner
        without its group size; the version).
        """
        if for_resume:
            return resume_identity(self._config, self._planner)
        transport = self._transport
        return loader_identity(
            self._config,
            self._planner,
            transport.global_ranks,
            transport.name,
        )

    # -- the entry points' bodies (LoaderFacade writes the sync and async forms) ---------------

    async def _produce(self, run: Runner) -> Any:
        started = self._begin_wait()
        try:
            if self._pipeline is None:
                if self._pass_finished:
                    return END
                await run.loop(self._start_pass())
            pipeline = self._pipeline
            assert pipeline is not None
            state = await run.loop(pipeline.next_state_bounded(), pump=True)
            if state is None:
                await run.loop(self._finish_pass())
                return END
            return self._deliver(state)
        finally:
            self._end_wait(started)

    async def _prefetch_until(self, goal: str, run: Runner) -> None:
        if self._launcher is None or self._pipeline is None or self._closed:
            return
        pipeline, target = self._pipeline, self._next_step()

        def done() -> bool:
            if goal == "plan":
                return pipeline.planned(target)
            return max(pipeline.exchanged_step, pipeline.exchange_launched_step) >= target

        await run.loop(pipeline.wait_until(done), pump=True)

    async def _restart(self, epoch: int, run: Runner) -> None:
        # load_state_dict() came first: the restored epoch keeps the restored position.
        restored = self._pipeline is None and not self._pass_finished
        if restored and self._position.keeps_restored(epoch):
            return
        if isinstance(self._source, OneShotSource):
            self._source.check_reusable(f"set_epoch({epoch})")
        # Draining finishes the in-flight steps' collectives, which may need caller launches.
        if self._pipeline is not None:
            await run.loop(self._restart_pass(), pump=True)
        self._reset_pass(epoch)

    async def _release(self, run: Runner) -> None:
        await run.loop(self._close_pass())
        await run.loop(self._release_resources())

    @property
    def _pass_running(self) -> bool:
        return self._pipeline is not None

    @property
    def _pass_ended(self) -> bool:
        return self._pass_finished and self._pipeline is None

    def _current_epoch(self) -> int:
        return self._position.epoch

    def _pump(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        # Async mode: the caller's thread runs the loop, so launches run inline between awaits.
        return self._launcher.pump(coro) if self._launcher is not None else coro

    def _pump_blocking(self, future: concurrent.futures.Future[T]) -> T:
        # Sync mode: the caller's thread runs queued launches while it waits for ``future``.
        if self._launcher is None:
            return future.result()
        return self._launcher.pump_blocking(future, self._config.timeout)

    # -- calibration ----------------------------------------------------------------------------

    def record_compute(self, seconds: float, *, bin: int | None = None) -> None:
        """Report the compute the last step delivered took on this rank, for calibration.

        ``seconds``: measured forward + backward time of one bin (``bin``, its index among
        this rank's ``bins_per_rank``) or of all of the step's bins (``bin=None``), without
        waiting on other ranks (time before the gradient all-reduce, or with device events).
        Only a :class:`~evenflow.engine.CalibratedCost` uses it; with another cost model this
        raises. Call it before the next ``next()``: a measurement recorded later may arrive
        after its step and be counted late. Non-finite, zero or negative seconds are accepted
        and counted as refused (see :attr:`calibration_stats`), never fitted.
        """
        if self._calibration is None:
            raise ConfigError(
                "record_compute() needs cost_model=CalibratedCost(...); this loader's cost "
                f"model is {self._planner.cost_model_id!r}, which does not calibrate."
            )
        if self._position.delivered == self._position.first_step:
            raise LoaderStateError(
                "record_compute() measures the last step delivered, but this pass has not "
                "delivered a step yet; call it after next()."
            )
        self._calibration.record(self._position.delivered - 1, seconds, bin)

    @property
    def calibration_stats(self) -> CalibrationStats | None:
        """How well the calibrated cost model predicts measured compute (None without
        :class:`~evenflow.engine.CalibratedCost`)."""
        if self._calibration is None:
            return None
        return self._calibration.stats(self._position.delivered - 1)

    # -- epochs and resume -------------------------------------------------------------------

    async def _restart_pass(self) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            await pipeline.drain(self._config.timeout)
            self._summarise_pass(pipeline, "restart")
        await self._close_pass()

    def _reset_pass(self, epoch: int) -> None:
        if self._calibration is not None:
            self._calibration.new_pass()
        self._meter.pause()
        self._position.new_pass(epoch)
        self._pass_finished = False
        self._last_host_batch = None
        self._last_stats = None
        self._last_loss_tokens = None
        self._tally.new_pass()
        set_epoch = getattr(self._source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The consumed position: plain data (msgpack- and ``torch.save``-friendly), laid out
        for ``torch.distributed.checkpoint`` too (ranks' data never share a key).

        Describes the steps *delivered* to the caller only; prefetched steps are not counted,
        so a restored loader re-reads and re-delivers them exactly. With a source whose
        position is global (``DatasetSource``) the state is the same on every rank at the
        same step and restores onto any number of ranks; otherwise it holds this rank's own
        entry, keyed by its process rank. With a balance window the source state is the one
        at the first step of the window that holds the next step: a restored loader reads the
        window again from there, plans it identically and skips the steps already delivered.
        A window the pass ended early (at ``max_steps`` or the source's end) is closed once
        delivered: the state is then the one after its last step.
        """
        return self._position.save(
            identity=self.identity(for_resume=True),
            source=self._source,
            transport=self._transport,
            config=self._config,
            finished=self._pass_finished,
            calibration=self._calibration,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; only before iteration starts.

        Also a ``torch.distributed.checkpoint`` ``Stateful``: ``dcp.load({"loader": loader},
        ...)`` calls it with what this rank needs of the saved state."""
        self._check_open()
        if self._pipeline is not None or self._position.delivered or self._pass_finished:
            raise LoaderStateError(
                "load_state_dict() must be called before iteration starts (or right after "
                "set_epoch()); this loader has already delivered or prefetched steps."
            )
        self._position.load(
            state,
            identity=self.identity(for_resume=True),
            source=self._source,
            transport=self._transport,
            config=self._config,
            calibration=self._calibration,
        )

    # -- internals ---------------------------------------------------------------------------

    def _next_step(self) -> int:
        return self._position.delivered

    async def _start_pass(self) -> None:
        if self._config.log_stats and self._transport.rank == 0:
            show_info_lines()
        interval = self._config.switch_interval
        if interval is not None and self._switch_release is None:
            SwitchIntervalScope.acquire(interval)
            # Released at close(), or when a loader dropped without close() is collected.
            self._switch_release = weakref.finalize(self, SwitchIntervalScope.release)
        loop = asyncio.get_running_loop()
        if self._launcher is not None:
            self._launcher.bind(loop)
        restored = self._position.restored
        if restored is not None:
            self._position.restored = None
            initial_iter = await loop.run_in_executor(
                self._threads.source,
                restore_source,
                self._source,
                self._position.read_from,
                restored.source,
            )
        else:
            initial_iter = None
        pipeline = Pipeline(
            source=self._source,
            config=self._config,
            transport=self._transport,
            planner=self._planner,
            metadata_fn=self._metadata_fn,
            pack_fn=self._pack_fn,
            collate_fn=self._collate_fn,
            stager=self._stager,
            tracer=self._tracer,
            first_step=self._position.first_step,
            cpu_executor=self._threads.cpu,
            source_executor=self._threads.source,
            initial_iter=initial_iter,
            read_from=self._position.read_from,
            initial_source_state=self._position.source_state,
            world=WorldRound(self._world_transport, on_uneven_end=self._config.on_uneven_end),
            assigned=self._assigned,
            dataset=self._dataset,
            calibration=self._calibration,
        )
        if self._launcher is not None:
            self._launcher.on_final = lambda op: (
                pipeline.exchange_launched() if op == "exchange" else None
            )
        self._pipeline = pipeline
        pipeline.start()

    async def _finish_pass(self) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            final = pipeline.final_round
            reason = "exhausted" if final is None else final.end_reason or "exhausted"
            if final is not None and final.uneven is not None:
                reason = "uneven"
            self._summarise_pass(pipeline, reason)
        await self._close_pass()
        self._pass_finished = True

    def _summarise_pass(self, pipeline: Pipeline, reason: str) -> None:
        final = pipeline.final_round
        report = getattr(self._source, "report", None)
        summary = PassSummary(
            epoch=self._position.epoch,
            steps=self._position.delivered,
            end_reason=reason,
            samples=self._tally.samples,
            tokens=self._tally.tokens,
            uneven=None if final is None else final.uneven,
            source=report if isinstance(report, SourceReport) else None,
            num_discarded_samples=pipeline.num_discarded_samples,
            num_outlier_bound_steps=self._tally.pass_balance.to_dict()["outlier_bound"],
            outlier_cost_fraction=self._tally.pass_balance.outlier_cost_fraction,
            num_zero_loss_steps=self._tally.zero_loss,
            transform=transform_report(self._source),
        )
        self._last_pass = summary
        if self._transport.rank == 0 and logger.isEnabledFor(logging.INFO):
            logger.info("%s", summary.log_line())

    async def _close_pass(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            await pipeline.aclose()
        if self._launcher is not None:
            self._launcher.clear()

    async def _release_resources(self) -> None:
        try:
            self._stager.close()
            self._tracer.close()
            if self._owns_transport:
                await self._transport.aclose()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._shutdown_executors)
        finally:
            if self._switch_release is not None:
                self._switch_release()  # runs SwitchIntervalScope.release once

    def _shutdown_executors(self) -> list[str]:
        """Stop the loader's threads (see :meth:`LoaderThreads.shutdown`)."""
        stuck = self._threads.shutdown(self._config.close_timeout, self._source)
        self.abandoned_threads = stuck
        return stuck

    def _deliver(self, state: StepState) -> Any:
        batch = self._stager.deliver(state.staged)
        self._position.deliver(state)
        if state.stats is not None and state.transform is not None:
            state.stats = dataclasses.replace(state.stats, transform=state.transform)
        self._last_stats = state.stats
        self._last_loss_tokens = step_loss_tokens(
            state.step, state.loss, world_round=self._world_transport is not None
        )
        self._tally.add(state, self._last_loss_tokens)  # (warns of a step with no loss target)
        self._last_host_batch = state.host_batch
        stats = state.stats
        if stats is not None:
            if (
                self._config.log_stats
                and self._transport.rank == 0
                and logger.isEnabledFor(logging.INFO)
            ):
                logger.info(stats.log_line())
            if self._stats_callback is not None:
                # Statistics are observability: a failing callback must not cost a step.
                try:
                    self._stats_callback(stats)
                except Exception:
                    logger.exception("stats_callback raised at step %d; continuing", stats.step)
        return batch

    def _begin_wait(self) -> float:
        started = self._meter.start_wait()
        interval = self._meter.compute_interval
        if interval is not None:
            self._tracer.add("compute", self._position.delivered - 1, interval[0], interval[1])
        return started

    def _end_wait(self, started: float) -> None:
        ended = self._meter.end_wait()
        self._tracer.add("wait", self._position.delivered - 1, started, ended)

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._mode or "new")
        return (
            f"<BalancedLoader {state} rank={self._transport.rank}/"
            f"{self._transport.num_ranks} step={self._position.delivered}>"
        )
