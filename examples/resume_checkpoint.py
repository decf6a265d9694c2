"""Checkpoint and resume: the batches after a restore equal those of an uninterrupted run.

What it shows:

* a ``torch.utils.data.DataLoader`` as the source: a map-style ``Dataset`` whose item ``i``
  is step ``i`` (``bins_per_rank`` bins of samples), read with ``batch_size=None``;
* two ways to resume it:
  - **stateful**: a small wrapper exposing ``state_dict()``/``load_state_dict()``; restoring
    starts the DataLoader's sampler at the saved position, without reading earlier steps;
  - **stateless**: the bare DataLoader; the loader re-reads and discards the consumed steps
    (exact for a deterministic source, slower for a long one);
* ``torch.save(loader.state_dict(), path)`` after some steps, a new loader, then
  ``loader.load_state_dict(torch.load(path, weights_only=True))``: the state is plain data.

The state describes the steps *delivered* to the loop, never the prefetched ones. Each rank
saves and restores its own state. The ranks are threads of this process (``InProcessGroup``).
Run it with::

    python examples/resume_checkpoint.py --out ckpt

Options: ``--out DIR`` (default ``./evenflow-ckpt``), ``--steps N`` (default 8),
``--stop-after N`` (default 3), ``--mode stateful|stateless`` (default: both).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessTransport
from evenflow.transports.testing import run_inprocess_threads

CONFIG = LoaderConfig(seq_len=256, bins_per_rank=2, log_stats=False)


class StepDataset(Dataset[list[list[torch.Tensor]]]):
    """Item ``i`` is step ``i`` of one rank: two bins of token tensors, seeded by (rank, i)."""

    def __init__(self, rank: int, num_steps: int) -> None:
        self.rank, self.num_steps = rank, num_steps

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, i: int) -> list[list[torch.Tensor]]:
        g = torch.Generator().manual_seed(self.rank * 10_000 + i)
        lengths = [[120, 100], [110, 90]] if self.rank == 0 else [[30, 20, 25], [15, 40]]
        return [[torch.randint(0, 500, (n,), generator=g) for n in b] for b in lengths]


class ResumableSteps:
    """A DataLoader over ``StepDataset`` that can start at any position."""

    def __init__(self, dataset: StepDataset) -> None:
        self.dataset, self.position = dataset, 0

    def __iter__(self) -> Iterator[list[list[torch.Tensor]]]:
        indices = range(self.position, len(self.dataset))
        for step in DataLoader(self.dataset, batch_size=None, sampler=indices):
            self.position += 1  # read by the loader right after this step is taken
            yield step

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def make_source(mode: str, rank: int, num_steps: int) -> Any:
    dataset = StepDataset(rank, num_steps)
    if mode == "stateful":
        return ResumableSteps(dataset)
    return DataLoader(dataset, batch_size=None)  # no state: resumed by fast-forwarding


def token_ids(batch: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [packed["input_ids"][0].tolist() for packed in batch]


def check_resume(mode: str, out: Path, num_steps: int, stop_after: int) -> bool:
    """Run uninterrupted, then stop-save-restore-finish; compare what every rank trained on."""

    def on_ranks(fn: Any) -> list[Any]:
        return run_inprocess_threads(2, fn, deadline=120.0, timeout=30.0)  # a fresh group

    def new_loader(t: InProcessTransport) -> BalancedLoader:
        return BalancedLoader(make_source(mode, t.rank, num_steps), config=CONFIG, transport=t)

    async def uninterrupted(t: InProcessTransport) -> list[Any]:
        async with new_loader(t) as loader:
            return [token_ids(batch) async for batch in loader]

    async def first_part(t: InProcessTransport) -> list[Any]:
        delivered = []
        async with new_loader(t) as loader:
            async for batch in loader:
                delivered.append(token_ids(batch))
                if len(delivered) == stop_after:
                    torch.save(loader.state_dict(), out / f"rank{t.rank}.pt")
                    break  # the "crash": prefetched steps are simply dropped
        return delivered

    async def resumed(t: InProcessTransport) -> list[Any]:
        state = torch.load(out / f"rank{t.rank}.pt", weights_only=True)
        async with new_loader(t) as loader:
            loader.load_state_dict(state)
            return [token_ids(batch) async for batch in loader]

    reference = on_ranks(uninterrupted)
    combined = [a + b for a, b in zip(on_ranks(first_part), on_ranks(resumed), strict=True)]
    same = combined == reference
    print(
        f"{mode}: stopped after {stop_after} of {len(reference[0])} steps, resumed; "
        f"batches equal to the uninterrupted run on every rank: {same}"
    )
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("evenflow-ckpt"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-after", type=int, default=3)
    parser.add_argument("--mode", choices=["stateful", "stateless"], action="append")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.mode or ["stateful", "stateless"]:
        if not check_resume(mode, args.out, args.steps, args.stop_after):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
