"""The transport extension point: one balance group's collectives, awaitable.

Read the :class:`Transport` docstring before writing a transport; it is the contract that the
conformance suite (:func:`evenflow.transports.testing.check_transport`) checks.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, Protocol, TypeVar

from evenflow.transports._sized import SizedIncoming, SizedOutgoing, check_sized
from evenflow.transports._wire import DEFAULT_MAX_FRAME_BYTES
from evenflow.transports.errors import RouteError, TransportClosedError, TransportError

__all__ = ["InlineLauncher", "Launcher", "Transport"]

T = TypeVar("T")

Outgoing = Mapping[int, Sequence[tuple[Hashable, Any]]]


def check_timeout(timeout: object) -> float:
    """``timeout`` in seconds, validated: the one check every transport constructor uses."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, but got {timeout!r}.")
    return float(timeout)


class Launcher(Protocol):
    """Runs the *launch* half of a collective on the thread that is allowed to launch.

    Transports whose ``launch_on_caller`` is True (NCCL/HCCL style) must start every
    collective through ``await self.launcher.launch(fn, op=..., final=...)``: ``fn`` is a short,
    non-blocking callable that enqueues device work and returns a handle. The engine replaces
    the default inline launcher with one that runs ``fn`` on the training loop's thread, only
    at launch points (``next()``, ``prefetch_plan()``, ``prefetch()``), in canonical order.
    ``final=True`` marks the last launch of one operation, so a launch point knows when an
    operation is fully in flight.
    """

    async def launch(self, fn: Callable[[], T], *, op: str, final: bool) -> T: ...


class InlineLauncher:
    """Runs launches immediately on the current thread (the default outside the engine)."""

    async def launch(self, fn: Callable[[], T], *, op: str, final: bool) -> T:
        return fn()


