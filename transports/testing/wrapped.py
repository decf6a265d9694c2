"""A transport that delegates to another one: the base for test doubles that watch or alter
what crosses the group (record launches, garble a message, inject a delay).

Subclass :class:`WrappedTransport` and override the collective you want to intercept; call
``super()`` (or ``self.inner``) to pass it on::

    class CountGathers(WrappedTransport):
        name = "count-gathers"

        def __init__(self, inner: Transport) -> None:
            super().__init__(inner)
            self.num_gathers = 0

        async def all_gather(self, obj):
            self.num_gathers += 1
            return await super().all_gather(obj)

The wrapper takes the inner member's rank, group size, global ranks and timeout, and closing it
closes the inner transport. It launches inline unless a subclass sets ``launch_on_caller``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

from evenflow.transports._base import Outgoing, Transport
from evenflow.transports._sized import SizedIncoming, SizedOutgoing

__all__ = ["WrappedTransport"]


class WrappedTransport(Transport):
    """Delegates every collective to ``inner``; override one to intercept it."""

    name: ClassVar[str] = "wrapped"

    def __init__(self, inner: Transport) -> None:
        if not isinstance(inner, Transport):
            raise TypeError(
                f"inner must be an evenflow Transport, but got {type(inner).__name__}; "
                "wrap a member of a group, e.g. InProcessGroup(2).transport(0)."
            )
        super().__init__(
            rank=inner.rank,
            num_ranks=inner.num_ranks,
            global_ranks=inner.global_ranks,
            timeout=inner.timeout,
        )
        self.inner = inner

    async def all_gather(self, obj: Any) -> list[Any]:
        return await self.inner.all_gather(obj)

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        return await self.inner.broadcast(obj, src=src)

    async def exchange(self, outgoing: Outgoing) -> dict[Hashable, Any]:
        return await self.inner.exchange(outgoing)

    async def exchange_sized(
        self, outgoing: SizedOutgoing, incoming: SizedIncoming
    ) -> dict[Hashable, Any]:
        if type(self).exchange is not WrappedTransport.exchange:
            # A subclass intercepts exchange: route this one through it too (the inherited
            # path, which calls self.exchange), so that it sees every exchange.
            return await super().exchange_sized(outgoing, incoming)
        return await self.inner.exchange_sized(outgoing, incoming)

    async def aclose(self) -> None:
        await super().aclose()
        await self.inner.aclose()
