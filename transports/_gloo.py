"""``GlooTransport``: a balance group's collectives on torch.distributed Gloo, off the loop.

**The byte protocol** (shared with :mod:`evenflow.transports._device`). Every operation moves
wire frames (:mod:`evenflow.transports._wire`) as one uint8 tensor in two steps:

1. *sizes*: a fixed-size int64 collective tells every receiver how many bytes each sender
   will send it (``all_to_all_single`` of one int64 per peer; ``broadcast`` of one int64);
2. *data*: after every receiver has validated those sizes, ONE uint8 collective moves the
   bytes (``all_to_all_single`` with uneven splits; ``broadcast`` for a broadcast).

Sizes are validated before any data collective because Gloo kills the receiving process
from a C++ thread when the bytes that arrive do not match the buffer. Gloo also rejects
``all_gather`` with uneven sizes, so ``all_gather`` sends its frame to every peer through
``all_to_all_single``.

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
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from evenflow.transports._base import Outgoing, Transport
from evenflow.transports._wire import (
    DEFAULT_MAX_FRAME_BYTES,
    _PendingFrames,
    decode_many,
    encode,
    encode_many,
)
from evenflow.transports.errors import (
    PeerEncodeError,
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)

__all__ = ["GlooTransport"]

T = TypeVar("T")

#: Size announced by a rank that failed to build its frames (see "Failing together").
_FAILED = -1

_PEER_WORDS = ("connection", "closed", "reset", "peer", "broken pipe", "socket")


# -- group set-up -------------------------------------------------------------------------------


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, but got {timeout!r}.")
    return float(timeout)


def _check_max_frame_bytes(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 64:
        raise ValueError(
            f"max_frame_bytes must be an integer >= 64 (bytes), but got {value!r}; the "
            f"default is {DEFAULT_MAX_FRAME_BYTES}."
        )
    return value


async def _close_owned(transport: Any, executor: ThreadPoolExecutor) -> None:
    """Shared ``aclose`` of the Gloo and device transports: mark closed, join the one thread
    that drives (or waits on) the group, and destroy the group if the transport created it
    and it is still healthy."""
    transport._closed = True
    transport._finalizer.detach()
    await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(executor.shutdown, wait=True)
    )
    if transport._owns_group and transport._broken is None:
        _destroy_group(transport._group)


def _membership(group: dist.ProcessGroup) -> dict[str, Any]:
    """``rank``, ``num_ranks`` and ``global_ranks`` of this process in ``group``."""
    return {
        "rank": dist.get_rank(group),
        "num_ranks": dist.get_world_size(group),
        "global_ranks": tuple(dist.get_process_group_ranks(group)),
    }


def _open_group(
    process_group: dist.ProcessGroup | None,
    ranks: Sequence[int] | None,
    timeout: float,
    backend: str,
    owner: str,
) -> tuple[dist.ProcessGroup, bool]:
    """Return ``(group, created)``: the given group, or a new one over ``ranks``."""
    if not dist.is_available() or not dist.is_initialized():
        raise TransportError(
            f"{owner} needs torch.distributed: call torch.distributed.init_process_group() "
            f"on every rank before creating it."
        )
    if process_group is not None:
        if ranks is not None:
            raise ValueError(
                f"{owner}: pass either process_group or ranks, not both (got ranks={ranks!r})."
            )
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{owner}: process_group must be a torch.distributed ProcessGroup or None, but "
                f"got {process_group!r}."
            )
        return process_group, False
    world = dist.get_world_size()
    if ranks is None:
        members = list(range(world))
    else:
        members = list(ranks)
        if (
            not members
            or any(isinstance(r, bool) or not isinstance(r, int) for r in members)
            or len(set(members)) != len(members)
            or not all(0 <= r < world for r in members)
        ):
            raise ValueError(
                f"{owner}: ranks must be distinct global ranks in [0, {world}), but got {ranks!r}."
            )
    # Default new_group semantics: EVERY rank of the world must call this, for every group,
    # in the same order, members or not (members alone would hang).
    group = dist.new_group(members, timeout=timedelta(seconds=timeout), backend=backend)
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{owner}: this process (global rank {dist.get_rank()}) is not in ranks="
            f"{sorted(members)!r}; create transports only on members (every rank must still "
            f"call the constructor in the same order, which it just did)."
        )
    return group, True


def _destroy_group(group: dist.ProcessGroup) -> None:
    # Destroying a Gloo subgroup is local; after the default group is gone it is already gone.
    if dist.is_initialized():
        dist.destroy_process_group(group)


# -- the protocol's pure parts ------------------------------------------------------------------


class _Protocol:
    """Frame building, size checks and error translation for one member of one group."""

    def __init__(
        self, *, rank: int, num_ranks: int, global_ranks: tuple[int, ...], name: str, limit: int
    ) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.global_ranks = global_ranks
        self.name = name
        self.limit = limit

    @classmethod
    def of(cls, transport: Transport, limit: int) -> _Protocol:
        """The protocol state of ``transport``'s membership."""
        return cls(
            rank=transport.rank,
            num_ranks=transport.num_ranks,
            global_ranks=transport.global_ranks,
            name=transport.name,
            limit=limit,
        )

    @property
    def where(self) -> str:
        return f"Rank {self.rank} ({self.name} group, global ranks {list(self.global_ranks)})"

    def frame_limit_error(self, op: str, size: int, target: str) -> TransportError:
        return TransportError(
            f"{self.where}: {op} would send a frame of {size} bytes to {target}, more than "
            f"max_frame_bytes={self.limit}. Send smaller payloads or raise max_frame_bytes on "
            f"every rank. No data was moved.",
            rank=self.rank,
            op=op,
        )

    def _target_sizes(self, op: str, targets: list[int], frame_sizes: list[int]) -> list[int]:
        """Bytes for every target (0 where it gets nothing), each checked against the limit."""
        sizes = [0] * self.num_ranks
        for target, size in zip(targets, frame_sizes, strict=True):
            if size > self.limit:
                raise self.frame_limit_error(op, size, f"rank {target}")
            sizes[target] = size
        return sizes

    def encode_exchange(
        self, op: str, outgoing: list[list[tuple[Hashable, Any]]]
    ) -> tuple[npt.NDArray[np.uint8], list[int]]:
        """One frame per target with items (empty targets get 0 bytes), in target order."""
        present = [t for t, items in enumerate(outgoing) if items]
        buffer, frame_sizes = encode_many([outgoing[t] for t in present])
        return buffer, self._target_sizes(op, present, frame_sizes)

    def pack_exchange(
        self, op: str, outgoing: list[list[tuple[Hashable, Any]]]
    ) -> tuple[_PendingFrames, _PendingFrames, list[int]]:
        """Pack an exchange's frames and check their sizes, copying no payload yet.

        Returns the frames for the other ranks that get items (in target order), the frame
        this rank sends itself (none when it sends itself nothing) and the bytes for every
        target, 0 where it gets nothing.
        """
        present = [t for t, items in enumerate(outgoing) if items and t != self.rank]
        own_items = outgoing[self.rank]
        peers = _PendingFrames([outgoing[t] for t in present])
        own = _PendingFrames([own_items] if own_items else [])
        sizes = self._target_sizes(
            op, [*present, self.rank] if own_items else present, [*peers.sizes, *own.sizes]
        )
        return peers, own, sizes

    def encode_one(self, op: str, obj: Any) -> npt.NDArray[np.uint8]:
        frame = encode(obj)
        if frame.size > self.limit:
            raise self.frame_limit_error(op, frame.size, "its peers")
        return frame

    def check_incoming(self, op: str, sizes: Sequence[int]) -> None:
        """Validate announced sizes before any data moves; raise what the group agrees on."""
        failed = [src for src, size in enumerate(sizes) if size == _FAILED]
        if failed:
            raise PeerEncodeError(
                f"{self.where}: {op} was abandoned because rank(s) "
                f"{', '.join(map(str, failed))} could not build their frames (their own error "
                f"says why). No data was moved; the group is still usable.",
                failed_ranks=tuple(failed),
                rank=self.rank,
                op=op,
            )
        bad = [(src, size) for src, size in enumerate(sizes) if not 0 <= size <= self.limit]
        if bad:
            raise WireFormatError(
                f"{self.where}: {op} refused announced frame sizes {bad!r} (sender, bytes): "
                f"each must be in [0, max_frame_bytes={self.limit}]. Every rank must use the "
                f"same max_frame_bytes. No data was received."
            )

    def merge_exchange(self, op: str, frames: list[Any]) -> dict[Hashable, Any]:
        received: dict[Hashable, Any] = {}
        origin: dict[Hashable, int] = {}
        for src, items in enumerate(frames):
            if items is None:
                continue
            if not isinstance(items, list):
                raise WireFormatError(
                    f"{self.where}: rank {src} sent an exchange frame holding "
                    f"{type(items).__name__}, not a list of (key, payload) pairs."
                )
            for item in items:
                if not isinstance(item, tuple) or len(item) != 2:
                    raise WireFormatError(
                        f"{self.where}: rank {src} sent {item!r:.80} where a (key, payload) "
                        f"pair belongs."
                    )
                key, payload = item
                if key in origin:
                    raise TransportError(
                        f"{self.where}: key {key!r} arrived from rank {origin[key]} and "
                        f"from rank {src}; keys must be unique per receiver.",
                        rank=self.rank,
                        op=op,
                    )
                origin[key] = src
                received[key] = payload
        return received

    def translate(self, op: str, exc: BaseException) -> TransportError:
        """A torch.distributed failure as the project's error (the caller chains it)."""
        text = str(exc)
        lower = text.lower()
        cls: type[TransportError]
        if "timed out" in lower or "timeout" in lower:
            cls = TransportTimeoutError
        elif any(word in lower for word in _PEER_WORDS):
            cls = PeerFailureError
        else:
            cls = TransportError
        return cls(
            f"{self.where}: {op} failed ({type(exc).__name__}): {text} The group is "
            f"unusable from now on; close this transport.",
            rank=self.rank,
            op=op,
        )


