"""The one-rank transport: no communication, but the same encoding as a real group.

A group of one still runs every object through the wire codec. That costs one encode and one
decode per operation and buys two guarantees a plain pass-through would not give: a payload
the wire format cannot carry raises ``EncodeError`` on one rank exactly as it would on many,
and what an operation returns never aliases the caller's objects (mutating a received array
cannot corrupt the sender's copy, as on a real group).

The helpers that turn one target's ``(key, payload)`` list into a single encodable value and
back are shared with the in-process transport, so both speak the same exchange layout.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

from evenflow.transports import _wire
from evenflow.transports._base import Outgoing, Transport
from evenflow.transports.errors import TransportError

__all__ = ["LocalTransport"]


def _pack_items(rank: int, target: int, items: object) -> list[list[Any]] | None:
    """One target's ``(key, payload)`` sequence as ``[keys, payloads]``; ``None`` when empty.

    Two parallel lists encode with less per-item overhead than a list of pairs. Raises
    ``TypeError`` for anything that is not a sequence of pairs, before any data moves.
    """
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(
            f"Rank {rank}: exchange outgoing[{target}] must be a list of (key, payload) pairs, "
            f"but got {items!r} ({type(items).__name__})."
        )
    if not items:
        return None
    keys: list[Any] = []
    payloads: list[Any] = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"Rank {rank}: every item of exchange outgoing[{target}] must be a "
                f"(key, payload) tuple, but got {item!r}; wrap it as (key, payload)."
            )
        keys.append(item[0])
        payloads.append(item[1])
    return [keys, payloads]


def _pack_outgoing(rank: int, outgoing: Outgoing) -> dict[int, list[list[Any]]]:
    """Every non-empty target of ``outgoing`` with its packed items (targets already checked)."""
    packed: dict[int, list[list[Any]]] = {}
    for target, items in outgoing.items():
        value = _pack_items(rank, target, items)
        if value is not None:
            packed[target] = value
    return packed


def _check_outgoing_mapping(rank: int, outgoing: object) -> None:
    if not isinstance(outgoing, Mapping):
        raise TypeError(
            f"Rank {rank}: exchange outgoing must map target ranks to lists of (key, payload) "
            f"pairs, but got {outgoing!r} ({type(outgoing).__name__})."
        )


def _unpack_into(
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
        raise TransportError(
            f"Rank {rank}: {op} received a malformed message from rank {sender} "
            f"(expected [keys, payloads] of equal length).",
            rank=rank,
            op=op,
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

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        self._check_open("exchange")
        _check_outgoing_mapping(self._rank, outgoing)
        self._check_routes(outgoing)
        packed = _pack_outgoing(self._rank, outgoing)
        received: dict[Hashable, Any] = {}
        if 0 in packed:
            _unpack_into(received, _roundtrip(packed[0]), rank=0, sender=0, op="exchange")
        return received
