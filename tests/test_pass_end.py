"""How a pass ends: uneven ends are warned about and counted, every pass is summarised, and the
pass's source iterator is released (generators closed, DataLoader workers shut down)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.data
from testkit.loaders import DEADLINE, IdSource, id_bins, make_loaders

from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig
from evenflow.engine.errors import SourceExhaustedError
from evenflow.transports import InProcessGroup


def _sizes(rank: int, step: int, epoch: int) -> list[list[int]]:
    return [[3 + rank, 2 + step % 3], [5, 1 + rank]]


def _source(rank: int, num_steps: int) -> IdSource:
    return IdSource(rank, _sizes, num_steps=num_steps)


class _Unsized:
    """A re-iterable source without ``len()``: how much it has left is unknown."""

    def __init__(self, rank: int, num_steps: int) -> None:
        self.rank, self.num_steps = rank, num_steps

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        for step in range(self.num_steps):
            yield id_bins(self.rank, step, _sizes(self.rank, step, 0))


async def _run(loaders: list[BalancedLoader]) -> list[int | BaseException]:
    async def one(loader: BalancedLoader) -> int | BaseException:
        n = 0
        try:
            async with loader:
                async for _ in loader:
                    n += 1
        except Exception as exc:
            return exc
        return n

    return await asyncio.wait_for(asyncio.gather(*(one(ld) for ld in loaders)), DEADLINE)


def _samples(rank: int, step: int) -> int:
    return sum(len(b) for b in _sizes(rank, step, 0))


def _tokens(rank: int, step: int) -> int:
    return sum(sum(b) for b in _sizes(rank, step, 0))


@pytest.mark.asyncio
async def test_an_uneven_end_warns_on_every_rank_naming_what_each_rank_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loaders = make_loaders(3, [_source(0, 6), _source(1, 4), _source(2, 5)])
    with caplog.at_level(logging.WARNING, logger="evenflow"):
        outcomes = await _run(loaders)
    assert outcomes == [4, 4, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # one per rank
    assert len(set(warnings)) == 1
    text = warnings[0]
    assert "The sources of ranks [1] ended at step 4" in text
    rank0 = f"rank 0: {_samples(0, 4)} samples ({_tokens(0, 4)} tokens) read, and 1 further step;"
    rank2 = f"rank 2: {_samples(2, 4)} samples ({_tokens(2, 4)} tokens) read, and 0 further steps"
    assert rank0 in text and rank2 in text
    unread = _samples(0, 4) + _samples(2, 4)
    assert f"{unread} samples in all at this step" in text
    for loader in loaders:
        summary = loader.last_pass
        assert summary is not None and summary.end_reason == "uneven" and summary.steps == 4
        assert summary.uneven is not None and summary.uneven.ended_ranks == (1,)
        assert summary.num_dropped_samples == unread
        assert loader.trace_summary()["pass"]["num_dropped_samples"] == unread
    # Every sample of the four delivered steps was trained on by exactly one rank.
    delivered = sum(ld.last_pass.samples for ld in loaders if ld.last_pass is not None)
    assert delivered == sum(_samples(r, s) for r in range(3) for s in range(4))


@pytest.mark.asyncio
async def test_under_raise_the_error_says_what_was_left() -> None:
    loaders = make_loaders(2, [_source(0, 6), _source(1, 4)], on_uneven_end="raise")
    outcomes = await _run(loaders)
    for outcome in outcomes:
        assert isinstance(outcome, SourceExhaustedError)
        assert "ranks [1] ended at step 4" in str(outcome)
        assert f"rank 0: {_samples(0, 4)} samples" in str(outcome)
        assert "1 further step" in str(outcome)


@pytest.mark.asyncio
async def test_a_source_without_len_reports_its_further_steps_as_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loaders = make_loaders(2, [_Unsized(0, 5), _Unsized(1, 3)])
    with caplog.at_level(logging.WARNING, logger="evenflow"):
        assert await _run(loaders) == [3, 3]
    text = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "rank 0:" in text and "an unknown number of further steps" in text


@pytest.mark.asyncio
async def test_even_ends_limits_and_restarts_are_summarised_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="evenflow"):
        loaders = make_loaders(2, [_source(0, 3), _source(1, 3)])
        assert await _run(loaders) == [3, 3]
        for loader in loaders:
            assert loader.last_pass is not None and loader.last_pass.end_reason == "exhausted"
            assert loader.last_pass.num_dropped_samples == 0
        total = sum(ld.last_pass.samples for ld in loaders if ld.last_pass is not None)
        assert total == sum(_samples(r, s) for r in range(2) for s in range(3))

        limited = make_loaders(2, [_source(0, 6), _source(1, 6)], max_steps=2)
        assert await _run(limited) == [2, 2]
        assert [ld.last_pass.end_reason for ld in limited if ld.last_pass] == ["limit", "limit"]

        restarted = make_loaders(2, [_source(0, 6), _source(1, 6)])

        async def restart(loader: BalancedLoader) -> tuple[str, int]:
            async with loader:
                await loader.__anext__()
                await loader.aset_epoch(1)
                summary = loader.last_pass
                assert summary is not None
                return summary.end_reason, summary.steps

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(restart(ld) for ld in restarted)), DEADLINE
        )
        assert outcomes == [("restart", 1), ("restart", 1)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_dataset_source_report_is_part_of_the_summary() -> None:
    samples = [[1] * (1 + i % 7) for i in range(50)]
    source = DatasetSource(samples, seq_len=16, bins_per_rank=2, seed=3)
    config = LoaderConfig(seq_len=16, bins_per_rank=2, log_stats=False)
    with BalancedLoader(source, config=config, metadata_fn=source.metadata_fn) as loader:
        delivered = sum(len(b["input_ids"][0]) for batch in loader for b in batch)
    summary = loader.last_pass
    assert summary is not None and summary.source == source.report
    assert summary.tokens == delivered
    assert summary.num_dropped_samples == source.report.num_dropped_samples
    assert summary.samples + summary.num_dropped_samples == len(samples)


class _Closing:
    """A re-iterable source whose iterators record that they were closed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.closed: list[int] = []
        self.opened = 0

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        self.opened += 1
        number = self.opened
        try:
            for step in range(10):
                yield id_bins(self.rank, step, _sizes(self.rank, step, 0))
        finally:
            self.closed.append(number)


