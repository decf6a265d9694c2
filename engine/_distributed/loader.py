"""The loader every rank of a mesh gets, and the error codec of the model-parallel broadcast.

Ranks that differ only in model-parallel coordinates must train on the same batch: the
*constructor* of a data-parallel coordinate reads, balances and collates, and sends each
delivered step's host batch to its peers through the
:class:`~evenflow.transports._broadcast.BatchBroadcaster` (its message format is described
there). ``end`` and ``error`` messages carry no batch; they make every peer stop or raise at
the same step as the constructor.

All of a group's collectives run on the broadcaster's single-worker executor (two threads
driving one Gloo group corrupt data), whether the loader is iterated synchronously or
asynchronously.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from evenflow.engine._config import LoaderConfig
from evenflow.engine._distributed.topology import Topology
from evenflow.engine._validate import check_int
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
from evenflow.transports._broadcast import BatchBroadcaster
from evenflow.transports.errors import (
    EncodeError,
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)

if TYPE_CHECKING:
    from evenflow.engine._pipeline.h2d import DeviceStager
    from evenflow.engine._pipeline.loader import BalancedLoader
    from evenflow.engine._pipeline.stats import StepStats

__all__ = ["DistributedLoader", "decode_error", "encode_error", "run_coroutine"]

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
    """Plain-data description of the constructor's failure, for its peers."""
    if isinstance(exc, RemoteStageError):
        return {
            "kind": "remote",
            "rank": exc.failed_rank,
            "stage": exc.stage,
            "step": exc.step,
            "type": exc.error_type,
            "message": exc.remote_message,
        }
    name = type(exc).__name__
    if type(exc) is _PORTABLE.get(name):
        return {"kind": "same", "type": name, "message": str(exc)[:4000]}
    return {
        "kind": "remote",
        "rank": rank,
        "stage": "constructor",
        "step": step,
        "type": name,
        "message": str(exc)[:4000],
    }


