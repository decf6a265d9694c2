"""Reading the rank's source: one step of bins, and the metadata of every sample in it.

A sync iterator is advanced on the source executor (its ``next()`` may block on I/O); an
async one on the loop, with the description (the user's ``metadata_fn``) on the CPU executor.
A failure is recorded on the step (stage ``"source"``, or ``"metadata"`` when
``metadata_fn`` raised) so that it is announced to the group like any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from evenflow.engine._model import SampleMetadata
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import ConfigError

__all__ = ["SourceReader"]

Described = tuple[list[Any], list[int], list[SampleMetadata]]


class SourceReader:
    """Reads steps from ``source`` (opened on the first read unless ``initial_iter`` is given)."""

    def __init__(
        self,
        *,
        source: Any,
        metadata_fn: Callable[[Any], Any],
        bins_per_rank: int,
        cpu_executor: concurrent.futures.Executor,
        source_executor: concurrent.futures.Executor,
        initial_iter: Iterator[Any] | None = None,
    ) -> None:
        self._source = source
        self._metadata_fn = metadata_fn
        self._bins_per_rank = bins_per_rank
        self._cpu = cpu_executor
        self._source_executor = source_executor
        self._iter: Iterator[Any] | AsyncIterator[Any] | None = initial_iter

    async def read(self, step: int) -> StepState:
        """The next step of the source: ``ok`` with its samples, ``end``, or ``error``."""
        state = StepState(step)
        try:
            if self._iter is None:
                self._iter = await self._open_source()
            if isinstance(self._iter, AsyncIterator):
                try:
                    raw = await self._iter.__anext__()
                except StopAsyncIteration:
                    state.status, state.end_reason = "end", "exhausted"
                    return state
                loop = asyncio.get_running_loop()
                described = await loop.run_in_executor(self._cpu, self._describe, raw)
                state.source_state = self._source_state()
            else:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._source_executor, self._read_sync)
                if result is None:
                    state.status, state.end_reason = "end", "exhausted"
                    return state
                described, state.source_state = result
            state.samples, state.sizes, state.metas = described
        except Exception as exc:
            state.status = "error"
            state.fail(getattr(exc, "_evenflow_stage", "source"), exc)
        return state

    async def _open_source(self) -> Iterator[Any] | AsyncIterator[Any]:
        if hasattr(self._source, "__aiter__"):
            return self._source.__aiter__()  # type: ignore[no-any-return]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._source_executor, iter, self._source)

    def _source_state(self) -> Any:
        state_dict = getattr(self._source, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _read_sync(self) -> tuple[Described, Any] | None:
        assert isinstance(self._iter, Iterator)
        try:
            raw = next(self._iter)
        except StopIteration:
            return None
        described = self._describe(raw)
        return described, self._source_state()

    def _describe(self, raw: Any) -> Described:
        """The step's samples (bin after bin, the objects themselves), bin sizes, metadata."""
        n = self._bins_per_rank
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__len__") or len(raw) != n:
            got = len(raw) if hasattr(raw, "__len__") else type(raw).__name__
            raise ConfigError(
                f"Each source step must be a sequence of bins_per_rank={n} bins, but got {got}. "
                "Make the source yield one list of bins (each a list of samples) per step."
            )
        for i, b in enumerate(raw):
            if isinstance(b, (str, bytes, bytearray, Mapping)) or not hasattr(b, "__len__"):
                raise ConfigError(
                    f"Source step bin {i} must be a sequence of samples, but got "
                    f"{type(b).__name__}. A step is a list of bins_per_rank bins, each a list "
                    "of samples; did the source skip the bin level?"
                )
        bins = [list(b) for b in raw]
        for i, b in enumerate(bins):
            if not b:
                raise ConfigError(
                    f"Source step bin {i} is empty; every bin must hold at least one sample "
                    "(the plan keeps bins_per_rank non-empty bins per rank)."
                )
        samples = list(itertools.chain.from_iterable(bins))
        try:
            metas = [self._describe_sample(sample) for sample in samples]
        except Exception as exc:
            exc._evenflow_stage = "metadata"  # type: ignore[attr-defined]
            raise
        return samples, list(map(len, bins)), metas

    def _describe_sample(self, sample: Any) -> SampleMetadata:
        meta = self._metadata_fn(sample)
        if isinstance(meta, SampleMetadata):
            return meta
        if isinstance(meta, int) and not isinstance(meta, bool):
            return SampleMetadata(tokens=meta)
        raise TypeError(
            f"metadata_fn must return a SampleMetadata or an int token count, but returned "
            f"{meta!r:.80} ({type(meta).__name__})."
        )
