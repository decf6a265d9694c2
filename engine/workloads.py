"""Synthetic workloads: seeded sample-length distributions and the source packers that fill a step.

A *workload* is what a rank's own data source produces before any balancing: a stream of sample
lengths drawn from a documented distribution, packed into ``bins_per_rank`` bins of at most
``seq_len`` tokens by a *source packer*. Benchmarks, the demo and tests use it to create steps
whose imbalance resembles real training data, reproducibly.

Reproducibility contract: the lengths of rank ``r`` at step ``s`` depend only on
``(distribution, packer, seed, r, s, bins_per_rank, seq_len, allow_oversized)``. Each (rank,
step) draws from its own generator seeded with ``SeedSequence([seed, r, s, 0])`` (token ids use
``[seed, r, s, 1]``), so any rank or step can be regenerated alone, in any order, on any
machine. The price: nothing carries over between steps, so a sample the packer could not place
is discarded instead of starting the next step (a real loader would keep it).

Distributions (lengths in tokens; mixtures of log-normal and log-uniform components, then
rounded and clipped to ``[1, seq_len]`` unless ``allow_oversized=True``): see :data:`SFT`,
:data:`PRETRAIN` and :data:`LONGCTX`. Packers: ``"firstfit"`` and ``"bfd"``, see
:func:`rank_step_lengths`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._validate import check_bool, check_choice, check_int, check_optional_int
from evenflow.engine.errors import ConfigError

__all__ = [
    "DISTRIBUTIONS",
    "LONGCTX",
    "PACKERS",
    "PRETRAIN",
    "SFT",
    "LengthMixture",
    "LogNormal",
    "LogUniform",
    "Packer",
    "fill_fraction",
    "make_step",
    "rank_step_lengths",
    "sample_lengths",
    "step_source",
]

Packer = Literal["firstfit", "bfd"]
PACKERS: tuple[str, ...] = ("firstfit", "bfd")

# Lengths are drawn in fixed-size chunks; the chunk size is part of the reproducibility contract
# (changing it changes every stream), so it is a constant, not an option.
_CHUNK = 256
# BFD places a buffer of this fraction of the step's capacity decreasingly, then offers this
# fraction more in arrival order to top up the gaps. Tuned on the named distributions: fill
# 97-100% and samples per step within ~10% of first-fit's (see _best_fit_decreasing).
_BFD_BUFFER_FACTOR = 0.9
_BFD_TOPUP_FACTOR = 0.25


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, but got {value!r}.")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, but got {value!r}.")


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal component: ``exp(N(ln(median), sigma^2))`` tokens, with mixture ``weight``."""

    weight: float
    median: float
    sigma: float

    def __post_init__(self) -> None:
        _positive("LogNormal.weight", self.weight)
        _positive("LogNormal.median", self.median)
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float)):
            raise ConfigError(f"LogNormal.sigma must be a number >= 0, but got {self.sigma!r}.")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ConfigError(f"LogNormal.sigma must be a finite number >= 0, got {self.sigma!r}.")

    def draw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.float64]:
        return rng.lognormal(math.log(self.median), self.sigma, size=n)


@dataclass(frozen=True, slots=True)
class LogUniform:
    """A log-uniform component on ``[low, high]`` tokens, with mixture ``weight``."""

    weight: float
    low: float
    high: float

    def __post_init__(self) -> None:
        _positive("LogUniform.weight", self.weight)
        _positive("LogUniform.low", self.low)
        _positive("LogUniform.high", self.high)
        if self.high < self.low:
            raise ConfigError(
                f"LogUniform.high must be >= low={self.low!r}, but got {self.high!r}; "
                "swap the bounds."
            )

    def draw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.float64]:
        return np.exp(rng.uniform(math.log(self.low), math.log(self.high), size=n))


@dataclass(frozen=True, slots=True)
class LengthMixture:
    """A documented distribution of sample lengths: a weighted mixture of components.

    ``default_seq_len`` is the packed-sequence length the distribution was designed for (what
    benchmarks use unless told otherwise); lengths are never scaled to ``seq_len``.
    """

    name: str
    components: tuple[LogNormal | LogUniform, ...]
    default_seq_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"LengthMixture.name must be a non-empty string, got {self.name!r}.")
        if not self.components:
            raise ConfigError(
                f"LengthMixture {self.name!r} needs at least one component, got none."
            )
        for c in self.components:
            if not isinstance(c, (LogNormal, LogUniform)):
                raise TypeError(
                    f"LengthMixture components must be LogNormal or LogUniform, but got {c!r}."
                )
        check_int("LengthMixture.default_seq_len", self.default_seq_len, minimum=1)

    def draw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        """``n`` unclipped lengths (int64, each >= 1), consuming ``rng`` deterministically."""
        weights = np.array([c.weight for c in self.components], dtype=np.float64)
        which = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        values = np.empty(n, dtype=np.float64)
        for k, component in enumerate(self.components):
            mask = which == k
            values[mask] = component.draw(rng, int(mask.sum()))
        return np.maximum(np.rint(values), 1).astype(np.int64)


