"""DatasetSource over a list, a torch Dataset and an in-memory Hugging Face Dataset."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from evenflow.engine import DatasetSource, IndexedSample
from evenflow.engine.errors import ConfigError, ResumeError

datasets = pytest.importorskip("datasets")

N = 400
SEQ_LEN = 64


def _lengths(n: int = N, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 48, size=n).tolist()


def _rows(n: int = N) -> list[dict[str, Any]]:
    return [{"id": i, "input_ids": list(range(length))} for i, length in enumerate(_lengths(n))]


class TorchRows(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.rows = _rows()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def _dataset(kind: str) -> Any:
    if kind == "list":
        return _rows()
    if kind == "torch":
        return TorchRows()
    rows = _rows()
    return datasets.Dataset.from_dict(
        {"id": [r["id"] for r in rows], "input_ids": [r["input_ids"] for r in rows]}
    )


def _ids(step: list[list[Any]]) -> list[list[int]]:
    return [[int(s["id"]) for s in b] for b in step]


def _epoch(source: DatasetSource) -> list[list[list[int]]]:
    return [_ids(step) for step in source]


KINDS = ["list", "torch", "hf"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packer", ["first_fit", "best_fit_decreasing"])
@pytest.mark.parametrize("num_ranks", [1, 3, 4])
def test_every_sample_once_across_ranks_except_the_reported_remainder(
    kind: str, packer: str, num_ranks: int
) -> None:
    data = _dataset(kind)
    sources = [
        DatasetSource(
            data, seq_len=SEQ_LEN, bins_per_rank=2, rank=r, num_ranks=num_ranks, packer=packer
        )
        for r in range(num_ranks)
    ]
    steps = [_epoch(s) for s in sources]
    assert len({len(s) for s in sources}) == 1 and [len(x) for x in steps] == [len(sources[0])] * (
        num_ranks
    )
    lengths = _lengths()
    delivered = []
    for per_rank in steps:
        for step in per_rank:
            assert len(step) == 2 and all(step)
            assert all(sum(lengths[i] for i in b) <= SEQ_LEN for b in step)
            delivered += [i for b in step for i in b]
    assert len(delivered) == len(set(delivered))
    report = sources[0].report
    assert report == sources[-1].report
    assert report.num_dropped_samples == N - len(delivered)
    missing = set(range(N)) - set(delivered)
    assert report.num_dropped_tokens == sum(lengths[i] for i in missing)
    # Bounded: less than one step per rank, plus the packer's remainder.
    assert report.num_dropped_tokens < (num_ranks + 1) * 2 * SEQ_LEN


def test_epochs_differ_and_are_reproducible_from_the_seed() -> None:
    data = _rows()
    a = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, seed=7)
    first = _epoch(a)
    a.set_epoch(1)
    second = _epoch(a)
    assert first != second
    b = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, seed=7)
    b.set_epoch(1)
    assert _epoch(b) == second
    c = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, seed=8)
    assert _epoch(c) != first
    ordered = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, shuffle=False)
    first_step = [i for b in _epoch(ordered)[0] for i in b]
    assert sorted(first_step) == list(range(len(first_step)))  # the stream in dataset order


def test_iterating_again_replays_the_epoch_never_zero_steps() -> None:
    source = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2)
    assert _epoch(source) == _epoch(source) and len(_epoch(source)) == len(source) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_exact_mid_epoch_and_across_set_epoch(kind: str) -> None:
    data = _dataset(kind)

    def make(rank: int) -> DatasetSource:
        return DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, rank=rank, num_ranks=2, seed=3)

    for rank in range(2):
        reference = make(rank)
        epochs = []
        for epoch in range(2):
            reference.set_epoch(epoch)
            epochs.append(_epoch(reference))
        for epoch in range(2):
            for k in (0, 1, len(epochs[epoch]) // 2, len(epochs[epoch])):
                source = make(rank)
                source.set_epoch(epoch)
                it = iter(source)
                for _ in range(k):
                    next(it)
                state = source.state_dict()
                assert (state["epoch"], state["step"]) == (epoch, k)
                restored = make(rank)
                restored.load_state_dict(state)
                assert _epoch(restored) == epochs[epoch][k:], (rank, epoch, k)
                restored.set_epoch(epoch + 1)  # the next epoch after a restore starts at 0
                assert restored.step == 0


def test_a_state_from_another_dataset_seed_or_layout_is_refused() -> None:
    source = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, seed=1)
    state = source.state_dict()
    with pytest.raises(ResumeError, match="seed=1"):
        DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, seed=2).load_state_dict(state)
    other = _rows()
    other[5]["input_ids"].append(0)
    with pytest.raises(ResumeError, match="lengths_fingerprint"):
        DatasetSource(other, seq_len=SEQ_LEN, bins_per_rank=2, seed=1).load_state_dict(state)
    with pytest.raises(ResumeError, match="beyond"):
        DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, seed=1).load_state_dict(
            {**state, "step": 10_000}
        )


def test_hf_lengths_come_from_arrow_columns_and_respect_an_indices_mapping() -> None:
    rows = _rows()
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "length": [len(r["input_ids"]) + 1 for r in rows],  # differs: the column is used
        }
    )
    by_list = DatasetSource(ds, seq_len=SEQ_LEN, bins_per_rank=2)
    assert by_list.lengths.tolist() == _lengths()
    by_column = DatasetSource(ds, seq_len=SEQ_LEN, bins_per_rank=2, length_column="length")
    assert by_column.lengths.tolist() == [n + 1 for n in _lengths()]
    picked = ds.select([9, 3, 5])
    assert DatasetSource(picked, seq_len=SEQ_LEN, bins_per_rank=1).lengths.tolist() == [
        _lengths()[i] for i in (9, 3, 5)
    ]
    assert by_list.fingerprint == DatasetSource(_rows(), seq_len=64, bins_per_rank=2).fingerprint
    listed = [{"tokens": r["input_ids"], "n": len(r["input_ids"])} for r in rows]
    for column in ("tokens", "n"):  # a plain list of rows: read item by item
        source = DatasetSource(listed, seq_len=SEQ_LEN, bins_per_rank=2, length_column=column)
        assert source.lengths.tolist() == _lengths()
    with pytest.raises(ConfigError, match=r"length_column='size' is not a column"):
        DatasetSource(ds, seq_len=SEQ_LEN, bins_per_rank=2, length_column="size")


def test_metadata_fn_reports_the_known_length_and_the_features_hook() -> None:
    rows = [{"input_ids": [1] * 10, "labels": [-100] * 4 + [1] * 6} for _ in range(40)]
    lengths = [12] * 40  # e.g. the lengths after a template the pack_fn adds
    source = DatasetSource(
        rows,
        seq_len=64,
        bins_per_rank=2,
        lengths=lengths,
        features_fn=lambda s: {"loss_tokens": sum(t != -100 for t in s["labels"])},
    )
    step = next(iter(source))
    meta = source.metadata_fn(step[0][0])
    assert meta.tokens == 12 and meta.features == {"loss_tokens": 6}
    assert source.metadata_fn({"input_ids": [1, 2, 3], "labels": [1, 1, 1]}).tokens == 3


def test_yield_indices_and_read_give_the_same_samples() -> None:
    data = _dataset("hf")
    by_sample = DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2)
    by_index = DatasetSource(
        data, seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2, yield_indices=True
    )
    for step, indexed in zip(by_sample, by_index, strict=True):
        for b, ib in zip(step, indexed, strict=True):
            assert all(isinstance(x, IndexedSample) for x in ib)
            assert by_index.read([x.dataset_index for x in ib]) == b
            assert [by_index.metadata_fn(x).tokens for x in ib] == [len(s["input_ids"]) for s in b]
    assert [a.tolist() for a in by_index.step_indices(0, rank=0)] == [
        [int(s["id"]) for s in b]
        for b in next(
            iter(DatasetSource(data, seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=2))
        )
    ]


def test_bad_samples_name_the_dataset_index(caplog: pytest.LogCaptureFixture) -> None:
    rows = _rows()
    rows[17] = {"input_ids": []}
    with pytest.raises(ConfigError, match="Dataset index 17 has length 0"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2)
    rows = _rows()
    rows[23] = {"input_ids": list(range(100))}
    with pytest.raises(ConfigError, match="Dataset index 23 has 100 tokens, more than seq_len=64"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2)
    with pytest.raises(TypeError, match="for dataset index 0"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, length_fn=lambda s: "12")
    with pytest.raises(ConfigError, match="dtype float64"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, lengths=np.ones(N) * 2.5)
    with pytest.raises(ConfigError, match="at most one of"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, lengths=[1] * N, length_fn=len)
    with pytest.raises(ConfigError, match="Pass both rank and num_ranks"):
        DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, rank=1)
    with pytest.raises(TypeError, match="map-style"):
        DatasetSource(iter(rows), seq_len=SEQ_LEN, bins_per_rank=2)
    with pytest.raises(ConfigError, match="not one step for each of num_ranks=500"):
        iter(DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=500))
    # Dropped oversized samples are counted and logged, never silent.
    with caplog.at_level(logging.INFO, logger="evenflow"):
        dropping = DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, oversized="drop")
        delivered = {int(s["id"]) for step in dropping for b in step for s in b if "id" in s}
    assert 23 not in delivered and dropping.report.num_oversized_dropped == 1
    assert "1 of them oversized" in caplog.text and "left unread" in caplog.text
    single = DatasetSource(rows, seq_len=SEQ_LEN, bins_per_rank=2, oversized="single")
    alone = [b for step in single for b in step if any(len(s["input_ids"]) == 100 for s in b)]
    assert len(alone) <= 1 and all(len(b) == 1 for b in alone)


def test_under_torch_distributed_an_unbound_source_needs_its_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        alone = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2)
        assert (alone.rank, alone.num_ranks) == (0, 1)  # a world of one rank
        # In a larger world a source no loader bound cannot guess its data-parallel rank.
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        unbound = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2)
        with pytest.raises(ConfigError, match="no loader has bound this DatasetSource"):
            len(unbound)
        given = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2)
        assert (given.rank, given.num_ranks) == (1, 2)
        assert len(given) > 0
    finally:
        dist.destroy_process_group()
