"""A group of N ranks inside one process: fast tests and large-N simulation.

Ranks may be asyncio tasks on one event loop, threads that each run their own loop, or any
mix. They meet like members of a real process group: the *k*-th collective of every rank
pairs with the *k*-th collective of every other rank, in what the group calls a *slot*.

How a collective runs (the invariants the code keeps):

* A rank encodes its contribution with the wire codec *before* touching shared state, so
  unsupported values and bad routes fail locally and the group stays in step.
* Arriving at slot *k* takes the group lock for O(1) work: record the contribution, compare
  the operation with the one the slot's first arrival declared, register a wake-up future on
  the rank's own loop. The last arrival marks the slot complete and wakes the others: O(N)
  for the whole operation. Nobody blocks a thread while waiting, so ranks sharing a loop all
  make progress; futures of other loops are woken with ``call_soon_threadsafe``.
* Every receiver builds its own result from the slot's frames (O(N) work per rank) by
  copying the bytes addressed to it into one fresh buffer and decoding that, exactly what a
  receive buffer of a real collective holds. Results therefore never alias another rank's
  objects, and arrays come back writable as they do on Gloo.
* Any failure (mismatched operations, a timeout, a rank closing or abandoning an operation)
  kills the whole group: waiting ranks wake at once and every later operation raises
  promptly, because a real group is unusable after such an event as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from evenflow.transports import _wire
from evenflow.transports._base import Outgoing, Transport
from evenflow.transports._protocol import pack_outgoing, unpack_into
from evenflow.transports._sized import (
    SizedIncoming,
    SizedOutgoing,
    check_sized,
    decode_segments,
    write_segments,
)
from evenflow.transports.errors import (
    CollectiveMismatchError,
    PeerEncodeError,
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)

__all__ = ["InProcessGroup", "InProcessStatistics", "InProcessTransport"]

#: ``delay_fn(rank, op_index, op) -> seconds`` injected before a rank joins an operation.
DelayFn = Callable[[int, int, str], float]

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]

_ALIGN = 64  # the wire format aligns raw buffers to 64 bytes within a frame


def _receive_buffer(frames: Sequence[np.ndarray[Any, np.dtype[np.uint8]]]) -> Any:
    """Copy ``frames`` back to back into one fresh, 64-byte aligned, writable buffer.

    This is what a real collective's receive buffer holds; decoding views into it.
    """
    total = sum(frame.size for frame in frames)
    raw = np.empty(total + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    buffer = raw[start : start + total]
    position = 0
    for frame in frames:
        buffer[position : position + frame.size] = frame
        position += frame.size
    return buffer


@dataclass(frozen=True)
class InProcessStatistics:
    """A snapshot of an :class:`InProcessGroup` (for tests and debugging)."""

    #: Ranks currently blocked in an operation, waiting for peers.
    num_waiting: int
    #: Operations some rank has started but not every rank has finished reading.
    num_open_operations: int
    #: Why the group is unusable, or ``None`` while it works.
    failure: str | None


def _format_ranks(ranks: Sequence[int], limit: int = 16) -> str:
    """``[0, 3, 5]``, shortened for large groups so messages stay readable."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    more = f", ... ({len(ranks) - limit} more)" if len(ranks) > limit else ""
    return f"[{shown}{more}]"


def _describe(op: str, src: int | None) -> str:
    return f"broadcast(src={src})" if op == "broadcast" else op


class _Slot:
    """Shared state of the operation at one position of the group's order."""

    __slots__ = (
        "arrived",
        "complete",
        "contributions",
        "first_rank",
        "inboxes",
        "index",
        "num_arrived",
        "op",
        "src",
        "unread",
        "waiters",
    )

    def __init__(self, index: int, op: str, src: int | None, first_rank: int, n: int) -> None:
        self.index = index
        self.op = op
        self.src = src
        self.first_rank = first_rank
        self.contributions: list[Any] = [None] * n
        # exchange only: target -> [(sender, frame)], so a receiver reads just its own mail.
        self.inboxes: dict[int, list[tuple[int, Any]]] = {}
        self.arrived = bytearray(n)
        self.num_arrived = 0
        self.waiters: dict[int, _Waiter] = {}
        self.complete = False
        self.unread = n


