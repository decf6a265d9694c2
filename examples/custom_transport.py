"""A custom transport: a wrapper that counts the bytes its rank sends and receives.

What it shows:

* subclassing ``evenflow.transports.Transport``: three collectives to implement
  (``all_gather``, ``broadcast``, ``exchange``), ``aclose()`` for the lifecycle, and the
  identity (``rank``, ``num_ranks``, ``global_ranks``, ``timeout``) passed to the base class;
* proving the contract with the public conformance suite,
  ``evenflow.transports.testing.check_transport``, given a maker of fresh groups (a function
  that wraps every member of a new in-process group);
* handing the transport to ``BalancedLoader`` and reading the counters after a few steps.

Bytes are counted as wire frames (``evenflow.transports.encode``): one frame per value
gathered or broadcast, one per target of an exchange, as the built-in transports send them.
Counting encodes every value a second time: fine for a diagnostic wrapper, wrong for a fast
path.
The wrapper works around transports that run off the caller's thread (``local``,
``inprocess``, ``gloo``); a ``launch_on_caller`` transport would also need its launcher
forwarded. Run it with::

    python examples/custom_transport.py

Options: ``--ranks N`` (default 2), ``--steps N`` (default 4).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessGroup, Transport, encode
from evenflow.transports.testing import check_transport


def frame_bytes(value: Any) -> int:
    """Size of ``value`` as one wire frame."""
    return int(encode(value).nbytes)


class CountingTransport(Transport):
    """Delegates every collective to ``inner`` and counts the bytes of this rank's traffic."""

    name = "counting"

    def __init__(self, inner: Transport) -> None:
        if inner.launch_on_caller:
            raise ValueError(
                f"CountingTransport wraps transports that run off the caller's thread, but "
                f"{inner.name!r} launches on the caller's thread; wrap 'gloo' or 'inprocess'."
            )
        super().__init__(
            rank=inner.rank,
            num_ranks=inner.num_ranks,
            global_ranks=inner.global_ranks,
            timeout=inner.timeout,
        )
        self.inner = inner
        self.bytes_sent = 0
        self.bytes_received = 0

    async def all_gather(self, obj: Any) -> list[Any]:
        self._check_open("all_gather")
        result = await self.inner.all_gather(obj)
        # Counted after success: a refused value moved nothing.
        self.bytes_sent += frame_bytes(obj) * (self.num_ranks - 1)
        self.bytes_received += sum(frame_bytes(v) for r, v in enumerate(result) if r != self.rank)
        return result

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        self._check_open("broadcast")
        result = await self.inner.broadcast(obj, src=src)
        size = frame_bytes(result)
        if self.rank == src:
            self.bytes_sent += size * (self.num_ranks - 1)
        else:
            self.bytes_received += size
        return result

    async def exchange(
        self, outgoing: Mapping[int, Sequence[tuple[Hashable, Any]]]
    ) -> dict[Hashable, Any]:
        self._check_open("exchange")
        received = await self.inner.exchange(outgoing)
        own = {key for key, _ in outgoing.get(self.rank, ())}
        self.bytes_sent += sum(
            frame_bytes(list(items)) for target, items in outgoing.items() if target != self.rank
        )
        # Received items do not say who sent them; all but our own came from peers.
        from_peers = [(key, value) for key, value in received.items() if key not in own]
        if from_peers:
            self.bytes_received += frame_bytes(from_peers)
        return received

    async def aclose(self) -> None:
        await self.inner.aclose()
        await super().aclose()


async def use_in_loader(transport: Transport, num_steps: int) -> str:
    """Train-loop stand-in: run a loader over ``transport`` and report its traffic."""
    counting = CountingTransport(transport)
    rank = counting.rank
    # Rank 0 reads long samples, the others short ones: balancing moves samples every step.
    lengths = [500, 480] if rank == 0 else [100, 120, 90, 140]
    steps = [
        [[np.arange(n, dtype=np.int32) for n in lengths] for _ in range(2)]
        for _ in range(num_steps)
    ]
    config = LoaderConfig(seq_len=1024, bins_per_rank=2, log_stats=False)
    async with BalancedLoader(steps, config=config, transport=counting) as loader:
        delivered = [batch async for batch in loader]
    await counting.aclose()
    return (
        f"rank {rank}: {len(delivered)} steps, sent {counting.bytes_sent} bytes, "
        f"received {counting.bytes_received} bytes"
    )


async def run(num_ranks: int, num_steps: int) -> None:
    # 1. The conformance suite. It takes a maker: every check runs on a new group, whose
    #    members it drives from this loop and closes after the check.
    def counting_group() -> list[CountingTransport]:
        group = InProcessGroup(num_ranks, timeout=30.0)
        return [CountingTransport(group.transport(r)) for r in range(num_ranks)]

    await check_transport(counting_group)
    print(f"CountingTransport passed check_transport on {num_ranks} ranks")
    # 2. The transport under a loader, on another fresh group.
    group = InProcessGroup(num_ranks, timeout=30.0)
    reports = await asyncio.gather(
        *(use_in_loader(group.transport(r), num_steps) for r in range(num_ranks))
    )
    print("\n".join(reports))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    asyncio.run(run(args.ranks, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