@pytest.mark.asyncio
async def test_a_pass_that_ends_early_closes_its_source_iterator() -> None:
    sources = [_Closing(0), _Closing(1)]
    loaders = make_loaders(2, sources, max_steps=2)

    async def two_passes(loader: BalancedLoader) -> int:
        n = 0
        async with loader:
            async for _ in loader:
                n += 1
            await loader.aset_epoch(1)
            async for _ in loader:
                n += 1
                break  # the caller leaves mid-pass; close() ends it
        return n

    assert await asyncio.wait_for(
        asyncio.gather(*(two_passes(ld) for ld in loaders)), DEADLINE
    ) == [3, 3]
    for source in sources:
        assert source.opened == 2 and sorted(source.closed) == [1, 2]


class _Steps(torch.utils.data.Dataset[list[list[list[int]]]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[list[list[int]]]:
        return [[[1] * (1 + i % 3)], [[2] * 2]]


def test_dataloader_workers_are_shut_down_when_the_pass_ends() -> None:
    before = set(multiprocessing.active_children())
    source = torch.utils.data.DataLoader(
        _Steps(), batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    config = LoaderConfig(seq_len=8, bins_per_rank=2, max_steps=3, log_stats=False)
    group = InProcessGroup(1, timeout=DEADLINE)
    with BalancedLoader(source, config=config, transport=group.transport(0)) as loader:
        assert len(list(loader)) == 3  # ends at the limit, with steps left in the workers
        lingering = set(multiprocessing.active_children()) - before
    assert not lingering, f"DataLoader workers still alive after the pass: {lingering}"
