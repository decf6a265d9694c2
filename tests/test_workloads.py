from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import SampleKey
from evenflow.engine.workloads import (
    DISTRIBUTIONS,
    PACKERS,
    SFT,
    LengthMixture,
    LogNormal,
    LogUniform,
    fill_fraction,
    make_step,
    rank_step_lengths,
    sample_lengths,
    step_source,
)


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("bins_per_rank", [1, 3, 16])
def test_packers_fill_exactly_the_bins_within_seq_len(
    distribution: str, packer: str, bins_per_rank: int
) -> None:
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    for rank in range(4):
        bins = rank_step_lengths(
            distribution,
            packer,
            rank=rank,
            step=7,
            bins_per_rank=bins_per_rank,
            seq_len=seq_len,
            seed=3,
        )
        assert len(bins) == bins_per_rank
        for lengths in bins:
            assert lengths, "every bin must be non-empty"
            assert sum(lengths) <= seq_len
            assert all(1 <= length <= seq_len for length in lengths)


@settings(max_examples=40, deadline=None)
@given(
    packer=st.sampled_from(PACKERS),
    bins_per_rank=st.integers(1, 8),
    seq_len=st.integers(1, 5000),
    seed=st.integers(0, 2**32),
    oversized=st.booleans(),
)
def test_packers_respect_seq_len_for_any_shape(
    packer: str, bins_per_rank: int, seq_len: int, seed: int, oversized: bool
) -> None:
    bins = rank_step_lengths(
        "pretrain",
        packer,
        rank=1,
        step=2,
        bins_per_rank=bins_per_rank,
        seq_len=seq_len,
        seed=seed,
        allow_oversized=oversized,
    )
    assert len(bins) == bins_per_rank
    for lengths in bins:
        assert lengths
        if any(length > seq_len for length in lengths):
            assert oversized
            assert len(lengths) == 1, "an oversized sample must sit alone in its bin"
        else:
            assert sum(lengths) <= seq_len


def test_oversized_samples_appear_only_when_allowed() -> None:
    kwargs = dict(bins_per_rank=4, seq_len=2048, seed=0)
    found = 0
    for step in range(20):
        clipped = rank_step_lengths("longctx", "firstfit", rank=0, step=step, **kwargs)  # type: ignore[arg-type]
        assert max(max(b) for b in clipped) <= 2048
        kept = rank_step_lengths(
            "longctx",
            "firstfit",
            rank=0,
            step=step,
            allow_oversized=True,
            **kwargs,  # type: ignore[arg-type]
        )
        found += sum(1 for b in kept if b[0] > 2048)
    assert found > 0


def test_bfd_fills_tighter_than_first_fit() -> None:
    for distribution, mixture in DISTRIBUTIONS.items():
        fills: dict[str, float] = {}
        for packer in PACKERS:
            per_rank = [
                fill_fraction(
                    rank_step_lengths(
                        distribution,
                        packer,
                        rank=rank,
                        step=0,
                        bins_per_rank=4,
                        seq_len=mixture.default_seq_len,
                        seed=11,
                    ),
                    mixture.default_seq_len,
                )
                for rank in range(32)
            ]
            fills[packer] = float(np.mean(per_rank))
        assert fills["bfd"] > fills["firstfit"], (distribution, fills)
        assert fills["bfd"] > 0.95, (distribution, fills)


def test_make_step_is_deterministic_and_seed_sensitive() -> None:
    kwargs = dict(num_ranks=4, bins_per_rank=3, seq_len=32768, step=5)
    a = make_step("sft", "firstfit", seed=1, **kwargs)  # type: ignore[arg-type]
    b = make_step("sft", "firstfit", seed=1, **kwargs)  # type: ignore[arg-type]
    c = make_step("sft", "firstfit", seed=2, **kwargs)  # type: ignore[arg-type]
    assert a == b
    assert [m.tokens for _, m in a[0]] != [m.tokens for _, m in c[0]]


def test_make_step_keys_and_layout() -> None:
    samples, reference_bins = make_step(
        "pretrain", "bfd", num_ranks=3, bins_per_rank=2, seq_len=32768, seed=4, step=9
    )
    assert len(reference_bins) == 6
    tokens = {key: meta.tokens for key, meta in samples}
    assert len(tokens) == len(samples)
    assert [k for b in reference_bins for k in b] == [k for k, _ in samples]
    for rank in range(3):
        keys = [k for b in reference_bins[2 * rank : 2 * rank + 2] for k in b]
        assert keys == [SampleKey(rank, 9, i) for i in range(len(keys))]
        # Each rank's bins are reproducible on their own, without the rest of the group.
        alone = rank_step_lengths(
            "pretrain", "bfd", rank=rank, step=9, bins_per_rank=2, seq_len=32768, seed=4
        )
        assert [[tokens[k] for k in b] for b in reference_bins[2 * rank : 2 * rank + 2]] == alone


