"""The step packers: capacity, conservation, determinism, bounded remainder, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenflow.engine import pack_lengths
from evenflow.engine._sources.packing import StepPacker
from evenflow.engine.errors import ConfigError

PACKERS = ["first_fit", "best_fit_decreasing"]

lengths_st = st.lists(st.integers(1, 40), min_size=0, max_size=300)


def _check(lengths: list[int], seq_len: int, bins: int, packer: str, oversized: bool) -> None:
    packed = pack_lengths(lengths, seq_len=seq_len, bins_per_rank=bins, packer=packer)
    array = np.asarray(lengths, dtype=np.int64)
    assert len(packed.bin_offsets) - 1 == packed.num_steps * bins
    for step in range(packed.num_steps):
        step_bins = packed.step(step)
        assert len(step_bins) == bins
        for b in step_bins:
            assert b.size >= 1, "every bin holds a sample"
            tokens = int(array[b].sum())
            assert tokens <= seq_len or (oversized and b.size == 1), (tokens, b)
    # Conservation: every position exactly once, in a step or in the remainder.
    everything = np.concatenate([packed.items, packed.remainder])
    assert sorted(everything.tolist()) == list(range(len(lengths)))
    # The remainder is less than one step.
    if packer == "first_fit":
        assert int(np.minimum(array[packed.remainder], seq_len).sum()) < bins * seq_len or (
            packed.remainder.size < bins
        )
    else:
        assert packed.remainder.size < bins
    # Determinism: a pure function of the lengths.
    again = pack_lengths(list(lengths), seq_len=seq_len, bins_per_rank=bins, packer=packer)
    assert np.array_equal(again.items, packed.items)
    assert np.array_equal(again.bin_offsets, packed.bin_offsets)
    assert np.array_equal(again.remainder, packed.remainder)


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(40, 100), bins=st.integers(1, 5))
def test_packers_respect_capacity_and_conserve_samples(
    packer: str, lengths: list[int], seq_len: int, bins: int
) -> None:
    _check(lengths, seq_len, bins, packer, oversized=False)


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 120), max_size=200), bins=st.integers(1, 4))
def test_an_oversized_sample_takes_a_bin_alone(packer: str, lengths: list[int], bins: int) -> None:
    _check(lengths, 50, bins, packer, oversized=True)


@pytest.mark.parametrize("packer", PACKERS)
@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cut=st.integers(0, 40), bins=st.integers(1, 4))
def test_a_packer_restored_from_its_pending_items_continues_identically(
    packer: str, lengths: list[int], cut: int, bins: int
) -> None:
    def stream(start: int) -> zip[tuple[int, int]]:
        return zip(range(start, len(lengths)), lengths[start:], strict=True)

    whole = StepPacker(seq_len=64, bins_per_rank=bins, packer=packer)
    source = stream(0)
    reference = []
    while (step := whole.next_step(source)) is not None:
        reference.append(step)
    first = StepPacker(seq_len=64, bins_per_rank=bins, packer=packer)
    consumed = iter(stream(0))
    counted = _Counting(consumed)
    head = []
    while len(head) < cut and (step := first.next_step(counted)) is not None:
        head.append(step)
    resumed = StepPacker(seq_len=64, bins_per_rank=bins, packer=packer)
    resumed.pending = first.pending
    rest = stream(counted.count)
    tail = []
    while (step := resumed.next_step(rest)) is not None:
        tail.append(step)
    assert head + tail == reference


class _Counting:
    def __init__(self, it: zip[tuple[int, int]]) -> None:
        self.it, self.count = it, 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> tuple[int, int]:
        item = next(self.it)
        self.count += 1
        return item


def test_best_fit_decreasing_fills_bins_fuller_than_first_fit() -> None:
    lengths = np.random.default_rng(0).integers(1, 600, size=5000)
    fill = {}
    for packer in PACKERS:
        packed = pack_lengths(lengths, seq_len=1024, bins_per_rank=2, packer=packer)
        fill[packer] = lengths[packed.items].sum() / ((len(packed.bin_offsets) - 1) * 1024)
    assert fill["best_fit_decreasing"] > fill["first_fit"] > 0.5


def test_bad_lengths_name_the_position() -> None:
    with pytest.raises(ConfigError, match=r"lengths\[2\] is 0"):
        pack_lengths([3, 4, 0, 5], seq_len=8, bins_per_rank=1)
    with pytest.raises(ConfigError, match="1-D sequence of integers"):
        pack_lengths([1.5, 2.0], seq_len=8, bins_per_rank=1)
    with pytest.raises(ConfigError, match="packer must be one of"):
        pack_lengths([1], seq_len=8, bins_per_rank=1, packer="next_fit")
