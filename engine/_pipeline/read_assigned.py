"""Shared-dataset mode: each rank reads the samples the plan assigned to it, by dataset index.

When every rank of a balance group reads the same map-style dataset, moving samples between
ranks is wasted work: a rank can read any sample itself. The source then yields
:class:`~evenflow.engine.IndexedSample` items (index and token count, no payload), each
rank's metadata message carries the dataset indices of its step (``indices``), the plan
assigns them like any samples, and the *read_assigned* stage — in place of the exchange —
reads this rank's planned samples with ``source.read(indices)`` on a bounded thread pool.
The exchange collective is skipped on every rank alike (all ranks are in shared mode, which
the first metadata round checks), so no payload byte crosses the network.

Reading happens one step at a time inside the pipeline, ``prefetch_depth`` steps ahead of the
caller, so it overlaps with training like the exchange it replaces. A read that fails is
recorded on the step and announced in the next metadata round, so every rank fails at the
same step; the error names the dataset index.

The stage (:class:`AssignedStage`) needs from the step its ``routes`` and ``messages`` (or its
window's), and adds ``received`` (``{key: sample}`` for every key of this rank's bins) and
``transform`` (the source's transform work for them, if it has a transform); a
failed read is recorded on the step (stage ``read_assigned``), nothing is raised.

**Agreement.** Every rank must see the same dataset: the same length and the same length
column (its fingerprint). ``build_loader`` compares them at build time; a loader built
directly compares them in its first metadata round. Either way every rank raises the same
``GroupMismatchError`` naming the first rank that differs and what differs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from evenflow.engine._pipeline.progress import Progress
from evenflow.engine._pipeline.routes import RankRoutes
from evenflow.engine._pipeline.sequencer import Sequencer
from evenflow.engine._pipeline.step import StepState
from evenflow.engine.errors import GroupMismatchError, TransformWorkerError

__all__ = [
    "AssignedReader",
    "AssignedStage",
    "dataset_mismatch",
    "shared_identity",
    "shared_source",
]

KeyTuple = tuple[int, int, int]


def shared_source(source: Any) -> Any:
    """``source`` when it declares shared-dataset mode (``shared`` is true and it can
    ``read(indices)``), else ``None``."""
    if getattr(source, "shared", False) is True and callable(getattr(source, "read", None)):
        return source
    return None


def shared_identity(source: Any) -> dict[str, Any] | None:
    """The dataset identity every rank of a shared-dataset group must agree on (``None`` in
    payload mode): the source's ``dataset_identity()``."""
    shared = shared_source(source)
    if shared is None:
        return None
    identity = shared.dataset_identity()
    return {"shared": True, **identity}


def dataset_mismatch(
    identities: Sequence[Any], global_ranks: Sequence[int], *, where: str
) -> GroupMismatchError | None:
    """The error naming the first rank whose dataset identity differs from the first rank's
    (``None`` when all agree). ``None`` entries are ranks in payload mode."""
    reference = identities[0]
    for rank, identity in enumerate(identities):
        if identity == reference:
            continue
        if reference is None or identity is None:
            shared = rank if identity is not None else 0
            payload = 0 if shared == rank else rank
            what = (
                f"rank {global_ranks[shared]} reads a shared dataset (DatasetSource(shared=True)) "
                f"but rank {global_ranks[payload]} does not"
            )
        else:
            names = {*identity, *reference}
            fields = sorted(k for k in names if identity.get(k) != reference.get(k))
            what = "; ".join(
                f"{name} is {identity.get(name)!r} on rank {global_ranks[rank]} but "
                f"{reference.get(name)!r} on rank {global_ranks[0]}"
                for name in fields
            )
        return GroupMismatchError(
            f"{where}: rank {global_ranks[rank]} sees a different dataset than rank "
            f"{global_ranks[0]}: {what}. In shared-dataset mode every rank of a balance group "
            "must read the same dataset (same samples, same lengths); give every rank the "
            "same dataset, or use shared=False so that each rank's samples travel to the rank "
            "that packs them."
        )
    return None


