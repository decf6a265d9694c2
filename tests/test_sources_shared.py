"""Shared-dataset mode: every rank reads the same dataset, only indices travel.

In-process ranks here (fast); real Gloo processes in ``test_sources_shared_gloo.py`` and, for
bitwise resume in fresh processes, ``test_sources_gloo.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, Tracer
from evenflow.engine.errors import ConfigError, GroupMismatchError, RemoteStageError
from evenflow.transports import InProcessGroup, Transport
from evenflow.transports.testing import WrappedTransport

datasets = pytest.importorskip("datasets")

N = 240
SEQ_LEN = 64


def _dataset(n: int = N) -> Any:
    lengths = np.random.default_rng(3).integers(1, 48, size=n)
    return datasets.Dataset.from_dict(
        {"id": list(range(n)), "input_ids": [[i % 251] * int(k) for i, k in enumerate(lengths)]}
    )


def ids_pack(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        assert all(t == s["id"] % 251 for t in s["input_ids"]), "payload corrupted"
    return [int(s["id"]) for s in samples]


class CountExchanges(WrappedTransport):
    """Counts exchanges and the payload items they carry."""

    name = "count-exchanges"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.num_exchanges = 0
        self.num_items = 0

    async def exchange(self, outgoing: Any) -> dict[Hashable, Any]:
        self.num_exchanges += 1
        self.num_items += sum(len(items) for items in outgoing.values())
        return await super().exchange(outgoing)


def _loaders(
    sources: list[DatasetSource], transports: list[Transport], **kw: Any
) -> list[BalancedLoader]:
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=2, log_stats=False)
    return [
        BalancedLoader(
            s,
            config=config,
            transport=t,
            metadata_fn=s.metadata_fn,
            pack_fn=ids_pack,
            cost_model="quadratic",
            **kw,
        )
        for s, t in zip(sources, transports, strict=True)
    ]


def _sources(n: int, data: Any = None, **kw: Any) -> list[DatasetSource]:
    data = _dataset() if data is None else data
    return [
        DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, rank=r, num_ranks=n, seed=4, **kw)
        for r in range(n)
    ]


async def _run(loaders: list[BalancedLoader]) -> list[list[Any]]:
    async def one(loader: BalancedLoader) -> list[Any]:
        async with loader:
            return [batch async for batch in loader]

    return list(await asyncio.gather(*(one(ld) for ld in loaders)))


def _counted(n: int) -> list[CountExchanges]:
    group = InProcessGroup(n, timeout=20.0)
    return [CountExchanges(group.transport(r)) for r in range(n)]


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [2, 4])
async def test_shared_mode_moves_no_payload_and_delivers_the_payload_modes_batches(n: int) -> None:
    payload_t, shared_t = _counted(n), _counted(n)
    payload = await _run(_loaders(_sources(n), list(payload_t)))
    shared = await _run(_loaders(_sources(n, shared=True, read_threads=2), list(shared_t)))
    assert len(payload[0]) > 3
    assert shared == payload  # bitwise the same batches on every rank
    assert sum(t.num_items for t in payload_t) > 0  # the plans do move samples
    assert [t.num_exchanges for t in shared_t] == [0] * n  # shared mode never exchanges


@pytest.mark.asyncio
async def test_shared_mode_traces_the_read_of_assigned_samples_as_its_own_stage() -> None:
    tracers = [Tracer(), Tracer()]
    group = InProcessGroup(2, timeout=20.0)
    sources = _sources(2, shared=True)
    loaders = [
        _loaders([s], [group.transport(r)], tracer=tracers[r])[0] for r, s in enumerate(sources)
    ]
    batches = await _run(loaders)
    stages = {span.stage for span in tracers[0].spans()}
    assert "read_assigned" in stages and "exchange" not in stages
    reads = {span.step for span in tracers[0].spans() if span.stage == "read_assigned"}
    assert reads >= set(range(len(batches[0])))  # one span per delivered step


class _Broken:
    """A map-style dataset whose sample ``bad`` cannot be read."""

    def __init__(self, data: Any, bad: int) -> None:
        self.data, self.bad = data, bad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        if index == self.bad:
            raise OSError(f"bad block under sample {index}")
        return self.data[index]


@pytest.mark.asyncio
async def test_a_failed_read_of_an_assigned_sample_fails_every_rank_at_its_step() -> None:
    data = _dataset()
    probe = _sources(2, data)[0]
    bad = int(probe.step_indices(2, rank=1)[0][0])  # read at step 2 by whichever rank packs it
    lengths = np.asarray(data["input_ids"], dtype=object)
    broken = _Broken(data, bad)
    sources = [
        DatasetSource(
            broken,
            seq_len=SEQ_LEN,
            bins_per_rank=2,
            rank=r,
            num_ranks=2,
            seed=4,
            lengths=[len(x) for x in lengths],
            shared=True,
        )
        for r in range(2)
    ]
    group = InProcessGroup(2, timeout=20.0)
    loaders = _loaders(sources, [group.transport(r) for r in range(2)])

    async def one(loader: BalancedLoader) -> tuple[int, BaseException]:
        delivered = 0
        async with loader:
            try:
                async for _ in loader:
                    delivered += 1
            except Exception as exc:
                return delivered, exc
        raise AssertionError("the broken sample was never read")

    results = await asyncio.gather(*(one(ld) for ld in loaders))
    assert [delivered for delivered, _ in results] == [2, 2]  # the same step on every rank
    messages = [str(exc) for _, exc in results]
    assert all(f"dataset index {bad}" in m for m in messages), messages
    assert any(isinstance(exc, RemoteStageError) for _, exc in results)  # the peer's verdict


@pytest.mark.asyncio
async def test_ranks_that_see_different_datasets_are_refused_before_any_sample_is_read() -> None:
    group = InProcessGroup(2, timeout=20.0)
    sources = [_sources(2, shared=True)[0], _sources(2, _dataset(N - 1), shared=True)[1]]
    loaders = _loaders(sources, [group.transport(r) for r in range(2)])
    results = await asyncio.gather(*(_run([ld]) for ld in loaders), return_exceptions=True)
    for result in results:
        assert isinstance(result, GroupMismatchError), result
        assert "rank 1 sees a different dataset" in str(result)
        assert f"num_samples is {N - 1} on rank 1 but {N} on rank 0" in str(result)


@pytest.mark.asyncio
async def test_a_shared_rank_beside_a_payload_rank_is_refused() -> None:
    group = InProcessGroup(2, timeout=20.0)
    sources = [_sources(2)[0], _sources(2, shared=True)[1]]
    loaders = _loaders(sources, [group.transport(r) for r in range(2)])
    results = await asyncio.gather(*(_run([ld]) for ld in loaders), return_exceptions=True)
    for result in results:
        assert isinstance(result, GroupMismatchError), result
        assert "rank 1 reads a shared dataset" in str(result)


def test_shared_mode_options_are_checked() -> None:
    data = _dataset()
    with pytest.raises(ConfigError, match="read_threads"):
        DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, shared=True, read_threads=0)
    with pytest.raises(ConfigError, match="features_fn needs each sample's content"):
        DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, shared=True, features_fn=dict)
    source = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, shared=True)
    assert source.shared and source.dataset_identity() == {
        "num_samples": N,
        "lengths_fingerprint": source.fingerprint,
    }
