"""One-shot iterators as sources: a second pass or an empty first pass is an error, never
zero steps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine.errors import ConfigError
from evenflow.transports import _wire

CONFIG = LoaderConfig(seq_len=32, bins_per_rank=2, log_stats=False)
STEPS = 3


def _steps() -> Iterator[list[list[np.ndarray]]]:
    for step in range(STEPS):
        yield [[np.full(3 + step, step, dtype=np.int32)], [np.full(2, step, dtype=np.int32)]]


async def _async_steps() -> AsyncIterator[list[list[np.ndarray]]]:
    for step in _steps():
        yield step


def _count(loader: BalancedLoader) -> int:
    return sum(1 for _ in loader)


def test_a_generator_gives_one_pass_then_set_epoch_names_the_fix() -> None:
    with BalancedLoader(_steps(), config=CONFIG) as loader:
        loader.set_epoch(0)  # before the first pass: nothing consumed yet
        assert _count(loader) == STEPS
        with pytest.raises(ConfigError, match=r"set_epoch\(1\).*one-shot iterator.*re-iterable"):
            loader.set_epoch(1)


def test_an_exhausted_generator_raises_at_iteration() -> None:
    steps = _steps()
    list(steps)
    with (
        BalancedLoader(steps, config=CONFIG) as loader,
        pytest.raises(ConfigError, match=r"yielded no step.*exhausted or consumed elsewhere"),
    ):
        _count(loader)


def test_a_generator_cannot_feed_two_loaders() -> None:
    steps = _steps()
    with BalancedLoader(steps, config=CONFIG) as first:
        with pytest.raises(ConfigError, match="already feeds another loader"):
            BalancedLoader(steps, config=CONFIG)
        assert _count(first) == STEPS


@pytest.mark.asyncio
async def test_an_async_generator_gives_one_pass_then_refuses_another() -> None:
    async with BalancedLoader(_async_steps(), config=CONFIG) as loader:
        assert len([b async for b in loader]) == STEPS
        with pytest.raises(ConfigError, match="one-shot iterator"):
            await loader.aset_epoch(1)


def test_re_iterable_sources_are_not_guarded() -> None:
    steps = list(_steps())
    with BalancedLoader(steps, config=CONFIG) as loader:
        assert _count(loader) == STEPS
        loader.set_epoch(1)
        assert _count(loader) == STEPS


class _StatefulIterator:
    """An iterator with its own state: still one-shot, its methods still reach the loader."""

    def __init__(self) -> None:
        self.position = 0
        self.epochs: list[int] = []

    def __iter__(self) -> _StatefulIterator:
        return self

    def __next__(self) -> list[list[np.ndarray]]:
        if self.position == STEPS:
            raise StopIteration
        self.position += 1
        return [[np.ones(2, np.int32)], [np.ones(3, np.int32)]]

    def __len__(self) -> int:
        return STEPS

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}


def test_the_guard_passes_state_len_and_epochs_through() -> None:
    source = _StatefulIterator()
    with BalancedLoader(source, config=CONFIG) as loader:
        loader.set_epoch(0)
        assert len(loader) == STEPS
        next(iter(loader))
        state = loader.state_dict()
        entry = state["ranks"]["0"]
        assert entry["stateful"] is True
        assert _wire.decode(entry["source"]) == {"position": 1}
    assert source.epochs == [0]
