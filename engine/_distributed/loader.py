"""The loader every rank of a mesh gets, and the error codec of the model-parallel broadcast.

Ranks that differ only in model-parallel coordinates must train on the same batch: the
*constructor* of a data-parallel coordinate reads, balances and collates, and sends each
delivered step's host batch to its peers through the
:class:`~evenflow.transports.internal.BatchBroadcaster` (its message format is described
there). ``end`` and ``error`` messages carry no batch; they make every peer stop or raise at
the same step as the constructor.

All of a group's collectives run on the broadcaster's single-worker executor (two threads
driving one Gloo group corrupt data), whether the loader is iterated synchronously or
asynchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from evenflow.engine._config import LoaderConfig
from evenflow.engine._distributed.topology import Topology
from evenflow.engine._pipeline.facade import END, LoaderFacade, Runner
from evenflow.engine._pipeline.loss_tokens import LossTokens
from evenflow.engine._pipeline.parts import (
    check_config,
    fingerprint_of,
    loader_identity,
    loader_parts,
    resume_identity,
)
from evenflow.engine._pipeline.resume import earlier_epoch_error, loader_state, read_state
from evenflow.engine.errors import (
    ConfigError,
    GroupMismatchError,
    LoaderStateError,
    PlanningError,
    RemoteStageError,
    ResumeError,
    SourceExhaustedError,
)
from evenflow.transports import Transport
from evenflow.transports.errors import (
    EncodeError,
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)
from evenflow.transports.internal import BatchBroadcaster, RemoteErrorInfo, traceback_note

if TYPE_CHECKING:
    from evenflow.engine._pipeline.h2d import DeviceStager
    from evenflow.engine._pipeline.loader import BalancedLoader
    from evenflow.engine._pipeline.pass_report import PassSummary
    from evenflow.engine._pipeline.stats import StepStats

__all__ = ["DistributedLoader", "decode_error", "encode_error"]

T = TypeVar("T")

# Errors a peer re-raises as the same class (their constructors take just a message).
_PORTABLE: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ConfigError,
        GroupMismatchError,
        PlanningError,
        SourceExhaustedError,
        TransportError,
        TransportTimeoutError,
        PeerFailureError,
        WireFormatError,
        EncodeError,
    )
}


# -- errors across the broadcast -----------------------------------------------------------------


def encode_error(exc: BaseException, *, rank: int, step: int) -> dict[str, Any]:
    """Plain-data description of the constructor's failure, for its peers.

    ``kind`` is ``"same"`` for the engine's own message-only errors (the peer raises the same
    class) and ``"remote"`` otherwise (the peer raises a ``RemoteStageError``); a
    ``RemoteStageError`` is forwarded with its origin (rank, stage, step, traceback) intact.
    """
    if isinstance(exc, RemoteStageError):
        return {"kind": "remote", "info": exc.to_info().to_wire()}
    info = RemoteErrorInfo.from_exception(exc, rank=rank, stage="constructor", step=step)
    kind = "same" if type(exc) is _PORTABLE.get(type(exc).__name__) else "remote"
    return {"kind": kind, "info": info.to_wire()}


def decode_error(data: Any) -> Exception:
    """The exception a peer raises for :func:`encode_error`'s description."""
    try:
        if not isinstance(data, dict) or data.get("kind") not in ("same", "remote"):
            raise WireFormatError(
                f"Malformed error description {data!r:.120} in a batch header: expected a "
                "mapping with kind 'same' or 'remote'."
            )
        info = RemoteErrorInfo.from_wire(data.get("info"), sender="the batch constructor")
        if info.rank is None or info.step is None:
            raise WireFormatError(
                f"Malformed error description in a batch header: it names rank {info.rank!r} "
                f"and step {info.step!r}; both must be non-negative integers."
            )
    except WireFormatError as exc:
        return exc
    portable = _PORTABLE.get(info.error_type)
    if data["kind"] == "same" and portable is not None:
        error = portable(info.message)
        if info.traceback:
            error.add_note(traceback_note(f"rank {info.rank}", info.traceback))
        return error
    return RemoteStageError.from_info(info, failed_rank=info.rank)


# -- the loader every rank of a mesh gets --------------------------------------------------------


