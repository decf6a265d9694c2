"""Reading the rank's source: one step of bins, and the metadata of every sample in it.

A sync iterator is advanced on the source executor (its ``next()`` may block on I/O); an
async one on the loop, with the description (the user's ``metadata_fn``) on the CPU executor.
A failure is recorded on the step (stage ``"source"``, or ``"metadata"`` when
``metadata_fn`` raised) so that it is announced to the group like any other. A bin that
breaks the packing constraints (more than ``seq_len`` tokens, or over a packing budget) fails
here, on the rank whose source yielded it, with a message about the source's step and bin;
the planner would only see it later, as a bin of its own input.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleMetadata
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import ConfigError
from evenflow.transports import Prepared, prepare
from evenflow.transports.internal import ThreadInterrupt

__all__ = ["SourceReader"]

logger = logging.getLogger("evenflow")

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
        prepare_payloads: bool = False,
        constraints: PackingConstraints | None = None,
        close_timeout: float = 10.0,
    ) -> None:
        self._close_timeout = close_timeout
        self._source = source
        self._constraints = constraints
        # Payload mode on a group: each sample is prepared for the wire when it is read, so
        # its frame size can travel in the metadata round (and an unencodable sample fails
        # here, announced like any read error, before any size is announced).
        self._prepare = prepare_payloads
        self._metadata_fn = metadata_fn
        self._bins_per_rank = bins_per_rank
        self._cpu = cpu_executor
        self._source_executor = source_executor
        self._iter: Iterator[Any] | AsyncIterator[Any] | None = initial_iter
        self._in_flight: concurrent.futures.Future[Any] | None = None  # on the source thread

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
                described = await loop.run_in_executor(self._cpu, self._describe, raw, state)
                state.source_state = self._source_state()
                if self._prepare:
                    state.prepared = await loop.run_in_executor(
                        self._cpu, _prepared, described[0], state
                    )
            else:
                result = await self._on_source_thread(functools.partial(self._read_sync, state))
                if result is None:
                    state.status, state.end_reason = "end", "exhausted"
                    return state
                described, state.source_state, state.prepared, state.indices = result[:4]
                state.transform = result[4]
            state.samples, state.sizes, state.metas = described
            state.steps_left = self._steps_left(step)
        except Exception as exc:
            state.status = "error"
            state.fail("source", exc)  # unless a part of the read (metadata, exchange) said so
        except BaseException as exc:
            # An async source runs on this loop: what it raises beyond Exception must not end
            # the pass as if the data had ended (a CancelledError) or kill the loop (a
            # KeyboardInterrupt). Only the cancellation of this very task passes through.
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise
            state.status = "error"
            state.fail("source", ThreadInterrupt(exc))
        return state

    async def position(self) -> Any:
        """The source's ``state_dict()`` before the pass's first read (``None`` without one
        or when it fails there): where a restore in the pass's first balance window starts."""
        try:
            return await self._on_source_thread(self._source_state)
        except Exception:
            return None

    async def aclose(self) -> None:
        """Release the pass's iterator: a generator is closed (its ``finally`` blocks run) and
        the reference dropped, which is what shuts down a ``DataLoader`` iterator's worker
        processes. A sync iterator is closed on the source executor, after any ``next()``
        still in flight there; an async one on the loop."""
        it, self._iter = self._iter, None
        if it is None:
            return
        if isinstance(it, AsyncIterator):
            aclose = getattr(it, "aclose", None)
            if callable(aclose):
                # e.g. still running: it ends with the loop; a clean-up stuck in user code is
                # left behind after close_timeout, like a stuck thread.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._close_timeout):
                        await aclose()
            return
        # The iterator travels in a list that the close empties, so that the last reference
        # (which shuts down a DataLoader's workers) is dropped inside the close itself.
        held, in_flight = [it], self._in_flight
        idle = in_flight is None or in_flight.done()
        del it, in_flight  # a finished open's future holds the iterator as its result
        self._in_flight = None
        try:
            closing = self._source_executor.submit(_close_iterator, held)
        except RuntimeError:  # the executor is shut down: no next() can be in flight
            _close_iterator(held)
            return
        if idle:
            # Nothing runs before it on the source thread: wait, so that the pass's
            # resources (worker processes, files) are released when the pass ends. A
            # next() still in flight (abandoned by drain or close) may block for good, so
            # then the close runs after it returns, without waiting; a clean-up that blocks
            # is waited for at most close_timeout.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(closing), self._close_timeout)

    async def _open_source(self) -> Iterator[Any] | AsyncIterator[Any]:
        if hasattr(self._source, "__aiter__"):
            return self._source.__aiter__()  # type: ignore[no-any-return]
        return await self._on_source_thread(functools.partial(iter, self._source))  # type: ignore[no-any-return]

    async def _on_source_thread(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` on the source executor; what is in flight there is remembered, since
        it keeps running when the awaiting stage is cancelled."""
        future = self._source_executor.submit(work)
        self._in_flight = future
        return await asyncio.wrap_future(future)

    def _steps_left(self, step: int) -> int | None:
        """Steps the source still has after ``step``, where it knows its length (reported to
        the group so that an uneven end can say what it leaves unread)."""
        try:
            size = len(self._source)
        except Exception:  # no __len__, or one that cannot answer
            return None
        return max(int(size) - step - 1, 0)

    def _source_state(self) -> Any:
        state_dict = getattr(self._source, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _read_sync(
        self, state: StepState
    ) -> tuple[Described, Any, list[Prepared] | None, Any, Any] | None:
        assert isinstance(self._iter, Iterator)
        try:
            raw = next(self._iter)
        except StopIteration:
            return None
        # Right after next(), on the same thread: the indices of the step just read and
        # the transform work its read did.
        indices = self._last_indices()
        last_transform = getattr(self._source, "last_read_transform", None)
        transform = last_transform() if callable(last_transform) else None
        described = self._describe(raw, state)
        prepared = _prepared(described[0], state) if self._prepare else None
        return described, self._source_state(), prepared, indices, transform

    def _last_indices(self) -> Any:
        last = getattr(self._source, "last_read_indices", None)
        if not callable(last):
            return None
        indices = last()
        return None if indices is None else np.asarray(indices, dtype=np.int64)

    def _describe(self, raw: Any, state: StepState) -> Described:
        """The step's samples (bin after bin, the objects themselves), bin sizes, metadata (a
        failure of ``metadata_fn`` is recorded on ``state`` as the ``metadata`` stage's)."""
        step = state.step
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
        with state.failing("metadata"):
            metas = [self._describe_sample(sample) for sample in samples]
        sizes = list(map(len, bins))
        self._check_bins(step, sizes, metas)
        return samples, sizes, metas

    def _check_bins(self, step: int, sizes: list[int], metas: list[SampleMetadata]) -> None:
        """Raise a ConfigError naming the source's step and bin when a bin cannot be packed."""
        c = self._constraints
        if c is None:
            return
        budgets = c.budgets
        start = 0
        for b, size in enumerate(sizes):
            members = metas[start : start + size]
            start += size
            tokens = sum(m.tokens for m in members)
            where = f"Source step {step}, bin {b}"
            if tokens > c.seq_len and not (size == 1 and c.oversized_policy == "single"):
                if size == 1:
                    fix = (
                        "drop or split such samples in the source, or set "
                        "LoaderConfig.oversized_policy='single' if pack_fn accepts a sample "
                        "longer than seq_len alone in its bin"
                    )
                else:
                    fix = (
                        "the source must pack each bin within seq_len (DatasetSource and "
                        "IterableSource do), or raise LoaderConfig.seq_len"
                    )
                raise ConfigError(
                    f"{where} holds {tokens} tokens in {size} sample(s), more than "
                    f"seq_len={c.seq_len}; {fix}."
                )
            for name, budget in budgets.items():
                total = 0.0
                for m in members:  # sample by sample, in bin order, as the planner adds
                    total += m.packing_costs.get(name, 0.0)
                if total > budget:
                    raise ConfigError(
                        f"{where} has packing_costs[{name!r}] summing to {total!r}, over "
                        f"packing_budgets[{name!r}]={budget!r}; the source must pack each bin "
                        "within the packing budgets, or raise the budget."
                    )

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


def _prepared(samples: list[Any], state: StepState) -> list[Prepared]:
    """Every sample measured for the wire; an unencodable one fails the exchange stage."""
    with state.failing("exchange"):
        return [prepare(sample) for sample in samples]


def _close_iterator(held: list[Iterator[Any]]) -> None:
    it = held.pop()
    close = getattr(it, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # the source's own clean-up failed: the pass is over anyway
            logger.warning("Closing the source iterator raised; continuing.", exc_info=True)
    del it, close  # the last references: a DataLoader iterator shuts its workers down here