SFT = LengthMixture(
    name="sft",
    components=(LogNormal(0.98, median=800, sigma=0.9), LogUniform(0.02, low=4096, high=32768)),
    default_seq_len=32768,
)
"""Supervised fine-tuning: chat turns around 800 tokens plus ~2% long documents.

98%: log-normal, median 800 tokens, sigma 0.9 (mean ~1,200; 90th percentile ~2,550).
2%: log-uniform on [4,096, 32,768] (mean ~13,500). Mean length ~1,450; designed for
``seq_len=32768`` (~22 samples per bin, ~1,000 samples per step at 8 ranks x 4 bins).
"""

PRETRAIN = LengthMixture(
    name="pretrain",
    components=(
        LogNormal(0.70, median=600, sigma=1.0),
        LogNormal(0.25, median=3000, sigma=0.9),
        LogUniform(0.05, low=16384, high=131072),
    ),
    default_seq_len=32768,
)
"""Pretraining mix with a long tail of documents.

70%: web pages, log-normal, median 600, sigma 1.0. 25%: books/code/papers, log-normal, median
3,000, sigma 0.9. 5%: long documents, log-uniform on [16,384, 131,072] (more than half of them
clipped to ``seq_len``, as a chunking pretraining loader would). Designed for ``seq_len=32768``.
"""

LONGCTX = LengthMixture(
    name="longctx",
    components=(
        LogNormal(0.40, median=1500, sigma=1.0),
        LogUniform(0.40, low=8192, high=65536),
        LogUniform(0.20, low=65536, high=262144),
    ),
    default_seq_len=131072,
)
"""Long-context training mix: few samples per bin, costs dominated by the quadratic term.

40%: short instructions, log-normal, median 1,500, sigma 1.0. 40%: log-uniform on
[8,192, 65,536]. 20%: log-uniform on [65,536, 262,144] (half clipped to ``seq_len``).
Designed for ``seq_len=131072`` (~4 samples per bin).
"""

DISTRIBUTIONS: dict[str, LengthMixture] = {m.name: m for m in (SFT, PRETRAIN, LONGCTX)}
"""The named distributions, by name."""


def _mixture(distribution: str | LengthMixture) -> LengthMixture:
    if isinstance(distribution, LengthMixture):
        return distribution
    check_choice("distribution", distribution, tuple(DISTRIBUTIONS))
    return DISTRIBUTIONS[distribution]


def _rng(seed: int, rank: int, step: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, rank, step, purpose]))


def sample_lengths(
    distribution: str | LengthMixture,
    num_samples: int,
    *,
    seq_len: int,
    seed: int,
    allow_oversized: bool = False,
) -> npt.NDArray[np.int64]:
    """``num_samples`` i.i.d. lengths (int64) from ``distribution``, clipped to ``[1, seq_len]``.

    With ``allow_oversized=True`` lengths above ``seq_len`` are kept. Deterministic per seed.
    """
    mixture = _mixture(distribution)
    check_int("num_samples", num_samples, minimum=0)
    check_int("seq_len", seq_len, minimum=1)
    check_int("seed", seed, minimum=0)
    check_bool("allow_oversized", allow_oversized)
    lengths = mixture.draw(np.random.default_rng(np.random.SeedSequence([seed])), num_samples)
    return lengths if allow_oversized else np.minimum(lengths, seq_len)


def _stream(
    mixture: LengthMixture, rng: np.random.Generator, seq_len: int, allow_oversized: bool
) -> Iterator[int]:
    while True:
        chunk = mixture.draw(rng, _CHUNK)
        if not allow_oversized:
            chunk = np.minimum(chunk, seq_len)
        yield from chunk.tolist()


