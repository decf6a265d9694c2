"""``GlooTransport``: a balance group's collectives on torch.distributed Gloo, off the loop.

**The byte protocol** is that of :mod:`evenflow.transports._protocol` (shared with the device
transport, the model-parallel broadcast and the start-up agreement): every operation moves
wire frames as one uint8 tensor in two steps, a fixed-size int64 *sizes* collective
(``all_to_all_single`` of one int64 per peer; ``broadcast`` of one int64), then, after every
receiver has validated those sizes, ONE uint8 *data* collective (``all_to_all_single`` with
uneven splits; ``broadcast`` for a broadcast). Failures of torch.distributed are mapped to
the project's errors there, too.

**Failing together.** A rank that cannot build its frames (``EncodeError``, a frame over
``max_frame_bytes``, malformed ``outgoing``) still takes part in the sizes step, announcing
``-1``; then every rank skips the data step and raises: the failing rank its own error, the
others a ``TransportError`` naming it. The group stays in step and usable. ``RouteError``
and a bad broadcast ``src`` are raised before any collective; the contract requires every
rank to make the same mistake. Ranks must agree on ``max_frame_bytes``: a receiver that
rejects sizes its sender accepted leaves the sender waiting until the group timeout.

**Threads.** Each transport owns exactly one single-worker executor (thread name
``evenflow-gloo-...``) and runs every collective of its group there: two threads driving one
Gloo group corrupt data. Frames are encoded and decoded on that thread too.

**Exchange, step by step.** ``exchange`` packs every frame's header first (this is where
encode errors surface, before anything is announced), starts the sizes step with
``async_op=True`` and copies the payloads for its peers into its send buffer while the sizes
travel, which hides the step's latency and the wait for the slowest peer. The data step is
likewise started asynchronously; the frame a rank sends *itself* takes no part in it (split
size 0) and is instead copied, once, straight into the end of the receive buffer and decoded
while the peers' bytes are in flight, the same overlap Gloo gives its own local copy. The
engine never sends a rank its own samples, so that path matters only to direct callers.

**Sized exchange: one collective.** ``exchange_sized`` is the engine's path: every sample
was prepared for the wire when it was read and its frame size travelled in the metadata round,
so every receiver sizes its buffer from ``incoming`` and the exchange is ONE uint8
``all_to_all_single`` (:mod:`evenflow.transports._sized`): the sender writes its frames into
the send buffer, the collective runs, the receiver decodes each frame. The sizes step of
``exchange`` is what this saves; ``exchange`` keeps it for callers that cannot know the sizes.

**Buffers.** One grow-only send buffer per transport is reused by every exchange (nothing
refers to it once the data step has returned), and large receives land in pooled buffers
(:class:`_ReceivePool`): the first-touch page faults of fresh multi-MiB buffers were measured
to cost as much as copying the data, and several times that on a loaded machine or at
64 MiB, above the largest size glibc serves from its heap (``evenflow bench exchange`` shows
it in its "raw fresh" column). Decoded arrays and tensors are views of the receive buffer,
as the wire format documents; the pool never reuses a buffer while any of them is alive.
``aclose()`` drops both.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from evenflow.transports._base import Outgoing, Transport, check_timeout
from evenflow.transports._channel import Channel
from evenflow.transports._protocol import (
    CLOSE_DEADLINE,
    FAILED,
    ROLL_CALL_SECONDS,
    Protocol,
    close_owned,
    membership,
    open_group,
    pack_outgoing,
    roll_call,
)
from evenflow.transports._sized import (
    SizedIncoming,
    SizedOutgoing,
    check_sized,
    decode_segments,
    write_segments,
)
from evenflow.transports._threads import WorkerThreads
from evenflow.transports._wire import DEFAULT_MAX_FRAME_BYTES, check_max_frame_bytes, decode_many
from evenflow.transports.errors import TransportError

__all__ = ["GlooTransport"]

T = TypeVar("T")


# -- buffer reuse -------------------------------------------------------------------------------

#: Receive buffers smaller than this come straight from the allocator: small allocations are
#: cheap, and a long-lived small result (metadata) must not pin a large pooled buffer.
_POOL_MIN_BYTES = 1 << 20
#: At most this many receive buffers are kept, busy or idle.
_POOL_MAX_BUFFERS = 4


class _ReceivePool:
    """Receive buffers that are reused only once no decoded view can still see them.

    Fresh memory of tens of MiB costs a page fault per 4 KiB on first touch, which on a busy
    machine was as slow as moving the bytes. So each large receive takes a *lease*: a new
    ndarray object over the start of a pooled backing buffer. ``np.frombuffer`` gives the
    lease a memoryview as its base, so numpy's base collapsing stops at the lease: every
    view derived from it (sliced, reshaped, read through a memoryview, wrapped by
    ``torch.from_numpy``) holds a reference to the lease itself. A backing buffer is handed
    out again only after a weak reference shows its last lease was freed, i.e. after the
    caller has dropped every decoded array and tensor of that receive. Nothing that still
    points into a buffer can be overwritten; a receive that finds every buffer busy gets
    fresh memory instead. Gloo's worker thread may drop its reference to an output tensor
    a moment after the collective has returned, so back-to-back receives sometimes alternate
    between two buffers; liveness is only ever over-estimated, never under-estimated.

    Used only on the transport's collective thread. Idle memory is bounded by
    ``_POOL_MAX_BUFFERS`` buffers of at most 1.25x the largest receive; :meth:`clear`
    releases it.
    """

    def __init__(self) -> None:
        self._backing: list[npt.NDArray[np.uint8]] = []
        self._leases: list[weakref.ref[npt.NDArray[np.uint8]] | None] = []

    def lease(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A writable uint8 array of ``nbytes`` bytes, reused when possible."""
        if nbytes < _POOL_MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        idle = [i for i, ref in enumerate(self._leases) if ref is None or ref() is None]
        fits = [i for i in idle if self._backing[i].size >= nbytes]
        if fits:
            index = min(fits, key=lambda i: self._backing[i].size)
        elif idle or len(self._backing) < _POOL_MAX_BUFFERS:
            # Grow-only with headroom, so that sizes drifting from step to step settle.
            backing = np.empty(nbytes + nbytes // 4, dtype=np.uint8)
            if idle:
                index = min(idle, key=lambda i: self._backing[i].size)
                self._backing[index] = backing
            else:
                index = len(self._backing)
                self._backing.append(backing)
                self._leases.append(None)
        else:
            return np.empty(nbytes, dtype=np.uint8)
        lease: npt.NDArray[np.uint8] = np.frombuffer(self._backing[index].data[:nbytes], np.uint8)
        self._leases[index] = weakref.ref(lease)
        return lease

    def clear(self) -> None:
        """Forget every buffer (leases still held stay valid: they keep their memory)."""
        self._backing.clear()
        self._leases.clear()


# -- the transport ------------------------------------------------------------------------------


class GlooTransport(Transport):
    """Collectives of one balance group over its own Gloo process group, off the event loop.

    ``process_group=None`` creates a dedicated group over ``ranks`` (default: the whole
    world) with ``dist.new_group(..., backend="gloo", timeout=timeout)``: like ``new_group``,
    the constructor must then run on EVERY rank of the world, in the same order for every
    transport, members or not (non-members get a ``ValueError`` after the call). Never hand
    it the training group: its collectives run on a background thread and would interleave
    with the training loop's. A given ``process_group`` must be a Gloo group nothing else
    uses; its own timeout then applies, and it is not destroyed by ``aclose()``.

    ``max_frame_bytes`` bounds every frame sent and received; all ranks must use the same
    value. See the module docstring for the protocol and the threading rules.
    """

    name = "gloo"
    launch_on_caller = False

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        ranks: Sequence[int] | None = None,
        timeout: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        seconds = check_timeout(timeout)
        limit = check_max_frame_bytes(max_frame_bytes)
        group, created = open_group(process_group, ranks, seconds, "gloo", "GlooTransport")
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(
                f"GlooTransport needs a Gloo process group, but the given group uses "
                f"{backend!r}; create one with dist.new_group(ranks, backend='gloo')."
            )
        super().__init__(**membership(group), timeout=seconds)
        self._group = group
        self._owns_group = created
        self._proto = Protocol.of(self, limit)
        # Reused across operations; both are touched only on the collective thread, and an
        # operation's collectives have completed before the next operation starts there.
        self._send_buffer: npt.NDArray[np.uint8] | None = None
        self._receive_pool = _ReceivePool()
        # A pooled lease: decoded views keep it alive, and the pool reuses its memory only
        # after they are all gone (see _ReceivePool).
        self._channel = Channel(group, self._proto, lease=self._receive_pool.lease)
        self._executor = WorkerThreads(1, name=f"evenflow-gloo-r{dist.get_rank()}")
        # A transport dropped without aclose() must not keep its thread forever.
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)

    @property
    def max_frame_bytes(self) -> int:
        return self._proto.limit

    # -- public operations ----------------------------------------------------------------------

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, ordered by group rank (each decoded from the wire)."""
        return await self._run("all_gather", functools.partial(self._channel.all_gather, obj))

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        """Member ``src``'s ``obj`` on every member (``src`` too gets a decoded copy)."""
        self._check_open("broadcast")
        self._check_src(src)
        return await self._run("broadcast", functools.partial(self._channel.broadcast, obj, src))

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        """Send each ``(key, payload)`` to its target; return what arrived for this rank."""
        self._check_open("exchange")
        self._check_routes(outgoing)
        return await self._run("exchange", functools.partial(self._exchange, outgoing))

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        """One ``all_to_all_single``, its splits from the prepared sizes and ``incoming``."""
        self._check_open("exchange")
        send, recv = check_sized(
            self.rank, self.num_ranks, outgoing, incoming, limit=self._proto.limit
        )
        return await self._run(
            "exchange", functools.partial(self._exchange_sized, outgoing, incoming, send, recv)
        )

    async def aclose(self) -> None:
        """Join the collective thread and destroy the group this transport created."""
        if not self._closed:
            # Joining waits for an operation still in flight, within CLOSE_DEADLINE: it ends
            # at once when its peers close their groups, at the group timeout otherwise.
            self._closed = True
            self._finalizer.detach()
            await close_owned(
                self._executor,
                self._group,
                destroy=self._owns_group and self._channel.broken is None,
                deadline=min(self.timeout, CLOSE_DEADLINE),
            )
        self._send_buffer = None
        self._receive_pool.clear()
        # The group's sockets close when the last reference to it goes: a closed transport
        # must not be that reference, wherever the transport itself is still held.
        self._channel.release()
        self._group = None  # type: ignore[assignment]

    async def roll_call(self, tag: str, deadline: float = ROLL_CALL_SECONDS) -> list[int] | None:
        """After a collective of this group failed: the global ranks that do not answer a
        roll call within ``deadline`` seconds (see :func:`roll_call`), or ``None`` when that
        cannot be told. Every surviving member must call it with the same ``tag``. Runs on
        the default executor: the collective thread may still be inside the failed call."""
        group = self._group
        if group is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(
            None,
            functools.partial(
                roll_call,
                group,
                rank=self.rank,
                global_ranks=self.global_ranks,
                tag=tag,
                deadline=deadline,
            ),
        )

    # -- plumbing -------------------------------------------------------------------------------

    async def _run(self, op: str, work: Callable[[], T]) -> T:
        self._check_open(op)
        broken = self._channel.broken
        if broken is not None:
            raise type(broken)(
                f"Rank {self.rank}: cannot run {op}: an earlier failure made this {self.name} "
                f"group unusable ({broken}).",
                rank=self.rank,
                op=op,
                peer_rank=broken.peer_rank,
            ) from broken
        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        try:
            return await future
        except asyncio.CancelledError:
            # The collective may still complete in the background: peers are out of step.
            self._channel.broken = TransportError(
                f"Rank {self.rank}: {op} was cancelled while in flight.", rank=self.rank, op=op
            )
            raise

    def _exchange_sized(
        self,
        outgoing: SizedOutgoing,
        incoming: SizedIncoming,
        send: list[int],
        recv: list[int],
    ) -> dict[Hashable, Any]:
        me, limit = self.rank, self._proto.limit
        # The frames a rank sends itself skip the collective (split size 0), as in exchange:
        # they are written straight into the end of the receive buffer and decoded while
        # the peers' bytes are in flight.
        peer_send, peer_recv = list(send), list(recv)
        peer_send[me] = peer_recv[me] = 0
        total = sum(peer_send)
        buffer = self._send_buffer
        if buffer is None or buffer.size < total:
            # Grow-only, as for exchange: nothing refers to it once a collective returned.
            buffer = self._send_buffer = np.empty(total + total // 4, dtype=np.uint8)
        send_bytes = buffer[:total]
        peers = {target: items for target, items in outgoing.items() if target != me}
        write_error = write_segments(peers, peer_send, send_bytes)
        from_peers, mine = sum(peer_recv), recv[me]
        received = self._receive_pool.lease(from_peers + mine)
        own_sizes = [0] * self.num_ranks
        own_sizes[me] = mine
        own_errors: list[Exception | None] = [None]

        def local() -> dict[Hashable, Any]:
            if not mine:
                return {}
            frames = received[from_peers:]
            own_errors[0] = write_segments({me: outgoing[me]}, own_sizes, frames)
            return decode_segments(frames, incoming, own_sizes, rank=me, limit=limit)

        own = self._channel.overlapped(
            "exchange",
            lambda: dist.all_to_all_single(
                torch.from_numpy(received[:from_peers]),
                torch.from_numpy(send_bytes),
                output_split_sizes=peer_recv,
                input_split_sizes=peer_send,
                group=self._group,
                async_op=True,
            ),
            local,
        )
        if write_error is not None or own_errors[0] is not None:
            raise write_error or own_errors[0]  # type: ignore[misc]
        result = decode_segments(received[:from_peers], incoming, peer_recv, rank=me, limit=limit)
        result.update(own)
        return result

    def _exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        op = "exchange"
        copy: Callable[[], None] | None = None
        try:
            peers, own, sizes = self._proto.pack_exchange(op, pack_outgoing(self.rank, outgoing))
            buffer = peers.buffer(self._send_buffer)
            local_error: Exception | None = None
        except Exception as exc:
            local_error, sizes = exc, [FAILED] * self.num_ranks
        else:
            # Grow-only: keep the larger buffer. Reusing it is safe because nothing refers
            # to the send buffer once the data collective has returned.
            if self._send_buffer is None or buffer.size > self._send_buffer.size:
                self._send_buffer = buffer
            # The copy runs while the sizes travel: it hides their latency and the wait for
            # the slowest peer. Everything that can reject the input has already run.
            copy = functools.partial(peers.write, buffer)
        channel = self._channel
        incoming = channel.sizes(op, sizes, overlap=copy)
        if local_error is not None:
            raise local_error
        channel.check(op, incoming)
        # The frame a rank sends itself skips the collective (split size 0): it is copied
        # once, straight from the payloads to the end of the receive buffer, while the
        # peers' bytes are in flight, which is the overlap Gloo gives its own local copy.
        mine = incoming[self.rank]
        peer_sizes, peer_incoming = list(sizes), list(incoming)
        peer_sizes[self.rank] = peer_incoming[self.rank] = 0
        from_peers = sum(peer_incoming)
        recv = self._receive_pool.lease(from_peers + mine)
        limit = self._proto.limit

        def local() -> Any:
            if not mine:
                return None
            frame = recv[from_peers:]
            own.write(frame)
            return decode_many(frame, [mine], max_frame_bytes=limit)[0]

        own_items = channel.overlapped(
            op,
            lambda: dist.all_to_all_single(
                torch.from_numpy(recv[:from_peers]),
                torch.from_numpy(buffer),
                output_split_sizes=peer_incoming,
                input_split_sizes=peer_sizes,
                group=self._group,
                async_op=True,
            ),
            local,
        )
        decoded = decode_many(recv[:from_peers], peer_incoming, max_frame_bytes=limit)
        decoded[self.rank] = own_items
        return self._proto.merge_exchange(op, decoded)
