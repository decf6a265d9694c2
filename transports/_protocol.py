"""The one byte protocol of everything in evenflow that talks to torch.distributed.

Four things live here, each once: the Gloo transport, the device transport, the
model-parallel batch broadcast (:mod:`evenflow.transports._broadcast`) and the start-up
agreement of ``build_loader`` are users of them. :class:`~evenflow.transports._channel.Channel`
runs the protocol's blocking form on a CPU group for all but the device transport.

**Group setup.** :func:`new_group` is the only place that creates a process group. It always
passes ``timeout=``: subgroups do not inherit the timeout of ``init_process_group``. With
default ``new_group`` semantics every rank of the world calls it for every group, in the same
order, members or not.

**Sizes first.** Every operation moves wire frames (:mod:`evenflow.transports._wire`) in two
steps: a fixed-size int64 collective tells every receiver how many bytes each sender will send
it; after every receiver has validated those sizes, ONE uint8 collective moves the bytes. Sizes
are validated before any data collective because Gloo kills the receiving process from a C++
thread when the bytes that arrive do not match the buffer. A rank that cannot build its frames
announces :data:`FAILED` instead of a size, so that every rank skips the data step and raises
together (the failing rank its own error, the others ``PeerEncodeError``). Gloo rejects
``all_gather`` with uneven sizes, so an all-gather sends its frame to every peer through
``all_to_all_single``.

**One exception mapper.** :func:`map_dist_error` turns a torch.distributed ``RuntimeError``
into the project's error by looking its message up in :data:`FAILURE_KINDS` (timeout, peer
gone, aborted, other) and :data:`ERROR_TYPES`, and names the peer that failed when that is
known: torch named it (``monitored_barrier`` does), or the group has only one other member.
Gloo's own messages name a peer by address and port only (measured with torch 2.13), e.g.
``Connection closed by peer [127.0.0.1]:35511`` or ``Timed out waiting 2000ms for recv
operation to complete``; a group of three or more then gets ``peer_rank=None``.

**One exchange layout.** :func:`pack_outgoing` turns ``outgoing`` into one ``[keys,
payloads]`` value per target (two parallel lists encode with less per-item overhead than a
list of pairs) and is the only check of its items; :func:`unpack_into` is its inverse on the
receiving side and the only check of what a peer sent. Every transport, in-memory ones
included, sends exactly these values.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch.distributed as dist

from evenflow.transports._base import Outgoing
from evenflow.transports._threads import WorkerThreads
from evenflow.transports._wire import _PendingFrames, encode, encode_many
from evenflow.transports.errors import (
    PeerEncodeError,
    PeerFailureError,
    TransportError,
    TransportTimeoutError,
    WireFormatError,
)

__all__ = [
    "ERROR_TYPES",
    "FAILED",
    "FAILURE_KINDS",
    "Protocol",
    "classify_failure",
    "CLOSE_DEADLINE",
    "ROLL_CALL_SECONDS",
    "close_owned",
    "roll_call",
    "destroy_group",
    "map_dist_error",
    "membership",
    "new_group",
    "open_group",
    "pack_outgoing",
    "unpack_into",
]

T = TypeVar("T")

#: Size announced by a rank that failed to build its frames: every rank skips the data step.
FAILED = -1

# -- group setup ---------------------------------------------------------------------------------


def new_group(members: Iterable[int], *, timeout: float, backend: str) -> dist.ProcessGroup | None:
    """A new process group over ``members`` with its own ``timeout``; ``None`` on non-members.

    Default ``new_group`` semantics: EVERY rank of the world must call this, for every group,
    in the same order, members or not (members alone would hang).
    """
    ranks = list(members)
    group = dist.new_group(ranks, timeout=timedelta(seconds=timeout), backend=backend)
    if dist.get_rank() not in ranks or not isinstance(group, dist.ProcessGroup):
        return None
    return group


def open_group(
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
    group = new_group(members, timeout=timeout, backend=backend)
    if group is None:
        raise ValueError(
            f"{owner}: this process (global rank {dist.get_rank()}) is not in ranks="
            f"{sorted(members)!r}; create transports only on members (every rank must still "
            f"call the constructor in the same order, which it just did)."
        )
    return group, True


def membership(group: dist.ProcessGroup) -> dict[str, Any]:
    """``rank``, ``num_ranks`` and ``global_ranks`` of this process in ``group``."""
    return {
        "rank": dist.get_rank(group),
        "num_ranks": dist.get_world_size(group),
        "global_ranks": tuple(dist.get_process_group_ranks(group)),
    }


def destroy_group(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` (local for Gloo subgroups; a no-op once the default group is gone)."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


#: Seconds a transport's ``aclose()`` waits for an operation still in flight on its thread
#: (a collective whose peer left without closing): past it the thread is abandoned (a
#: daemon; the operation ends at the group timeout) and the close goes on.
CLOSE_DEADLINE = 5.0


async def close_owned(
    executor: WorkerThreads,
    group: dist.ProcessGroup,
    *,
    destroy: bool,
    deadline: float = CLOSE_DEADLINE,
) -> None:
    """Join the one thread that drives (or waits on) ``group``, for at most ``deadline``
    seconds; then destroy the group if asked.

    Shared ``aclose`` of the Gloo and device transports: ``destroy`` is true when the
    transport created the group and no failure left it unusable. A thread still inside a
    collective at the deadline is abandoned (it holds the group until the collective fails
    or times out) and the group is not destroyed under it.
    """
    executor.stop(cancel_futures=True)
    stuck = await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(executor.join, deadline)
    )
    if destroy and not stuck:
        destroy_group(group)


# -- the exception mapper ------------------------------------------------------------------------

FailureKind = Literal["timeout", "peer", "aborted", "other"]

#: Lower-case phrases that identify a failure kind, tried in this order ("other" if none).
FAILURE_KINDS: tuple[tuple[FailureKind, tuple[str, ...]], ...] = (
    ("timeout", ("timed out", "timeout")),
    ("aborted", ("abort",)),
    ("peer", ("connection", "closed", "reset", "peer", "broken pipe", "socket")),
)

#: The project's error type of each failure kind. An aborted communicator is a dead group,
#: like a dead peer: the engine treats both as the group's failure.
ERROR_TYPES: dict[FailureKind, type[TransportError]] = {
    "timeout": TransportTimeoutError,
    "peer": PeerFailureError,
    "aborted": PeerFailureError,
    "other": TransportError,
}

_WHAT: dict[FailureKind, str] = {
    "timeout": "a peer did not answer within the group timeout",
    "peer": "a peer's connection closed or reset: it crashed or left",
    "aborted": "the communicator was aborted",
    "other": "torch.distributed raised",
}

#: How torch names a failed rank (``monitored_barrier``: "Rank 2 failed to pass ...").
_NAMED_PEER = re.compile(r"\brank (\d+) failed\b", re.IGNORECASE)


def classify_failure(text: str) -> FailureKind:
    """The failure kind of a torch.distributed error message (see :data:`FAILURE_KINDS`)."""
    lower = text.lower()
    for kind, phrases in FAILURE_KINDS:
        if any(phrase in lower for phrase in phrases):
            return kind
    return "other"


def _failed_peer(text: str, kind: FailureKind, rank: int, num_ranks: int) -> tuple[int | None, str]:
    """``(group rank, how it is known)`` of the peer that failed, or ``(None, "")``."""
    named = _NAMED_PEER.search(text)
    if named is not None and 0 <= int(named.group(1)) < num_ranks:
        return int(named.group(1)), "named by torch.distributed"
    if kind in ("timeout", "peer") and num_ranks == 2:
        return 1 - rank, "the only other member"
    return None, ""


def map_dist_error(
    exc: BaseException,
    *,
    where: str,
    op: str,
    rank: int,
    global_ranks: Sequence[int],
    advice: str,
) -> TransportError:
    """A torch.distributed failure as the project's error (the caller raises it ``from exc``).

    ``where`` starts the message (who failed), ``rank`` and ``global_ranks`` describe the
    group (``global_ranks[r]`` is group rank ``r``) and ``advice`` ends the message.
    """
    text = str(exc).strip()
    kind = classify_failure(text)
    peer, how = _failed_peer(text, kind, rank, len(global_ranks))
    blame = ""
    if peer is not None:
        blame = f" The failed peer is group rank {peer} (global rank {global_ranks[peer]}), {how}."
    return ERROR_TYPES[kind](
        f"{where}: {op} failed ({_WHAT[kind]}; {type(exc).__name__}): {text}{blame} {advice}",
        rank=rank,
        op=op,
        peer_rank=peer,
    )


# -- after a failure: who is still there -----------------------------------------------------------

#: Seconds a roll call waits for the members that have not answered yet, and how often it
#: looks at the store meanwhile.
ROLL_CALL_SECONDS = 1.0
_ROLL_CALL_POLL = 0.02


def roll_call(
    group: dist.ProcessGroup,
    *,
    rank: int,
    global_ranks: Sequence[int],
    tag: str,
    deadline: float = ROLL_CALL_SECONDS,
) -> list[int] | None:
    """After a collective of ``group`` failed on every member: the global ranks that do not
    answer a roll call within ``deadline`` seconds (a crashed or stuck peer), or ``None``
    when that cannot be told.

    Gloo names a failed peer only by address, so a group of three or more cannot say who
    left. Every surviving member of the failed collective calls this with the same ``tag``
    (e.g. the operation and step): each writes its own key to the world's store (the
    rendezvous store, which outlives any one training process under torchrun), then waits
    for the others'. The store is reached through torch's default-group registry; where it
    is not available (or was hosted by the rank that died) the answer is ``None``.
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        prefix = f"evenflow/roll-call/{group.group_name}/{tag}/"
        store.set(f"{prefix}{global_ranks[rank]}", "here")
        if deadline <= 0:
            return []  # answered only
        until = time.monotonic() + deadline
        waiting = [p for p in global_ranks if p != global_ranks[rank]]
        while True:
            # Polled, not store.wait(): a wait that times out logs a warning per key.
            waiting = [p for p in waiting if not store.check([f"{prefix}{p}"])]
            if not waiting or time.monotonic() >= until:
                return waiting
            time.sleep(_ROLL_CALL_POLL)
    except Exception:
        return None


