"""Every step source keeps the resume contract: ``evenflow.engine.testing.check_step_source``
run against each kind of source the engine ships, and shown to fail on a source that breaks it.

The kinds: ``DatasetSource`` in payload and shared-dataset mode (on rank 1 of 2, so the epoch
is dealt), ``IterableSource`` over a stateful stream (a Hugging Face iterable dataset, a
``torchdata`` node) and over a stateless factory (resumed by replay), and both sources with
two transform worker processes and a randomized transform.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from testkit.transforms import noisy

from evenflow.engine import DatasetSource, IterableSource
from evenflow.engine.testing import check_step_source

datasets = pytest.importorskip("datasets")
nodes = pytest.importorskip("torchdata.nodes")

# torchdata 0.11 calls a torch API that torch 2.13 deprecates; not our warning to fix.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

N = 120
SEQ_LEN = 64
SEED = 9


def _rows() -> list[dict[str, Any]]:
    lengths = np.random.default_rng(4).integers(1, 40, size=N)
    return [{"id": i, "input_ids": [i % 251] * int(n)} for i, n in enumerate(lengths)]


def _hf_rows() -> Any:
    rows = _rows()
    return datasets.Dataset.from_dict(
        {"id": [r["id"] for r in rows], "input_ids": [r["input_ids"] for r in rows]}
    )


def _dataset(**kw: Any) -> Callable[[], DatasetSource]:
    def make() -> DatasetSource:
        return DatasetSource(
            _rows(), seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2, seed=SEED, **kw
        )

    return make


def _factory(epoch: int) -> Iterator[dict[str, Any]]:
    rows = _rows()
    order = np.random.default_rng((SEED, epoch)).permutation(len(rows))
    return (rows[i] for i in order)


def _iterable(kind: str, **kw: Any) -> Callable[[], IterableSource]:
    streams: dict[str, Callable[[], Any]] = {
        "factory": lambda: _factory,
        "hf": lambda: _hf_rows().to_iterable_dataset(num_shards=4),
        "node": lambda: nodes.IterableWrapper(_rows()),
    }

    def make() -> IterableSource:
        return IterableSource(streams[kind](), seq_len=SEQ_LEN, bins_per_rank=2, seed=SEED, **kw)

    return make


SOURCES = {
    "dataset-payload": _dataset(),
    "dataset-shared": _dataset(shared=True),
    "dataset-best-fit": _dataset(packer="best_fit_decreasing"),
    "iterable-hf": _iterable("hf"),
    "iterable-node": _iterable("node", packer="best_fit_decreasing"),
    "iterable-factory-replay": _iterable("factory"),
}
WITH_WORKERS = {
    "dataset-payload-workers": _dataset(transform=noisy, transform_workers=2),
    "iterable-hf-workers": _iterable("hf", transform=noisy, transform_workers=2),
    "iterable-factory-workers": _iterable("factory", transform=noisy, transform_workers=2),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_source_resumes_exactly_at_every_checked_position(name: str) -> None:
    assert check_step_source(SOURCES[name]) >= 4


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_later_epoch_resumes_as_exactly(name: str) -> None:
    assert check_step_source(SOURCES[name], epoch=1, positions=[2]) >= 4


@pytest.mark.parametrize("name", sorted(WITH_WORKERS))
def test_sources_with_transform_workers_resume_exactly(name: str) -> None:
    """The transform's random state is that of ``(seed, epoch, index)`` (a stream's: of
    ``(seed, epoch, step, slot)``), so the restored source transforms exactly as the saving one
    would have; steps packed ahead for the workers are in the state (stateful streams) or
    replayed (factories)."""
    steps = check_step_source(WITH_WORKERS[name], positions=[0, 3])
    assert steps >= 4


class _Forgetful:
    """A source that restores one step too far: the bug the check exists to catch."""

    def __init__(self) -> None:
        self._inner = _dataset()()

    def set_epoch(self, epoch: int) -> None:
        self._inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._inner)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        skipped = {**state, "step": min(state["step"] + 1, len(self._inner))}
        self._inner.load_state_dict(skipped)


class _Unencodable(_Forgetful):
    def state_dict(self) -> dict[str, Any]:
        return {**self._inner.state_dict(), "where": object()}


def test_the_check_names_the_position_of_a_source_that_resumes_wrongly() -> None:
    with pytest.raises(AssertionError, match=r"saved after step 0, step 0 differs"):
        check_step_source(_Forgetful)
    with pytest.raises(AssertionError, match=r"after step 0 is not plain data a checkpoint"):
        check_step_source(_Unencodable)
    with pytest.raises(ValueError, match=r"positions holds 999, but epoch 0 has \d+ steps"):
        check_step_source(_dataset(), positions=[999])


def test_the_default_comparison_sees_arrays_and_tensors() -> None:
    """A sample that differs only inside an array must count as different."""
    import torch

    from evenflow.engine.testing import _same

    assert _same([{"a": np.arange(3)}], [{"a": np.arange(3)}])
    assert not _same([{"a": np.arange(3)}], [{"a": np.arange(1, 4)}])
    assert not _same(np.arange(3), np.arange(3, dtype=np.int32))
    assert _same((torch.ones(2),), (torch.ones(2),))
    assert not _same((torch.ones(2),), (torch.zeros(2),))
    assert not _same([1, 2], (1, 2))