@dataclass(frozen=True)
class _Failure:
    """Why the group died, and where. Each rank turns it into its own error."""

    kind: Literal["mismatch", "timeout", "closed", "cancelled"]
    index: int
    rank: int
    detail: str
    missing: tuple[int, ...] = ()

    def for_waiter(self, rank: int, index: int, op: str, timeout: float) -> TransportError:
        """The error of a rank that was waiting in slot ``index`` when the group died."""
        where = f"{op} (operation #{index})"
        if index == self.index and self.kind == "mismatch":
            return CollectiveMismatchError(f"Rank {rank}: {self.detail}", rank=rank, op=op)
        if index == self.index and self.kind == "timeout":
            return TransportTimeoutError(
                f"Rank {rank}: {where} timed out: ranks {_format_ranks(self.missing)} of the "
                f"inprocess group did not join within {timeout:g} s. The group is unusable now.",
                rank=rank,
                op=op,
            )
        return self.for_arrival(rank, index, op)

    def for_arrival(self, rank: int, index: int, op: str) -> TransportError:
        """The error of a rank that starts an operation after the group died."""
        if index == self.index and self.kind == "mismatch":
            return CollectiveMismatchError(f"Rank {rank}: {self.detail}", rank=rank, op=op)
        return PeerFailureError(
            f"Rank {rank}: {op} (operation #{index}) cannot complete because the inprocess "
            f"group is unusable: {self.detail}",
            rank=rank,
            op=op,
        )


