"""A synchronous DDP training loop on Gloo, fed by evenflow, launched with torchrun.

What it shows:

* ``build_loader`` on every rank of a torchrun job: it forms the balance groups (one per node
  by default), creates the data-plane process groups and checks that every rank built the
  same loader;
* a plain ``for batch in loader`` loop: each step is ``bins_per_rank`` packed sequences
  (microbatches) that DDP trains one after another, synchronising gradients on the last one;
* the per-step balance statistics (``loader.last_stats``): the slowest rank's predicted cost
  before and after balancing, and how many samples moved;
* the loss recipe that keeps balancing out of the optimiser's way: summed token losses over
  the world's loss tokens (``loader.last_loss_tokens``), times the world size DDP divides by.

Every rank reads its own synthetic steps; rank 0 draws a few long samples at every step, so
without balancing it would be the straggler. Run it with::

    torchrun --standalone --nproc-per-node 2 examples/ddp_sync_torchrun.py

Options: ``--steps N`` (default 8), ``--seq-len N`` (default 256). The test suite runs it
with ``--steps 3``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from evenflow.engine import LoaderConfig, LossTokens, build_loader

VOCAB = 64
BINS_PER_RANK = 2


def synthetic_steps(rank: int, num_steps: int, seq_len: int) -> Iterator[list[list[Any]]]:
    """This rank's steps: ``BINS_PER_RANK`` bins of samples that fit ``seq_len`` each."""
    rng = torch.Generator().manual_seed(1000 + rank)
    for _ in range(num_steps):
        bins = []
        for _ in range(BINS_PER_RANK):
            # Rank 0 packs two long samples per bin, the others many short ones.
            if rank == 0:
                lengths = [seq_len // 2 - 8, seq_len // 2 - 8]
            else:
                lengths = torch.randint(8, seq_len // 8, (6,), generator=rng).tolist()
            bins.append(
                [{"input_ids": torch.randint(0, VOCAB, (n,), generator=rng)} for n in lengths]
            )
        yield bins


class TinyLM(nn.Module):
    """An embedding and a linear head: enough to have gradients for DDP to synchronise."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))  # type: ignore[no-any-return]


def train_step(
    model: DistributedDataParallel, batch: list[dict[str, Any]], tokens: LossTokens
) -> float:
    """Forward and backward over every microbatch; gradients are all-reduced on the last.

    Each microbatch's summed token loss is scaled by ``world_size / world loss tokens``: DDP
    averages gradients over ranks, so the update is the gradient of the mean token loss over
    the whole world, whatever balancing moved (a per-rank mean would weight tokens by the
    plan; see docs/howto/loss-normalisation.md). Returns this rank's share of that mean.
    """
    scale = tokens.loss_scale(dist.get_world_size())
    total = 0.0
    for i, packed in enumerate(batch):
        last = i == len(batch) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            ids, labels = packed["input_ids"][0], packed["labels"][0]
            logits = model(ids[:-1])
            # Next-token loss: labels are -100 at each sample's first token, so no target
            # crosses a boundary between packed samples.
            summed = nn.functional.cross_entropy(
                logits, labels[1:], ignore_index=-100, reduction="sum"
            )
            (summed * scale).backward()  # type: ignore[no-untyped-call]
        total += summed.item() / max(tokens.world, 1)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun provides rank, world size and address
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights everywhere
    model = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = LoaderConfig(
        seq_len=args.seq_len, bins_per_rank=BINS_PER_RANK, timeout=60.0, log_stats=False
    )
    source = synthetic_steps(rank, args.steps, args.seq_len)
    try:
        with build_loader(source, config, cost_model="quadratic") as loader:
            for batch in loader:
                tokens = loader.last_loss_tokens
                assert tokens is not None  # the default pack counts every sample's targets
                share = torch.tensor(train_step(model, batch, tokens))
                dist.all_reduce(share)  # the mean token loss over the world
                loss = share.item()
                optimizer.step()
                optimizer.zero_grad()
                stats = loader.last_stats
                if rank == 0 and stats is not None:
                    print(
                        f"step {stats.step}: loss {loss:.3f}, max cost "
                        f"{stats.max_cost_before:.3g} -> {stats.max_cost_after:.3g}, "
                        f"moved {stats.num_moved} samples, "
                        f"predicted speedup {stats.predicted_speedup:.2f}x",
                        flush=True,
                    )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