def decode_error(info: Any) -> Exception:
    """The exception a peer raises for :func:`encode_error`'s description."""
    if not isinstance(info, dict):
        return WireFormatError(f"Malformed error description {info!r:.120} in a batch header.")
    if info.get("kind") == "same" and info.get("type") in _PORTABLE:
        return _PORTABLE[info["type"]](str(info.get("message", "")))
    try:
        return RemoteStageError(
            failed_rank=int(info["rank"]),
            stage=str(info["stage"]),
            step=int(info["step"]),
            error_type=str(info["type"]),
            message=str(info["message"]),
        )
    except (KeyError, TypeError, ValueError):
        return WireFormatError(f"Malformed error description {info!r:.120} in a batch header.")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code (in a helper thread if this thread
    already runs an event loop, e.g. the sync API called from async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evenflow-close") as pool:
        return pool.submit(asyncio.run, coro).result()


# -- the loader every rank of a mesh gets --------------------------------------------------------

_END: Any = object()
FOLLOWER_STATE_FORMAT = "evenflow.follower"


class DistributedLoader:
    """The loader :func:`~evenflow.engine.build_loader` returns: ``BalancedLoader``'s API on
    every rank of a mesh.

    On a *constructor* rank it wraps a ``BalancedLoader`` over the rank's balance group and,
    when the rank has model-parallel peers, broadcasts each delivered step's host batch to
    them. On a *follower* rank it never reads a source: each ``next()`` receives the
    constructor's batch (and copies it to ``device`` like the constructor does). End of data
    and errors reach followers in the same message stream, so they stop or raise at the same
    step. Every rank of a model-parallel group must iterate the same way (both sync or both
    async) and the same number of steps, and call ``set_epoch`` / ``load_state_dict`` at the
    same points. A follower's ``last_stats`` is always None.

    Limit: the constructor sends a batch when its caller takes it, so a follower's ``next()``
    waits for the constructor's; model-parallel peers run in lockstep anyway.
    """

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
    ) -> None:
        self._topology = topology
        self._config = config
        self._inner = inner
        self._transport = transport
        self._bc = broadcaster
        self._stager = stager
        self._identity = identity
        self._release_groups = release
        self._mode: str | None = None
        self._closed = False
        # Follower-side position; constructors read theirs from the inner loader.
        self._epoch = 0
        self._step = 0
        self._last_host: Any = None
        # How the current pass ended on the message stream: None, "end" or "error".
        self._pass_state: str | None = None
        self._failure: BaseException | None = None

    @classmethod
    def constructor(
        cls,
        *,
        inner: BalancedLoader,
        topology: Topology,
        transport: Transport,
        broadcaster: BatchBroadcaster | None,
        release: Callable[[], None],
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
    ) -> DistributedLoader:
        from evenflow.engine._pipeline.h2d import DeviceStager
        from evenflow.engine._pipeline.loader import BalancedLoader

        if broadcaster is None:
            raise ValueError("A follower rank needs the broadcast group of its constructor.")
        # A never-iterated loader validates the arguments exactly as the constructor's does
        # and yields the identity that the build agreement compares.
        shadow = BalancedLoader((), config=config, **loader_kwargs)
        try:
            identity = {**shadow.identity(), "group": list(topology.balance_group)}
        finally:
            shadow.close()
        stager = DeviceStager(
            loader_kwargs.get("device"),
            move_fn=loader_kwargs.get("move_fn"),
            cpu_fields=tuple(loader_kwargs.get("cpu_fields", ())),
        )
        return cls(
            topology=topology,
            config=config,
            inner=None,
            transport=None,
            broadcaster=broadcaster,
            stager=stager,
            identity=identity,
            release=release,
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
    def last_host_batch(self) -> Any:
        return self._inner.last_host_batch if self._inner is not None else self._last_host

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps(self._identity, sort_keys=True, default=str).encode()
        ).hexdigest()[:24]

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

    # -- sync iteration ------------------------------------------------------------------------

    def __iter__(self) -> DistributedLoader:
        self._enter("sync")
        return self

    def __next__(self) -> Any:
        self._enter("sync")
        self._check_pass()
        if self._inner is None:
            assert self._bc is not None
            if self._pass_state == "end":
                raise StopIteration
            result = self._accept(*self._bc.call(self._receive))
            if result is _END:
                raise StopIteration
            return result
        try:
            batch = next(self._inner)
        except StopIteration:
            self._announce_sync("end", None)
            raise
        except Exception as exc:
            self._announce_sync("error", exc)
            raise
        if self._bc is not None:
            header = self._header("ok", None)
            try:
                self._bc.call(functools.partial(self._bc.send, header, self._inner.last_host_batch))
            except EncodeError as exc:  # raised before anything was sent
                self._announce_sync("error", exc)
                raise
        return batch

    def prefetch_plan(self) -> None:
        """See ``BalancedLoader.prefetch_plan``; a no-op on followers."""
        if self._inner is not None:
            self._inner.prefetch_plan()

    def prefetch(self) -> None:
        """See ``BalancedLoader.prefetch``; a no-op on followers."""
        if self._inner is not None:
            self._inner.prefetch()

    def __enter__(self) -> DistributedLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the loader, its transport and broadcast, and destroy the groups built for it."""
        if self._closed:
            return
        if self._mode == "async":
            raise LoaderStateError(
                "This loader is iterated asynchronously; use 'await loader.aclose()' or "
                "'async with loader:'."
            )
        self._closed = True
        try:
            if self._inner is not None:
                self._inner.close()
            if self._transport is not None:
                run_coroutine(self._transport.aclose())
        finally:
            self._release()

    def set_epoch(self, epoch: int) -> None:
        """Start a new pass at ``epoch`` on every rank of the model-parallel group."""
        self._check_epoch(epoch)
        if self._inner is not None:
            self._inner.set_epoch(epoch)
        self._new_pass(epoch)

    # -- async iteration ------------------------------------------------------------------------

    def __aiter__(self) -> DistributedLoader:
        self._enter("async")
        return self

    async def __anext__(self) -> Any:
        self._enter("async")
        self._check_pass()
        if self._inner is None:
            assert self._bc is not None
            if self._pass_state == "end":
                raise StopAsyncIteration
            result = self._accept(*(await self._bc.acall(self._receive)))
            if result is _END:
                raise StopAsyncIteration
            return result
        try:
            batch = await self._inner.__anext__()
        except StopAsyncIteration:
            await self._announce_async("end", None)
            raise
        except Exception as exc:
            await self._announce_async("error", exc)
            raise
        if self._bc is not None:
            header = self._header("ok", None)
            try:
                await self._bc.acall(
                    functools.partial(self._bc.send, header, self._inner.last_host_batch)
                )
            except EncodeError as exc:
                await self._announce_async("error", exc)
                raise
        return batch

    async def aprefetch_plan(self) -> None:
        if self._inner is not None:
            await self._inner.aprefetch_plan()

    async def aprefetch(self) -> None:
        if self._inner is not None:
            await self._inner.aprefetch()

    async def __aenter__(self) -> DistributedLoader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Async form of :meth:`close`."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._inner is not None:
                await self._inner.aclose()
            if self._transport is not None:
                await self._transport.aclose()
        finally:
            # Joining the broadcast thread may wait for a collective in flight.
            await asyncio.get_running_loop().run_in_executor(None, self._release)

    async def aset_epoch(self, epoch: int) -> None:
        """Async form of :meth:`set_epoch`."""
        self._check_epoch(epoch)
        if self._inner is not None:
            await self._inner.aset_epoch(epoch)
        self._new_pass(epoch)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The consumed position (a follower's holds only epoch and step)."""
        if self._inner is not None:
            return self._inner.state_dict()
        return {
            "format": FOLLOWER_STATE_FORMAT,
            "version": 1,
            "epoch": self._epoch,
            "step": self._step,
            "rank": self._topology.rank,
            "constructor": self._topology.constructor,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` on this rank, before iterating."""
        self._check_open()
        if self._inner is not None:
            self._inner.load_state_dict(state)
            return
        if not isinstance(state, dict) or state.get("format") != FOLLOWER_STATE_FORMAT:
            raise ResumeError(
                f"This rank ({self._topology.rank}) receives its batches from rank "
                f"{self._topology.constructor} and restores only a follower state "
                f"(format {FOLLOWER_STATE_FORMAT!r}), but got {state!r:.120}."
            )
        if state.get("fingerprint") != self.fingerprint():
            raise ResumeError(
                f"The saved follower state has fingerprint {state.get('fingerprint')!r} but this "
                f"loader has {self.fingerprint()!r}: the configuration or layout changed."
            )
        if self._step or self._pass_state is not None:
            raise LoaderStateError(
                "load_state_dict() must be called before iteration starts (or right after "
                "set_epoch())."
            )
        self._epoch = check_int("state['epoch']", state.get("epoch"), minimum=0)
        self._step = check_int("state['step']", state.get("step"), minimum=0)

    # -- internals ------------------------------------------------------------------------------

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
            raise LoaderStateError("This DistributedLoader is closed; build a new one.")

    def _check_pass(self) -> None:
        if self._pass_state == "error":
            assert self._failure is not None
            raise self._failure

    @staticmethod
    def _check_epoch(epoch: object) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, but got {epoch!r}.")

    def _new_pass(self, epoch: int) -> None:
        self._epoch, self._step = epoch, 0
        self._pass_state, self._failure = None, None
        self._last_host = None

    def _header(self, status: str, exc: BaseException | None) -> dict[str, Any]:
        assert self._inner is not None
        inner = self._inner
        # After delivery ``inner.step`` counts the delivered step; "end"/"error" name the
        # step that was asked for.
        step = inner.step - 1 if status == "ok" else inner.step
        info = None if exc is None else encode_error(exc, rank=self._topology.rank, step=step)
        return {"status": status, "epoch": inner.epoch, "step": step, "error": info}

    def _announce_sync(self, status: str, exc: BaseException | None) -> None:
        """Tell the followers that this pass ended or failed (once per pass)."""
        if self._pass_state is not None:
            return
        self._pass_state, self._failure = status, exc
        if self._bc is not None:
            header = self._header(status, exc)
            with contextlib.suppress(TransportError, LoaderStateError):
                self._bc.call(functools.partial(self._bc.send, header))

    async def _announce_async(self, status: str, exc: BaseException | None) -> None:
        if self._pass_state is not None:
            return
        self._pass_state, self._failure = status, exc
        if self._bc is not None:
            header = self._header(status, exc)
            with contextlib.suppress(TransportError, LoaderStateError):
                await self._bc.acall(functools.partial(self._bc.send, header))

    def _receive(self) -> tuple[dict[str, Any], Any, Any]:
        """On the broadcast thread: one message, staged to the device when it is a batch."""
        assert self._bc is not None and self._stager is not None
        header, batch = self._bc.receive()
        staged = self._stager.stage(batch) if header.get("status") == "ok" else None
        return header, batch, staged

    def _accept(self, header: dict[str, Any], batch: Any, staged: Any) -> Any:
        """Deliver a received message: the batch, ``_END``, or raise the announced error."""
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
            return _END
        if status == "error":
            self._pass_state, self._failure = "error", decode_error(header.get("error"))
            raise self._failure
        if status != "ok":
            raise WireFormatError(f"Unknown batch message status {status!r}.")
        delivered = self._stager.deliver(staged)
        self._step += 1
        self._last_host = batch
        return delivered

    def _release(self) -> None:
        try:
            if self._bc is not None:
                self._bc.close()
            if self._stager is not None:
                self._stager.close()
        finally:
            self._release_groups()
