"""Exact resume with torchdata's StatefulDataLoader as the source."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from testkit.loaders import record_pass

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessGroup

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

# torchdata 0.11 calls a torch API that torch 2.13 deprecates; not our warning to fix.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

STEPS = 10


class Steps(torch.utils.data.Dataset[list[list[np.ndarray]]]):
    """Item ``i`` is rank ``rank``'s step ``i``: two bins of token arrays."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int) -> list[list[np.ndarray]]:
        rng = np.random.default_rng([self.rank, step])
        long = self.rank == step % 2
        return [
            [
                rng.integers(0, 1000, size=int(n), dtype=np.int32)
                for n in (rng.integers(20, 30, size=2) if long else rng.integers(1, 8, size=4))
            ]
            for _ in range(2)
        ]


def _loaders(depth: int) -> list[BalancedLoader]:
    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(seq_len=64, bins_per_rank=2, prefetch_depth=depth, log_stats=False)
    return [
        BalancedLoader(
            stateful_dataloader.StatefulDataLoader(Steps(r), batch_size=None, shuffle=False),
            config=config,
            transport=group.transport(r),
            cost_model="quadratic",
        )
        for r in range(2)
    ]


def _flat(batch: list[dict[str, Any]]) -> list[bytes]:
    return [b["input_ids"].numpy().tobytes() + b["cu_seq_lens_q"].numpy().tobytes() for b in batch]


@pytest.mark.asyncio
async def test_stateful_dataloader_resumes_bitwise() -> None:
    recorded = await asyncio.gather(*(record_pass(ld, _flat) for ld in _loaders(2)))
    assert recorded[0][1][3]["ranks"]["0"]["source"] is not None  # the source state was captured
    for k in (0, 4, STEPS - 1):
        resumed = _loaders(depth=3)
        for r, loader in enumerate(resumed):
            loader.load_state_dict(recorded[r][1][k])

        async def tail(loader: BalancedLoader) -> list[Any]:
            async with loader:
                return [_flat(b) async for b in loader]

        tails = await asyncio.gather(*(tail(ld) for ld in resumed))
        for r in range(2):
            assert tails[r] == recorded[r][0][k + 1 :], f"rank {r}, k={k}"