# -- the exchange layout -------------------------------------------------------------------------


def pack_outgoing(rank: int, outgoing: Outgoing) -> dict[int, list[list[Any]]]:
    """Every non-empty target of ``outgoing`` with its items as ``[keys, payloads]``.

    The targets must already be checked (``Transport._check_routes``). Raises ``TypeError``
    for anything that is not a sequence of ``(key, payload)`` tuples, before any data moves.
    """
    packed: dict[int, list[list[Any]]] = {}
    for target, given in outgoing.items():
        items: object = given  # callers pass anything; the annotation is the contract
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(
                f"Rank {rank}: exchange outgoing[{target}] must be a list of (key, payload) "
                f"pairs, but got {items!r:.80} ({type(items).__name__})."
            )
        if not items:
            continue
        keys: list[Any] = []
        payloads: list[Any] = []
        for item in items:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(
                    f"Rank {rank}: every item of exchange outgoing[{target}] must be a "
                    f"(key, payload) tuple, but got {item!r:.80}; wrap it as (key, payload)."
                )
            keys.append(item[0])
            payloads.append(item[1])
        packed[target] = [keys, payloads]
    return packed


def unpack_into(
    received: dict[Hashable, Any], packed: object, *, rank: int, sender: int, op: str
) -> None:
    """Add one sender's decoded ``[keys, payloads]`` to ``received``.

    Keys must be unique per receiver; a duplicate is the senders' bug, reported here because
    only the receiver sees every sender's keys.
    """
    if (
        not isinstance(packed, list)
        or len(packed) != 2
        or not isinstance(packed[0], list)
        or not isinstance(packed[1], list)
        or len(packed[0]) != len(packed[1])
    ):
        raise WireFormatError(
            f"Rank {rank}: {op} received a malformed message from rank {sender} "
            f"(expected [keys, payloads] of equal length, got {packed!r:.80})."
        )
    for key, payload in zip(packed[0], packed[1], strict=True):
        if key in received:
            raise TransportError(
                f"Rank {rank}: {op} received key {key!r} more than once (again from rank "
                f"{sender}); keys must be unique per receiving rank.",
                rank=rank,
                op=op,
            )
        received[key] = payload


