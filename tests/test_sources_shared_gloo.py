"""Shared-dataset mode on two real Gloo processes: no payload crosses the wire, the batches
are bitwise those of payload mode, and a rank whose dataset differs is refused at build on
every rank. (Bitwise resume in fresh processes: ``test_sources_gloo.py``.)"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.transports.launch import RankPool

pytestmark = pytest.mark.multiprocess

datasets = pytest.importorskip("datasets")

N = 200
SEQ_LEN = 64


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=120.0) as ranks:
        yield ranks


def _dataset(n: int = N, longer: int | None = None) -> Any:
    lengths = np.random.default_rng(8).integers(1, 48, size=n)
    if longer is not None:
        lengths[longer] += 1
    return datasets.Dataset.from_dict(
        {"id": list(range(n)), "input_ids": [[i % 251] * int(k) for i, k in enumerate(lengths)]}
    )


def _ids(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        assert all(t == s["id"] % 251 for t in s["input_ids"]), "payload corrupted"
    return [int(s["id"]) for s in samples]


def _config() -> Any:
    from evenflow.engine import LoaderConfig

    return LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=2, log_stats=False)


def _modes(rank: int, num_ranks: int) -> dict[str, Any]:
    """Payload mode and shared mode over the same dataset on Gloo, exchanges counted."""
    from evenflow.engine import BalancedLoader, DatasetSource
    from evenflow.transports import GlooTransport, Transport
    from evenflow.transports.testing import WrappedTransport

    class CountExchanges(WrappedTransport):
        def __init__(self, inner: Transport) -> None:
            super().__init__(inner)
            self.num_exchanges = self.num_items = 0

        async def exchange(self, outgoing: Any) -> dict[Hashable, Any]:
            self.num_exchanges += 1
            self.num_items += sum(len(items) for items in outgoing.values())
            return await super().exchange(outgoing)

    out: dict[str, Any] = {}
    for mode in ("payload", "shared"):
        source = DatasetSource(
            _dataset(),
            seq_len=SEQ_LEN,
            bins_per_rank=2,
            rank=rank,
            num_ranks=num_ranks,
            seed=2,
            shared=mode == "shared",
        )
        transport = CountExchanges(GlooTransport(timeout=10.0))
        loader = BalancedLoader(
            source,
            config=_config(),
            transport=transport,
            metadata_fn=source.metadata_fn,
            pack_fn=_ids,
            cost_model="quadratic",
        )
        with loader:
            batches = list(loader)
        out[mode] = {
            "batches": batches,
            "exchanges": transport.num_exchanges,
            "items": transport.num_items,
        }
    return out


def test_shared_mode_on_gloo_moves_no_payload_and_matches_payload_mode(pool: RankPool) -> None:
    results = pool.run(_modes)
    for rank in range(2):
        payload, shared = results[rank]["payload"], results[rank]["shared"]
        assert len(payload["batches"]) > 3
        assert shared["batches"] == payload["batches"], rank
        assert shared["exchanges"] == 0 and shared["items"] == 0
    assert sum(r["payload"]["items"] for r in results) > 0  # payload mode did move samples


def _build(rank: int, num_ranks: int, differ: str) -> dict[str, Any]:
    """build_loader in shared mode; rank 1's dataset differs as ``differ`` says."""
    from evenflow.engine import DatasetSource, build_loader

    if rank == 1 and differ == "length":
        data = _dataset(N + 1)
    elif rank == 1 and differ == "lengths":
        data = _dataset(longer=17)
    else:
        data = _dataset()
    source = DatasetSource(
        data, seq_len=SEQ_LEN, bins_per_rank=2, rank=rank, num_ranks=num_ranks, shared=True
    )
    try:
        loader = build_loader(source, _config(), balance_group_size=2, pack_fn=_ids)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    with loader:
        return {"steps": len(list(loader))}


@pytest.mark.parametrize(
    ("differ", "what"),
    [
        ("length", f"num_samples is {N + 1} on rank 1 but {N} on rank 0"),
        ("lengths", "lengths_fingerprint is '"),
    ],
)
def test_a_rank_whose_dataset_differs_is_refused_at_build_on_every_rank(
    pool: RankPool, differ: str, what: str
) -> None:
    results = pool.run(_build, differ)
    for result in results:
        assert result.get("error") == "GroupMismatchError", result
        assert "build_loader: rank 1 sees a different dataset than rank 0" in result["message"]
        assert what in result["message"]


def test_build_loader_accepts_ranks_that_share_one_dataset(pool: RankPool) -> None:
    results = pool.run(_build, "none")
    assert results[0] == results[1] and results[0]["steps"] > 3
