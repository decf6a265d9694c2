"""``IterableSource``: steps from a stream of samples, packed as they arrive.

What it wraps, and how a pass restarts and resumes:

=================================  =====================================  =======================
wrapped object                     each pass (``iter``)                   resume
=================================  =====================================  =======================
a factory ``f()`` or ``f(epoch)``  calls it for a fresh iterator          replays and skips
a ``torchdata.nodes`` node         ``node.reset()``                       ``node.reset(state)``
a re-iterable with ``state_dict``  ``iter(obj)`` (HF ``IterableDataset``,  ``obj.load_state_dict``
and ``load_state_dict``            ``StatefulDataLoader``)
any other re-iterable              ``iter(obj)``                          replays and skips
=================================  =====================================  =======================

A one-shot iterator (a generator object) is refused: a second pass over it would yield nothing.
The state of a stateful stream also holds the samples the packer has buffered but not yet
delivered (at most one under ``"first_fit"``; fewer than ``buffer_tokens + seq_len`` tokens under
``"best_fit_decreasing"``; plus the rest of the current upstream batch with ``batched=True``;
plus, with ``transform_workers``, the raw samples of the steps packed ahead for the workers),
encoded with the wire format, so they must be plain data, numpy arrays or tensors.
"""

from __future__ import annotations

import collections
import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._model import SampleMetadata
from evenflow.engine._sources._common import (
    LengthMemo,
    LoaderBinding,
    SourceReport,
    check_oversized,
)
from evenflow.engine._sources._lengths import default_length
from evenflow.engine._sources.packing import Item, StepPacker
from evenflow.engine._sources.transform_pool import Ticket
from evenflow.engine._sources.transforms import SampleTransforms, TransformWorkers
from evenflow.engine._validate import check_bool, check_int
from evenflow.engine.errors import ConfigError, ResumeError, TransformWorkerError
from evenflow.transports import decode, encode
from evenflow.transports.internal import NOTE_PREFIX

__all__ = ["IterableSource"]

logger = logging.getLogger("evenflow")

STATE_FORMAT = "evenflow.IterableSource"
STATE_VERSION = 1


class _Stream:
    """The upstream iterator as ``(sample, length)`` items, checked, with its own buffer."""

    def __init__(self, owner: IterableSource, iterator: Iterator[Any]) -> None:
        self._owner = owner
        self._it = iterator
        self.leftover: collections.deque[Any] = collections.deque()  # rest of a batch
        self.num_read = 0
        self.num_oversized = 0
        self.oversized_tokens = 0
        self.exhausted = False  # the upstream raised StopIteration (never asked again)

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Item:
        owner = self._owner
        while True:
            if self.leftover:
                sample = self.leftover.popleft()
            else:
                if self.exhausted:
                    raise StopIteration
                try:
                    raw = next(self._it)
                except StopIteration:
                    # Remembered in the state: a stream restored after its end must not be
                    # reopened (a data loader would start its next epoch).
                    self.exhausted = True
                    raise
                if owner._batched:
                    self.leftover.extend(raw)
                    continue
                sample = raw
            position = self.num_read
            self.num_read += 1
            length = owner._measure(sample)
            if isinstance(length, bool) or not isinstance(length, int):
                raise TypeError(
                    f"length_fn returned {length!r:.80} ({type(length).__name__}) for sample "
                    f"{position} of epoch {owner._epoch}'s stream; it must return an int."
                )
            if length < 1:
                raise ConfigError(
                    f"Sample {position} of epoch {owner._epoch}'s stream has length {length}; "
                    "every sample needs at least 1 token. Filter empty samples upstream."
                )
            if length > owner._seq_len:
                if owner._oversized == "error":
                    raise ConfigError(
                        f"Sample {position} of epoch {owner._epoch}'s stream has {length} "
                        f"tokens, more than seq_len={owner._seq_len}. Pass oversized='drop' "
                        "to skip such samples (counted in the report) or oversized='single'."
                    )
                if owner._oversized == "drop":
                    self.num_oversized += 1
                    self.oversized_tokens += length
                    continue
            # The payload carries its length, so the step can tell metadata_fn without
            # measuring the sample again.
            return ((sample, length), length)