class DistributedLoader(LoaderFacade):
    """The loader :func:`~evenflow.engine.build_loader` returns: ``BalancedLoader``'s API on
    every rank of a mesh.

    On a *constructor* rank it wraps a ``BalancedLoader`` over the rank's balance group and,
    when the rank has model-parallel peers, broadcasts each delivered step's host batch to
    them. On a *follower* rank it never reads a source: each ``next()`` receives the
    constructor's batch (and copies it to ``device`` like the constructor does). End of data
    and errors reach followers in the same message stream, so they stop or raise at the same
    step. Every rank of a model-parallel group must iterate the same way (both sync or both
    async) and the same number of steps, and call ``set_epoch`` / ``load_state_dict`` at the
    same points. A follower's ``last_stats`` is always None. The lifecycle (modes, closing,
    misuse errors) is ``BalancedLoader``'s, from the same :class:`LoaderFacade`.

    Limit: the constructor sends a batch when its caller takes it, so a follower's ``next()``
    waits for the constructor's; model-parallel peers run in lockstep anyway.
    """

    _reopen_hint = "build a new one"

    def __init__(
        self,
        *,
        topology: Topology,
        config: LoaderConfig,
        inner: BalancedLoader | None,
        transport: Transport | None,
        broadcaster: BatchBroadcaster | None,
        stager: DeviceStager | None,
        identity: dict[str, Any],
        release: Callable[[], None],
        resume: dict[str, Any] | None = None,
        world_transport: Transport | None = None,
    ) -> None:
        super().__init__()
        self._topology = topology
        self._world_transport = world_transport
        self._config = config
        self._inner = inner
        self._transport = transport
        self._bc = broadcaster
        self._stager = stager
        self._identity = identity
        self._resume_identity = resume or {}
        self._release_groups = release
        # Follower-side position; constructors read theirs from the inner loader.
        self._epoch = 0
        self._step = 0
        self._last_host: Any = None
        self._last_loss: LossTokens | None = None
        # How the current pass ended on the message stream: None, "end" or "error".
        self._pass_state: str | None = None
        self._failure: BaseException | None = None
        self._restored_pending = False  # a follower restored and not yet iterating

    @classmethod
    def constructor(
        cls,
        *,
        inner: BalancedLoader,
        topology: Topology,
        transport: Transport,
        broadcaster: BatchBroadcaster | None,
        release: Callable[[], None],
        world_transport: Transport | None = None,
    ) -> DistributedLoader:
        return cls(
            topology=topology,
            config=inner.config,
            inner=inner,
            transport=transport,
            broadcaster=broadcaster,
            stager=None,
            identity=inner.identity(),
            release=release,
            resume=inner.identity(for_resume=True),
            world_transport=world_transport,
        )

    @classmethod
    def follower(
        cls,
        *,
        config: LoaderConfig,
        topology: Topology,
        broadcaster: BatchBroadcaster | None,
        loader_kwargs: dict[str, Any],
        release: Callable[[], None],
        transport: str,
    ) -> DistributedLoader:
        """A follower of ``topology``'s constructor. ``loader_kwargs`` are validated exactly as
        the constructor's ``BalancedLoader`` validates them, and the identity is the
        constructor's (same function, same planner, group and transport name; ``transport``
        is the build's transport name, ``"gloo"`` or ``"device"``)."""
        if broadcaster is None:
            raise ValueError("A follower rank needs the broadcast group of its constructor.")
        group = topology.balance_group
        parts = loader_parts(check_config(config), num_ranks=len(group), **loader_kwargs)
        # build_loader gives a balance group of one rank a local transport.
        name = "local" if len(group) == 1 else transport
        return cls(
            topology=topology,
            config=config,
            inner=None,
            transport=None,
            broadcaster=broadcaster,
            stager=parts.stager,
            identity=loader_identity(config, parts.planner, group, name),
            release=release,
            resume=resume_identity(config, parts.planner),
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def config(self) -> LoaderConfig:
        return self._config

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def is_constructor(self) -> bool:
        """Whether this rank reads and balances (else it receives its constructor's batches)."""
        return self._inner is not None

    @property
    def transport(self) -> Transport | None:
        """The balance group's transport (None on followers)."""
        return self._transport

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """Global ranks of the balance group this rank's data comes from."""
        return self._topology.balance_group

    @property
    def mp_ranks(self) -> tuple[int, ...]:
        """This rank's model-parallel peers (constructor first), itself included."""
        return self._topology.mp_group

    @property
    def step(self) -> int:
        return self._inner.step if self._inner is not None else self._step

    @property
    def epoch(self) -> int:
        return self._inner.epoch if self._inner is not None else self._epoch

    @property
    def last_stats(self) -> StepStats | None:
        return self._inner.last_stats if self._inner is not None else None

    @property
    def last_loss_tokens(self) -> LossTokens | None:
        """Loss targets of the last delivered step (a follower gets its constructor's)."""
        return self._inner.last_loss_tokens if self._inner is not None else self._last_loss

    @property
    def last_host_batch(self) -> Any:
        return self._inner.last_host_batch if self._inner is not None else self._last_host

    # Calibration: the constructor measures for its data-parallel coordinate; a follower's
    # measurement would repeat it, so it is not sent.
    def record_compute(self, seconds: float, *, bin: int | None = None) -> None:
        """``BalancedLoader.record_compute`` on a constructor; a no-op on a follower."""
        if self._inner is not None:
            self._inner.record_compute(seconds, bin=bin)

    @property
    def calibration_stats(self) -> Any:
        return self._inner.calibration_stats if self._inner is not None else None

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def fingerprint(self) -> str:
        return fingerprint_of(self._identity)

    def trace_summary(self) -> dict[str, Any]:
        return self._inner.trace_summary() if self._inner is not None else {}

    def __len__(self) -> int:
        if self._inner is not None:
            return len(self._inner)
        if self._config.max_steps is None:
            raise TypeError(
                "len() of a follower rank's loader is unknown: it has no source and "
                "config.max_steps is None."
            )
        return self._config.max_steps

    def __repr__(self) -> str:
        role = "constructor" if self._inner is not None else "follower"
        return (
            f"<DistributedLoader {role} rank={self._topology.rank} "
            f"group={list(self.group_ranks)} mp={list(self.mp_ranks)} step={self.step}>"
        )

    # -- the entry points' bodies (LoaderFacade writes the sync and async forms) ---------------

    async def _produce(self, run: Runner) -> Any:
        self._check_pass()
        if self._inner is None:
            assert self._bc is not None
            self._restored_pending = False
            if self._pass_state == "end":
                return END
            return self._accept(*(await self._broadcast(run, self._receive)))
        try:
            batch = await self._inner._next(run.blocking)
        except BaseException as exc:
            # Any error, a KeyboardInterrupt included: followers must stop at this step too.
            # Not the caller's own cancellation (an asyncio.timeout around the call): the pass
            # goes on, and the next call continues it.
            task = asyncio.current_task() if not run.blocking else None
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise
            await self._announce(run, "error", exc)
            raise
        if batch is END:
            await self._announce(run, "end", None)
            return END
        if self._bc is not None:
            send = functools.partial(
                self._bc.send, self._header("ok", None), self._inner.last_host_batch
            )
            try:
                await self._broadcast(run, send)
            except EncodeError as exc:  # raised before anything was sent
                await self._announce(run, "error", exc)
                raise
        return batch

    async def _prefetch_until(self, goal: str, run: Runner) -> None:
        # A follower has no launch points of its own; its constructor's loader does.
        if self._inner is not None:
            await self._inner._prefetch(goal, run.blocking)

    async def _restart(self, epoch: int, run: Runner) -> None:
        """A new pass at ``epoch`` on every rank of the model-parallel group (a restored
        position is kept by ``set_epoch`` of its own epoch, as ``BalancedLoader`` keeps it)."""
        if self._inner is not None:
            await self._inner._set_epoch(epoch, run.blocking)
            self._new_pass(epoch)
            return
        if self._restored_pending:
            # The constructor's rule (BalancedLoader._restart), so the model-parallel group
            # cannot diverge: the restored epoch keeps its position, an earlier one is refused.
            if epoch == self._epoch:
                return
            if epoch < self._epoch:
                raise earlier_epoch_error(epoch, self._epoch, self._step)
        self._new_pass(epoch)

    @property
    def _pass_ended(self) -> bool:
        return self._pass_state == "end"

    def _current_epoch(self) -> int:
        return self.epoch

    @property
    def last_pass(self) -> PassSummary | None:
        """How the last finished pass ended (``BalancedLoader.last_pass``). On a follower rank,
        which reads no source, ``None``: its constructor's summary describes the pass."""
        return self._inner.last_pass if self._inner is not None else None

    async def _release(self, run: Runner) -> None:
        """Close the loader, its transport and broadcast, and destroy the groups built for it."""
        try:
            if self._inner is not None:
                await self._inner._close(run.blocking)
            if self._transport is not None:
                await run.once(self._transport.aclose())
            if self._world_transport is not None:
                await run.once(self._world_transport.aclose())
        finally:
            # Joining the broadcast thread may wait for a collective in flight.
            await run.offload(self._release_now)

    @property
    def _pass_running(self) -> bool:
        return self._inner is not None and self._inner._pass_running

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The consumed position. A follower's holds only the fields every rank shares (epoch,
        step, identity): the same as its constructor's, so a ``torch.distributed.checkpoint``
        of the whole mesh never mixes ranks' data."""
        if self._inner is not None:
            return self._inner.state_dict()
        return loader_state(
            epoch=self._epoch,
            step=self._step,
            identity=self._resume_identity,
            source=None,
            source_state=None,
            process_rank=None,
            group_rank=0,
            group=[],
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` on this rank, before iterating."""
        self._check_open()
        if self._inner is not None:
            self._inner.load_state_dict(state)
            return
        if self._step or self._pass_state is not None:
            raise LoaderStateError(
                "load_state_dict() must be called before iteration starts (or right after "
                "set_epoch())."
            )
        try:
            restore = read_state(
                state,
                identity=self._resume_identity,
                source=None,
                process_rank=None,
                group_rank=0,
                group=[],
                max_steps=self._config.max_steps,
            )
        except ResumeError as exc:
            raise ResumeError(
                f"Rank {self._topology.rank} (a follower of rank {self._topology.constructor}) "
                f"cannot restore this state: {exc}"
            ) from None
        self._epoch, self._step = restore.epoch, restore.step
        self._restored_pending = True

    # -- internals ------------------------------------------------------------------------------

    def _check_pass(self) -> None:
        if self._pass_state == "error":
            assert self._failure is not None
            raise self._failure

    def _new_pass(self, epoch: int) -> None:
        self._restored_pending = False
        self._epoch, self._step = epoch, 0
        self._pass_state, self._failure = None, None
        self._last_host = None
        self._last_loss = None

    def _header(self, status: str, exc: BaseException | None) -> dict[str, Any]:
        assert self._inner is not None
        inner = self._inner
        # After delivery ``inner.step`` counts the delivered step; "end"/"error" name the
        # step that was asked for.
        step = inner.step - 1 if status == "ok" else inner.step
        info = None if exc is None else encode_error(exc, rank=self._topology.rank, step=step)
        loss = inner.last_loss_tokens if status == "ok" else None
        return {
            "status": status,
            "epoch": inner.epoch,
            "step": step,
            "error": info,
            "loss_tokens": None if loss is None else loss.to_dict(),
        }

    async def _announce(self, run: Runner, status: str, exc: BaseException | None) -> None:
        """Tell the followers that this pass ended or failed (once per pass)."""
        if self._pass_state is not None:
            return
        self._pass_state, self._failure = status, exc
        if self._bc is not None:
            header = self._header(status, exc)
            with contextlib.suppress(TransportError, LoaderStateError):
                await self._broadcast(run, functools.partial(self._bc.send, header))

    async def _broadcast(self, run: Runner, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the broadcaster's thread (its group's only thread)."""
        assert self._bc is not None
        return self._bc.call(fn) if run.blocking else await self._bc.acall(fn)

    def _receive(self) -> tuple[dict[str, Any], Any, Any]:
        """On the broadcast thread: one message, staged to the device when it is a batch."""
        assert self._bc is not None and self._stager is not None
        header, batch = self._bc.receive()
        staged = self._stager.stage(batch) if header.get("status") == "ok" else None
        return header, batch, staged

    def _accept(self, header: dict[str, Any], batch: Any, staged: Any) -> Any:
        """Deliver a received message: the batch, ``END``, or raise the announced error."""
        assert self._stager is not None
        status = header.get("status")
        if (header.get("epoch"), header.get("step")) != (self._epoch, self._step):
            self._pass_state = "error"
            self._failure = GroupMismatchError(
                f"Rank {self._topology.rank} expected epoch {self._epoch} step {self._step} from "
                f"rank {self._topology.constructor}, but received epoch {header.get('epoch')!r} "
                f"step {header.get('step')!r}. Ranks of a model-parallel group must call "
                "set_epoch() and load_state_dict() identically."
            )
            raise self._failure
        if status == "end":
            self._pass_state = "end"
            return END
        if status == "error":
            self._pass_state, self._failure = "error", decode_error(header.get("error"))
            raise self._failure
        if status != "ok":
            raise WireFormatError(f"Unknown batch message status {status!r}.")
        delivered = self._stager.deliver(staged)
        self._step += 1
        self._last_host = batch
        self._last_loss = _loss_tokens_from(header.get("loss_tokens"))
        return delivered

    def _release_now(self) -> None:
        try:
            if self._bc is not None:
                self._bc.close()
            if self._stager is not None:
                self._stager.close()
        finally:
            self._release_groups()


def _loss_tokens_from(value: Any) -> LossTokens | None:
    """The constructor's ``LossTokens`` from a batch header (peer data: checked)."""
    if value is None:
        return None
    names = ("step", "rank", "group", "world")
    if not isinstance(value, dict) or any(
        isinstance(value.get(n), bool) or not isinstance(value.get(n), int) for n in names
    ):
        raise WireFormatError(
            f"Malformed loss_tokens {value!r:.120} in a batch header: expected integer "
            f"{', '.join(names)}."
        )
    return LossTokens(**{n: value[n] for n in names})