class Transport(abc.ABC):
    """Collectives within one balance group of ``num_ranks`` members.

    **Who calls it.** The engine, from one asyncio event loop per process. It issues one
    group's operations in a canonical order that is identical on every member: operation *k*
    on rank 0 pairs with operation *k* on every other rank. A transport may rely on that order
    and must not reorder; it must run one group's blocking collectives on exactly one thread
    (two threads driving one Gloo group corrupt data). Operations are awaited one at a time
    per group, but several groups may be active at once.

    **What to implement.**

    * ``all_gather(obj)`` → list of every member's ``obj``, indexed by group rank.
    * ``broadcast(obj, src=r)`` → member ``r``'s ``obj`` on every member (others pass any value,
      typically ``None``; it is ignored).
    * ``exchange(outgoing)`` → ``{key: payload}`` of everything addressed to this rank, where
      ``outgoing`` maps a target group rank to a list of ``(key, payload)``; a rank may send
      to itself, lists may be empty or missing, sizes may be uneven. Keys are plain encodable
      values (int tuples in the engine), unique per receiver.
    * ``exchange_sized(outgoing, incoming)`` (optional) → like ``exchange``, for callers that
      know every byte count in advance: ``outgoing`` maps a target to ``(key, Prepared)``
      pairs (:func:`~evenflow.transports.prepare`), ``incoming`` maps a sender to the
      ``(key, nbytes)`` pairs this rank receives from it, in the sender's order, and every
      rank's ``incoming`` agrees with its senders' ``outgoing``. A transport that sizes its
      receive buffers from ``incoming`` moves the data in ONE collective; the default sends
      the prepared values through ``exchange`` and checks that exactly the expected keys
      arrived.
    * ``objects`` are anything :mod:`evenflow.transports` wire format encodes (dicts with
      string keys, lists, tuples, scalars, bytes, numpy arrays, torch CPU tensors); no pickle
      may ever touch peer bytes.

    **What to raise.** ``RouteError`` (before any data moves) for a target outside
    ``range(num_ranks)``; ``TransportTimeoutError`` when peers do not answer within
    ``timeout`` seconds; ``PeerFailureError`` when a peer dies; ``TransportClosedError`` after
    ``aclose()``. A rank whose exchange payloads cannot be encoded still takes part in the
    operation: it raises ``EncodeError`` and every other rank raises ``PeerEncodeError`` naming
    it; no data moves and the group stays usable (the engine relies on this to fail every rank
    at the same step). Foreign exceptions
    are chained (``raise ... from exc``) and messages name the rank and the operation. After
    a timeout or peer failure the group is dead: later operations raise promptly.

    **Cancellation.** Cancelling an awaiting operation abandons its result; a collective that
    already started on the wire may complete in the background, so a group whose operation
    was cancelled must be treated as unusable and closed.

    **Lifecycle.** ``aclose()`` is idempotent, releases threads and buffers it owns (never the
    caller's process groups) and makes later operations raise ``TransportClosedError``.
    ``async with transport:`` closes on exit.

    **Launch thread.** ``launch_on_caller`` declares that collectives must be launched on the
    training loop's thread at caller-synchronized points (NCCL/HCCL); such transports start
    every collective through :attr:`launcher` (see :class:`Launcher`).
    """

    #: Registry name of the implementation (``"gloo"``, ``"inprocess"``, ...).
    name: ClassVar[str] = "custom"
    #: Whether collectives must be launched on the caller's thread (see class docstring).
    launch_on_caller: ClassVar[bool] = False

    def __init__(
        self,
        *,
        rank: int,
        num_ranks: int,
        global_ranks: Sequence[int] | None = None,
        timeout: float = 60.0,
    ) -> None:
        if num_ranks < 1 or not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, num_ranks={num_ranks}), but got rank={rank!r}.")
        ranks = tuple(range(num_ranks)) if global_ranks is None else tuple(global_ranks)
        if len(ranks) != num_ranks:
            raise ValueError(
                f"global_ranks must list num_ranks={num_ranks} ranks, but got {ranks!r}."
            )
        seconds = check_timeout(timeout)
        self._rank = rank
        self._num_ranks = num_ranks
        self._global_ranks = ranks
        self._timeout = seconds
        self._closed = False
        self.launcher: Launcher = InlineLauncher()

    @property
    def rank(self) -> int:
        """This member's rank inside the group (0-based)."""
        return self._rank

    @property
    def num_ranks(self) -> int:
        """Number of members of the group."""
        return self._num_ranks

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global (world) rank of each member, indexed by group rank."""
        return self._global_ranks

    @property
    def timeout(self) -> float:
        """Seconds a collective may wait for peers before raising ``TransportTimeoutError``."""
        return self._timeout

    @property
    def closed(self) -> bool:
        return self._closed

    @abc.abstractmethod
    async def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, ordered by group rank.

        Raises:
            EncodeError: ``obj`` cannot be encoded; raised before anything moves.
            TransportTimeoutError: a peer did not join within :attr:`timeout` seconds.
            PeerFailureError: a peer died.
            TransportError: promptly, in any operation after a timeout or a peer failure
                (the group is dead).
            TransportClosedError: after :meth:`aclose`.
        """

    @abc.abstractmethod
    async def broadcast(self, obj: Any, *, src: int) -> Any:
        """Member ``src``'s ``obj`` on every member.

        Raises:
            RouteError: ``src`` is not a group rank; raised before anything moves.
            EncodeError: on ``src``, ``obj`` cannot be encoded.
            TransportTimeoutError: a peer did not join within :attr:`timeout` seconds.
            PeerFailureError: a peer died.
            TransportError: promptly, in any operation after a timeout or a peer failure
                (the group is dead).
            TransportClosedError: after :meth:`aclose`.
        """

    @abc.abstractmethod
    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        """Send each ``(key, payload)`` to its target rank; return what this rank received.

        Raises:
            TypeError: ``outgoing`` is not a mapping of target ranks to ``(key, payload)``
                lists; raised before anything moves.
            RouteError: a target is not a group rank; raised before anything moves.
            EncodeError: a payload of this rank cannot be encoded. The rank still takes part,
                so that no data moves anywhere and the group stays usable.
            PeerEncodeError: a peer's payloads could not be encoded (``failed_ranks`` names
                it); no data moved and the group stays usable.
            TransportTimeoutError: a peer did not join within :attr:`timeout` seconds.
            PeerFailureError: a peer died.
            TransportError: promptly, in any operation after a timeout or a peer failure
                (the group is dead).
            TransportClosedError: after :meth:`aclose`.
        """

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        """:meth:`exchange` with every byte count known in advance (see the class docstring).

        This default serves transports that implement only :meth:`exchange`: it sends the
        prepared values through it (whatever collectives that takes) and checks that exactly
        the keys of ``incoming`` arrived. The built-in transports override it with a single
        collective sized from ``incoming``.

        Raises:
            TypeError: ``outgoing`` or ``incoming`` is not a mapping of ranks to lists of
                ``(key, Prepared)`` or ``(key, nbytes)`` pairs; raised before anything moves.
            ValueError: a target or sender is not a group rank, or a byte count is not a
                frame size (a positive multiple of the frame alignment within the frame
                limit); raised before anything moves.
            TransportError: the keys that arrived are not those of ``incoming`` (this
                default only).
            PeerEncodeError, TransportTimeoutError, PeerFailureError, TransportClosedError:
                as for :meth:`exchange`.
        """
        self._check_open("exchange")
        check_sized(self._rank, self._num_ranks, outgoing, incoming, limit=DEFAULT_MAX_FRAME_BYTES)
        received = await self.exchange(
            {target: [(key, p.value) for key, p in items] for target, items in outgoing.items()}
        )
        expected = {key for items in incoming.values() for key, _ in items}
        if set(received) != expected:
            missing = sorted(map(repr, expected - set(received)))[:5]
            extra = sorted(map(repr, set(received) - expected))[:5]
            raise TransportError(
                f"Rank {self._rank}: exchange_sized expected keys that did not arrive "
                f"({', '.join(missing) or 'none'}) or received unexpected ones "
                f"({', '.join(extra) or 'none'}); every rank's incoming must match its "
                "senders' outgoing.",
                rank=self._rank,
                op="exchange",
            )
        return received

    async def aclose(self) -> None:
        """Release what the transport owns. Idempotent; later operations raise
        ``TransportClosedError``.

        Closing is also how a caller gives up a group that timed out or lost a peer: the
        conformance suite closes every transport after each check, a timed-out one included,
        and counts an exception from ``aclose()`` as a failure.
        """
        self._closed = True

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- helpers for implementations -------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TransportClosedError(
                f"Rank {self._rank}: cannot run {op} on a closed {self.name} transport.",
                rank=self._rank,
                op=op,
            )

    def _check_src(self, src: int) -> None:
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self._num_ranks:
            raise RouteError(
                f"Rank {self._rank}: broadcast src must be a group rank in "
                f"[0, {self._num_ranks}), but got {src!r}.",
                rank=self._rank,
                op="broadcast",
            )

    def _check_routes(self, outgoing: Outgoing) -> None:
        """``outgoing`` is a mapping whose targets are group ranks (``TypeError``/``RouteError``).

        The items are checked where the exchange layout is built
        (:func:`evenflow.transports._protocol.pack_outgoing`).
        """
        if not isinstance(outgoing, Mapping):
            raise TypeError(
                f"Rank {self._rank}: exchange outgoing must map target ranks to lists of "
                f"(key, payload) pairs, but got {outgoing!r:.80} ({type(outgoing).__name__})."
            )
        bad = sorted(
            repr(t)
            for t in outgoing
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._num_ranks
        )
        if bad:
            raise RouteError(
                f"Rank {self._rank}: exchange routes payloads to targets outside the group "
                f"[0, {self._num_ranks}): {', '.join(bad)}. No data was moved.",
                rank=self._rank,
                op="exchange",
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<{type(self).__name__} rank={self._rank}/{self._num_ranks} "
            f"global_ranks={self._global_ranks} {state}>"
        )