@dataclass
class _Ahead:
    """A packed step not yet delivered (raw samples), its transform ticket once sent to the
    workers, or the error packing it raised (raised when the step is due, not earlier)."""

    packed: list[list[tuple[Any, int]]] | None
    ticket: Ticket | None = None
    error: BaseException | None = None


class IterableSource(TransformWorkers):
    """Steps of ``bins_per_rank`` bins of ``seq_len`` tokens from a stream of samples.

    ``samples``: a factory (``lambda: ...`` or ``lambda epoch: ...`` returning a fresh
    iterator), a Hugging Face ``IterableDataset``, a ``torchdata.nodes`` node, a
    ``StatefulDataLoader`` or any re-iterable. Each rank wraps its own stream (shard it
    upstream, e.g. ``datasets.distributed.split_dataset_by_node``). ``batched=True``: each
    upstream item is a list of samples (a ``DataLoader`` batch with ``collate_fn=list``).
    ``length_fn`` measures a sample (default: ``len(sample["input_ids"])`` or ``len``).

    The number of steps of a stream is not known in advance: no ``len()``. Ranks whose
    streams end at different steps end together at the shortest (``on_uneven_end``).

    ``transform``: a per-sample function called as ``transform(sample, rng)`` on each packed
    step's raw samples; ``rng`` is a ``numpy.random.Generator`` seeded by ``(seed, epoch,
    step, slot)`` (slot: the sample's position in the step as packed), so a sample is
    transformed identically on any rank or worker and after a resume. The lengths
    (``length_fn``, measured on the raw sample) must be the token counts of the
    *transformed* samples: they pack and plan the step before any transform runs.
    ``transform_workers=N`` runs the transform in ``N`` worker processes (the stream itself
    is iterated in the training process and the raw samples are sent to the workers,
    pickled; large arrays come back through shared memory); the next ``2 * N`` steps are
    packed and sent ahead, and a saved state holds their raw samples. See the how-to
    "Heavy transforms".
    """

    def __init__(
        self,
        samples: Any,
        *,
        seq_len: int | None = None,
        bins_per_rank: int | None = None,
        length_fn: Callable[[Any], int] | None = None,
        packer: str = "first_fit",
        buffer_tokens: int | None = None,
        oversized: str = "error",
        batched: bool = False,
        features_fn: Callable[[Any], dict[str, Any]] | None = None,
        transform: Callable[[Any, np.random.Generator], Any] | None = None,
        transform_workers: int = 0,
        seed: int = 0,
    ) -> None:
        self._kind, self._takes_epoch = _classify(samples)
        workers = check_int("transform_workers", transform_workers, minimum=0)
        if workers and transform is None:
            raise ConfigError(
                f"transform_workers={workers} was given without a transform: a stream's "
                "samples are read in the training process, so the workers would only copy "
                "them. Pass transform=fn (a module-level function fn(sample, rng)) or "
                "transform_workers=0."
            )
        self._transforms = SampleTransforms(
            None, transform, workers=workers, seed=check_int("seed", seed, minimum=0)
        )
        self._rank = 0
        StepPacker(
            seq_len=1 if seq_len is None else seq_len,
            bins_per_rank=1 if bins_per_rank is None else bins_per_rank,
            packer=packer,
            buffer_tokens=buffer_tokens,
        )
        self._samples = samples
        self._binding = LoaderBinding(
            "IterableSource", seq_len=seq_len, bins_per_rank=bins_per_rank
        )
        self._packer, self._buffer_tokens = packer, buffer_tokens
        self._oversized = check_oversized(oversized)
        self._batched = check_bool("batched", batched)
        if length_fn is not None and not callable(length_fn):
            raise TypeError(f"length_fn must be callable, but got {length_fn!r:.80}.")
        if features_fn is not None and not callable(features_fn):
            raise TypeError(f"features_fn must be callable, but got {features_fn!r:.80}.")
        measure = length_fn or default_length

        def checked(sample: Any) -> Any:
            value = measure(sample)
            return (
                int(value) if hasattr(value, "__index__") and not isinstance(value, bool) else value
            )

        self._measure = checked
        self._memo = LengthMemo(measure, features_fn)
        self._epoch = 0
        self._step = 0
        self._resume: dict[str, Any] | None = None
        self._live: tuple[StepPacker, _Stream, collections.deque[_Ahead]] | None = None
        self._report: SourceReport | None = None

    def bind_loader(
        self, *, seq_len: int, bins_per_rank: int, rank: int | None, num_ranks: int | None
    ) -> ConfigError | None:
        """Called by the loader that reads this source: its ``seq_len`` and ``bins_per_rank``
        (a stream is sharded by whoever makes it, so the ranks are not used). Values given to
        the source that disagree are refused: the error is returned, and raised by every
        later use."""
        del num_ranks
        self._rank = 0 if rank is None else rank  # named in the bottleneck warning
        return self._binding.bind(seq_len=seq_len, bins_per_rank=bins_per_rank)

    @property
    def _seq_len(self) -> int:
        return self._binding.require("seq_len")

    @property
    def _bins_per_rank(self) -> int:
        return self._binding.require("bins_per_rank")

    @property
    def stateful(self) -> bool:
        """Whether the wrapped object saves its own position (else resume replays)."""
        return self._kind in ("node", "stateful")

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Steps yielded so far in the current pass."""
        return self._step

    @property
    def report(self) -> SourceReport | None:
        """What the last finished pass delivered and left unread (this rank), or ``None``."""
        return self._report

    def metadata_fn(self, sample: Any) -> SampleMetadata:
        """The ``metadata_fn`` for a ``BalancedLoader`` over this source (the length the source
        measured, plus ``features_fn(sample)`` as features when given)."""
        return self._memo.metadata(sample)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its beginning; forwarded to the wrapped object's
        ``set_epoch`` where it has one (a factory taking an argument receives it instead)."""
        self._epoch = check_int("epoch", epoch)
        self._step = 0
        self._resume = None
        self._live = None  # a state saved now describes the start of the epoch
        forward = getattr(self._samples, "set_epoch", None)
        if self._kind != "factory" and callable(forward):
            forward(epoch)

    def __iter__(self) -> Iterator[list[list[Any]]]:
        if self._binding.refusal is not None:
            raise self._binding.refusal
        resume, self._resume = self._resume, None
        self._step = 0 if resume is None else int(resume["step"])
        self._live = None
        return self._steps(resume)

    def _open(self, upstream: Any) -> Iterator[Any]:
        samples = self._samples
        if self._kind == "factory":
            made = samples(self._epoch) if self._takes_epoch else samples()
            if not hasattr(made, "__iter__"):
                raise TypeError(
                    f"The factory returned {type(made).__name__}, not an iterator of samples."
                )
            return iter(made)
        if self._kind == "node":
            samples.reset(upstream)
            return samples  # type: ignore[no-any-return]
        if upstream is not None:
            samples.load_state_dict(upstream)
        return iter(samples)

    def _steps(self, resume: dict[str, Any] | None) -> Iterator[list[list[Any]]]:
        packer = StepPacker(
            seq_len=self._seq_len,
            bins_per_rank=self._bins_per_rank,
            packer=self._packer,
            buffer_tokens=self._buffer_tokens,
        )
        replay = 0
        if resume is not None and resume["upstream"] is None and resume["pending"] is None:
            replay = int(resume["step"])
        ended = resume is not None and bool((resume["counters"] or {}).get("exhausted"))
        upstream = iter(()) if ended else self._open(None if resume is None else resume["upstream"])
        stream = _Stream(self, upstream)
        stream.exhausted = ended
        if resume is not None and resume["pending"] is not None:
            buffered = decode(resume["pending"])
            packer.pending = [((s, int(n)), int(n)) for s, n in buffered["items"]]
            stream.leftover.extend(buffered["leftover"])
            counters = resume["counters"]
            stream.num_read = int(counters["read"])
            stream.num_oversized = int(counters["oversized"])
            stream.oversized_tokens = int(counters["oversized_tokens"])
        ahead: collections.deque[_Ahead] = collections.deque()
        if resume is not None and resume.get("ahead") is not None:
            for packed in decode(resume["ahead"]):
                ahead.append(_Ahead([[(s, int(n)) for s, n in b] for b in packed]))
        for done in range(replay):  # no saved position: read and discard the consumed steps
            if packer.next_step(stream) is None:
                raise ResumeError(
                    f"The stream ended after {done} steps while replaying to step {replay}; "
                    "a stream without state must yield the same samples on every pass."
                )
        self._live = (packer, stream, ahead)
        self._memo.clear()
        transforms = self._transforms
        transforms.start_pass()
        try:
            yield from self._deliver(packer, stream, ahead)
        finally:
            transforms.drop({i: a.ticket for i, a in enumerate(ahead) if a.ticket is not None})
            transforms.warn_if_bottleneck(self._epoch, self._rank)
        self._finish(packer, stream, resumed=resume is not None)

    def _deliver(
        self, packer: StepPacker, stream: _Stream, ahead: collections.deque[_Ahead]
    ) -> Iterator[list[list[Any]]]:
        """The steps, transformed. With workers, the next ``2 * workers`` steps are packed and
        sent to them before this one is collected, so they work while the loader plans and
        packs (as ``DataLoader``'s ``prefetch_factor=2``); their raw samples stay in
        ``ahead`` until delivered, so a state saved meanwhile holds them."""
        transforms = self._transforms
        workers = transforms.workers
        depth = 1 + 2 * workers
        ended = False
        while True:
            while not ended and len(ahead) < depth:
                try:
                    packed = packer.next_step(stream)
                except Exception as exc:
                    if not ahead:
                        raise
                    ahead.append(_Ahead(None, error=exc))  # due when its step is
                    packed = None
                if packed is None:
                    ended = True
                else:
                    ahead.append(_Ahead(packed))
            if not ahead:
                return
            if workers:
                try:
                    for k, entry in enumerate(ahead):
                        if entry.packed is not None and entry.ticket is None:
                            raw = [s for b in entry.packed for s, _ in b]
                            step = self._step + k
                            entry.ticket = transforms.submit_stream(raw, self._epoch, step)
                except TransformWorkerError as exc:  # a worker lost while sending: this step
                    exc.add_note(f"{NOTE_PREFIX}while reading (source step {self._step}).")
                    raise
            entry = ahead[0]
            if entry.packed is None:
                assert entry.error is not None
                raise entry.error
            raw = [s for b in entry.packed for s, _ in b]
            if entry.ticket is not None:
                items = transforms.collect(entry.ticket)
            elif transforms.active:
                items = transforms.stream_step(raw, self._epoch, self._step)
            else:
                items = raw
            ahead.popleft()
            self._memo.remember(items, [n for b in entry.packed for _, n in b])
            out, at = [], 0
            for b in entry.packed:
                out.append(items[at : at + len(b)])
                at += len(b)
            self._step += 1
            yield out

    def _finish(self, packer: StepPacker, stream: _Stream, *, resumed: bool) -> None:
        if not resumed and stream.num_read == 0:
            raise ConfigError(
                f"The wrapped {type(self._samples).__name__} yielded no samples in epoch "
                f"{self._epoch}. An iterator that was already consumed yields nothing: pass a "
                "factory (e.g. IterableSource(lambda: make_samples(), ...)) or a re-iterable."
            )
        if not resumed and self._step == 0:
            raise ConfigError(
                f"The stream of epoch {self._epoch} held {stream.num_read} samples: not enough "
                f"for one step of bins_per_rank={self._bins_per_rank} bins."
            )
        left = packer.pending
        self._report = SourceReport(
            epoch=self._epoch,
            num_steps=self._step,
            num_samples=stream.num_read,
            num_dropped_samples=len(left) + stream.num_oversized,
            num_dropped_tokens=sum(n for _, n in left) + stream.oversized_tokens,
            num_oversized_dropped=stream.num_oversized,
        )
        logger.info("%s", self._report.log_line("IterableSource"))

    def state_dict(self) -> dict[str, Any]:
        """The position after the last step yielded: the epoch and step, and for a stateful
        stream its own state plus the buffered samples (plain data; the samples as bytes)."""
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "upstream": None,
            "pending": None,
            "counters": None,
            "packing": self._packing(),
            "ahead": None,  # raw samples of the steps packed ahead for the transform workers
        }
        live = self._live
        if self.stateful and live is not None:
            packer, stream, ahead = live
            getter = self._samples.state_dict
            state["upstream"] = copy.deepcopy(getter())
            steps = [
                [[[sample, n] for sample, n in b] for b in a.packed]
                for a in ahead
                if a.packed is not None
            ]
            state["ahead"] = bytes(encode(steps)) if steps else None
            buffered = {
                "items": [list(payload) for payload, _ in packer.pending],
                "leftover": list(stream.leftover),
            }
            state["pending"] = bytes(encode(buffered))
            state["counters"] = {
                "read": stream.num_read,
                "oversized": stream.num_oversized,
                "oversized_tokens": stream.oversized_tokens,
                "exhausted": stream.exhausted,
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after a saved position on the next iteration."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ResumeError(
                f"An IterableSource state must be the dict its state_dict() returned, but got "
                f"{state!r:.120}."
            )
        if state.get("version") != STATE_VERSION:
            raise ResumeError(f"The state has version {state.get('version')!r}; expected 1.")
        if state.get("packing") != self._packing():
            raise ResumeError(
                f"The state was saved with packing {state.get('packing')!r}, but this source "
                f"has {self._packing()!r}; restore with the same settings."
            )
        if (state.get("upstream") is None) == self.stateful and state.get("step"):
            raise ResumeError(
                "The state was saved from a "
                + ("stateless" if self.stateful else "stateful")
                + " stream; restore it with the same kind of wrapped object."
            )
        self.set_epoch(check_int("state['epoch']", state.get("epoch")))
        check_int("state['step']", state.get("step"))
        self._resume = state
        self._step = int(state["step"])

    def _packing(self) -> dict[str, Any]:
        return {
            "seq_len": self._seq_len,
            "bins_per_rank": self._bins_per_rank,
            "packer": self._packer,
            "buffer_tokens": self._buffer_tokens,
            "oversized": self._oversized,
            "batched": self._batched,
        }

    def __repr__(self) -> str:
        return f"<IterableSource {self._kind} epoch={self._epoch} step={self._step}>"


