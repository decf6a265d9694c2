"""IterableSource over factories, HF iterable datasets, torchdata nodes and StatefulDataLoader."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.engine import IterableSource
from evenflow.engine.errors import ConfigError, ResumeError

datasets = pytest.importorskip("datasets")
nodes = pytest.importorskip("torchdata.nodes")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

# torchdata 0.11 calls a torch API that torch 2.13 deprecates; not our warning to fix.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

N = 240
SEQ_LEN = 64


def _lengths(epoch: int = 0) -> list[int]:
    return np.random.default_rng(epoch).integers(1, 48, size=N).tolist()


def _rows(epoch: int = 0) -> list[dict[str, Any]]:
    return [{"id": i, "input_ids": list(range(n))} for i, n in enumerate(_lengths(epoch))]


def _hf() -> Any:
    rows = _rows()
    return datasets.Dataset.from_dict(
        {"id": [r["id"] for r in rows], "input_ids": [r["input_ids"] for r in rows]}
    )


def factory(epoch: int) -> Iterator[dict[str, Any]]:
    yield from _rows(epoch)


MAKERS: dict[str, Callable[[], Any]] = {
    "factory": lambda: factory,
    "hf": lambda: _hf().to_iterable_dataset(num_shards=4),
    "node": lambda: nodes.IterableWrapper(_rows()),
    "dataloader": lambda: stateful_dataloader.StatefulDataLoader(
        _hf().with_format("numpy"), batch_size=8, num_workers=2, collate_fn=list
    ),
}


def _source(kind: str, packer: str = "first_fit", **kw: Any) -> IterableSource:
    return IterableSource(
        MAKERS[kind](),
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        packer=packer,
        batched=kind == "dataloader",
        **kw,
    )


def _ids(step: list[list[Any]]) -> list[list[int]]:
    return [[int(s["id"]) for s in b] for b in step]


def _pass(source: IterableSource) -> list[list[list[int]]]:
    return [_ids(step) for step in source]


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("packer", ["first_fit", "best_fit_decreasing"])
def test_every_sample_once_except_the_reported_remainder(kind: str, packer: str) -> None:
    source = _source(kind, packer)
    steps = _pass(source)
    delivered = [i for step in steps for b in step for i in b]
    assert len(delivered) == len(set(delivered))
    lengths = _lengths()
    for step in steps:
        assert len(step) == 2 and all(sum(lengths[i] for i in b) <= SEQ_LEN for b in step)
    report = source.report
    assert report is not None and report.num_steps == len(steps) and report.num_samples == N
    assert report.num_dropped_samples == N - len(delivered)
    assert report.num_dropped_tokens == sum(lengths[i] for i in set(range(N)) - set(delivered))
    assert source.stateful == (kind != "factory")


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("packer", ["first_fit", "best_fit_decreasing"])
def test_resume_is_exact_including_the_buffered_samples(kind: str, packer: str) -> None:
    reference = _pass(_source(kind, packer))
    for k in (0, 3, len(reference) // 2, len(reference)):
        source = _source(kind, packer)
        it = iter(source)
        for _ in range(k):
            next(it)
        state = source.state_dict()
        if source.stateful and k:
            assert state["upstream"] is not None and isinstance(state["pending"], bytes)
        # Finishing the pass (rather than abandoning it) lets loader workers exit at once.
        assert [_ids(step) for step in it] == reference[k:]
        restored = _source(kind, packer)
        restored.load_state_dict(state)
        assert _pass(restored) == reference[k:], (kind, packer, k)


def test_resume_across_set_epoch_with_a_factory_of_the_epoch() -> None:
    source = _source("factory")
    first = _pass(source)
    source.set_epoch(1)
    second = _pass(source)
    assert first != second
    again = _source("factory")
    again.set_epoch(1)
    it = iter(again)
    for _ in range(4):
        next(it)
    state = again.state_dict()
    restored = _source("factory")
    restored.load_state_dict(state)
    assert restored.epoch == 1 and _pass(restored) == second[4:]


def test_set_epoch_is_forwarded_to_the_wrapped_object() -> None:
    class Epochs:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return iter(_rows(self.epochs[-1] if self.epochs else 0))

    wrapped = Epochs()
    source = IterableSource(wrapped, seq_len=SEQ_LEN, bins_per_rank=2)
    source.set_epoch(3)
    assert wrapped.epochs == [3] and _pass(source) == [
        _ids(s) for s in IterableSource(lambda: iter(_rows(3)), seq_len=SEQ_LEN, bins_per_rank=2)
    ]


def test_hf_streams_split_by_node_cover_the_dataset_once() -> None:
    from datasets.distributed import split_dataset_by_node

    stream = _hf().to_iterable_dataset(num_shards=4)
    sources = [
        IterableSource(
            split_dataset_by_node(stream, rank=r, world_size=2), seq_len=SEQ_LEN, bins_per_rank=2
        )
        for r in range(2)
    ]
    per_rank = [[i for step in _pass(s) for b in step for i in b] for s in sources]
    assert not set(per_rank[0]) & set(per_rank[1])
    dropped = sum(s.report.num_dropped_samples for s in sources if s.report is not None)
    assert len(per_rank[0]) + len(per_rank[1]) + dropped == N


def test_a_one_shot_iterator_is_refused_naming_the_fix() -> None:
    with pytest.raises(TypeError, match=r"one-shot iterator.*Pass a factory"):
        IterableSource(factory(0), seq_len=SEQ_LEN, bins_per_rank=2)
    with pytest.raises(TypeError, match="one-shot iterator"):
        IterableSource(iter(_rows()), seq_len=SEQ_LEN, bins_per_rank=2)
    consumed = factory(0)
    source = IterableSource(lambda: consumed, seq_len=SEQ_LEN, bins_per_rank=2)
    assert _pass(source)
    source.set_epoch(1)
    with pytest.raises(ConfigError, match=r"yielded no samples in epoch 1.*pass a factory"):
        _pass(source)


def test_bad_samples_name_their_stream_position(caplog: pytest.LogCaptureFixture) -> None:
    rows = _rows()
    rows[7] = {"id": 7, "input_ids": []}
    with pytest.raises(ConfigError, match="Sample 7 of epoch 0's stream has length 0"):
        _pass(IterableSource(lambda: iter(rows), seq_len=SEQ_LEN, bins_per_rank=2))
    rows = _rows()
    rows[9] = {"id": 9, "input_ids": list(range(90))}
    with pytest.raises(ConfigError, match="Sample 9 of epoch 0's stream has 90 tokens"):
        _pass(IterableSource(lambda: iter(rows), seq_len=SEQ_LEN, bins_per_rank=2))
    with pytest.raises(TypeError, match="for sample 0 of epoch 0's stream"):
        _pass(
            IterableSource(
                lambda: iter(rows), seq_len=SEQ_LEN, bins_per_rank=2, length_fn=lambda s: 2.0
            )
        )
    with caplog.at_level(logging.INFO, logger="evenflow"):
        source = IterableSource(
            lambda: iter(rows), seq_len=SEQ_LEN, bins_per_rank=2, oversized="drop"
        )
        assert 9 not in {i for step in _pass(source) for b in step for i in b}
    assert source.report is not None and source.report.num_oversized_dropped == 1
    assert "1 of them oversized" in caplog.text
    with pytest.raises(TypeError, match="takes no argument or one"):
        IterableSource(lambda a, b: iter(rows), seq_len=SEQ_LEN, bins_per_rank=2)


def test_a_state_of_other_settings_is_refused() -> None:
    source = _source("node")
    state = source.state_dict()
    with pytest.raises(ResumeError, match="packing"):
        _source("node", packer="best_fit_decreasing").load_state_dict(state)


def test_metadata_fn_uses_the_measured_length() -> None:
    source = IterableSource(
        factory, seq_len=SEQ_LEN, bins_per_rank=2, length_fn=lambda s: len(s["input_ids"]) + 1
    )
    step = next(iter(source))
    assert source.metadata_fn(step[0][0]).tokens == len(step[0][0]["input_ids"]) + 1


def test_a_state_saved_right_after_set_epoch_starts_that_epoch_afresh() -> None:
    source = _source("node", "best_fit_decreasing")
    it = iter(source)
    next(it)
    assert source.state_dict()["pending"]  # the packer holds samples mid-pass
    source.set_epoch(1)
    state = source.state_dict()
    assert (state["epoch"], state["step"], state["pending"]) == (1, 0, None)
    restored = _source("node", "best_fit_decreasing")
    restored.load_state_dict(state)
    assert _pass(restored) == _pass(_source("node", "best_fit_decreasing"))