def normalize_outgoing(outgoing: Outgoing, num_ranks: int) -> list[list[tuple[Hashable, Any]]]:
    """``outgoing`` as one list of ``(key, payload)`` tuples per target rank."""
    lists: list[list[tuple[Hashable, Any]]] = [[] for _ in range(num_ranks)]
    for target, items in outgoing.items():
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(
                    f"outgoing[{target}] must hold (key, payload) pairs, but holds "
                    f"{item!r:.80}; pass a list of 2-tuples."
                )
            lists[target].append((item[0], item[1]))
    return lists


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
        seconds = _check_timeout(timeout)
        limit = _check_max_frame_bytes(max_frame_bytes)
        group, created = _open_group(process_group, ranks, seconds, "gloo", "GlooTransport")
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(
                f"GlooTransport needs a Gloo process group, but the given group uses "
                f"{backend!r}; create one with dist.new_group(ranks, backend='gloo')."
            )
        super().__init__(**_membership(group), timeout=seconds)
        self._group = group
        self._owns_group = created
        self._proto = _Protocol.of(self, limit)
        self._broken: TransportError | None = None
        # Reused across operations; both are touched only on the collective thread, and an
        # operation's collectives have completed before the next operation starts there.
        self._send_buffer: npt.NDArray[np.uint8] | None = None
        self._receive_pool = _ReceivePool()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"evenflow-gloo-r{dist.get_rank()}"
        )
        # A transport dropped without aclose() must not keep its thread forever.
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)

    @property
    def max_frame_bytes(self) -> int:
        return self._proto.limit

    # -- public operations ----------------------------------------------------------------------

    async def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, ordered by group rank (each decoded from the wire)."""
        return await self._run("all_gather", functools.partial(self._all_gather, obj))

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        """Member ``src``'s ``obj`` on every member (``src`` too gets a decoded copy)."""
        self._check_open("broadcast")
        self._check_src(src)
        return await self._run("broadcast", functools.partial(self._broadcast, obj, src))

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        """Send each ``(key, payload)`` to its target; return what arrived for this rank."""
        self._check_open("exchange")
        self._check_routes(outgoing)
        return await self._run("exchange", functools.partial(self._exchange, outgoing))

    async def aclose(self) -> None:
        """Join the collective thread and destroy the group this transport created."""
        if not self._closed:
            # Joining waits for an operation still in flight (at most the group timeout).
            await _close_owned(self, self._executor)
        self._send_buffer = None
        self._receive_pool.clear()

    # -- plumbing -------------------------------------------------------------------------------

    async def _run(self, op: str, work: Callable[[], T]) -> T:
        self._check_open(op)
        if self._broken is not None:
            raise type(self._broken)(
                f"Rank {self.rank}: cannot run {op}: an earlier failure made this {self.name} "
                f"group unusable ({self._broken}).",
                rank=self.rank,
                op=op,
            ) from self._broken
        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        try:
            return await future
        except asyncio.CancelledError:
            # The collective may still complete in the background: peers are out of step.
            self._broken = TransportError(
                f"Rank {self.rank}: {op} was cancelled while in flight.", rank=self.rank, op=op
            )
            raise

    def _collective(self, op: str, call: Callable[[], T]) -> T:
        """Run one blocking collective (or start one); translate and remember a failure."""
        try:
            return call()
        except RuntimeError as exc:
            error = self._proto.translate(op, exc)
            self._broken = error
            raise error from exc

    def _overlapped(
        self, op: str, start: Callable[[], dist.Work | None], local: Callable[[], T]
    ) -> T:
        """Start a collective (``async_op=True``), run ``local`` meanwhile, wait for it."""
        work = self._collective(op, start)
        assert work is not None  # async_op=True always returns a Work
        try:
            return local()
        finally:
            # Also when ``local`` failed: nothing may touch the collective's buffers, or
            # start another operation, before it is done.
            self._collective(op, work.wait)

    def _sizes(
        self, op: str, sizes: list[int], overlap: Callable[[], None] | None = None
    ) -> list[int]:
        """Exchange sizes; run ``overlap`` (local work) while they are in flight."""
        send = torch.tensor(sizes, dtype=torch.int64)
        recv = torch.empty(self.num_ranks, dtype=torch.int64)
        if overlap is None:
            self._collective(op, lambda: dist.all_to_all_single(recv, send, group=self._group))
            return [int(s) for s in recv.tolist()]

        def local() -> None:
            try:
                overlap()
            except Exception as exc:
                # Our sizes are announced but their data cannot follow: the peers will wait
                # in the data step, so the group is out of step for good.
                self._broken = TransportError(
                    f"{self._proto.where}: {op} failed after announcing its sizes "
                    f"({type(exc).__name__}: {exc}); the group is unusable, close this "
                    f"transport.",
                    rank=self.rank,
                    op=op,
                )
                raise self._broken from exc

        self._overlapped(
            op,
            lambda: dist.all_to_all_single(recv, send, group=self._group, async_op=True),
            local,
        )
        return [int(s) for s in recv.tolist()]

    def _move(
        self, op: str, send: torch.Tensor, sizes: list[int], incoming: list[int]
    ) -> npt.NDArray[np.uint8]:
        # A pooled lease: decoded views keep it alive, and the pool reuses its memory only
        # after they are all gone (see _ReceivePool).
        recv = self._receive_pool.lease(sum(incoming))
        self._collective(
            op,
            lambda: dist.all_to_all_single(
                torch.from_numpy(recv),
                send,
                output_split_sizes=incoming,
                input_split_sizes=sizes,
                group=self._group,
            ),
        )
        return recv

    def _checked(self, op: str, incoming: list[int]) -> None:
        try:
            self._proto.check_incoming(op, incoming)
        except WireFormatError as exc:
            # Our sender will enter the data step without us: the group is out of step.
            self._broken = TransportError(str(exc), rank=self.rank, op=op)
            raise

    def _exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        op = "exchange"
        copy: Callable[[], None] | None = None
        try:
            peers, own, sizes = self._proto.pack_exchange(
                op, normalize_outgoing(outgoing, self.num_ranks)
            )
            buffer = peers.buffer(self._send_buffer)
            local_error: Exception | None = None
        except Exception as exc:
            local_error, sizes = exc, [_FAILED] * self.num_ranks
        else:
            # Grow-only: keep the larger buffer. Reusing it is safe because nothing refers
            # to the send buffer once the data collective has returned.
            if self._send_buffer is None or buffer.size > self._send_buffer.size:
                self._send_buffer = buffer
            # The copy runs while the sizes travel: it hides their latency and the wait for
            # the slowest peer. Everything that can reject the input has already run.
            copy = functools.partial(peers.write, buffer)
        incoming = self._sizes(op, sizes, overlap=copy)
        if local_error is not None:
            raise local_error
        self._checked(op, incoming)
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

        own_items = self._overlapped(
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

    def _all_gather(self, obj: Any) -> list[Any]:
        op = "all_gather"
        n = self.num_ranks
        try:
            frame = self._proto.encode_one(op, obj)
            local_error: Exception | None = None
        except Exception as exc:
            local_error, frame = exc, np.empty(0, dtype=np.uint8)
        incoming = self._sizes(op, [_FAILED if local_error else frame.size] * n)
        if local_error is not None:
            raise local_error
        self._checked(op, incoming)
        # all_to_all_single needs one input segment per peer: the frame, n times.
        send = torch.from_numpy(frame)
        received = self._move(op, send.repeat(n) if n > 1 else send, [frame.size] * n, incoming)
        frames = decode_many(received, incoming, max_frame_bytes=self._proto.limit)
        return frames

    def _broadcast(self, obj: Any, src: int) -> Any:
        op = "broadcast"
        local_error: Exception | None = None
        frame = np.empty(0, dtype=np.uint8)
        if self.rank == src:
            try:
                frame = self._proto.encode_one(op, obj)
            except Exception as exc:
                local_error = exc
        size = torch.tensor([_FAILED if local_error else frame.size], dtype=torch.int64)
        self._collective(op, lambda: dist.broadcast(size, group=self._group, group_src=src))
        if local_error is not None:
            raise local_error
        announced = int(size.item())
        incoming = [0] * self.num_ranks
        incoming[src] = announced
        self._checked(op, incoming)
        data = torch.from_numpy(frame if self.rank == src else np.empty(announced, np.uint8))
        self._collective(op, lambda: dist.broadcast(data, group=self._group, group_src=src))
        # src decodes its own frame too: nobody receives an alias of the caller's objects.
        return decode_many(data.numpy(), [announced], max_frame_bytes=self._proto.limit)[0]