class AssignedReader:
    """Reads one step's planned samples of this rank from a shared source.

    ``executor`` is the bounded pool the reads run on (owned by the loader); a step's
    indices are split into at most ``threads`` contiguous chunks, one ``source.read`` call
    each, so a dataset with ``__getitems__`` is asked once per chunk.
    """

    def __init__(self, source: Any, executor: concurrent.futures.Executor, *, threads: int) -> None:
        self._source = source
        self._executor = executor
        self._threads = max(1, threads)
        #: The transform work of the last :meth:`read` (a ``StepTransform``, or ``None``
        #: when the source has no transform); read it right after the read returns.
        self.last_transform: Any = None

    async def read(
        self, step: int, routes: RankRoutes, messages: Mapping[int, Sequence[dict[str, Any]]]
    ) -> dict[Hashable, Any]:
        """``{key: sample}`` for every key of this rank's planned bins; ``messages[s]`` holds
        every rank's metadata message of step ``s``, for each step ``s`` a key names (the
        step itself, or any step of its balance window)."""
        keys = [key for keys in routes.bins for key in keys]
        columns = {
            s: [np.asarray(m["indices"], dtype=np.int64) for m in msgs]
            for s, msgs in messages.items()
        }
        indices = [int(columns[key[1]][key[0]][key[2]]) for key in keys]
        # At least ~16 samples per call: a thread hop costs more than a tiny read.
        chunks = max(1, min(self._threads, len(indices) // 16))
        bounds = np.linspace(0, len(indices), chunks + 1).astype(int).tolist()
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._executor, self._read_chunk, step, indices[a:b])
                for a, b in itertools.pairwise(bounds)
            )
        )
        samples = [sample for part, _ in parts for sample in part]
        work = [figure for _, figure in parts if figure is not None]
        self.last_transform = sum(work[1:], work[0]) if work else None
        return dict(zip(keys, samples, strict=True))

    def _read_chunk(self, step: int, indices: list[int]) -> tuple[list[Any], Any]:
        """A chunk's samples, and (right after the read, on its thread) the transform work
        the source did for them."""
        try:
            samples = list(self._source.read(indices))
            if len(samples) != len(indices):
                raise ValueError(
                    f"read({len(indices)} indices) returned {len(samples)} samples; it must "
                    "return one sample per index, in order."
                )
            last_transform = getattr(self._source, "last_read_transform", None)
            return samples, last_transform() if callable(last_transform) else None
        except TransformWorkerError:
            raise  # names its indices; reading them again would restart the workers
        except Exception:
            # Find the index that fails, so that the error names it (error path only).
            for index in indices:
                try:
                    self._source.read([index])
                except Exception as exc:
                    raise RuntimeError(
                        f"Reading dataset index {index} (assigned to this rank at step {step} "
                        f"in shared-dataset mode) failed: {type(exc).__name__}: {exc}"
                    ) from exc
            raise


class AssignedStage:
    """The exchange stage of shared-dataset mode: take the exchange turn without a collective
    (every rank is in shared mode), then read this rank's planned samples by dataset index
    (none for a step delivered before a restore)."""

    def __init__(self, *, reader: AssignedReader, sequencer: Sequencer, progress: Progress) -> None:
        self._reader = reader
        self._sequencer = sequencer
        self._progress = progress

    async def run(self, state: StepState) -> None:
        if state.terminal:
            return
        if state.skip:
            await self._sequencer.turn(state.step, "exchange")
            await self._sequencer.advance(state.step, "exchange")
            return
        await self._sequencer.turn(state.step, "exchange")
        self._progress.exchanged_step = state.step
        self._progress.notify()
        await self._sequencer.advance(state.step, "exchange")
        if state.error is not None or state.routes is None or state.messages is None:
            return
        try:
            messages = state.step_messages()
            state.received = await self._reader.read(state.step, state.routes, messages)
            state.transform = self._reader.last_transform
        except Exception as exc:
            state.fail("read_assigned", exc)
