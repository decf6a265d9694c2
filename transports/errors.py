"""The error tree of evenflow's data plane.

``EvenflowError`` is the root of every error the project raises on purpose; the engine adds
its own branches in ``evenflow.engine.errors``. Foreign exceptions (``RuntimeError`` from
torch.distributed, ``msgpack`` exceptions) are translated at the transport boundary and
chained with ``from exc`` so the original stays visible::

    EvenflowError
    ├── ConfigError (ValueError)   an invalid setting or argument (the engine raises it too)
    ├── WireFormatError            bytes that are not a valid evenflow frame
    ├── EncodeError (TypeError)    a payload holds a value the wire format cannot carry
    └── TransportError             a collective failed
        ├── TransportTimeoutError  a peer did not answer within the group timeout
        ├── PeerFailureError       a peer died or its connection broke
        ├── PeerEncodeError        a peer could not encode its part of an exchange
        ├── CollectiveMismatchError  ranks issued different collectives at the same turn
        ├── RouteError (ValueError)  a payload addressed to a rank outside the group
        └── TransportClosedError   an operation on a closed transport
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "EncodeError",
    "EvenflowError",
    "PeerEncodeError",
    "PeerFailureError",
    "RouteError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "WireFormatError",
]


class EvenflowError(Exception):
    """Root of every error evenflow raises on purpose."""


class ConfigError(EvenflowError, ValueError):
    """A configuration value or argument is invalid. The message names it and the fix."""


class WireFormatError(EvenflowError):
    """Received bytes are not a valid frame: truncated, oversized, corrupted or hostile."""


class EncodeError(EvenflowError, TypeError):
    """A payload contains a value the wire format cannot carry (named with its path)."""


class TransportError(EvenflowError):
    """A collective operation failed. The message names the rank and the operation.

    ``rank`` is the group rank that raised, ``op`` the operation, and ``peer_rank`` the group
    rank of the peer that failed when that is known (torch.distributed named it, or the group
    has only one other member), else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        op: str | None = None,
        peer_rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.peer_rank = peer_rank


class TransportTimeoutError(TransportError, TimeoutError):
    """A peer did not take part in a collective within the group timeout."""


class PeerFailureError(TransportError):
    """A peer process died or its connection broke during a collective."""


class PeerEncodeError(TransportError):
    """Another rank could not encode its payloads, so an exchange moved no data anywhere.

    That rank raises its own ``EncodeError``; the others raise this, naming it in
    ``failed_ranks`` (group ranks). The group stays usable.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_ranks: tuple[int, ...],
        rank: int | None = None,
        op: str | None = None,
    ) -> None:
        super().__init__(message, rank=rank, op=op)
        self.failed_ranks = failed_ranks


class CollectiveMismatchError(TransportError):
    """Ranks of one group issued different collectives at the same position of the order."""


class RouteError(TransportError, ValueError):
    """An exchange addressed a payload to a rank outside the group; no data moved."""


class TransportClosedError(TransportError):
    """An operation was started on a transport that is closed."""
