"""What every framework adapter shares: microbatches, epochs, restores and gathered states.

A framework pulls *microbatches*: one per forward pass, ``gradient_accumulation_steps`` per
optimizer step. A loader delivers *steps*: ``bins_per_rank`` packed bins per rank. The adapters
map one onto the other with ``bins_per_rank = bins_per_microbatch * microbatches_per_step``, so
one optimizer step is exactly one balanced step and the world's loss tokens of that step
(``loader.last_loss_tokens.world``) are the loss divisor of every microbatch in it.

:class:`LoaderView` is the object a framework iterates. It owns the epoch rules the
frameworks rely on, whatever the loader's own lifecycle rules are:

* ``set_epoch(epoch)`` is forwarded to the loader at the top of every epoch, and iterating
  again without it starts the next epoch explicitly (a completed pass never yields nothing);
* a restored state is applied *after* the loader's ``set_epoch`` for the state's epoch, so
  the order in which a framework calls ``load_state_dict`` and ``set_epoch`` does not matter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from evenflow.engine._distributed.build import build_loader
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._sources.dataset import DatasetSource
from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError, ResumeError
from evenflow.transports.internal import Channel, Protocol, new_group

__all__ = [
    "LoaderView",
    "gather_state",
    "make_loader",
    "merge_packed",
    "merge_states",
    "state_group",
]

logger = logging.getLogger("evenflow")


def merge_packed(bins: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from several packed bins of ``default_pack_fn``'s layout.

    The samples stay separate: ``position_ids`` restart at every sample, labels keep their -100
    at every sample's start, and ``cu_seq_lens_q/k`` list every sample boundary of the row. So a
    causal LM trains on the merged row exactly as on its bins one by one (what Hugging Face's
    ``DataCollatorWithFlattening`` does for a batch of several examples).
    """
    if not bins:
        raise ValueError("merge_packed needs at least one packed bin, but got none.")
    if len(bins) == 1:
        return dict(bins[0])
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
        missing = [i for i, b in enumerate(bins) if key not in b]
        if missing:
            raise KeyError(
                f"Packed bin {missing[0]} has no {key!r}: merging bins into one row needs the "
                "layout of default_pack_fn (input_ids, labels, position_ids, cu_seq_lens_q/k, "
                "max_length_q/k). Use default_pack_fn, or one microbatch per bin."
            )
    boundaries = [bins[0]["cu_seq_lens_q"]]
    offset = bins[0]["cu_seq_lens_q"][-1]
    for b in bins[1:]:
        boundaries.append(b["cu_seq_lens_q"][1:] + offset)
        offset = offset + b["cu_seq_lens_q"][-1]
    cu = torch.cat(boundaries)
    longest = max(int(b["max_length_q"]) for b in bins)
    return {
        "input_ids": torch.cat([b["input_ids"] for b in bins], dim=1),
        "labels": torch.cat([b["labels"] for b in bins], dim=1),
        "position_ids": torch.cat([b["position_ids"] for b in bins], dim=1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


class LoaderView:
    """The iterable a training framework reads: a loader's steps as microbatches.

    ``loader``: a ``BalancedLoader`` or ``DistributedLoader`` whose ``bins_per_rank`` is
    ``bins_per_microbatch * microbatches_per_step``. Each step's bins are cut into
    ``microbatches_per_step`` microbatches of ``bins_per_microbatch`` bins, merged into one row
    each (:func:`merge_packed`) unless ``merge=False``, and ``extra`` (e.g.
    ``{"use_cache": False}``) is added to every microbatch mapping.

    ``gather_group``: a Gloo group of every rank (:func:`state_group`); then
    :meth:`state_dict` is collective and returns every rank's state merged
    (:func:`merge_states`), for frameworks that write one process's checkpoint for all.

    ``with_num_items``: add ``num_items_in_batch`` (the world's loss tokens of the microbatch's
    step) to every microbatch, so ``model(**batch)`` divides by it whatever the framework
    fetched ahead.

    ``len()`` is the number of microbatches of the current epoch. It is not a
    ``torch.utils.data.DataLoader``, so Accelerate's ``prepare`` returns it unchanged and never
    re-shards what the loader already assigned to this rank.
    """

    def __init__(
        self,
        loader: Any,
        *,
        bins_per_microbatch: int = 1,
        merge: bool = True,
        extra: dict[str, Any] | None = None,
        gather_group: Any = None,
        with_num_items: bool = False,
    ) -> None:
        self._loader = loader
        self._group = gather_group
        self._per = check_int("bins_per_microbatch", bins_per_microbatch, minimum=1)
        bins = loader.config.bins_per_rank
        if bins % self._per:
            raise ConfigError(
                f"bins_per_rank={bins} is not a multiple of bins_per_microbatch={self._per}: "
                "every optimizer step must take whole microbatches. Make bins_per_rank "
                "bins_per_microbatch x microbatches_per_step."
            )
        self._merge = merge
        self._extra = dict(extra or {})
        self._requested: int | None = None  # set_epoch's epoch, not yet started
        self._current = -1  # the epoch of the last pass started
        self._pending: dict[str, Any] | None = None
        self._generation = 0  # which iterator may read the loader
        self._delivering = False
        self._with_num_items = bool(with_num_items)
        self._boundary: dict[str, Any] | None = None
        self._yielded = 0  # microbatches of the current step taken so far

    @property
    def loader(self) -> Any:
        return self._loader

    @property
    def microbatches_per_step(self) -> int:
        return int(self._loader.config.bins_per_rank) // self._per

    @property
    def epoch(self) -> int:
        """The epoch being iterated (or requested by ``set_epoch`` and about to start)."""
        return self._current if self._requested is None else self._requested

    def __len__(self) -> int:
        return len(self._loader) * self.microbatches_per_step

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the one the next iteration trains. The loader's ``set_epoch`` (and a
        pending restore of that epoch after it) runs when that iteration takes its first
        item, so ``set_epoch`` may come before or after ``iter()`` (Lightning creates the
        iterator of its first epoch before it sets the epoch)."""
        self._requested = check_int("epoch", epoch, minimum=0)

    @property
    def num_items_in_batch(self) -> int:
        """The loss targets of the whole world in the step being trained
        (``loader.last_loss_tokens.world``): the divisor of every microbatch's summed token
        loss that makes the update the world's mean token loss, with or without balancing."""
        tokens = self._loader.last_loss_tokens
        if tokens is None:
            raise ConfigError(
                "The loader does not know this step's loss tokens: no step was delivered yet, "
                "or a custom pack_fn's metadata_fn sets no loss_tokens. Use the default "
                "pack_fn or set SampleMetadata.loss_tokens."
            )
        return int(tokens.world)

    @property
    def start_epoch(self) -> int:
        """The epoch to continue with: a restored state's epoch, else the next one."""
        pending = self._pending
        if pending is not None and isinstance(pending.get("epoch"), int):
            return int(pending["epoch"])
        return self._current + 1

    def state_dict(self) -> dict[str, Any]:
        """The position of the last step whose microbatches were all taken (plain data).

        A framework that fetches ahead (Lightning takes the next microbatch before it trains
        the current one) may have taken the first microbatches of the next step when it
        checkpoints; they belong to a step it has not trained, so the state is then the one
        at that step's start. With a ``gather_group`` the states of every rank are merged
        (collective: call it on every rank)."""
        if 0 < self._yielded < self.microbatches_per_step and self._boundary is not None:
            state: dict[str, Any] = self._boundary
        else:
            state = self._loader.state_dict()
        return gather_state(state, self._group)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position when its epoch starts: before the next iteration takes its first
        item, after the loader's ``set_epoch``. The order of ``load_state_dict``, ``set_epoch``
        and ``iter()`` before that does not matter."""
        if not isinstance(state, dict):
            raise ResumeError(
                f"A loader state must be the dict state_dict() returned, but got {state!r:.120}."
            )
        if self._delivering:
            raise ResumeError(
                "load_state_dict() was called in the middle of an epoch; restore before the "
                "epoch starts (before iterating, or right after set_epoch)."
            )
        self._pending = state

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        return self._microbatches(self._generation)

    def _start(self) -> None:
        """Start the epoch of this iteration: the requested one, else the restored one, else
        the one after the last (explicitly: the loader never sees a second iteration of a
        finished pass)."""
        pending, self._pending = self._pending, None
        epoch = self._requested
        if epoch is None:
            epoch = self._current + 1
            if pending is not None and isinstance(pending.get("epoch"), int):
                epoch = max(epoch, int(pending["epoch"]))
        self._requested = None
        self._warn_unfinished(epoch)
        self._loader.set_epoch(epoch)
        self._current = epoch
        if pending is not None:
            self._restore(pending, epoch)

    def _warn_unfinished(self, epoch: int) -> None:
        """Say so when a new epoch starts before the last one was read to its end: the
        framework stopped reading (it counted fewer steps for the epoch than the loader has),
        and the rest of that epoch's samples do not train."""
        if self._current < 0 or not self._delivering:
            return
        try:
            remaining = len(self._loader) - int(self._loader.step)
        except TypeError:  # a source without len(): nothing to compare with
            return
        if remaining > 0:
            logger.warning(
                "Epoch %d starts while epoch %d still had %d of its %d steps unread: the "
                "training framework stopped reading the loader early (it counts the steps of "
                "an epoch once, from the first). Those steps' samples do not train in epoch %d.",
                epoch,
                self._current,
                remaining,
                len(self._loader),
                self._current,
            )

    def _microbatches(self, generation: int) -> Iterator[Any]:
        if generation != self._generation:
            return
        self._start()
        per, count = self._per, self.microbatches_per_step
        self._delivering = True
        try:
            steps = iter(self._loader)
            while True:
                # The position at this step boundary: what a checkpoint taken while the
                # framework still trains the previous step (but prefetched into this one)
                # must hold.
                self._boundary = self._loader.state_dict()
                self._yielded = 0
                try:
                    batch = next(steps)
                except StopIteration:
                    return
                extra = dict(self._extra)
                if self._with_num_items:
                    extra["num_items_in_batch"] = self.num_items_in_batch
                for start in range(0, len(batch), per):
                    chunk = batch[start : start + per]
                    item = merge_packed(chunk) if self._merge else chunk
                    if extra and isinstance(item, dict):
                        item = {**item, **extra}
                    self._yielded += 1
                    yield item
                if generation != self._generation:
                    return  # a newer iteration owns the loader now
                assert self._yielded == count
        finally:
            if generation == self._generation:
                self._delivering = False
                self._yielded = 0

    def _restore(self, state: dict[str, Any], epoch: int) -> None:
        saved = state.get("epoch")
        if not isinstance(saved, int) or saved > epoch:
            raise ResumeError(
                f"The framework starts epoch {epoch}, but the loader's checkpoint is in epoch "
                f"{saved!r}: the framework's own epoch count and the loader's disagree. Resume "
                "with the same training arguments and dataset."
            )
        if saved == epoch:
            self._loader.load_state_dict(state)
            return
        # A checkpoint of an earlier epoch is one the framework saved at that epoch's end:
        # check that it is (so nothing of that epoch is skipped), then start ``epoch``.
        self._loader.set_epoch(saved)
        self._loader.load_state_dict(state)
        remaining = len(self._loader) - self._loader.step
        self._loader.set_epoch(epoch)
        if remaining > 0:
            raise ResumeError(
                f"The framework resumes at epoch {epoch}, but the loader's checkpoint is at "
                f"step {state.get('step')} of epoch {saved}, {remaining} steps before its end: "
                "those samples would never train. Resume from a checkpoint saved by the same "
                "run, with the same training arguments."
            )


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state from every rank's ``loader.state_dict()`` of the same step.

    The shared fields (epoch, step, identity, digest, a global ``position``) are the same on
    every rank; per-rank entries live under distinct ``ranks`` keys and are united. A loader
    restores from the merged state by reading its own entry, so one file written by one process
    serves every rank (what Accelerate's ``save_state`` and Lightning's checkpoints do).
    """
    if not states:
        raise ValueError("merge_states needs the state of at least one rank.")
    merged = dict(states[0])
    ranks: dict[str, Any] = dict(merged.get("ranks") or {})
    for i, state in enumerate(states[1:], start=1):
        for key, value in state.items():
            if key == "ranks":
                continue
            if merged.get(key) != value:
                raise ResumeError(
                    f"Rank {i}'s loader state differs from rank 0's in {key!r} "
                    f"({value!r:.80} vs {merged.get(key)!r:.80}): the ranks were saved at "
                    "different steps. Save every rank at the same step."
                )
        ranks.update(state.get("ranks") or {})
    if ranks:
        merged["ranks"] = ranks
    return merged


def gather_state(state: dict[str, Any], group: Any) -> dict[str, Any]:
    """Every rank's ``state`` over the Gloo ``group`` (msgpack frames, never pickle),
    merged with :func:`merge_states`. ``group`` None: this rank's state alone."""
    if group is None:
        return state
    channel = Channel(
        group,
        Protocol(
            rank=dist.get_rank(group),
            num_ranks=dist.get_world_size(group),
            global_ranks=tuple(dist.get_process_group_ranks(group)),
            name="checkpoint",
            limit=64 << 20,
            advice="Every rank must save its checkpoint at the same step.",
        ),
    )
    return merge_states(channel.all_gather(state, op="loader state"))


def state_group(timeout: float) -> Any:
    """A Gloo group of the whole world for :func:`gather_state` (None in one process).

    Every rank must create it at the same point (it is a ``new_group``); the training process
    group is left to training, whatever its backend."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return new_group(range(dist.get_world_size()), timeout=timeout, backend="gloo")


def make_loader(
    dataset: Any,
    config: Any,
    *,
    rank: int,
    num_ranks: int,
    seed: int,
    source_kwargs: dict[str, Any] | None = None,
    loader_kwargs: dict[str, Any] | None = None,
) -> Any:
    """A loader over ``dataset`` for this rank: a shuffled, packed ``DatasetSource`` (shared
    mode: every rank holds the same dataset, so only indices travel) under ``build_loader``
    when a torch.distributed world of several ranks is up, else a single-rank
    ``BalancedLoader``. A ``DatasetSource`` given as ``dataset`` is used as it is."""
    if isinstance(dataset, DatasetSource):
        source = dataset
        if (source.rank, source.num_ranks) != (rank, num_ranks):
            raise ConfigError(
                f"The DatasetSource is rank {source.rank} of {source.num_ranks}, but the "
                f"trainer runs this process as data-parallel rank {rank} of {num_ranks}. Build "
                "it with the trainer's rank and world size, or pass the dataset itself."
            )
    else:
        options: dict[str, Any] = {"shared": True, "seed": seed, **(source_kwargs or {})}
        source = DatasetSource(
            dataset,
            seq_len=config.seq_len,
            bins_per_rank=config.bins_per_rank,
            rank=rank,
            num_ranks=num_ranks,
            **options,
        )
    kwargs = dict(loader_kwargs or {})
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return build_loader(source, config, **kwargs)
    return BalancedLoader(source, config=config, **kwargs)
