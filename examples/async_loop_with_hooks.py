"""An async training loop: ``async for`` over the loader, with the two prefetch hooks.

What it shows:

* iterating a ``BalancedLoader`` with ``async with loader: async for batch in loader``;
* the launch points a device transport (NCCL/HCCL) needs: ``await loader.aprefetch_plan()``
  right after the forward pass (the next step's metadata gather is launched while the device
  is busy) and ``await loader.aprefetch()`` right after the backward pass (planning finishes
  and the next step's payload exchange is launched). With a transport that runs off the
  caller's thread, like the in-process one used here, both return at once, so one loop works
  unchanged with every transport;
* ``loader.last_stats`` per step and ``loader.trace_summary()["caller"]`` at the end: how
  long the loop waited for data against how long it computed.

The ranks are threads of this process connected by an ``InProcessGroup``; each runs its own
event loop, as each process of a real job would. Run it with::

    python examples/async_loop_with_hooks.py

Options: ``--ranks N`` (default 2), ``--steps N`` (default 6).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch
from torch import nn

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessTransport
from evenflow.transports.testing import run_inprocess_threads

SEQ_LEN = 128
BINS_PER_RANK = 2


async def rank_steps(rank: int, num_steps: int) -> AsyncIterator[list[list[Any]]]:
    """An async source: each step is ``BINS_PER_RANK`` bins of token samples.

    Rank 0 reads long samples and every other rank short ones, so balancing has work to do.
    """
    rng = torch.Generator().manual_seed(rank)
    for _ in range(num_steps):
        await asyncio.sleep(0)  # stands in for awaiting a storage client
        lengths = [56, 60] if rank == 0 else [12, 9, 15, 7]
        yield [
            [torch.randint(0, 100, (n,), generator=rng) for n in lengths]
            for _ in range(BINS_PER_RANK)
        ]


def sgd_step(model: nn.Module, lr: float) -> None:
    """Plain SGD. (Building a ``torch.optim`` optimizer imports torch's compiler stack, which
    costs seconds of start-up that a tiny example does not need.)"""
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(lr * param.grad)
                param.grad = None


async def train(transport: InProcessTransport, num_steps: int) -> list[str]:
    """One rank's training loop; returns its log lines."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100))
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=BINS_PER_RANK, log_stats=False)
    loader = BalancedLoader(
        rank_steps(transport.rank, num_steps),
        config=config,
        transport=transport,
        cost_model="quadratic",
    )
    lines = []
    async with loader:
        async for batch in loader:
            losses = []
            for packed in batch:  # one microbatch per packed sequence
                ids, labels = packed["input_ids"][0], packed["labels"][0]
                losses.append(nn.functional.cross_entropy(model(ids[:-1]), labels[1:]))
            await loader.aprefetch_plan()  # after forward: launch the next metadata gather
            torch.stack(losses).sum().backward()  # type: ignore[no-untyped-call]
            await loader.aprefetch()  # after backward: launch the next payload exchange
            sgd_step(model, lr=0.1)
            stats = loader.last_stats
            assert stats is not None
            tokens = sum(int(p["input_ids"].numel()) for p in batch)
            lines.append(
                f"rank {transport.rank} step {stats.step}: trains {tokens} tokens; slowest rank "
                f"{stats.max_cost_before:.3g} -> {stats.max_cost_after:.3g}, "
                f"moved {stats.num_moved} samples"
            )
        caller = loader.trace_summary()["caller"]
        lines.append(
            f"rank {transport.rank}: waited {caller['wait']['total'] * 1e3:.1f} ms for data, "
            f"computed {caller['compute']['total'] * 1e3:.1f} ms "
            f"(data stall {caller['data_stall_fraction']:.1%}; the 'training' here is a "
            "toy that takes almost no time, so the stall is large: with a real model's step "
            "the pipeline stays ahead, see `evenflow bench pipeline`)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)

    async def rank_main(transport: InProcessTransport) -> list[str]:
        return await train(transport, args.steps)

    results = run_inprocess_threads(args.ranks, rank_main, deadline=120.0, timeout=30.0)
    for lines in results:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