# -- the protocol's pure parts -------------------------------------------------------------------

_CLOSE_ADVICE = "The group is unusable from now on; close this transport."


@dataclass(frozen=True)
class Protocol:
    """Frame building, size checks and error mapping for one member of one group.

    ``advice`` ends every message of a failed collective (the default suits a transport);
    ``label``, when given, replaces the default start of every message (:attr:`where`).
    """

    rank: int
    num_ranks: int
    global_ranks: tuple[int, ...]
    name: str
    limit: int
    advice: str = _CLOSE_ADVICE
    label: str = ""

    @classmethod
    def of(cls, transport: Any, limit: int) -> Protocol:
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
        if self.label:
            return self.label
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
        self, op: str, packed: dict[int, list[list[Any]]]
    ) -> tuple[npt.NDArray[np.uint8], list[int]]:
        """One frame per target with items (others get 0 bytes), in target order."""
        present = sorted(packed)
        buffer, frame_sizes = encode_many([packed[t] for t in present])
        return buffer, self._target_sizes(op, present, frame_sizes)

    def pack_exchange(
        self, op: str, packed: dict[int, list[list[Any]]]
    ) -> tuple[_PendingFrames, _PendingFrames, list[int]]:
        """Pack an exchange's frames and check their sizes, copying no payload yet.

        Returns the frames for the other ranks that get items (in target order), the frame
        this rank sends itself (none when it sends itself nothing) and the bytes for every
        target, 0 where it gets nothing.
        """
        present = sorted(t for t in packed if t != self.rank)
        own_items = packed.get(self.rank)
        peers = _PendingFrames([packed[t] for t in present])
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
        failed = [src for src, size in enumerate(sizes) if size == FAILED]
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

    def merge_exchange(self, op: str, frames: Sequence[Any]) -> dict[Hashable, Any]:
        """What arrived for this rank, from each sender's decoded frame (``None``: nothing)."""
        received: dict[Hashable, Any] = {}
        for sender, packed in enumerate(frames):
            if packed is not None:
                unpack_into(received, packed, rank=self.rank, sender=sender, op=op)
        return received

    def translate(self, op: str, exc: BaseException) -> TransportError:
        """A torch.distributed failure of this member as the project's error."""
        return map_dist_error(
            exc,
            where=self.where,
            op=op,
            rank=self.rank,
            global_ranks=self.global_ranks,
            advice=self.advice,
        )
