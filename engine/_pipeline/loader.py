"""``BalancedLoader``: the public face of the pipeline, as an async and a sync iterator."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.launchpoints import CallerLauncher
from evenflow.engine._pipeline.pipeline import Pipeline
from evenflow.engine._pipeline.stats import StepStats
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import ConfigError, LoaderStateError, StallTimeoutError
from evenflow.transports import Transport

__all__ = ["BalancedLoader"]

logger = logging.getLogger("evenflow")

STATE_FORMAT = "evenflow.loader"
_RUNTIME_ONLY = ("prefetch_depth", "timeout", "log_stats", "switch_interval")
STATE_VERSION = 1
LIBRARY_VERSION = "0.1.0"


def default_metadata_fn(sample: Any) -> int:
    """Token count of a sample: ``len(sample["input_ids"])`` for mappings, else ``len(sample)``."""
    if isinstance(sample, dict) and "input_ids" in sample:
        return len(sample["input_ids"])
    try:
        return len(sample)
    except TypeError:
        raise TypeError(
            f"The default metadata_fn cannot measure a sample of type {type(sample).__name__}; "
            "pass metadata_fn=lambda sample: SampleMetadata(tokens=...)."
        ) from None


class _KeepSource:
    """The algorithm used with ``balance=False``: always keep the source layout."""

    name = "source"
    algorithm_id = "source-v1"

    def assign(self, problem: Any) -> None:
        return None


class BalancedLoader:
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
    ) -> None:
        from evenflow.engine._pipeline.h2d import DeviceStager
        from evenflow.engine._pipeline.pack import default_collate_fn, default_pack_fn
        from evenflow.engine._planning.planner import Planner
        from evenflow.engine._tracing import StallMeter, resolve_tracer

        if not isinstance(config, LoaderConfig):
            raise TypeError(f"config must be a LoaderConfig, but got {config!r:.80}.")
        if not (hasattr(source, "__iter__") or hasattr(source, "__aiter__")):
            raise TypeError(
                f"source must be an iterable or async iterable of steps, but got "
                f"{type(source).__name__}."
            )
        for name, fn in (
            ("metadata_fn", metadata_fn),
            ("pack_fn", pack_fn),
            ("collate_fn", collate_fn),
            ("move_fn", move_fn),
            ("stats_callback", stats_callback),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, but got {fn!r:.80}.")
        self._source = source
        self._config = config
        self._metadata_fn = metadata_fn or default_metadata_fn
        self._pack_fn = pack_fn or default_pack_fn
        self._collate_fn = collate_fn or default_collate_fn
        self._transport, self._owns_transport = _resolve_transport(transport, config)
        self._planner = Planner(
            num_ranks=self._transport.num_ranks,
            bins_per_rank=config.bins_per_rank,
            seq_len=config.seq_len,
            cost_model=cost_model,
            algorithm=algorithm if config.balance else _KeepSource(),
            objective=config.objective,
            min_balance_gain=config.min_balance_gain,
            oversized_policy=config.oversized_policy,
            packing_budgets=dict(config.packing_budgets or {}) or None,
        )
        self._stager = DeviceStager(device, move_fn=move_fn, cpu_fields=tuple(cpu_fields))
        self._tracer = resolve_tracer(tracer)
        self._tracer.bind(self._transport.global_ranks[self._transport.rank])
        self._meter = StallMeter()
        self._stats_callback = stats_callback
        self._launcher: CallerLauncher | None = None
        if self._transport.launch_on_caller:
            self._launcher = CallerLauncher()
            self._transport.launcher = self._launcher
        self._cpu = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="evenflow-cpu")
        self._source_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="evenflow-source"
        )
        self._mode: str | None = None  # "async" | "sync"
        self._closed = False
        self._pipeline: Pipeline | None = None
        self._pass_finished = False
        self._loop_thread: _LoopThread | None = None
        self._epoch = 0
        self._first_step = 0
        self._delivered = 0  # steps delivered in this pass, counting restored ones
        self._last_stats: StepStats | None = None
        self._last_host_batch: Any = None
        self._source_state: Any = None
        self._restored: dict[str, Any] | None = None

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
        return self._delivered

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def last_stats(self) -> StepStats | None:
        """Balance statistics of the last *consumed* step (never of a prefetched one)."""
        return self._last_stats

    @property
    def last_host_batch(self) -> Any:
        """The host (CPU) view of the last delivered batch."""
        return self._last_host_batch

    @property
    def group_ranks(self) -> tuple[int, ...]:
        return self._transport.global_ranks

    def __len__(self) -> int:
        limit = self._config.max_steps
        try:
            size: int | None = len(self._source)  # type: ignore[arg-type]
        except TypeError:  # no __len__ (mypy cannot know whether the source is Sized)
            size = None
        if limit is None and size is None:
            raise TypeError(
                "len() of this BalancedLoader is unknown: the source has no len() and "
                "config.max_steps is None."
            )
        return min(v for v in (limit, size) if v is not None)

    def trace_summary(self) -> dict[str, Any]:
        """Per-stage timings (when tracing) and the caller's data stall versus compute."""
        summary = dict(self._tracer.summary())
        summary["caller"] = self._meter.summary()
        return summary

    def fingerprint(self, *, for_resume: bool = False) -> str:
        """Digest of :meth:`identity` (24 hex characters)."""
        identity = self.identity(for_resume=for_resume)
        text = json.dumps(identity, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def identity(self, *, for_resume: bool = False) -> dict[str, Any]:
        """Plain data every rank of a group must agree on: configuration, planner identity
        (cost model and algorithm), group layout, transport and library version.

        ``for_resume=True`` leaves out the settings that may change across a restart without
        changing what is delivered (prefetch depth, timeout, logging).
        """
        config = self._config.to_dict()
        if for_resume:
            for name in _RUNTIME_ONLY:
                config.pop(name, None)
        return {
            "config": config,
            "planner": self._planner.identity(),
            "group": list(self._transport.global_ranks),
            "transport": self._transport.name,
            "version": LIBRARY_VERSION,
        }

    # -- async iteration ---------------------------------------------------------------------

    def __aiter__(self) -> BalancedLoader:
        self._enter("async")
        return self

    async def __anext__(self) -> Any:
        self._enter("async")
        started = self._begin_wait()
        try:
            if self._pipeline is None:
                if self._pass_finished:
                    raise StopAsyncIteration
                await self._start_pass()
            pipeline = self._pipeline
            assert pipeline is not None
            goal = self._next_state(pipeline)
            state = await (self._launcher.pump(goal) if self._launcher else goal)
            if state is None:
                await self._finish_pass()
                raise StopAsyncIteration
            return self._deliver(state)
        finally:
            self._end_wait(started)

    async def aprefetch_plan(self) -> None:
        """Async form of :meth:`prefetch_plan`."""
        self._enter("async")
        if self._launcher is not None and self._pipeline is not None:
            pipeline, target = self._pipeline, self._next_step()
            await self._launcher.pump(pipeline.wait_until(lambda: pipeline.gathered_step >= target))

    async def aprefetch(self) -> None:
        """Async form of :meth:`prefetch`."""
        self._enter("async")
        if self._launcher is not None and self._pipeline is not None:
            pipeline, target = self._pipeline, self._next_step()
            await self._launcher.pump(
                pipeline.wait_until(
                    lambda: max(pipeline.exchanged_step, pipeline.exchange_launched_step) >= target
                )
            )

    async def __aenter__(self) -> BalancedLoader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel in-flight work and release every resource. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._close_pass()
        await self._release()

    # -- sync iteration ----------------------------------------------------------------------

    def __iter__(self) -> BalancedLoader:
        self._enter("sync")
        return self

    def __next__(self) -> Any:
        self._enter("sync")
        started = self._begin_wait()
        try:
            thread = self._ensure_thread()
            if self._pipeline is None:
                if self._pass_finished:
                    raise StopIteration
                thread.call(self._start_pass())
            pipeline = self._pipeline
            assert pipeline is not None
            future = thread.submit(self._next_state(pipeline))
            state = (
                self._launcher.pump_blocking(future, self._config.timeout)
                if self._launcher
                else future.result()
            )
            if state is None:
                thread.call(self._finish_pass())
                raise StopIteration
            return self._deliver(state)
        finally:
            self._end_wait(started)

    def prefetch_plan(self) -> None:
        """Launch point: make sure the next step's metadata gather has been launched.

        Needed only for transports that launch on the caller's thread (NCCL/HCCL); a no-op
        otherwise. Call it on every rank at the same point of the training step, while device
        compute is pending. Repeated calls are harmless; it never advances the source.
        """
        self._hook(lambda p, t: p.gathered_step >= t)

    def prefetch(self) -> None:
        """Launch point: finish planning and launch the next step's payload exchange.

        Same rules as :meth:`prefetch_plan` (which it includes).
        """
        self._hook(lambda p, t: max(p.exchanged_step, p.exchange_launched_step) >= t)

    def _hook(self, done: Callable[[Pipeline, int], bool]) -> None:
        if self._mode == "async":
            raise LoaderStateError(
                "This loader is iterated asynchronously; await loader.aprefetch() / "
                "loader.aprefetch_plan() instead of the sync hooks."
            )
        if self._launcher is None or self._pipeline is None or self._closed:
            return
        pipeline, target = self._pipeline, self._next_step()
        thread = self._ensure_thread()
        future = thread.submit(pipeline.wait_until(lambda: done(pipeline, target)))
        self._launcher.pump_blocking(future, self._config.timeout)

    def __enter__(self) -> BalancedLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Cancel in-flight work, release buffers, join every thread. Idempotent."""
        if self._closed:
            return
        if self._mode == "async":
            raise LoaderStateError(
                "This loader is iterated asynchronously; use 'await loader.aclose()' or "
                "'async with loader:'."
            )
        self._closed = True
        thread = self._loop_thread
        if thread is None:
            thread = self._ensure_thread(allow_closed=True)
        try:
            thread.call(self._close_pass())
            thread.call(self._release())
        finally:
            thread.stop()
            self._loop_thread = None

    # -- epochs and resume -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start a new pass at ``epoch``: forwards the epoch to the source's ``set_epoch`` if
        it has one and restarts the step count at 0.

        Called mid-pass, it ends the current pass on every rank of the group at the next
        metadata round (peers see the end of their pass there) and discards the steps in
        flight, finishing their collectives first so the group stays in step. Every rank must
        then either call ``set_epoch`` too or keep iterating to the end of its pass.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, but got {epoch!r}.")
        self._check_open()
        if self._pipeline is not None:
            if self._mode == "async":
                raise LoaderStateError(
                    "set_epoch() was called while an async pass is running; await "
                    "loader.aset_epoch(epoch) instead."
                )
            thread = self._ensure_thread()
            future = thread.submit(self._restart_pass())
            if self._launcher is not None:
                self._launcher.pump_blocking(future, self._config.timeout)
            else:
                future.result()
        self._reset_pass(epoch)

    async def aset_epoch(self, epoch: int) -> None:
        """Async form of :meth:`set_epoch`."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, but got {epoch!r}.")
        self._check_open()
        goal = self._restart_pass()
        await (self._launcher.pump(goal) if self._launcher is not None else goal)
        self._reset_pass(epoch)

    async def _restart_pass(self) -> None:
        pipeline = self._pipeline
        if pipeline is not None:
            await pipeline.drain(self._config.timeout)
        await self._close_pass()

    def _reset_pass(self, epoch: int) -> None:
        self._meter.pause()
        self._restored = None
        self._epoch = epoch
        self._pass_finished = False
        self._first_step = 0
        self._delivered = 0
        self._source_state = None
        self._last_host_batch = None
        self._last_stats = None
        set_epoch = getattr(self._source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The consumed position: plain data (msgpack- and ``torch.save``-friendly).

        Describes the steps *delivered* to the caller only; prefetched steps are not counted,
        so a restored loader re-reads and re-delivers them exactly.
        """
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._delivered,
            "source": self._source_state,
            "source_stateful": callable(getattr(self._source, "state_dict", None)),
            "rank": self._transport.rank,
            "group": list(self._transport.global_ranks),
            "fingerprint": self.fingerprint(for_resume=True),
            "identity": self.identity(for_resume=True),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; only before iteration starts."""
        from evenflow.engine._pipeline.resume import validate_state

        self._check_open()
        if self._pipeline is not None or self._delivered or self._pass_finished:
            raise LoaderStateError(
                "load_state_dict() must be called before iteration starts (or right after "
                "set_epoch()); this loader has already delivered or prefetched steps."
            )
        validate_state(state, self)
        self._epoch = int(state["epoch"])
        set_epoch = getattr(self._source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        self._restored = state
        self._first_step = self._delivered = int(state["step"])
        self._source_state = state["source"]

    # -- internals ---------------------------------------------------------------------------

    def _enter(self, mode: str) -> None:
        self._check_open()
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise LoaderStateError(
                f"This loader is iterated in {self._mode} mode; it cannot also be iterated in "
                f"{mode} mode. Use one loader per iteration style."
            )

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderStateError("This BalancedLoader is closed; create a new one.")

    def _next_step(self) -> int:
        return self._delivered

    async def _start_pass(self) -> None:
        interval = self._config.switch_interval
        if interval is not None and sys.getswitchinterval() > interval:
            sys.setswitchinterval(interval)
        loop = asyncio.get_running_loop()
        if self._launcher is not None:
            self._launcher.bind(loop)
        if self._restored is not None:
            from evenflow.engine._pipeline.resume import restore_source

            restored, self._restored = self._restored, None
            initial_iter = await loop.run_in_executor(
                self._source_executor, restore_source, self._source, restored
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
            first_step=self._first_step,
            cpu_executor=self._cpu,
            source_executor=self._source_executor,
            initial_iter=initial_iter,
        )
        if self._launcher is not None:
            self._launcher.on_final = lambda op: (
                pipeline.exchange_launched() if op == "exchange" else None
            )
        self._pipeline = pipeline
        pipeline.start()

    async def _next_state(self, pipeline: Pipeline) -> StepState | None:
        try:
            # Every collective is bounded by the timeout on its own; a step may need two of
            # them (its exchange and the next metadata round), hence twice the timeout.
            async with asyncio.timeout(2 * self._config.timeout):
                return await pipeline.next_state()
        except TimeoutError:
            if pipeline.finished:
                raise
            raise StallTimeoutError(
                f"No step arrived within 2 x timeout={self._config.timeout:g} s on rank "
                f"{self._transport.rank}; the pipeline is at {pipeline.position()}. A source "
                "or callback may be blocked; raise LoaderConfig.timeout if steps are slower."
            ) from None

    async def _finish_pass(self) -> None:
        await self._close_pass()
        self._pass_finished = True

    async def _close_pass(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            await pipeline.aclose()
        if self._launcher is not None:
            self._launcher.clear()

    async def _release(self) -> None:
        self._stager.close()
        self._tracer.close()
        if self._owns_transport:
            await self._transport.aclose()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown_executors)

    def _shutdown_executors(self) -> None:
        self._cpu.shutdown(wait=True, cancel_futures=True)
        # Joins the source thread: a source blocked inside next() delays close() until it
        # returns (a thread cannot be interrupted).
        self._source_executor.shutdown(wait=True, cancel_futures=True)

    def _deliver(self, state: StepState) -> Any:
        batch = self._stager.deliver(state.staged)
        self._delivered = state.step + 1
        self._source_state = state.source_state
        self._last_stats = state.stats
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
            self._tracer.add("compute", self._delivered - 1, interval[0], interval[1])
        return started

    def _end_wait(self, started: float) -> None:
        ended = self._meter.end_wait()
        self._tracer.add("wait", self._delivered - 1, started, ended)

    def _ensure_thread(self, *, allow_closed: bool = False) -> _LoopThread:
        if not allow_closed:
            self._check_open()
        if self._loop_thread is None:
            self._loop_thread = _LoopThread()
        return self._loop_thread

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self._mode or "new")
        return (
            f"<BalancedLoader {state} rank={self._transport.rank}/"
            f"{self._transport.num_ranks} step={self._delivered}>"
        )


def _resolve_transport(
    transport: Transport | str | None, config: LoaderConfig
) -> tuple[Transport, bool]:
    if isinstance(transport, Transport):
        return transport, False
    if transport is None:
        transport = "local"
    if isinstance(transport, str):
        from evenflow.transports._registry import create_transport

        return create_transport(transport, timeout=config.timeout), True
    raise TypeError(
        f"transport must be a Transport, a transport name or None, but got {transport!r:.80}."
    )


class _LoopThread:
    """An event loop in a background thread, for sync iteration."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="evenflow-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Any) -> Any:
        return self.submit(coro).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        self.call(_drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
