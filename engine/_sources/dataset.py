"""``DatasetSource``: steps from a map-style dataset, sharded across ranks without communication.

Every epoch is planned the same way on every rank, from the lengths alone:

1. the dataset indices (without the oversized ones under ``oversized="drop"``) are permuted
   with a generator seeded by ``(seed, epoch)`` (or kept in order with ``shuffle=False``);
2. the permuted lengths are packed into *units* of ``bins_per_rank`` bins (see ``packing``);
3. unit ``u`` goes to rank ``u % num_ranks`` as its step ``u // num_ranks``.

So every rank knows every rank's steps, the shards are disjoint, and every rank has the same
number of steps per epoch, ``num_units // num_ranks``. The position is global (the consumed
units are a prefix of the epoch's), so a state restores onto any number of ranks: the rest of
the epoch is dealt to the new ranks (see ``elastic``). What the epoch leaves unread is the
packer's remainder (less than one unit) plus the last ``num_units % num_ranks`` units (fewer
than ``num_ranks``): at most about ``num_ranks * bins_per_rank`` bins' worth of samples, counted
in :attr:`DatasetSource.report` and logged at INFO when an epoch is planned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.engine._model import SampleMetadata
from evenflow.engine._sources._common import (
    IndexedSample,
    LengthMemo,
    LoaderBinding,
    SourceReport,
    check_oversized,
)
from evenflow.engine._sources._lengths import default_length, fingerprint, read_lengths
from evenflow.engine._sources.elastic import Dealing
from evenflow.engine._sources.packing import PackedSteps, StepPacker, pack_lengths
from evenflow.engine._sources.transform_pool import Ticket
from evenflow.engine._sources.transforms import SampleTransforms, TransformWorkers
from evenflow.engine._validate import check_bool, check_int
from evenflow.engine.errors import ConfigError, ResumeError

__all__ = ["DatasetSource"]

logger = logging.getLogger("evenflow")

STATE_FORMAT = "evenflow.DatasetSource"
STATE_VERSION = 2


@dataclass(frozen=True)
class _Epoch:
    epoch: int
    order: npt.NDArray[np.int64]  # dataset indices in stream order
    packed: PackedSteps
    dealing: Dealing
    num_steps: int
    report: SourceReport


class DatasetSource(TransformWorkers):
    """Steps of ``bins_per_rank`` bins of ``seq_len`` tokens from a map-style dataset.

    ``dataset``: anything with ``__len__`` and ``__getitem__`` (a list, a
    ``torch.utils.data.Dataset``, a Hugging Face ``datasets.Dataset``); samples are fetched
    with ``dataset.__getitems__(indices)`` when it exists (one call per step), else one
    ``dataset[i]`` each. Lengths: ``lengths``, ``length_column`` or ``length_fn`` (at most
    one; see the reference for the defaults), read once when the source is built.

    ``rank`` / ``num_ranks``: this rank's position among the data-parallel ranks that share
    the dataset. Without them the source is single-rank, unless ``torch.distributed`` is
    initialised: then they are required (the data-parallel rank is not the global rank under
    tensor or pipeline parallelism, and a wrong guess would silently duplicate data).

    ``yield_indices=True`` yields :class:`IndexedSample` ``(index, tokens)`` items instead of
    samples; :meth:`read` fetches samples by index.

    ``shared=True`` declares that every rank of the balance group reads this same dataset
    (shared storage, or the same Hugging Face dataset on every node): the source yields
    :class:`IndexedSample` items, the loader plans dataset indices, and each rank reads the
    samples assigned to it with :meth:`read` on ``read_threads`` threads after planning, so
    no payload crosses the network (``read`` then runs on several threads at once: the
    dataset must allow concurrent reads, or pass ``read_threads=1``). The loader refuses a
    group whose ranks see different datasets (:meth:`dataset_identity`).

    ``transform``: a per-sample function called as ``transform(sample, rng)`` after the read,
    whose result is the sample the loader plans and packs; ``rng`` is a
    ``numpy.random.Generator`` seeded by ``(seed, epoch, dataset index)`` only, so a sample
    is transformed identically on any rank, worker or step. The lengths (``lengths``,
    ``length_column``, ``length_fn``) must be the token counts of the *transformed* samples:
    they plan the step before any transform runs. ``transform_workers=N`` runs the read and
    the transform in ``N`` worker processes (started with ``spawn`` on the first read,
    reused until the loader closes; ``transform`` and ``dataset`` must be picklable, the
    transform a module-level function); ``0`` runs them on the loader's threads. In payload
    mode a step is transformed on the rank that reads it, before its metadata round (the
    moved samples carry transformed payloads); in shared-dataset mode each rank transforms
    only the samples the plan assigned to it. See the how-to "Heavy transforms".

    Its state is global: the same on every rank at the same step, and restorable onto a
    different number of ranks (the rest of the epoch is dealt to them).
    """

    #: The state is the same on every rank at the same step (see ``elastic``).
    global_position = True

    def __init__(
        self,
        dataset: Any,
        *,
        seq_len: int | None = None,
        bins_per_rank: int | None = None,
        rank: int | None = None,
        num_ranks: int | None = None,
        lengths: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
        length_column: str | None = None,
        length_fn: Callable[[Any], int] | None = None,
        packer: str = "first_fit",
        buffer_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        oversized: str = "error",
        yield_indices: bool = False,
        features_fn: Callable[[Any], dict[str, Any]] | None = None,
        shared: bool = False,
        read_threads: int = 4,
        transform: Callable[[Any, np.random.Generator], Any] | None = None,
        transform_workers: int = 0,
    ) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                f"dataset must be map-style (with __len__ and __getitem__), but got "
                f"{type(dataset).__name__}; wrap an iterable in IterableSource instead."
            )
        # The packer validates seq_len, bins_per_rank, packer and buffer_tokens (with stand-in
        # values for what the loader will give).
        StepPacker(
            seq_len=1 if seq_len is None else seq_len,
            bins_per_rank=1 if bins_per_rank is None else bins_per_rank,
            packer=packer,
            buffer_tokens=buffer_tokens,
        )
        _check_ranks(rank, num_ranks)
        self._binding = LoaderBinding(
            "DatasetSource",
            seq_len=seq_len,
            bins_per_rank=bins_per_rank,
            rank=rank,
            num_ranks=num_ranks,
        )
        self._packer, self._buffer_tokens = packer, buffer_tokens
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_int("seed", seed, minimum=0)
        self._oversized = check_oversized(oversized)
        self._shared = check_bool("shared", shared)
        self._read_threads = check_int("read_threads", read_threads, minimum=1)
        # Shared mode plans indices: the samples are read only once they are assigned.
        self._yield_indices = check_bool("yield_indices", yield_indices) or self._shared
        if features_fn is not None and not callable(features_fn):
            raise TypeError(f"features_fn must be callable, but got {features_fn!r:.80}.")
        if features_fn is not None and self._yield_indices:
            raise ConfigError(
                "features_fn needs each sample's content, but with shared=True or "
                "yield_indices=True the source yields dataset indices and reads samples only "
                "after planning. Store the features in a dataset column and give the planner "
                "token counts only, or use shared=False."
            )
        self._dataset = dataset
        self._transforms = SampleTransforms(
            dataset,
            transform,
            workers=check_int("transform_workers", transform_workers, minimum=0),
            seed=self._seed,
        )
        self._lengths = read_lengths(
            dataset, lengths=lengths, length_column=length_column, length_fn=length_fn
        )
        self._lengths.flags.writeable = False
        self._fingerprint = fingerprint(self._lengths)
        self._eligible: npt.NDArray[np.int64] | None = None
        measure = length_fn if length_fn is not None else default_length
        if length_column is not None:
            measure = _column_measure(length_column)
        self._memo = LengthMemo(measure, features_fn)
        self._epoch = 0
        self._step = 0  # steps yielded in the current epoch
        self._start = 0  # where the next iter() starts (set by load_state_dict)
        self._dealing: Dealing | None = None  # set by an elastic restore, for its epoch only
        self._plan: _Epoch | None = None
        self._last_read: npt.NDArray[np.int64] | None = None
        if seq_len is not None:
            self._check_lengths(seq_len)  # as early as possible

    # -- the loader's values -------------------------------------------------------------

    def bind_loader(
        self, *, seq_len: int, bins_per_rank: int, rank: int | None, num_ranks: int | None
    ) -> ConfigError | None:
        """Called by the loader that reads this source: its ``seq_len`` and ``bins_per_rank``
        and this rank's place among the data-parallel ranks. Values given to the source that
        disagree are refused: the error is returned, and raised by every later use."""
        refusal = self._binding.bind(
            seq_len=seq_len, bins_per_rank=bins_per_rank, rank=rank, num_ranks=num_ranks
        )
        if refusal is None:
            self._check_lengths(seq_len)
            self._plan = None
        return refusal

    def _check_lengths(self, seq_len: int) -> None:
        oversized_at = np.flatnonzero(self._lengths > seq_len)
        if oversized_at.size and self._oversized == "error":
            i = int(oversized_at[0])
            raise ConfigError(
                f"Dataset index {i} has {int(self._lengths[i])} tokens, more than seq_len="
                f"{seq_len} ({oversized_at.size} such samples). Pass oversized='drop' to skip "
                "them (counted in the report), oversized='single' to give each a bin alone "
                "(with LoaderConfig.oversized_policy='single'), or filter the dataset."
            )
        keep = self._lengths <= seq_len if self._oversized == "drop" else None
        self._eligible = (
            np.arange(len(self._lengths), dtype=np.int64) if keep is None else np.flatnonzero(keep)
        )

    @property
    def _seq_len(self) -> int:
        return self._binding.require("seq_len")

    @property
    def _bins_per_rank(self) -> int:
        return self._binding.require("bins_per_rank")

    @property
    def _rank(self) -> int:
        return self._ranks()[0]

    @property
    def _num_ranks(self) -> int:
        return self._ranks()[1]

    def _ranks(self) -> tuple[int, int]:
        binding = self._binding
        if binding.refusal is not None:
            raise binding.refusal
        rank, num_ranks = binding.values["rank"], binding.values["num_ranks"]
        if rank is None or num_ranks is None:
            return _resolve_ranks(None, None)
        return rank, num_ranks

    # -- what every rank can compute -----------------------------------------------------

    @property
    def dataset(self) -> Any:
        return self._dataset

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """The token count of every dataset index (read-only)."""
        return self._lengths

    @property
    def fingerprint(self) -> str:
        """Digest of :attr:`lengths`: ranks that read the same dataset have the same one."""
        return self._fingerprint

    @property
    def shared(self) -> bool:
        """Whether every rank of the balance group reads this dataset (shared-dataset mode)."""
        return self._shared

    @property
    def read_threads(self) -> int:
        """Threads that read a rank's assigned samples in shared-dataset mode."""
        return self._read_threads

    def dataset_identity(self) -> dict[str, Any]:
        """What every rank of a shared-dataset group must agree on: the dataset's length and
        the fingerprint of its length column (plain data)."""
        return {"num_samples": len(self._lengths), "lengths_fingerprint": self._fingerprint}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_ranks(self) -> int:
        return self._num_ranks

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Steps yielded so far in the current epoch."""
        return self._step

    @property
    def report(self) -> SourceReport:
        """The current epoch's step count and what it leaves unread (all ranks together)."""
        return self._epoch_plan().report

    def __len__(self) -> int:
        """Steps per rank in the current epoch (the same on every rank)."""
        return self._epoch_plan().num_steps

    def step_indices(self, step: int, *, rank: int | None = None) -> list[npt.NDArray[np.int64]]:
        """The dataset indices of ``rank``'s (default: this rank's) step ``step``, per bin."""
        plan = self._epoch_plan()
        rank = self._rank if rank is None else check_int("rank", rank, minimum=0)
        if rank >= self._num_ranks:
            raise ConfigError(f"rank must be < num_ranks={self._num_ranks}, but got {rank}.")
        if not 0 <= check_int("step", step) < plan.num_steps:
            raise ConfigError(
                f"step must be < {plan.num_steps} (steps in epoch {plan.epoch}), but got {step}."
            )
        if step < plan.dealing.base_step:
            raise ConfigError(
                f"step {step} comes before the position this source was restored at (step "
                f"{plan.dealing.base_step}, on {plan.dealing.num_ranks} ranks before)."
            )
        unit = plan.dealing.unit(step, rank)
        return [plan.order[positions] for positions in plan.packed.step(unit)]

    def read(self, indices: Sequence[int], *, epoch: int | None = None) -> list[Any]:
        """The samples at ``indices`` (one ``__getitems__`` call where the dataset has it),
        transformed when the source has a ``transform`` (with the random state of ``epoch``,
        default the current one), in the worker processes when it has any.

        An error the dataset or the transform raises keeps its type and message and gains a
        note naming the dataset index (or, for one ``__getitems__`` call, the indices) it
        was reading; from a worker it also keeps the worker's traceback as a note. A worker
        that dies or hangs past ``LoaderConfig.timeout`` raises ``TransformWorkerError``."""
        return self._transforms.read(indices, self._epoch if epoch is None else epoch)

    def last_read_indices(self) -> npt.NDArray[np.int64] | None:
        """The dataset indices of the step the iterator yielded last, in sample order (the
        loader sends them with the step's metadata, so errors name samples by index)."""
        return self._last_read

    def metadata_fn(self, sample: Any) -> SampleMetadata:
        """The ``metadata_fn`` for a ``BalancedLoader`` over this source: the token count the
        source already knows (plus ``features_fn(sample)`` as features, when given)."""
        return self._memo.metadata(sample)

    # -- iteration and position ----------------------------------------------------------

    def __iter__(self) -> Iterator[list[list[Any]]]:
        """The current epoch's steps for this rank, from step 0 — or from the position
        :meth:`load_state_dict` restored. Iterating again replays the epoch; call
        :meth:`set_epoch` for the next one."""
        if self._binding.refusal is not None:
            raise self._binding.refusal
        plan = self._epoch_plan()
        if plan.num_steps == 0:
            raise ConfigError(
                f"The dataset has {len(self._lengths)} samples ({int(self._lengths.sum())} "
                f"tokens): not one step for each of num_ranks={self._num_ranks} ranks "
                f"(bins_per_rank={self._bins_per_rank} bins of seq_len={self._seq_len}). Use "
                "a larger dataset, fewer ranks, or smaller steps."
            )
        start, self._start = self._start, 0
        self._step = start
        return self._steps(plan, start)

    def _steps(self, plan: _Epoch, start: int) -> Iterator[list[list[Any]]]:
        ahead: dict[int, Ticket] = {}  # steps submitted to the transform workers
        self._transforms.start_pass()
        try:
            yield from self._step_items(plan, start, ahead)
        finally:
            self._transforms.drop(ahead)
            self._transforms.warn_if_bottleneck(plan.epoch, self._rank)

    def _step_items(
        self, plan: _Epoch, start: int, ahead: dict[int, Ticket]
    ) -> Iterator[list[list[Any]]]:
        # With workers in payload mode, the next steps' samples are submitted before this
        # one is collected, so the workers are never idle while the loader plans and packs
        # (2 steps per worker ahead, as DataLoader's prefetch_factor=2).
        lookahead = 2 * self._transforms.workers if not self._yield_indices else 0
        for step in range(start, plan.num_steps):
            bins = self.step_indices(step)
            sizes = [len(b) for b in bins]
            flat = np.concatenate(bins)
            self._last_read = flat
            tokens = self._lengths[flat].tolist()
            if self._yield_indices:
                items: list[Any] = [
                    IndexedSample(i, n) for i, n in zip(flat.tolist(), tokens, strict=True)
                ]
            elif lookahead:
                later = [
                    np.concatenate(self.step_indices(s)).tolist() if s not in ahead else []
                    for s in range(step, min(step + 1 + lookahead, plan.num_steps))
                ]
                items = self._transforms.read_ahead(step, later, ahead, plan.epoch)
                self._memo.remember(items, tokens)
            else:
                items = self.read(flat.tolist(), epoch=plan.epoch)
                self._memo.remember(items, tokens)
            out, at = [], 0
            for size in sizes:
                out.append(items[at : at + size])
                at += size
            self._step = step + 1
            yield out

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` (its own permutation); the next iteration starts at step 0."""
        self._epoch = check_int("epoch", epoch)
        self._step = self._start = 0
        self._dealing = None

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, steps yielded, how the epoch is dealt) and what must match on
        restore (plain data). It holds nothing about this rank: every rank at the same step
        has the same state."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "dealing": self._epoch_plan().dealing.to_state(),
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position: the next iteration yields the steps after it, bitwise
        the same (the epoch's packing is recomputed from the lengths and the seed).

        A state saved with a different ``num_ranks`` (any rank's: they are all the same) is
        restored elastically: the units of the epoch not yet consumed are dealt to this
        source's ranks, each exactly once, and step numbers continue at the saved step."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ResumeError(
                f"A DatasetSource state must be the dict its state_dict() returned, but got "
                f"{state!r:.120}."
            )
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ResumeError(
                f"The state has version {version!r}; this evenflow reads versions 1 and "
                f"{STATE_VERSION}."
            )
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ResumeError(
                    f"The state was saved with {key}={state.get(key)!r}, but this source has "
                    f"{key}={value!r}; restore with the same dataset, seed, ranks and packing."
                )
        epoch, step = state.get("epoch"), state.get("step")
        for name, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResumeError(f"state[{name!r}] must be a non-negative integer, got {value!r}.")
        assert isinstance(epoch, int) and isinstance(step, int)
        self.set_epoch(epoch)
        plan = self._epoch_plan()
        num_units = plan.packed.num_steps
        if version == 1:  # saved before elastic restores existed: one dealing per epoch
            ranks = check_int("state['num_ranks']", state.get("num_ranks"), minimum=1)
            saved = Dealing(0, 0, ranks)
        else:
            saved = Dealing.from_state(state.get("dealing") or {}, num_units)
        if not saved.base_step <= step <= saved.num_steps(num_units):
            raise ResumeError(
                f"The state is at step {step}, beyond the {saved.num_steps(num_units)} steps of "
                f"epoch {epoch} (or before its restored position)."
            )
        dealing = saved.rebase(step, self._num_ranks)
        if dealing != plan.dealing:
            self._dealing = dealing
            self._plan = None
        self._step = self._start = step

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self._seed,
            "num_samples": len(self._lengths),
            "lengths_fingerprint": self._fingerprint,
            "packing": {
                "seq_len": self._seq_len,
                "bins_per_rank": self._bins_per_rank,
                "packer": self._packer,
                "buffer_tokens": self._buffer_tokens,
                "oversized": self._oversized,
                "shuffle": self._shuffle,
            },
        }

    # -- planning ------------------------------------------------------------------------

    def _epoch_plan(self) -> _Epoch:
        plan = self._plan
        dealing = self._dealing or Dealing(0, 0, self._num_ranks)
        if plan is not None and plan.epoch == self._epoch and plan.dealing == dealing:
            return plan
        epoch = self._epoch
        if self._eligible is None:
            self._check_lengths(self._seq_len)
        order = self._eligible
        assert order is not None
        if self._shuffle:
            rng = np.random.default_rng([self._seed, epoch])
            order = order[rng.permutation(order.size)]
        packed = pack_lengths(
            self._lengths[order],
            seq_len=self._seq_len,
            bins_per_rank=self._bins_per_rank,
            packer=self._packer,
            buffer_tokens=self._buffer_tokens,
        )
        num_steps = dealing.num_steps(packed.num_steps)
        end = dealing.end_unit(packed.num_steps)
        delivered = order[packed.items[: packed.bin_offsets[end * self._bins_per_rank]]]
        report = SourceReport(
            epoch=epoch,
            num_steps=num_steps,
            num_samples=len(self._lengths),
            num_dropped_samples=len(self._lengths) - delivered.size,
            num_dropped_tokens=int(self._lengths.sum() - self._lengths[delivered].sum()),
            num_oversized_dropped=len(self._lengths) - self._eligible.size,
        )
        plan = self._plan = _Epoch(epoch, order, packed, dealing, num_steps, report)
        logger.info("%s", report.log_line(f"DatasetSource (rank {self._rank}/{self._num_ranks})"))
        return plan

    def __repr__(self) -> str:
        values = self._binding.values
        return (
            f"<DatasetSource {len(self._lengths)} samples rank={values['rank']}/"
            f"{values['num_ranks']} epoch={self._epoch} step={self._step}>"
        )


def _column_measure(column: str) -> Callable[[Any], int]:
    def measure(sample: Any) -> int:
        value = sample[column]
        return len(value) if hasattr(value, "__len__") else int(value)

    return measure


def _check_ranks(rank: int | None, num_ranks: int | None) -> None:
    if rank is None and num_ranks is None:
        return
    if rank is None or num_ranks is None:
        raise ConfigError(
            f"Pass both rank and num_ranks (or neither), but got rank={rank!r}, "
            f"num_ranks={num_ranks!r}."
        )
    check_int("num_ranks", num_ranks, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= num_ranks:
        raise ConfigError(f"rank must be < num_ranks={num_ranks}, but got rank={rank}.")


def _resolve_ranks(rank: int | None, num_ranks: int | None) -> tuple[int, int]:
    """Ranks of a source no loader has bound: explicit, or one rank without a world."""
    _check_ranks(rank, num_ranks)
    if rank is not None and num_ranks is not None:
        return rank, num_ranks
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            "torch.distributed is initialised and no loader has bound this DatasetSource, so "
            "its rank and num_ranks are unknown: give it to build_loader / BalancedLoader "
            "(which set them from the loader's group), or pass rank= and num_ranks= (this "
            "rank's data-parallel rank and the data-parallel size; under tensor or pipeline "
            "parallelism they differ from the global rank and the world size)."
        )
    return 0, 1