def _classify(samples: Any) -> tuple[str, bool]:
    kind = type(samples)
    if inspect.isgenerator(samples) or (hasattr(kind, "__next__") and not hasattr(kind, "reset")):
        raise TypeError(
            f"samples is a one-shot iterator ({kind.__name__}): a second pass (the next epoch, "
            "a resumed run) would yield nothing. Pass a factory instead, e.g. "
            "IterableSource(lambda: make_samples(), ...), or a re-iterable object."
        )
    if hasattr(kind, "__next__") and hasattr(kind, "reset") and hasattr(kind, "state_dict"):
        return "node", False
    if hasattr(kind, "__iter__"):
        stateful = hasattr(kind, "state_dict") and hasattr(kind, "load_state_dict")
        return ("stateful" if stateful else "iterable"), False
    if callable(samples):
        try:
            parameters = inspect.signature(samples).parameters.values()
        except (TypeError, ValueError):
            return "factory", False
        required = [
            p
            for p in parameters
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) > 1:
            raise TypeError(
                f"A samples factory takes no argument or one (the epoch), but {samples!r:.80} "
                f"requires {len(required)}."
            )
        return "factory", len(required) == 1
    raise TypeError(
        f"samples must be a factory, an iterable dataset, a torchdata node or a data loader, "
        f"but got {kind.__name__}."
    )
