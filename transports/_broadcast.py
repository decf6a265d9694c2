"""Model-parallel batch broadcast: one rank builds a batch, its tp/cp/pp peers receive it.

Ranks that differ only in model-parallel coordinates must train on the same batch. Only the
*constructor* of a data-parallel coordinate reads, balances and collates; after each delivered
step it broadcasts the host (CPU) batch to its peers over a Gloo group of those ranks, which
then copy it to their own device. The peers never touch their source.

One batch is one *message*, sent with the sizes-first protocol of
:mod:`evenflow.transports._protocol` in a fixed order (so every member can size its receive
buffers before the bytes arrive):

1. ``broadcast`` of one int64: the header's length, validated by every receiver;
2. ``broadcast`` of the header: a wire frame (msgpack + raw buffers, never pickle) holding the
   caller's fields (the engine sends status, epoch, step and error), the batch's structure
   with every large tensor replaced by an index, and each such tensor's dtype and shape;
3. one ``broadcast`` per large tensor, sent directly from its memory as a flat byte view (a
   saving of one copy per tensor over packing them into the header frame).

Tensors below ``inline_bytes`` ride inside the header instead: one small copy is cheaper than
one collective each. All of a group's collectives run on the broadcaster's one single-worker
executor (two threads driving one Gloo group corrupt data); failures of torch.distributed are
mapped by the protocol's one mapper.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from evenflow.transports import _wire
from evenflow.transports._channel import Channel
from evenflow.transports._protocol import CLOSE_DEADLINE, Protocol
from evenflow.transports._threads import WorkerThreads
from evenflow.transports.errors import (
    PeerFailureError,
    TransportClosedError,
    TransportError,
    WireFormatError,
)

__all__ = ["BatchBroadcaster", "join_batch", "split_batch"]

T = TypeVar("T")

MESSAGE_VERSION = 1
#: Tensors smaller than this travel inside the header frame.
DEFAULT_INLINE_BYTES = 64 << 10
#: Largest header a receiver accepts (a header holds the small tensors of one batch).
MAX_HEADER_BYTES = 1 << 30
#: Largest single tensor a receiver allocates.
MAX_TENSOR_BYTES = 1 << 40


# -- batch structure ---------------------------------------------------------------------------


def split_batch(batch: Any, *, inline_bytes: int = DEFAULT_INLINE_BYTES) -> tuple[Any, list[Any]]:
    """``(tree, tensors)``: the batch's structure, and the large tensors it refers to by index.

    The tree is tagged so that it decodes unambiguously whatever the user's keys are:
    ``["t", i]`` tensor ``i``, ``["d", keys, values]`` mapping, ``["l", items]`` list,
    ``["u", items]`` tuple (namedtuples included), ``["v", value]`` any other wire value.
    Large tensors are returned contiguous, on the CPU, flattened to bytes.
    """
    tensors: list[Any] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes < inline_bytes:
                return ["v", tensor]
            tensors.append(tensor.contiguous())
            return ["t", len(tensors) - 1]
        if isinstance(value, dict):
            return ["d", list(value.keys()), [walk(v) for v in value.values()]]
        if isinstance(value, list):
            return ["l", [walk(v) for v in value]]
        if isinstance(value, tuple):
            return ["u", [walk(v) for v in value]]
        return ["v", value]

    return walk(batch), tensors


def join_batch(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`split_batch` (namedtuples come back as tuples, mappings as dicts)."""

    def walk(node: Any) -> Any:
        if not isinstance(node, (list, tuple)) or not node:
            raise WireFormatError(f"Malformed batch structure node {node!r:.80}.")
        tag = node[0]
        if tag == "v" and len(node) == 2:
            return node[1]
        if tag == "t" and len(node) == 2 and isinstance(node[1], int):
            if not 0 <= node[1] < len(tensors):
                raise WireFormatError(f"Batch structure refers to missing tensor {node[1]}.")
            return tensors[node[1]]
        if tag == "d" and len(node) == 3 and len(node[1]) == len(node[2]):
            return {k: walk(v) for k, v in zip(node[1], node[2], strict=True)}
        if tag == "l" and len(node) == 2:
            return [walk(v) for v in node[1]]
        if tag == "u" and len(node) == 2:
            return tuple(walk(v) for v in node[1])
        raise WireFormatError(f"Malformed batch structure node {node!r:.80}.")

    return walk(tree)


def _describe(tensor: torch.Tensor) -> list[Any]:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]