class InProcessGroup:
    """Shared state of ``num_ranks`` in-process ranks; hands out one transport per rank.

    ``timeout`` is how many seconds a rank waits for its peers in one operation before it
    raises ``TransportTimeoutError``. ``delay_fn(rank, op_index, op)``, if given, returns
    seconds the rank sleeps before joining operation number ``op_index`` (``op`` is
    ``"all_gather"``, ``"broadcast"`` or ``"exchange"``): tests use it to shuffle timings.
    ``global_ranks`` defaults to ``range(num_ranks)``.

    The group is safe to use from several threads, each with its own event loop.
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        timeout: float = 60.0,
        delay_fn: DelayFn | None = None,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(
                f"num_ranks must be an integer >= 1, but got {num_ranks!r}; pass the group size."
            )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(
                f"timeout must be a positive, finite number of seconds, but got {timeout!r}."
            )
        if delay_fn is not None and not callable(delay_fn):
            raise TypeError(
                f"delay_fn must be callable as delay_fn(rank, op_index, op) -> seconds or None, "
                f"but got {delay_fn!r}."
            )
        self._num_ranks = num_ranks
        self._timeout = float(timeout)
        self._delay_fn = delay_fn
        self._global_ranks = None if global_ranks is None else tuple(global_ranks)
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._failure: _Failure | None = None
        self._transports: dict[int, InProcessTransport] = {}

    @property
    def num_ranks(self) -> int:
        """Number of ranks in the group."""
        return self._num_ranks

    @property
    def timeout(self) -> float:
        """Seconds a rank waits for its peers before ``TransportTimeoutError``."""
        return self._timeout

    def statistics(self) -> InProcessStatistics:
        """How many ranks wait, how many operations are open, and why the group failed."""
        with self._lock:
            return InProcessStatistics(
                num_waiting=sum(len(slot.waiters) for slot in self._slots.values()),
                num_open_operations=len(self._slots),
                failure=None if self._failure is None else self._failure.detail,
            )

    def transport(self, rank: int) -> InProcessTransport:
        """The transport of member ``rank``; the same object on every call."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._num_ranks:
            raise ValueError(
                f"rank must be an integer in [0, {self._num_ranks}) for this group, "
                f"but got {rank!r}."
            )
        with self._lock:
            transport = self._transports.get(rank)
            if transport is None:
                transport = InProcessTransport(self, rank, self._global_ranks)
                self._transports[rank] = transport
            return transport

    def __repr__(self) -> str:
        state = "ok" if self._failure is None else "failed"
        return f"<InProcessGroup num_ranks={self._num_ranks} timeout={self._timeout:g} {state}>"

    # -- used by InProcessTransport ---------------------------------------------------------

    def _delay(self, rank: int, index: int, op: str) -> float:
        if self._delay_fn is None:
            return 0.0
        delay = self._delay_fn(rank, index, op)
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not delay >= 0:
            raise ValueError(
                f"delay_fn({rank}, {index}, {op!r}) must return a non-negative number of "
                f"seconds, but returned {delay!r}."
            )
        return float(delay)

    def _arrive(
        self,
        rank: int,
        index: int,
        op: str,
        *,
        src: int | None,
        contribution: Any,
        waiter: _Waiter,
        deliveries: Sequence[tuple[int, Any]] = (),
    ) -> _Slot:
        """Join slot ``index``; the slot is complete on return if this rank came last.

        ``deliveries`` are ``(target, frame)`` pairs of an exchange, filed per target.
        """
        with self._lock:
            if self._failure is not None:
                raise self._failure.for_arrival(rank, index, op)
            slot = self._slots.get(index)
            if slot is None:
                slot = _Slot(index, op, src, rank, self._num_ranks)
                self._slots[index] = slot
            elif slot.op != op or slot.src != src:
                detail = (
                    f"ranks issued different collectives at operation #{index}: rank "
                    f"{slot.first_rank} issued {_describe(slot.op, slot.src)} but rank {rank} "
                    f"issued {_describe(op, src)}. Every rank must issue the same collectives "
                    f"in the same order."
                )
                self._fail_locked(_Failure("mismatch", index, rank, detail), waiter[0])
                raise CollectiveMismatchError(f"Rank {rank}: {detail}", rank=rank, op=op)
            slot.contributions[rank] = contribution
            for target, frame in deliveries:
                slot.inboxes.setdefault(target, []).append((rank, frame))
            slot.arrived[rank] = 1
            slot.num_arrived += 1
            if slot.num_arrived == self._num_ranks:
                slot.complete = True
                _wake(slot.waiters.values(), waiter[0])
                slot.waiters.clear()
            else:
                slot.waiters[rank] = waiter
            return slot

    def _settle(self, rank: int, slot: _Slot, op: str, *, timed_out: bool) -> None:
        """After a wake-up or a timeout: return if ``slot`` completed, else raise why not."""
        with self._lock:
            slot.waiters.pop(rank, None)
            if slot.complete:
                return
            if self._failure is None and timed_out:
                missing = tuple(r for r in range(self._num_ranks) if not slot.arrived[r])
                detail = (
                    f"rank {rank} timed out at operation #{slot.index} ({op}) waiting "
                    f"{self._timeout:g} s for ranks {_format_ranks(missing)}."
                )
                failure = _Failure("timeout", slot.index, rank, detail, missing)
                self._fail_locked(failure, asyncio.get_running_loop())
            assert self._failure is not None, "a slot is woken only on completion or failure"
            raise self._failure.for_waiter(rank, slot.index, op, self._timeout)

    def _abandon(self, rank: int, index: int, kind: Literal["closed", "cancelled"]) -> None:
        """Rank ``rank`` left the group (closed, or cancelled mid-operation): peers fail fast."""
        with self._lock:
            if self._failure is not None:
                return
            if kind == "closed":
                detail = f"rank {rank} closed its transport."
            else:
                detail = f"rank {rank} abandoned operation #{index} (its task was cancelled)."
            self._fail_locked(_Failure(kind, index, rank, detail), asyncio.get_running_loop())

    def _release(self, slot: _Slot) -> None:
        """One receiver is done with ``slot``; the last one frees its frames."""
        with self._lock:
            slot.unread -= 1
            if slot.unread == 0 and self._slots.get(slot.index) is slot:
                del self._slots[slot.index]

    def _fail_locked(self, failure: _Failure, loop: asyncio.AbstractEventLoop) -> None:
        self._failure = failure
        for slot in self._slots.values():
            _wake(slot.waiters.values(), loop)
        # Waiting ranks hold their own slot; everything else is garbage from now on.
        self._slots.clear()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _wake(waiters: Any, current: asyncio.AbstractEventLoop) -> None:
    """Resolve every waiter's future, from whichever thread runs ``current``."""
    for loop, future in list(waiters):
        if loop is current:
            _set_done(future)
        else:
            # A closed loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_done, future)


