"""Step sources under BalancedLoader: in-process ranks (2 and 4) and 2 real Gloo processes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DatasetSource, IterableSource, LoaderConfig
from evenflow.transports import InProcessGroup

datasets = pytest.importorskip("datasets")

N = 300
SEQ_LEN = 64


def _dataset() -> Any:
    lengths = np.random.default_rng(5).integers(1, 48, size=N)
    return datasets.Dataset.from_dict(
        {
            "id": list(range(N)),
            "input_ids": [[i % 251] * int(n) for i, n in enumerate(lengths)],
        }
    )


def ids_pack(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        assert all(t == s["id"] % 251 for t in s["input_ids"]), "payload corrupted"
    return [int(s["id"]) for s in samples]


def _loader(source: Any, transport: Any, depth: int = 2) -> BalancedLoader:
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=depth, log_stats=False)
    return BalancedLoader(
        source,
        config=config,
        transport=transport,
        metadata_fn=source.metadata_fn,
        pack_fn=ids_pack,
        cost_model="quadratic",
    )


async def _run(loaders: list[BalancedLoader]) -> list[tuple[list[Any], list[Any]]]:
    async def one(loader: BalancedLoader) -> tuple[list[Any], list[Any]]:
        batches, states = [], []
        async with loader:
            async for batch in loader:
                batches.append(batch)
                states.append(loader.state_dict())
        return batches, states

    return list(await asyncio.gather(*(one(ld) for ld in loaders)))


def _sources(n: int, **kw: Any) -> list[DatasetSource]:
    data = _dataset()
    return [
        DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, rank=r, num_ranks=n, seed=1, **kw)
        for r in range(n)
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [2, 4])
async def test_the_loader_conserves_every_sample_of_a_dataset_source(n: int) -> None:
    sources = _sources(n)
    expected = [
        {int(i) for r in range(n) for b in sources[r].step_indices(s) for i in b}
        for s in range(len(sources[0]))
    ]
    group = InProcessGroup(n, timeout=20.0)
    results = await _run([_loader(src, group.transport(r)) for r, src in enumerate(sources)])
    assert [len(b) for b, _ in results] == [len(sources[0])] * n
    for step, want in enumerate(expected):
        got = [i for batches, _ in results for b in batches[step] for i in b]
        assert len(got) == len(set(got)) and set(got) == want, f"step {step}"
    everything = {i for want in expected for i in want}
    assert len(everything) == N - sources[0].report.num_dropped_samples


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [1, 3])
async def test_loader_resume_over_a_dataset_source_is_bitwise(depth: int) -> None:
    group = InProcessGroup(2, timeout=20.0)
    recorded = await _run([_loader(s, group.transport(r)) for r, s in enumerate(_sources(2))])
    num_steps = len(recorded[0][0])
    for k in (0, 3, num_steps // 2, num_steps - 1):
        group = InProcessGroup(2, timeout=20.0)
        loaders = [_loader(s, group.transport(r), depth) for r, s in enumerate(_sources(2))]
        for r, loader in enumerate(loaders):
            loader.load_state_dict(recorded[r][1][k])
        tails = await _run(loaders)
        for r in range(2):
            assert tails[r][0] == recorded[r][0][k + 1 :], (r, k)


def test_loader_resume_across_set_epoch_with_an_iterable_source() -> None:
    data = _dataset()

    def make() -> IterableSource:
        return IterableSource(
            lambda epoch: iter(data.shuffle(seed=epoch)), seq_len=SEQ_LEN, bins_per_rank=2
        )

    def epoch_one(loader: BalancedLoader, stop: int | None) -> tuple[list[Any], Any]:
        batches, state = [], None
        with loader:
            if stop is None:
                loader.set_epoch(1)
            for batch in loader:
                batches.append(batch)
                if len(batches) == stop:
                    state = loader.state_dict()
                    break
        return batches, state

    reference, _ = epoch_one(_loader(make(), None), None)
    assert len(reference) > 5
    first = _loader(make(), None)
    first.set_epoch(1)
    head, state = epoch_one(first, 4)
    assert head == reference[:4] and state["epoch"] == 1
    resumed = _loader(make(), None)
    resumed.load_state_dict(state)
    with resumed:
        assert list(resumed) == reference[4:]


# -- two real Gloo processes -----------------------------------------------------------------


def _gloo_rank(rank: int, num_ranks: int) -> dict[str, Any]:
    from evenflow.transports import GlooTransport

    source = DatasetSource(
        _dataset(), seq_len=SEQ_LEN, bins_per_rank=2, rank=rank, num_ranks=num_ranks, seed=1
    )
    expected = [
        [int(i) for b in source.step_indices(s, rank=r) for i in b]
        for s in range(len(source))
        for r in range(num_ranks)
    ]
    loader = _loader(source, GlooTransport(timeout=10.0))
    with loader:
        batches = [[list(b) for b in batch] for batch in loader]
    return {"batches": batches, "expected": expected, "steps": len(source)}


@pytest.mark.multiprocess
def test_two_gloo_processes_conserve_every_sample_of_a_dataset_source() -> None:
    from evenflow.transports.launch import run_ranks

    results = run_ranks(_gloo_rank, 2, timeout=10.0, deadline=120.0)
    steps = results[0]["steps"]
    assert results[1]["steps"] == steps > 0
    assert results[0]["expected"] == results[1]["expected"]  # computed alike on both ranks
    for step in range(steps):
        got = [i for r in range(2) for b in results[r]["batches"][step] for i in b]
        want = [i for part in results[0]["expected"][2 * step : 2 * step + 2] for i in part]
        assert len(got) == len(set(got)) and set(got) == set(want), f"step {step}"
