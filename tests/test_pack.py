from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenflow.engine._pipeline.pack import count_loss_tokens, default_collate_fn, default_pack_fn
from evenflow.engine.errors import ConfigError


def _as_list(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.reshape(-1).tolist()]


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
    assert _as_list(packed["labels"]) == [-100, 6, 7, -100, -100, 10]
    assert _as_list(packed["cu_seq_lens_q"]) == [0, 3, 4, 6]
    assert _as_list(packed["cu_seq_lens_k"]) == [0, 3, 4, 6]
    assert packed["max_length_q"] == packed["max_length_k"] == 3
    assert isinstance(packed["max_length_q"], int) and isinstance(packed["max_length_k"], int)
    for name in ("input_ids", "labels", "position_ids"):
        assert packed[name].dtype == torch.int64 and packed[name].shape == (1, 6)
    assert packed["cu_seq_lens_q"].dtype == torch.int32 and packed["cu_seq_lens_q"].shape == (4,)
    assert sorted(packed) == [
        "cu_seq_lens_k",
        "cu_seq_lens_q",
        "input_ids",
        "labels",
        "max_length_k",
        "max_length_q",
        "position_ids",
    ]


def test_pack_matches_a_reference_on_random_bins() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        lengths = rng.integers(1, 50, size=int(rng.integers(1, 8)))
        samples = [rng.integers(0, 32_000, size=int(n)) for n in lengths]
        packed = default_pack_fn(samples, seq_len=int(lengths.sum()))
        expected_positions = [p for n in lengths for p in range(int(n))]
        assert _as_list(packed["input_ids"]) == [int(v) for s in samples for v in s]
        assert _as_list(packed["position_ids"]) == expected_positions
        cu = _as_list(packed["cu_seq_lens_q"])
        assert [b - a for a, b in itertools.pairwise(cu)] == [int(n) for n in lengths]
        assert packed["max_length_q"] == int(lengths.max())


def test_labels_keep_each_samples_masks_and_ignore_every_first_position() -> None:
    samples = [
        {"input_ids": [1, 2, 3, 4], "labels": [1, -100, -100, 4]},  # a masked prompt
        {"input_ids": np.array([5, 6]), "labels": torch.tensor([5, 6])},
    ]
    packed = default_pack_fn(samples, seq_len=8)
    assert _as_list(packed["labels"]) == [-100, -100, -100, 4, -100, 6]
    assert packed["labels"].dtype == torch.int64
    assert count_loss_tokens(packed) == 2 == sum(count_loss_tokens(s) for s in samples)

    # A sample without labels (or with labels=None) trains on its own tokens.
    mixed = [{"input_ids": [1, 2], "labels": [1, -100]}, [3, 4], {"input_ids": [5], "labels": None}]
    assert _as_list(default_pack_fn(mixed, seq_len=8)["labels"]) == [-100, -100, -100, 4, -100]


def test_packing_never_writes_into_a_samples_labels() -> None:
    own = np.array([7, 8, 9])
    sample = {"input_ids": own, "labels": own}
    packed = default_pack_fn([sample, sample], seq_len=6)
    assert _as_list(packed["labels"]) == [-100, 8, 9, -100, 8, 9]
    assert own.tolist() == [7, 8, 9]


def test_count_loss_tokens_follows_the_shifted_labels() -> None:
    assert count_loss_tokens([1, 2, 3]) == 2
    assert count_loss_tokens(torch.tensor([4])) == 0
    assert count_loss_tokens({"input_ids": [1, 2, 3], "labels": [1, 2, 3]}) == 2
    assert count_loss_tokens({"input_ids": [1, 2, 3], "labels": [1, -100, 3]}) == 1
    assert count_loss_tokens({"input_ids": [1, 2, 3], "labels": None}) == 2
    with pytest.raises(ConfigError, match="3 input_ids but 2 labels"):
        count_loss_tokens({"input_ids": [1, 2, 3], "labels": [1, 2]})
    with pytest.raises(ConfigError, match="1-D"):
        count_loss_tokens(np.zeros((2, 3), dtype=np.int64))


def test_read_only_numpy_inputs_pack_without_warnings_or_aliasing() -> None:
    buffer = np.arange(6, dtype=np.int64)
    buffer.setflags(write=False)
    packed = default_pack_fn([buffer[:4], buffer[4:]], seq_len=6)
    assert _as_list(packed["input_ids"]) == [0, 1, 2, 3, 4, 5]
    packed["input_ids"][0, 0] = 99  # the output owns its memory
    assert buffer[0] == 0


def test_single_sample_output_does_not_alias_a_tensor_input() -> None:
    source = torch.tensor([4, 5, 6])
    packed = default_pack_fn([source], seq_len=3)
    packed["input_ids"][0, 0] = 0
    assert _as_list(source) == [4, 5, 6]


def test_oversized_singleton_is_allowed() -> None:
    packed = default_pack_fn([list(range(10))], seq_len=4)
    assert packed["input_ids"].numel() == 10
    assert _as_list(packed["cu_seq_lens_q"]) == [0, 10]


def test_overfull_bin_names_seq_len_and_total() -> None:
    with pytest.raises(ValueError, match=r"5 tokens.*seq_len=4"):
        default_pack_fn([[1, 2, 3], [4, 5]], seq_len=4)


def test_exactly_full_bin_is_accepted() -> None:
    packed = default_pack_fn([[1, 2], [3, 4]], seq_len=4)
    assert _as_list(packed["cu_seq_lens_q"]) == [0, 2, 4]


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


_SAMPLE = st.tuples(
    st.lists(st.integers(0, 31_999), min_size=1, max_size=12),
    st.none() | st.lists(st.booleans(), min_size=12, max_size=12),  # where the labels mask
)


@given(st.lists(_SAMPLE, min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_pack_layout_properties(drawn: list[tuple[list[int], list[bool] | None]]) -> None:
    samples: list[Any] = []
    for tokens, mask in drawn:
        if mask is None:
            samples.append(tokens)
        else:
            labels = [-100 if masked else t for t, masked in zip(tokens, mask, strict=False)]
            samples.append({"input_ids": tokens, "labels": labels})
    packed = default_pack_fn(samples, seq_len=sum(len(t) for t, _ in drawn))
    total = sum(len(t) for t, _ in drawn)
    for name in ("input_ids", "labels", "position_ids"):
        assert packed[name].shape == (1, total) and packed[name].dtype == torch.int64
    cu = packed["cu_seq_lens_q"]
    assert cu is packed["cu_seq_lens_k"] and cu.dtype == torch.int32
    assert _as_list(cu) == [0, *itertools.accumulate(len(t) for t, _ in drawn)]
    assert packed["max_length_q"] == packed["max_length_k"] == max(len(t) for t, _ in drawn)
    # Positions restart exactly at the boundaries.
    assert [i for i, p in enumerate(_as_list(packed["position_ids"])) if p == 0] == _as_list(cu)[
        :-1
    ]
    # Labels: -100 at every start and wherever the sample masks; the token everywhere else.
    expected: list[int] = []
    for tokens, mask in drawn:
        for j, token in enumerate(tokens):
            expected.append(-100 if j == 0 or (mask is not None and mask[j]) else token)
    assert _as_list(packed["labels"]) == expected
    assert count_loss_tokens(packed) == sum(label != -100 for label in expected)
    assert count_loss_tokens(packed) == sum(count_loss_tokens(s) for s in samples)
