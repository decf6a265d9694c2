"""The sizes-first protocol of :mod:`evenflow.transports._protocol`, run on one CPU group.

:class:`Channel` is what the Gloo transport, the model-parallel batch broadcast and the
start-up agreement of ``build_loader`` share: blocking collectives on the calling thread
(which must be the one thread that drives the group), each failure mapped by the protocol's
one mapper and remembered, because a group is out of step for good after it. The device
transport speaks the same protocol through launch points instead.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from evenflow.transports._protocol import FAILED, Protocol
from evenflow.transports._wire import decode_many
from evenflow.transports.errors import TransportClosedError, TransportError, WireFormatError

__all__ = ["Channel"]

T = TypeVar("T")


class Channel:
    """The sizes-first protocol on one CPU (Gloo) group, blocking, on the calling thread.

    Callers run it on the one thread that drives the group. After a failed collective, or
    sizes that a peer's data cannot follow, :attr:`broken` holds the error: the group is out
    of step for good and the caller must refuse further operations.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        protocol: Protocol,
        *,
        lease: Callable[[int], npt.NDArray[np.uint8]] | None = None,
    ) -> None:
        self.group = group
        self.protocol = protocol
        #: Where received bytes land: ``lease(nbytes)`` (the Gloo transport pools them).
        self.lease = lease or functools.partial(np.empty, dtype=np.uint8)
        self.broken: TransportError | None = None

    def release(self) -> None:
        """Drop the reference to the group (after its owner closed): the group's sockets
        close with its last reference, and a closed transport must not be that one. Any later
        operation fails as on a broken group."""
        self.group = None  # type: ignore[assignment]
        # A failed collective's error keeps its traceback, whose frames hold the group (and
        # form a cycle with this channel): clear their locals, or the group's sockets stay
        # open until a garbage collection.
        _forget_frames(self.broken)
        if self.broken is None:
            self.broken = TransportClosedError(
                "this channel's transport was closed", rank=self.protocol.rank, op="close"
            )

    def collective(self, op: str, call: Callable[[], T]) -> T:
        """Run one blocking collective (or start one); map and remember a failure."""
        try:
            return call()
        except RuntimeError as exc:
            error = self.protocol.translate(op, exc)
            self.broken = error
            raise error from exc

    def overlapped(
        self, op: str, start: Callable[[], dist.Work | None], local: Callable[[], T]
    ) -> T:
        """Start a collective (``async_op=True``), run ``local`` meanwhile, wait for it."""
        work = self.collective(op, start)
        assert work is not None  # async_op=True always returns a Work
        try:
            return local()
        finally:
            # Also when ``local`` failed: nothing may touch the collective's buffers, or
            # start another operation, before it is done.
            self.collective(op, work.wait)

    def sizes(
        self, op: str, sizes: list[int], overlap: Callable[[], None] | None = None
    ) -> list[int]:
        """Exchange sizes (one int64 per peer); run ``overlap`` while they are in flight."""
        send = torch.tensor(sizes, dtype=torch.int64)
        recv = torch.empty(self.protocol.num_ranks, dtype=torch.int64)
        if overlap is None:
            self.collective(op, lambda: dist.all_to_all_single(recv, send, group=self.group))
            return [int(s) for s in recv.tolist()]

        def local() -> None:
            try:
                overlap()
            except Exception as exc:
                # Our sizes are announced but their data cannot follow: the peers will wait
                # in the data step, so the group is out of step for good.
                self.broken = TransportError(
                    f"{self.protocol.where}: {op} failed after announcing its sizes "
                    f"({type(exc).__name__}: {exc}); the group is unusable, close this "
                    f"transport.",
                    rank=self.protocol.rank,
                    op=op,
                )
                raise self.broken from exc

        self.overlapped(
            op,
            lambda: dist.all_to_all_single(recv, send, group=self.group, async_op=True),
            local,
        )
        return [int(s) for s in recv.tolist()]

    def broadcast_size(self, op: str, size: int, src: int) -> int:
        """Group rank ``src``'s announced size, on every member (``src`` passes its own)."""
        box = torch.tensor([size], dtype=torch.int64)
        self.collective(op, lambda: dist.broadcast(box, group=self.group, group_src=src))
        return int(box.item())

    def check(self, op: str, incoming: Sequence[int]) -> None:
        """:meth:`Protocol.check_incoming`; refused sizes also leave the group out of step."""
        try:
            self.protocol.check_incoming(op, incoming)
        except WireFormatError as exc:
            # Our sender will enter the data step without us: the group is out of step.
            self.broken = TransportError(str(exc), rank=self.protocol.rank, op=op)
            raise

    def broadcast_bytes(self, op: str, data: torch.Tensor, src: int) -> None:
        """One uint8 (or any contiguous) tensor from group rank ``src``, in place."""
        self.collective(op, lambda: dist.broadcast(data, group=self.group, group_src=src))

    def all_gather(self, obj: Any, *, op: str = "all_gather") -> list[Any]:
        """Every member's ``obj``, ordered by group rank (each decoded from the wire)."""
        proto = self.protocol
        n = proto.num_ranks
        try:
            frame = proto.encode_one(op, obj)
            local_error: Exception | None = None
        except Exception as exc:
            local_error, frame = exc, np.empty(0, dtype=np.uint8)
        incoming = self.sizes(op, [FAILED if local_error else frame.size] * n)
        if local_error is not None:
            raise local_error
        self.check(op, incoming)
        # all_to_all_single needs one input segment per peer: the frame, n times.
        send = torch.from_numpy(frame)
        send = send.repeat(n) if n > 1 else send
        recv = self.lease(sum(incoming))
        self.collective(
            op,
            lambda: dist.all_to_all_single(
                torch.from_numpy(recv),
                send,
                output_split_sizes=incoming,
                input_split_sizes=[frame.size] * n,
                group=self.group,
            ),
        )
        return decode_many(recv, incoming, max_frame_bytes=proto.limit)

    def broadcast(self, obj: Any, src: int, *, op: str = "broadcast") -> Any:
        """Group rank ``src``'s ``obj`` on every member (``src`` too gets a decoded copy)."""
        proto = self.protocol
        local_error: Exception | None = None
        frame = np.empty(0, dtype=np.uint8)
        if proto.rank == src:
            try:
                frame = proto.encode_one(op, obj)
            except Exception as exc:
                local_error = exc
        announced = self.broadcast_size(op, FAILED if local_error else frame.size, src)
        if local_error is not None:
            raise local_error
        incoming = [0] * proto.num_ranks
        incoming[src] = announced
        self.check(op, incoming)
        data = torch.from_numpy(frame if proto.rank == src else np.empty(announced, np.uint8))
        self.broadcast_bytes(op, data, src)
        # src decodes its own frame too: nobody receives an alias of the caller's objects.
        return decode_many(data.numpy(), [announced], max_frame_bytes=proto.limit)[0]


def _forget_frames(exc: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``exc``'s traceback and in those
    of the exceptions it was raised from (the traceback text stays)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