def _allocate(desc: Any) -> torch.Tensor:
    """An empty tensor for a received descriptor, validated (the header is peer data)."""
    ok = isinstance(desc, (list, tuple)) and len(desc) == 2
    dtype = getattr(torch, desc[0], None) if ok and isinstance(desc[0], str) else None
    shape = desc[1] if ok else None
    if (
        not isinstance(dtype, torch.dtype)
        or not isinstance(shape, (list, tuple))
        or not all(isinstance(d, int) and d >= 0 for d in shape)
        or math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES
    ):
        raise WireFormatError(f"Malformed tensor descriptor {desc!r:.120} in a batch header.")
    return torch.empty(tuple(shape), dtype=dtype)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (every dtype broadcasts as bytes)."""
    return tensor.reshape(-1).view(torch.uint8)


# -- the broadcaster ---------------------------------------------------------------------------


class BatchBroadcaster:
    """Messages from the constructor (``ranks[0]``) to the other ``ranks`` of one Gloo group.

    ``send`` on the constructor and ``receive`` on every peer, the same number of times in the
    same order. Blocking methods run on the broadcaster's own executor (use :meth:`call` or
    :meth:`acall`). After a failed collective the group is dead: later calls raise at once.
    ``ranks`` and ``rank`` are global ranks; ``process_group`` is the group over ``ranks``.
    """

    def __init__(
        self,
        process_group: Any,
        *,
        ranks: tuple[int, ...],
        rank: int,
        timeout: float,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the broadcast group {ranks!r}.")
        self._ranks = ranks
        self._rank = rank
        self._inline = inline_bytes
        self._closed = False
        self._src = dist.get_group_rank(process_group, ranks[0])
        self._channel = Channel(
            process_group,
            Protocol(
                rank=dist.get_rank(process_group),
                num_ranks=len(ranks),
                global_ranks=tuple(dist.get_process_group_ranks(process_group)),
                name="model-parallel broadcast",
                limit=MAX_HEADER_BYTES,
                advice=(
                    f"A peer left, crashed or did not iterate within {timeout:g} s; every "
                    "rank of a model-parallel group must iterate the same steps."
                ),
                label=(
                    f"Rank {rank}: the model-parallel batch broadcast from rank {ranks[0]} "
                    f"to ranks {list(ranks)}"
                ),
            ),
        )
        self._executor = WorkerThreads(1, name=f"evenflow-mp-{ranks[0]}")

    @property
    def is_sender(self) -> bool:
        return self._rank == self._ranks[0]

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the broadcaster's thread and wait for it (sync callers)."""
        self._check_open()
        return self._executor.submit(fn).result()

    async def acall(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the broadcaster's thread (async callers)."""
        self._check_open()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(
                f"Rank {self._rank}: the model-parallel broadcast among ranks "
                f"{list(self._ranks)} is closed; build a new loader.",
                rank=self._rank,
                op="broadcast",
            )
        broken = self._channel.broken
        if broken is not None:
            raise PeerFailureError(
                f"Rank {self._rank}: the model-parallel broadcast among ranks "
                f"{list(self._ranks)} failed earlier ({str(broken)[:200]}); it cannot be used "
                "again.",
                rank=self._rank,
                op="broadcast",
            )

    def send(self, header: dict[str, Any], batch: Any = None) -> None:
        """Broadcast one message (blocking). Encoding errors raise before anything is sent."""
        assert self.is_sender, "only the constructor sends"
        tree, tensors = split_batch(batch, inline_bytes=self._inline)
        channel = self._channel
        frame = channel.protocol.encode_one(
            "broadcast (header)",
            {
                **header,
                "v": MESSAGE_VERSION,
                "tree": tree,
                "tensors": [_describe(t) for t in tensors],
            },
        )
        channel.broadcast_size("broadcast (header size)", frame.size, self._src)
        channel.broadcast_bytes("broadcast (header)", torch.from_numpy(frame), self._src)
        for tensor in tensors:
            if tensor.numel():
                channel.broadcast_bytes("broadcast (tensor)", _as_bytes(tensor), self._src)

    def receive(self) -> tuple[dict[str, Any], Any]:
        """Receive one message (blocking): ``(header, batch)``; ``batch`` is None unless ok."""
        assert not self.is_sender, "the constructor does not receive"
        channel = self._channel
        length = channel.broadcast_size("broadcast (header size)", 0, self._src)
        incoming = [0] * channel.protocol.num_ranks
        incoming[self._src] = length
        channel.check("broadcast (header size)", incoming)
        payload = torch.empty(length, dtype=torch.uint8)
        channel.broadcast_bytes("broadcast (header)", payload, self._src)
        try:
            header = _wire.decode(payload.numpy(), max_frame_bytes=MAX_HEADER_BYTES)
            if not isinstance(header, dict) or header.get("v") != MESSAGE_VERSION:
                raise WireFormatError(
                    f"Rank {self._rank}: a batch header from rank {self._ranks[0]} is not a "
                    f"version {MESSAGE_VERSION} header; are all ranks running the same evenflow?"
                )
            tensors = [_allocate(d) for d in header.get("tensors", [])]
        except WireFormatError as exc:
            # The sender will broadcast tensors we cannot size: the group is out of step.
            channel.broken = TransportError(str(exc), rank=self._rank, op="broadcast")
            raise
        for tensor in tensors:
            if tensor.numel():
                channel.broadcast_bytes("broadcast (tensor)", _as_bytes(tensor), self._src)
        batch = join_batch(header.get("tree"), tensors) if header.get("status") == "ok" else None
        return header, batch

    def close(self) -> None:
        """Join the broadcaster's thread, for at most ``CLOSE_DEADLINE`` seconds (a broadcast
        whose peer left is abandoned there). Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True, deadline=CLOSE_DEADLINE)
        self._channel.release()