def test_step_source_yields_int32_samples_and_resumes() -> None:
    kwargs = dict(rank=2, bins_per_rank=4, seq_len=8192, seed=6, vocab_size=1000)
    steps = list(step_source("sft", "bfd", num_steps=3, **kwargs))  # type: ignore[arg-type]
    assert len(steps) == 3
    for offset, step in enumerate(steps):
        expected = rank_step_lengths(
            "sft", "bfd", rank=2, step=offset, bins_per_rank=4, seq_len=8192, seed=6
        )
        assert [[len(s["input_ids"]) for s in b] for b in step] == expected
        for b in step:
            for sample in b:
                ids = sample["input_ids"]
                assert ids.dtype == np.int32
                assert ids.min() >= 0
                assert ids.max() < 1000
    resumed = next(step_source("sft", "bfd", num_steps=1, start_step=2, **kwargs))  # type: ignore[arg-type]
    assert len(resumed) == 4
    for got, want in zip(resumed, steps[2], strict=True):
        assert len(got) == len(want)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
    assert list(step_source("sft", "bfd", num_steps=0, **kwargs)) == []  # type: ignore[arg-type]


def test_sft_distribution_matches_its_documentation() -> None:
    lengths = sample_lengths("sft", 40000, seq_len=10**6, seed=0)
    assert lengths.dtype == np.int64
    assert 700 <= float(np.median(lengths)) <= 900
    long_fraction = float(np.mean(lengths >= 4096))
    # 2% drawn from [4096, 32768] plus the log-normal's own tail above 4096 (~3%).
    assert 0.02 < long_fraction < 0.08
    assert int(lengths.max()) <= 32768 * 2
    clipped = sample_lengths("sft", 40000, seq_len=2000, seed=0)
    assert int(clipped.max()) == 2000
    assert int(clipped.min()) >= 1
    np.testing.assert_array_equal(clipped, np.minimum(lengths, 2000))


def test_custom_mixture_is_accepted() -> None:
    mixture = LengthMixture(
        name="fixed", components=(LogUniform(1.0, low=100, high=100),), default_seq_len=1000
    )
    bins = rank_step_lengths(
        mixture, "firstfit", rank=0, step=0, bins_per_rank=2, seq_len=1000, seed=0
    )
    assert bins == [[100] * 10, [100] * 10]
    assert fill_fraction(bins, 1000) == 1.0
    assert SFT.components[0] == LogNormal(0.98, median=800, sigma=0.9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distribution": "chat"}, "distribution must be one of"),
        ({"packer": "nextfit"}, "packer must be one of"),
        ({"bins_per_rank": 0}, "bins_per_rank must be an integer >= 1"),
        ({"seq_len": True}, "seq_len must be an integer"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"rank": 1.5}, "rank must be an integer"),
    ],
)
def test_rank_step_lengths_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(
        distribution="sft", packer="bfd", rank=0, step=0, bins_per_rank=2, seq_len=4096, seed=0
    )
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        rank_step_lengths(**args)  # type: ignore[arg-type]


def test_other_entry_points_reject_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="num_ranks"):
        make_step("sft", "bfd", num_ranks=0, bins_per_rank=1, seq_len=10, seed=0)
    with pytest.raises(ConfigError, match="vocab_size"):
        step_source(
            "sft",
            "bfd",
            rank=0,
            bins_per_rank=1,
            seq_len=10,
            seed=0,
            num_steps=1,
            vocab_size=2**40,
        )
    with pytest.raises(ConfigError, match="num_steps"):
        step_source("sft", "bfd", rank=0, bins_per_rank=1, seq_len=10, seed=0, num_steps=-1)
    with pytest.raises(ConfigError, match="high"):
        LogUniform(1.0, low=10, high=5)
    with pytest.raises(ConfigError, match="sigma"):
        LogNormal(1.0, median=10, sigma=-1)
    with pytest.raises(TypeError, match="components"):
        LengthMixture(name="x", components=(1.0,), default_seq_len=10)  # type: ignore[arg-type]