def _first_fit(stream: Iterator[int], bins_per_rank: int, seq_len: int) -> list[list[int]]:
    # Each arriving sample goes to the first open bin with room; the step closes at the first
    # sample that fits no bin. Any sample fits an empty bin (an oversized one only an empty
    # bin, which it then closes), so at close every bin is non-empty.
    bins: list[list[int]] = [[] for _ in range(bins_per_rank)]
    free = [seq_len] * bins_per_rank
    for length in stream:
        for i in range(bins_per_rank):
            if length > seq_len:
                if not bins[i]:
                    bins[i].append(length)
                    free[i] = 0
                    break
            elif length <= free[i]:
                bins[i].append(length)
                free[i] -= length
                break
        else:
            return bins
    raise AssertionError("the length stream is endless")  # pragma: no cover


def _best_fit_decreasing(
    stream: Iterator[int], bins_per_rank: int, seq_len: int
) -> list[list[int]]:
    # Phase 1: buffer ~90% of the step's capacity and place it longest first, each sample into
    # the fullest bin that still fits it. Phase 2: top up the gaps best-fit from the next ~25%
    # of capacity in arrival order, discarding what fits nowhere. Buffering more and placing
    # it all decreasingly would fill as well but keep only the longest samples of the buffer
    # (in sft, ~half the samples per step); the two phases keep the step's mix close to the
    # stream's, as a loader that carries leftovers over would in steady state.
    capacity = bins_per_rank * seq_len
    buffer: list[int] = []
    buffered = 0
    for length in stream:
        buffer.append(length)
        buffered += min(length, seq_len)
        if buffered >= capacity * _BFD_BUFFER_FACTOR and len(buffer) >= bins_per_rank:
            break
    buffer.sort(reverse=True)
    bins: list[list[int]] = [[] for _ in range(bins_per_rank)]
    free = [seq_len] * bins_per_rank

    def place(length: int) -> None:
        best = -1
        if length > seq_len:  # oversized: alone in an empty bin, which it closes
            best = next((i for i in range(bins_per_rank) if not bins[i]), -1)
            if best >= 0:
                bins[best].append(length)
                free[best] = 0
            return
        for i in range(bins_per_rank):
            if length <= free[i] and (best < 0 or free[i] < free[best]):
                best = i
        if best >= 0:
            bins[best].append(length)
            free[best] -= length

    for length in buffer:
        place(length)
    # Every sample fits an empty bin, so while one is empty the stream keeps filling: the loop
    # ends with every bin non-empty.
    offered = 0
    for length in stream:
        if offered >= capacity * _BFD_TOPUP_FACTOR and all(bins):
            break
        offered += min(length, seq_len)
        place(length)
    return bins


