"""Step sources on four real Gloo processes: conservation across the world, and bitwise resume
in fresh processes at several steps, prefetch depths and across ``set_epoch`` — for a
``DatasetSource`` in payload mode and in shared-dataset mode, and an ``IterableSource``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DatasetSource, IterableSource, LoaderConfig

datasets = pytest.importorskip("datasets")

N = 400
SEQ_LEN = 64
RANKS = 4
#: (epoch, steps delivered before the save, prefetch depth of the restored loader)
CUTS = ((0, 1, 1), (0, 3, 3), (1, 2, 2))
KINDS = ("dataset", "shared", "iterable")


def _dataset() -> Any:
    lengths = np.random.default_rng(11).integers(1, 48, size=N)
    return datasets.Dataset.from_dict(
        {"id": list(range(N)), "input_ids": [[i % 251] * int(n) for i, n in enumerate(lengths)]}
    )


def _ids(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    assert sum(len(s["input_ids"]) for s in samples) <= seq_len
    for s in samples:
        assert all(t == s["id"] % 251 for t in s["input_ids"]), "payload corrupted"
    return [int(s["id"]) for s in samples]


def _source(kind: str, rank: int, num_ranks: int) -> Any:
    data = _dataset()
    if kind in ("dataset", "shared"):
        return DatasetSource(
            data,
            seq_len=SEQ_LEN,
            bins_per_rank=2,
            rank=rank,
            num_ranks=num_ranks,
            seed=7,
            shared=kind == "shared",
        )
    # Each rank streams its own shard, reshuffled per epoch: an IterableSource over a factory.
    shard = data.shard(num_shards=num_ranks, index=rank)
    return IterableSource(
        lambda epoch: iter(shard.shuffle(seed=epoch)), seq_len=SEQ_LEN, bins_per_rank=2
    )


def _loader(kind: str, rank: int, num_ranks: int, depth: int) -> BalancedLoader:
    from evenflow.transports import GlooTransport

    source = _source(kind, rank, num_ranks)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=depth, log_stats=False)
    return BalancedLoader(
        source,
        config=config,
        transport=GlooTransport(timeout=10.0),
        metadata_fn=source.metadata_fn,
        pack_fn=_ids,
        cost_model="quadratic",
    )


def _record(rank: int, num_ranks: int) -> dict[str, Any]:
    """Per source kind, two epochs: every batch and the state saved after it."""
    return {kind: _record_kind(rank, num_ranks, kind) for kind in KINDS}


def _record_kind(rank: int, num_ranks: int, kind: str) -> dict[str, Any]:
    loader = _loader(kind, rank, num_ranks, depth=2)
    epochs: list[dict[str, Any]] = []
    with loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            batches, states = [], []
            for batch in loader:
                batches.append(batch)
                states.append(loader.state_dict())
            epochs.append({"batches": batches, "states": states})
    return {"epochs": epochs}


def _resume(rank: int, num_ranks: int, kind: str, states: list[dict[str, Any]]) -> list[list[Any]]:
    """For each cut, a loader in this (fresh) process restored from ``states[cut]``: the rest
    of its epoch."""
    tails = []
    for (_, _, depth), state in zip(CUTS, states, strict=True):
        loader = _loader(kind, rank, num_ranks, depth=depth)
        loader.load_state_dict(state)
        with loader:
            tails.append(list(loader))
    return tails


@pytest.mark.multiprocess
def test_four_gloo_ranks_conserve_samples_and_resume_bitwise_in_fresh_processes() -> None:
    from evenflow.transports.launch import run_ranks

    recorded = run_ranks(_record, RANKS, timeout=10.0, deadline=180.0)
    for kind in KINDS:
        _check_epochs(kind, [r[kind] for r in recorded])
    # Resume at each cut in fresh processes; the tails must be bitwise the recorded ones.
    states = {
        kind: [[r[kind]["epochs"][e]["states"][cut - 1] for e, cut, _ in CUTS] for r in recorded]
        for kind in KINDS
    }
    tails = run_ranks(_resume_rank, RANKS, args=(states,), timeout=10.0, deadline=180.0)
    # Shared mode reads its planned samples itself: bitwise the batches of payload mode.
    assert [r["shared"] for r in recorded] == [r["dataset"] for r in recorded]
    for kind in KINDS:
        for rank in range(RANKS):
            for (epoch, cut, _), tail in zip(CUTS, tails[rank][kind], strict=True):
                want = recorded[rank][kind]["epochs"][epoch]["batches"][cut:]
                assert tail == want, (kind, rank, epoch, cut)
        assert len({len(t) for t in tails[0][kind]}) > 1  # the cuts are at different places


def _check_epochs(kind: str, recorded: list[dict[str, Any]]) -> None:
    for epoch in (0, 1):
        runs = [r["epochs"][epoch] for r in recorded]
        steps = len(runs[0]["batches"])
        assert steps > 3 and all(len(r["batches"]) == steps for r in runs), kind
        got = [i for r in runs for batch in r["batches"] for b in batch for i in b]
        assert len(got) == len(set(got)), f"{kind} epoch {epoch}: a sample delivered twice"
        assert set(got) <= set(range(N))
        if kind in ("dataset", "shared"):
            # What was not delivered is what the source reports it leaves unread, and every
            # rank computes the same number of steps.
            source = _source(kind, 0, RANKS)
            source.set_epoch(epoch)
            assert N - len(got) == source.report.num_dropped_samples
            assert len(source) == steps
        else:
            assert len(got) > 0.8 * N, f"{kind} epoch {epoch}: only {len(got)} samples"
    first = [i for r in recorded for b in r["epochs"][0]["batches"][0] for i in b]
    again = [i for r in recorded for b in r["epochs"][1]["batches"][0] for i in b]
    assert first != again, f"{kind}: epochs must differ"


def _resume_rank(
    rank: int, num_ranks: int, states: dict[str, list[Any]]
) -> dict[str, list[list[Any]]]:
    return {kind: _resume(rank, num_ranks, kind, states[kind][rank]) for kind in KINDS}
