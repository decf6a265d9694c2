"""The sized exchange: one collective when every rank already knows every byte count.

An ordinary exchange must first tell each receiver how many bytes each sender will send it (a
sizes collective), because Gloo aborts the receiving process when the bytes that arrive do
not fit the buffer. The engine knows those counts before the exchange: each sample is
:func:`prepare`-d for the wire when it is read (its frame header packed, its size known, no
data copied), its size travels in the metadata round that every rank gathers anyway, and the
plan that every rank holds says which samples go where. So every receiver can size its
buffer from the plan, and the exchange is a single uint8 collective.

**Layout.** Every sample is its own wire frame (:mod:`evenflow.transports._wire`). A sender
writes the frames for each target back to back, in the order of its ``outgoing`` list, and
the segments for the targets in rank order; a receiver gets, from each sender, exactly the
frames its ``incoming`` list names, in that order, and decodes each one separately. Keys do not
travel: both sides name them.

**What is checked.** Before any data moves, on each rank: the arguments' types, targets and
senders in the group, and that every size is a frame size (a positive multiple of 64 within
``max_frame_bytes``). The byte counts on the two sides of each pair are equal by
construction — both are sums of the sizes in the gathered metadata over the same plan, which
every rank holds (design invariant 5, the same agreement that decides on every rank whether a
step exchanges at all). After the data moved, each frame is decoded and validated on its own:
a frame that does not fill exactly its announced size is a ``WireFormatError`` naming the
sender and the key, never a crash. A sender whose frame can no longer be written (a byte
string changed size since it was prepared) sends zeros in its place, so the pair stays in
step: it raises its own error and its receivers raise ``PeerEncodeError`` naming it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.transports._wire import _ALIGN, _MAGIC, _build, _FrameBuilder, decode_many
from evenflow.transports.errors import PeerEncodeError, TransportError, WireFormatError

__all__ = [
    "Prepared",
    "SizedIncoming",
    "SizedOutgoing",
    "check_sized",
    "decode_segments",
    "prepare",
    "write_segments",
]


class Prepared:
    """One object measured for the wire: its frame header packed and its size known, its
    data not yet copied. Create it with :func:`prepare`.

    ``value`` is the object itself (held, not copied: arrays and tensors in it must not be
    resized before the frame is written); ``nbytes`` is the exact size of its frame.
    """

    __slots__ = ("_builder", "nbytes", "value")

    def __init__(self, value: Any, builder: _FrameBuilder | _Zeros) -> None:
        self.value = value
        self._builder = builder
        #: Exact size of the object's wire frame (a multiple of 64).
        self.nbytes: int = builder.size

    def write(self, out: memoryview) -> None:
        """Write the frame into ``out``, exactly :attr:`nbytes` bytes."""
        self._builder.write(out)

    @classmethod
    def zeros(cls, nbytes: int) -> Prepared:
        """A stand-in of ``nbytes`` zero bytes, for a sender that must keep its announced
        sizes but has no payload: its receivers raise ``PeerEncodeError`` naming it."""
        return cls(None, _Zeros(nbytes))

    def __repr__(self) -> str:
        return f"<Prepared {type(self.value).__name__} {self.nbytes} bytes>"


class _Zeros:
    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def write(self, out: memoryview) -> None:
        np.frombuffer(out, dtype=np.uint8)[:] = 0


def prepare(obj: Any) -> Prepared:
    """``obj`` measured for the wire. Raises ``EncodeError`` naming the first value the wire
    format cannot carry — at preparation, so that nothing can fail once sizes are announced."""
    return Prepared(obj, _build(obj, "payload"))


SizedOutgoing = Mapping[int, Sequence[tuple[Hashable, Prepared]]]
SizedIncoming = Mapping[int, Sequence[tuple[Hashable, int]]]


def _frame_size(value: object, limit: int) -> bool:
    return type(value) is int and _ALIGN <= value <= limit and value % _ALIGN == 0


def check_sized(
    rank: int, num_ranks: int, outgoing: object, incoming: object, *, limit: int
) -> tuple[list[int], list[int]]:
    """Validate a sized exchange's arguments; return the bytes for every target and from
    every sender (0 where none). Raises ``TypeError``/``ValueError`` before any data moves."""
    where = f"Rank {rank}: exchange_sized"
    send = [0] * num_ranks
    recv = [0] * num_ranks
    for name, table, totals in (("outgoing", outgoing, send), ("incoming", incoming, recv)):
        if not isinstance(table, Mapping):
            raise TypeError(
                f"{where} {name} must map group ranks to lists, but got {type(table).__name__}."
            )
        for peer, items in table.items():
            if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < num_ranks:
                raise ValueError(
                    f"{where} {name} names rank {peer!r}, outside the group [0, {num_ranks})."
                )
            if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
                raise TypeError(f"{where} {name}[{peer}] must be a list of (key, ...) pairs.")
            for item in items:
                if not isinstance(item, tuple) or len(item) != 2:
                    raise TypeError(
                        f"{where} every item of {name}[{peer}] must be a (key, "
                        f"{'Prepared' if name == 'outgoing' else 'nbytes'}) tuple, but got "
                        f"{item!r:.80}."
                    )
                value = item[1]
                if name == "outgoing":
                    if not isinstance(value, Prepared):
                        raise TypeError(
                            f"{where} outgoing[{peer}] holds {type(value).__name__} for key "
                            f"{item[0]!r}; wrap each payload with prepare(payload)."
                        )
                    size = value.nbytes
                else:
                    size = value
                if not _frame_size(size, limit):
                    raise ValueError(
                        f"{where} {name}[{peer}] gives key {item[0]!r} a frame of {size!r} "
                        f"bytes; a frame size is a positive multiple of {_ALIGN} within "
                        f"max_frame_bytes={limit}."
                    )
                totals[peer] += size
    return send, recv


def write_segments(
    outgoing: SizedOutgoing, send: Sequence[int], buffer: npt.NDArray[np.uint8]
) -> Exception | None:
    """Write every target's frames into ``buffer`` (segments in rank order). A frame that
    cannot be written leaves zeros in its place (the receiver reports it); the first such
    error is returned for the sender to raise after the collective."""
    view = buffer.data
    error: Exception | None = None
    position = 0
    for target, total in enumerate(send):
        end = position + total
        for _, prepared in outgoing.get(target, ()):
            size = prepared.nbytes
            try:
                prepared.write(view[position : position + size])
            except Exception as exc:
                buffer[position : position + size] = 0
                error = error or TransportError(
                    f"exchange_sized could not write a prepared payload of {size} bytes "
                    f"({type(exc).__name__}: {exc}); a payload changed after prepare(). No "
                    "peer received it; they raise PeerEncodeError naming this rank."
                )
            position += size
        assert position == end
    return error


def decode_segments(
    buffer: npt.NDArray[np.uint8],
    incoming: SizedIncoming,
    recv: Sequence[int],
    *,
    rank: int,
    limit: int,
) -> dict[Hashable, Any]:
    """Decode every expected frame from the receive buffer (segments in sender order)."""
    received: dict[Hashable, Any] = {}
    position = 0
    for sender, total in enumerate(recv):
        if not total:
            continue
        items = incoming[sender]
        sizes = [size for _, size in items]
        segment = buffer[position : position + total]
        position += total
        try:
            payloads = decode_many(segment, sizes, max_frame_bytes=limit)
        except WireFormatError:
            _raise_for_frame(segment, items, rank=rank, sender=sender, limit=limit)
            raise
        for (key, _), payload in zip(items, payloads, strict=True):
            if key in received:
                raise TransportError(
                    f"Rank {rank}: exchange_sized expects key {key!r} more than once (again "
                    f"from rank {sender}); keys must be unique per receiving rank.",
                    rank=rank,
                    op="exchange",
                )
            received[key] = payload
    return received


def _raise_for_frame(
    segment: npt.NDArray[np.uint8],
    items: Sequence[tuple[Hashable, int]],
    *,
    rank: int,
    sender: int,
    limit: int,
) -> None:
    """Name the first frame of ``sender``'s segment that does not decode."""
    position = 0
    for key, size in items:
        frame = segment[position : position + size]
        position += size
        if size >= len(_MAGIC) and not frame[: len(_MAGIC)].any():
            raise PeerEncodeError(
                f"Rank {rank}: rank {sender} could not write the payload of key {key!r} (its "
                "own error says why); the exchange moved zeros in its place.",
                failed_ranks=(sender,),
                rank=rank,
                op="exchange",
            )
        try:
            decode_many(frame, [size], max_frame_bytes=limit)
        except WireFormatError as exc:
            raise WireFormatError(
                f"Rank {rank}: the payload of key {key!r} from rank {sender} does not fill "
                f"the {size} bytes announced for it in the metadata round: {exc}. Ranks "
                "must hold the same plan and announce the sizes of the frames they send."
            ) from exc
