"""Packers: sample lengths in, steps of ``bins_per_rank`` non-empty bins out.

Both packers are deterministic, pure functions of the length stream, and work one step at a
time, carrying what did not fit into the next step:

* ``"first_fit"`` — each arriving sample goes into the first of the step's bins with room;
  the step closes at the first sample that fits no bin, and that sample opens the next step.
  At most one sample is carried between steps.
* ``"best_fit_decreasing"`` — the step buffers samples (what was carried, then new arrivals)
  until they hold ``buffer_tokens`` tokens (default: one step's capacity plus one
  bin's, ``(bins_per_rank + 1) * seq_len``), seeds each bin with one of the longest buffered
  samples, then places the rest longest first, each into the fullest bin that still fits it.
  What fits nowhere is carried, in arrival order, to the next step: fewer than
  ``buffer_tokens + seq_len`` tokens. Bins end fuller than with first-fit; a short sample may
  wait a few steps in the buffer.

A sample longer than ``seq_len`` (allowed only under ``oversized="single"``) occupies a bin
alone. Every step the packers emit has exactly ``bins_per_rank`` non-empty bins, each within
``seq_len`` tokens (or one oversized sample); when the stream ends, what is left (fewer than a
step's worth) is the *remainder*, which the caller reports.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from evenflow.engine._validate import check_choice, check_int, check_optional_int
from evenflow.engine.errors import ConfigError

__all__ = ["PACKERS", "PackedSteps", "Packer", "StepPacker", "pack_lengths"]

Packer = Literal["first_fit", "best_fit_decreasing"]
PACKERS: tuple[str, ...] = ("first_fit", "best_fit_decreasing")

# An item is (payload, length): the payload is what the bins hold (a dataset position, or a
# sample read from a stream), the length its token count (>= 1).
Item = tuple[Any, int]


class StepPacker:
    """Packs a stream of ``(payload, length)`` items into steps, one :meth:`next_step` at a time.

    :attr:`pending` holds the items carried into the next step; it is the packer's whole
    state, so saving it (with the stream's position) and assigning it back resumes exactly.
    """

    def __init__(
        self,
        *,
        seq_len: int,
        bins_per_rank: int,
        packer: str = "first_fit",
        buffer_tokens: int | None = None,
    ) -> None:
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        self.bins_per_rank = check_int("bins_per_rank", bins_per_rank, minimum=1)
        self.packer = check_choice("packer", packer, PACKERS)
        check_optional_int("buffer_tokens", buffer_tokens, minimum=1)
        self.buffer_tokens = (
            (bins_per_rank + 1) * seq_len if buffer_tokens is None else buffer_tokens
        )
        self._carry: list[Item] = []  # first-fit: the sample that closed the last step
        self._buckets: dict[int, list[Item]] = {}  # best-fit-decreasing buffer, by length
        self._present: list[int] = []
        self._buffered_tokens = 0
        self._buffered_count = 0

    def next_step(self, stream: Iterator[Item]) -> list[list[Any]] | None:
        """The next step's bins of payloads, or ``None`` once ``stream`` cannot fill one
        (``pending`` then holds the remainder)."""
        if self.packer == "first_fit":
            return self._first_fit(stream)
        return self._best_fit_decreasing(stream)

    def _first_fit(self, stream: Iterator[Item]) -> list[list[Any]] | None:
        n, seq_len = self.bins_per_rank, self.seq_len
        bins: list[list[Any]] = [[] for _ in range(n)]
        free = [seq_len] * n
        pending, self._carry = self._carry, []
        source: Iterator[Item] = iter(pending) if pending else stream
        used: list[Item] = []  # items of this step, kept only to form the remainder
        while True:
            for payload, length in source:
                if length > seq_len:  # oversized: alone in an empty bin, which it closes
                    i = next((j for j in range(n) if not bins[j]), -1)
                    if i < 0:
                        self._carry = [(payload, length), *_rest(source, stream)]
                        return bins
                    bins[i].append(payload)
                    free[i] = 0
                else:
                    for i in range(n):
                        if length <= free[i]:
                            bins[i].append(payload)
                            free[i] -= length
                            break
                    else:
                        self._carry = [(payload, length), *_rest(source, stream)]
                        return bins
                used.append((payload, length))
            if source is stream:
                break
            source = stream
        # The stream ended. Any sample fits an empty bin, so the bins are all non-empty
        # exactly when a full step was formed.
        if all(bins):
            return bins
        self._carry = used
        return None

    def _best_fit_decreasing(self, stream: Iterator[Item]) -> list[list[Any]] | None:
        # The buffer is a bucket per length (arrival order inside a bucket) and the sorted list
        # of the lengths present. "Each item, longest first, into the fullest bin that fits
        # it" then never scans an item that fits nowhere: bins only fill up, so the next item
        # placed is always the longest (earliest) one of length <= the largest free space.
        # The pushes and pops are written out inline: this loop runs once per sample.
        n, seq_len = self.bins_per_rank, self.seq_len
        buckets, present = self._buckets, self._present
        tokens, count, target = self._buffered_tokens, self._buffered_count, self.buffer_tokens
        insort, bisect_right = bisect.insort, bisect.bisect_right
        if tokens < target or count < n:
            for item in stream:
                length = item[1]
                bucket = buckets.get(length)
                if bucket is None:
                    buckets[length] = [item]
                    insort(present, length)
                else:
                    bucket.append(item)
                tokens += length if length < seq_len else seq_len
                count += 1
                if tokens >= target and count >= n:
                    break
        if count < n:
            self._buffered_tokens, self._buffered_count = tokens, count
            return None
        bins: list[list[Any]] = [[] for _ in range(n)]
        free = [0] * n
        i = 0
        while present:
            if i < n:  # seed every bin with one of the n longest items
                best, k = i, len(present)
            else:
                most_free = max(free)
                k = bisect_right(present, most_free)
                if k == 0:
                    break  # nothing buffered fits anywhere
            length = present[k - 1]
            bucket = buckets[length]
            payload = bucket.pop(0)[0]  # buckets are short: most lengths occur once
            if not bucket:
                del buckets[length]
                del present[k - 1]
            tokens -= length if length < seq_len else seq_len
            count -= 1
            if i < n:
                free[i] = seq_len - length if length < seq_len else 0
                i += 1
            else:
                best = -1
                for j in range(n):
                    if length <= free[j] and (best < 0 or free[j] < free[best]):
                        best = j
                free[best] -= length
            bins[best].append(payload)
        self._buffered_tokens, self._buffered_count = tokens, count
        return bins

    def _push(self, item: Item) -> None:
        length = item[1]
        bucket = self._buckets.get(length)
        if bucket is None:
            bucket = self._buckets[length] = []
            bisect.insort(self._present, length)
        bucket.append(item)
        self._buffered_tokens += min(length, self.seq_len)
        self._buffered_count += 1

    @property
    def pending(self) -> list[Item]:
        """The items carried into the next step, in the order that restores them exactly."""
        if self.packer == "first_fit":
            return list(self._carry)
        return [item for length in reversed(self._present) for item in self._buckets[length]]

    @pending.setter
    def pending(self, items: list[Item]) -> None:
        if self.packer == "first_fit":
            self._carry = list(items)
            return
        self._buckets, self._present = {}, []
        self._buffered_tokens = self._buffered_count = 0
        for item in items:
            self._push(item)


def _rest(source: Iterator[Item], stream: Iterator[Item]) -> list[Item]:
    # The carried items not reached yet stay ahead of the stream.
    return list(source) if source is not stream else []


@dataclass(frozen=True)
class PackedSteps:
    """Steps packed from a length array (see :func:`pack_lengths`).

    ``items``: positions into the packed length array, bin after bin; ``bin_offsets``: bin
    ``b`` holds ``items[bin_offsets[b]:bin_offsets[b + 1]]``; step ``s`` is bins
    ``s * bins_per_rank`` to ``(s + 1) * bins_per_rank - 1``. ``remainder``: the positions
    left over when the lengths could not fill another step.
    """

    bins_per_rank: int
    items: npt.NDArray[np.int64]
    bin_offsets: npt.NDArray[np.int64]
    remainder: npt.NDArray[np.int64]

    @property
    def num_steps(self) -> int:
        return (len(self.bin_offsets) - 1) // self.bins_per_rank

    def step(self, step: int) -> list[npt.NDArray[np.int64]]:
        """The positions of step ``step``, one array per bin."""
        first = step * self.bins_per_rank
        bounds = self.bin_offsets[first : first + self.bins_per_rank + 1].tolist()
        return [self.items[a:b] for a, b in itertools.pairwise(bounds)]


def pack_lengths(
    lengths: Sequence[int] | npt.NDArray[np.integer[Any]],
    *,
    seq_len: int,
    bins_per_rank: int,
    packer: str = "first_fit",
    buffer_tokens: int | None = None,
) -> PackedSteps:
    """Pack ``lengths`` (in order) into steps of ``bins_per_rank`` bins with ``packer``.

    A pure function: the same lengths and arguments give the same steps on every machine.
    Lengths must be >= 1; a length above ``seq_len`` takes a bin alone.
    """
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ConfigError(
            f"lengths must be a 1-D sequence of integers, but got shape {array.shape} and "
            f"dtype {array.dtype}."
        )
    if array.size and int(array.min()) < 1:
        bad = int(np.flatnonzero(array < 1)[0])
        raise ConfigError(
            f"lengths[{bad}] is {int(array[bad])}; every sample needs at least 1 token."
        )
    state = StepPacker(
        seq_len=seq_len, bins_per_rank=bins_per_rank, packer=packer, buffer_tokens=buffer_tokens
    )
    stream = zip(range(array.size), array.tolist(), strict=True)
    items: list[int] = []
    offsets = [0]
    while (bins := state.next_step(stream)) is not None:
        for b in bins:
            items.extend(b)
            offsets.append(len(items))
    return PackedSteps(
        bins_per_rank=bins_per_rank,
        items=np.asarray(items, dtype=np.int64),
        bin_offsets=np.asarray(offsets, dtype=np.int64),
        remainder=np.asarray(sorted(p for p, _ in state.pending), dtype=np.int64),
    )
