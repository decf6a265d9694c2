"""The one-rank transport: no communication, but the same encoding as a real group.

A group of one still runs every object through the wire codec. That costs one encode and one
decode per operation and buys two guarantees a plain pass-through would not give: a payload
the wire format cannot carry raises ``EncodeError`` on one rank exactly as it would on many,
and what an operation returns never aliases the caller's objects (mutating a received array
cannot corrupt the sender's copy, as on a real group).

Its exchange speaks the one exchange layout of :mod:`evenflow.transports._protocol`, like
every other transport.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

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
from evenflow.transports.errors import WireFormatError

__all__ = ["LocalTransport"]


def _roundtrip(obj: Any) -> Any:
    return _wire.decode(_wire.encode(obj))


class LocalTransport(Transport):
    """A balance group of exactly one rank: collectives return this rank's own data.

    ``all_gather(obj)`` returns ``[obj]``, ``broadcast(obj, src=0)`` returns ``obj`` and
    ``exchange`` delivers only self-sends; every value is encoded and decoded on the way, so
    unsupported values fail as on a real group and results never alias the arguments.
    ``global_rank`` is this process's world rank (for messages and ``global_ranks``).
    """

    name: ClassVar[str] = "local"

    def __init__(self, *, global_rank: int = 0, timeout: float = 60.0) -> None:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int) or global_rank < 0:
            raise ValueError(
                f"global_rank must be a non-negative integer, but got {global_rank!r}."
            )
        super().__init__(rank=0, num_ranks=1, global_ranks=(global_rank,), timeout=timeout)

    async def all_gather(self, obj: Any) -> list[Any]:
        self._check_open("all_gather")
        return [_roundtrip(obj)]

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        self._check_open("broadcast")
        self._check_src(src)
        return _roundtrip(obj)

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        """Self-sends only, written and decoded as on a real group (no collective)."""
        self._check_open("exchange")
        send, recv = check_sized(0, 1, outgoing, incoming, limit=_wire.DEFAULT_MAX_FRAME_BYTES)
        if send != recv:
            raise WireFormatError(
                f"Rank 0: exchange_sized sends itself {send[0]} bytes but expects {recv[0]}."
            )
        buffer = np.empty(send[0], dtype=np.uint8)
        error = write_segments(outgoing, send, buffer)
        if error is not None:
            raise error
        return decode_segments(buffer, incoming, recv, rank=0, limit=_wire.DEFAULT_MAX_FRAME_BYTES)

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        self._check_open("exchange")
        self._check_routes(outgoing)
        packed = pack_outgoing(self._rank, outgoing)
        received: dict[Hashable, Any] = {}
        if 0 in packed:
            unpack_into(received, _roundtrip(packed[0]), rank=0, sender=0, op="exchange")
        return received