class InProcessTransport(Transport):
    """One member of an :class:`InProcessGroup` (create it with ``group.transport(rank)``).

    Behaves like a real collective: operations pair by position, mismatched operations raise
    ``CollectiveMismatchError`` on every rank, a missing peer raises
    ``TransportTimeoutError`` after the group timeout, and a closed or cancelled peer makes
    the others raise ``PeerFailureError`` at once. Exchange results are ordered by sender
    rank, then by the sender's order.
    """

    name: ClassVar[str] = "inprocess"

    def __init__(
        self, group: InProcessGroup, rank: int, global_ranks: Sequence[int] | None
    ) -> None:
        super().__init__(
            rank=rank, num_ranks=group.num_ranks, global_ranks=global_ranks, timeout=group.timeout
        )
        self._group = group
        self._next_index = 0
        self._busy = False

    @property
    def group(self) -> InProcessGroup:
        """The group this transport belongs to."""
        return self._group

    async def all_gather(self, obj: Any) -> list[Any]:
        self._begin("all_gather")
        try:
            slot = await self._collective("all_gather", None, _wire.encode(obj))
            try:
                frames: list[np.ndarray[Any, np.dtype[np.uint8]]] = slot.contributions
                buffer = _receive_buffer(frames)
                sizes = [frame.size for frame in frames]
            finally:
                self._group._release(slot)
            return list(_wire.decode_many(buffer, sizes))
        finally:
            self._busy = False

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        self._begin("broadcast")
        try:
            self._check_src(src)
            frame = _wire.encode(obj) if src == self._rank else None
            slot = await self._collective("broadcast", src, frame)
            try:
                buffer = _receive_buffer([slot.contributions[src]])
            finally:
                self._group._release(slot)
            return _wire.decode(buffer)
        finally:
            self._busy = False

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        self._begin("exchange")
        try:
            self._check_routes(outgoing)
            packed = pack_outgoing(self._rank, outgoing)
            targets = sorted(packed)
            local_error: Exception | None = None
            deliveries: list[tuple[int, Any]] = []
            try:
                buffer, sizes = _wire.encode_many([packed[t] for t in targets])
            except Exception as exc:
                # Join the operation anyway, with a failure marker for every rank, so the
                # group stays in step and every peer learns who failed (as on Gloo).
                local_error = exc
                deliveries = [(target, None) for target in range(self._num_ranks)]
            else:
                start = 0
                for target, size in zip(targets, sizes, strict=True):
                    deliveries.append((target, buffer[start : start + size]))
                    start += size
            slot = await self._collective("exchange", None, None, deliveries)
            try:
                # Arrival order is timing-dependent; sender order is not.
                mail = sorted(slot.inboxes.get(self._rank, ()), key=lambda item: item[0])
                failed = sorted({sender for sender, frame in mail if frame is None})
                senders = [sender for sender, _ in mail]
                frames = [frame for _, frame in mail]
                if local_error is None and not failed:
                    incoming = _receive_buffer(frames)
            finally:
                self._group._release(slot)
            if local_error is not None:
                raise local_error
            if failed:
                raise PeerEncodeError(
                    f"Rank {self._rank}: exchange was abandoned because rank(s) "
                    f"{', '.join(map(str, failed))} could not encode their payloads (their own "
                    "error says why). No data was moved; the group is still usable.",
                    failed_ranks=tuple(failed),
                    rank=self._rank,
                    op="exchange",
                )
            messages = _wire.decode_many(incoming, [frame.size for frame in frames])
            received: dict[Hashable, Any] = {}
            for sender, message in zip(senders, messages, strict=True):
                unpack_into(received, message, rank=self._rank, sender=sender, op="exchange")
            return received
        finally:
            self._busy = False

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        """One collective: each target's prepared frames, sized on both sides in advance.

        Unlike a real collective this one can see what each sender delivered, so a segment
        whose length differs from what ``incoming`` announced raises ``WireFormatError``
        naming the sender (on Gloo the same disagreement is what the shared plan rules out).
        """
        self._begin("exchange")
        try:
            send, recv = check_sized(
                self._rank, self._num_ranks, outgoing, incoming, limit=_wire.DEFAULT_MAX_FRAME_BYTES
            )
            buffer = np.empty(sum(send), dtype=np.uint8)
            write_error = write_segments(outgoing, send, buffer)
            deliveries: list[tuple[int, Any]] = []
            start = 0
            for target, size in enumerate(send):
                if size:
                    deliveries.append((target, buffer[start : start + size]))
                start += size
            slot = await self._collective("exchange", None, None, deliveries)
            try:
                mail = sorted(slot.inboxes.get(self._rank, ()), key=lambda item: item[0])
                arrived = [0] * self._num_ranks
                for sender, frame in mail:
                    arrived[sender] = 0 if frame is None else frame.size
                if arrived == recv:
                    received = _receive_buffer([frame for _, frame in mail if frame is not None])
            finally:
                self._group._release(slot)
            if write_error is not None:
                raise write_error
            if arrived != recv:
                bad = [
                    (s, arrived[s], recv[s])
                    for s in range(self._num_ranks)
                    if arrived[s] != recv[s]
                ]
                raise WireFormatError(
                    f"Rank {self._rank}: exchange_sized received (sender, bytes, announced) "
                    f"{bad!r}: a sender's frames do not add up to the sizes announced for "
                    "them. Ranks must hold the same plan."
                )
            return decode_segments(
                received, incoming, recv, rank=self._rank, limit=_wire.DEFAULT_MAX_FRAME_BYTES
            )
        finally:
            self._busy = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._group._abandon(self._rank, self._next_index, "closed")

    # -- internals ------------------------------------------------------------------------

    def _begin(self, op: str) -> None:
        self._check_open(op)
        if self._busy:
            raise TransportError(
                f"Rank {self._rank}: {op} started while another operation of this transport "
                f"is still running; await one operation at a time per transport.",
                rank=self._rank,
                op=op,
            )
        self._busy = True

    async def _collective(
        self,
        op: str,
        src: int | None,
        contribution: Any,
        deliveries: Sequence[tuple[int, Any]] = (),
    ) -> _Slot:
        """Take the next position of the order, wait for every peer, return the full slot."""
        index = self._next_index
        self._next_index += 1
        group = self._group
        try:
            delay = group._delay(self._rank, index, op)
            if delay > 0:
                await asyncio.sleep(delay)
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            waiter = (loop, future)
            slot = group._arrive(
                self._rank,
                index,
                op,
                src=src,
                contribution=contribution,
                waiter=waiter,
                deliveries=deliveries,
            )
            if slot.complete:
                return slot
            timed_out = False
            try:
                await asyncio.wait_for(future, group.timeout)
            except TimeoutError:
                timed_out = True
            self._check_open(op)  # closed by another task of this rank while waiting
            group._settle(self._rank, slot, op, timed_out=timed_out)
            return slot
        except asyncio.CancelledError:
            group._abandon(self._rank, index, "cancelled")
            raise
