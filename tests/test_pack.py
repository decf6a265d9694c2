from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from evenflow.engine._pipeline.pack import default_collate_fn, default_pack_fn
from evenflow.engine.errors import ConfigError


def _as_list(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.tolist()]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(list, id="list"),
        pytest.param(tuple, id="tuple"),
        pytest.param(lambda xs: np.asarray(xs, dtype=np.int32), id="numpy-int32"),
        pytest.param(lambda xs: torch.tensor(xs, dtype=torch.int64), id="tensor"),
        pytest.param(lambda xs: {"input_ids": list(xs), "meta": "ignored"}, id="dict"),
    ],
)
def test_pack_concatenates_and_marks_boundaries(make: Any) -> None:
    samples = [make([5, 6, 7]), make([8]), make([9, 10])]
    packed = default_pack_fn(samples, seq_len=8)
    assert _as_list(packed["input_ids"]) == [5, 6, 7, 8, 9, 10]
    assert _as_list(packed["position_ids"]) == [0, 1, 2, 0, 0, 1]
    assert _as_list(packed["cu_seqlens"]) == [0, 3, 4, 6]
    assert _as_list(packed["seq_lens"]) == [3, 1, 2]
    assert packed["max_seqlen"] == 3
    assert isinstance(packed["max_seqlen"], int)
    assert packed["input_ids"].dtype == torch.int64
    assert packed["position_ids"].dtype == torch.int64
    assert packed["cu_seqlens"].dtype == torch.int32
    assert "labels" not in packed


def test_pack_matches_a_reference_on_random_bins() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        lengths = rng.integers(1, 50, size=int(rng.integers(1, 8)))
        samples = [rng.integers(0, 32_000, size=int(n)) for n in lengths]
        packed = default_pack_fn(samples, seq_len=int(lengths.sum()))
        expected_positions = [p for n in lengths for p in range(int(n))]
        assert _as_list(packed["input_ids"]) == [int(v) for s in samples for v in s]
        assert _as_list(packed["position_ids"]) == expected_positions
        cu = _as_list(packed["cu_seqlens"])
        assert [b - a for a, b in itertools.pairwise(cu)] == [int(n) for n in lengths]
        assert packed["max_seqlen"] == int(lengths.max())


def test_labels_are_packed_only_when_every_sample_has_them() -> None:
    samples = [
        {"input_ids": [1, 2], "labels": [-100, 2]},
        {"input_ids": np.array([3]), "labels": torch.tensor([3])},
    ]
    packed = default_pack_fn(samples, seq_len=4)
    assert _as_list(packed["labels"]) == [-100, 2, 3]
    assert packed["labels"].dtype == torch.int64

    mixed = [{"input_ids": [1, 2], "labels": [1, 2]}, [3]]
    assert "labels" not in default_pack_fn(mixed, seq_len=4)
    with_none = [{"input_ids": [1, 2], "labels": None}, {"input_ids": [3], "labels": [3]}]
    assert "labels" not in default_pack_fn(with_none, seq_len=4)


def test_read_only_numpy_inputs_pack_without_warnings_or_aliasing() -> None:
    buffer = np.arange(6, dtype=np.int64)
    buffer.setflags(write=False)
    packed = default_pack_fn([buffer[:4], buffer[4:]], seq_len=6)
    assert _as_list(packed["input_ids"]) == [0, 1, 2, 3, 4, 5]
    packed["input_ids"][0] = 99  # the output owns its memory
    assert buffer[0] == 0


def test_single_sample_output_does_not_alias_a_tensor_input() -> None:
    source = torch.tensor([4, 5, 6])
    packed = default_pack_fn([source], seq_len=3)
    packed["input_ids"][0] = 0
    assert _as_list(source) == [4, 5, 6]


def test_oversized_singleton_is_allowed() -> None:
    packed = default_pack_fn([list(range(10))], seq_len=4)
    assert packed["input_ids"].numel() == 10
    assert _as_list(packed["cu_seqlens"]) == [0, 10]


def test_overfull_bin_names_seq_len_and_total() -> None:
    with pytest.raises(ValueError, match=r"5 tokens.*seq_len=4"):
        default_pack_fn([[1, 2, 3], [4, 5]], seq_len=4)


def test_exactly_full_bin_is_accepted() -> None:
    packed = default_pack_fn([[1, 2], [3, 4]], seq_len=4)
    assert _as_list(packed["cu_seqlens"]) == [0, 2, 4]


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "samples is empty"),
        ([[1], []], r"samples\[1\] has no tokens"),
        ([[1], np.array([], dtype=np.int64)], r"samples\[1\] has no tokens"),
        ([[1.5, 2.0]], "integer token ids"),
        ([torch.tensor([1.0])], "integer tensor"),
        ([torch.tensor([True])], "bool tensor"),
        ([[[1, 2], [3, 4]]], "1-D"),
        ([{"labels": [1]}], "without 'input_ids'"),
        ([{"input_ids": [1, 2], "labels": [1]}], "2 input_ids but 1 labels"),
    ],
)
def test_bad_samples_raise_clear_errors(samples: list[Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        default_pack_fn(samples, seq_len=8)


@pytest.mark.parametrize("bad", ["abc", 5, None])
def test_non_sequence_samples_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"samples\[0\]"):
        default_pack_fn([bad], seq_len=8)


@pytest.mark.parametrize("bad", [0, -1, True, 4.0])
def test_seq_len_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        default_pack_fn([[1]], seq_len=bad)  # type: ignore[arg-type]


def test_bin_must_be_a_sequence() -> None:
    with pytest.raises(TypeError, match="samples must be a sequence"):
        default_pack_fn({"input_ids": [1]}, seq_len=8)  # type: ignore[arg-type]


def test_collate_returns_the_bins_unchanged() -> None:
    bins = [default_pack_fn([[1, 2]], seq_len=2), default_pack_fn([[3]], seq_len=2)]
    collated = default_collate_fn(bins)
    assert collated is bins
    as_tuple = default_collate_fn(tuple(bins))
    assert isinstance(as_tuple, list)
    assert as_tuple[1] is bins[1]
    with pytest.raises(TypeError, match="packed_bins"):
        default_collate_fn(bins[0])  # type: ignore[arg-type]