def rank_step_lengths(
    distribution: str | LengthMixture,
    packer: str,
    *,
    rank: int,
    step: int,
    bins_per_rank: int,
    seq_len: int,
    seed: int,
    allow_oversized: bool = False,
) -> list[list[int]]:
    """The sample lengths of one rank's step: ``bins_per_rank`` non-empty bins, in pack order.

    ``packer="firstfit"``: samples arrive in stream order and each goes into the first bin with
    room; the step closes at the first sample that fits no bin (typical of streaming loaders;
    bins end 60-99% full, fuller with more bins). ``packer="bfd"``: best-fit-decreasing over a
    buffer of ~90% of the step's capacity, then best-fit top-up from the stream; bins end
    97-100% full. Every bin holds at most ``seq_len`` tokens, except a bin holding one
    oversized sample alone when ``allow_oversized=True``.
    """
    mixture = _mixture(distribution)
    check_choice("packer", packer, PACKERS)
    check_int("rank", rank, minimum=0)
    check_int("step", step, minimum=0)
    check_int("bins_per_rank", bins_per_rank, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    check_int("seed", seed, minimum=0)
    check_bool("allow_oversized", allow_oversized)
    stream = _stream(mixture, _rng(seed, rank, step, 0), seq_len, allow_oversized)
    if packer == "firstfit":
        return _first_fit(stream, bins_per_rank, seq_len)
    return _best_fit_decreasing(stream, bins_per_rank, seq_len)


def make_step(
    distribution: str | LengthMixture,
    packer: str,
    *,
    num_ranks: int,
    bins_per_rank: int,
    seq_len: int,
    seed: int,
    step: int = 0,
    allow_oversized: bool = False,
) -> tuple[list[tuple[SampleKey, SampleMetadata]], list[list[SampleKey]]]:
    """One whole step of a balance group, as the planner receives it.

    Returns ``(samples, reference_bins)``: every sample as ``(SampleKey(rank, step, i),
    SampleMetadata(tokens=length))`` with ``i`` counting the rank's samples in bin order, and
    the source layout as a rank-major list of ``num_ranks * bins_per_rank`` lists of keys.
    Rank ``r``'s bins equal ``rank_step_lengths(..., rank=r, step=step)``.
    """
    check_int("num_ranks", num_ranks, minimum=1)
    samples: list[tuple[SampleKey, SampleMetadata]] = []
    reference_bins: list[list[SampleKey]] = []
    for rank in range(num_ranks):
        index = 0
        for lengths in rank_step_lengths(
            distribution,
            packer,
            rank=rank,
            step=step,
            bins_per_rank=bins_per_rank,
            seq_len=seq_len,
            seed=seed,
            allow_oversized=allow_oversized,
        ):
            keys = []
            for length in lengths:
                key = SampleKey(rank, step, index)
                index += 1
                samples.append((key, SampleMetadata(tokens=length)))
                keys.append(key)
            reference_bins.append(keys)
    return samples, reference_bins


def step_source(
    distribution: str | LengthMixture,
    packer: str,
    *,
    rank: int,
    bins_per_rank: int,
    seq_len: int,
    seed: int,
    num_steps: int | None,
    start_step: int = 0,
    vocab_size: int = 32000,
    allow_oversized: bool = False,
) -> Iterator[list[list[dict[str, npt.NDArray[np.int32]]]]]:
    """A rank-local source: per step, ``bins_per_rank`` bins of samples ``{"input_ids": ...}``.

    ``input_ids`` is an int32 array of the sample's length holding token ids uniform in
    ``[0, vocab_size)`` (the samples of one step are views into one array). Steps run from
    ``start_step`` for ``num_steps`` steps (``None``: endless); step ``s`` is the same however
    it is reached, so resuming at ``start_step=s`` reproduces the rest of the stream.
    """
    _mixture(distribution)
    check_choice("packer", packer, PACKERS)
    check_int("rank", rank, minimum=0)
    check_int("bins_per_rank", bins_per_rank, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    check_int("seed", seed, minimum=0)
    check_optional_int("num_steps", num_steps, minimum=0)
    check_int("start_step", start_step, minimum=0)
    check_int("vocab_size", vocab_size, minimum=1)
    if vocab_size > 2**31:
        raise ConfigError(
            f"vocab_size must fit int32 token ids (<= 2**31), but got {vocab_size!r}."
        )
    check_bool("allow_oversized", allow_oversized)
    return _step_source(
        distribution=distribution,
        packer=packer,
        rank=rank,
        bins_per_rank=bins_per_rank,
        seq_len=seq_len,
        seed=seed,
        num_steps=num_steps,
        start_step=start_step,
        vocab_size=vocab_size,
        allow_oversized=allow_oversized,
    )


def _step_source(
    *,
    distribution: str | LengthMixture,
    packer: str,
    rank: int,
    bins_per_rank: int,
    seq_len: int,
    seed: int,
    num_steps: int | None,
    start_step: int,
    vocab_size: int,
    allow_oversized: bool,
) -> Iterator[list[list[dict[str, npt.NDArray[np.int32]]]]]:
    # Split from step_source so argument errors raise at the call, not at the first next().
    step = start_step
    while num_steps is None or step < start_step + num_steps:
        bins = rank_step_lengths(
            distribution,
            packer,
            rank=rank,
            step=step,
            bins_per_rank=bins_per_rank,
            seq_len=seq_len,
            seed=seed,
            allow_oversized=allow_oversized,
        )
        flat = [length for lengths in bins for length in lengths]
        tokens = _rng(seed, rank, step, 1).integers(0, vocab_size, size=sum(flat), dtype=np.int32)
        offsets = np.cumsum([0, *flat]).tolist()
        out: list[list[dict[str, npt.NDArray[np.int32]]]] = []
        i = 0
        for lengths in bins:
            out.append(
                [
                    {"input_ids": tokens[offsets[i + j] : offsets[i + j + 1]]}
                    for j in range(len(lengths))
                ]
            )
            i += len(lengths)
        yield out
        step += 1


def fill_fraction(bins: Sequence[Sequence[int]], seq_len: int) -> float:
    """Tokens held over tokens available (``len(bins) * seq_len``) for bins of lengths."""
    check_int("seq_len", seq_len, minimum=1)
    if not bins:
        return 0.0
    return sum(sum(b) for b in bins) / (len(bins) * seq_len)
