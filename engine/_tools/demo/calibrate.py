"""The demo's cost model: seconds of forward + backward, fitted to bins timed on this machine.

Before training, every rank times the same set of packed bins (:func:`calibration_bins`: one
long sample, many short ones, half-full bins) through the real model on the one thread it
trains with, while the other ranks do the same — the conditions of training. Timings are CPU
time, so that other jobs on a shared machine do not enter the model. The ranks average
their timings and each fits the same :class:`FittedCost`. The fit has five terms with a
physical meaning (per bin, per sample, per token, per query-key pair, and a cubic one for
attention outgrowing the caches), so a noisy timing moves a coefficient a little instead of
bending an interpolated curve. The fit is the library's
(:func:`~evenflow.engine._planning.calibration.fit_coefficients`, the one online calibration
uses), and the loaders start from it and keep calibrating while training
(:meth:`FittedCost.calibrated`). The demo then checks the start-up fit against the compute it
measures while training, and says so when they disagree.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from evenflow.engine._model import SampleMetadata
from evenflow.engine._pipeline.pack import IGNORE_INDEX
from evenflow.engine._planning.calibration import CalibratedCost, fit_coefficients
from evenflow.engine._tools.demo.model import TinyCausalLM, packed_loss
from evenflow.engine._validate import check_int

__all__ = ["CubicTerm", "FittedCost", "calibration_bins", "time_bins"]


def calibration_bins(seq_len: int) -> list[list[int]]:
    """The packed bins (lists of sample lengths) that :func:`time_bins` times.

    Full bins of equal samples from one sample of ``seq_len`` down to many short ones, two
    half-full bins (full bins alone could not tell a per-token cost from a per-bin one) and
    two bins of long samples of other lengths.
    """
    check_int("seq_len", seq_len, minimum=16)
    bins = []
    for div in (1, 2, 4, 8, 32, 128):
        length = max(2, seq_len // div)
        bins.append([length] * (seq_len // length))
    for div in (2, 8):
        length = seq_len // div
        bins.append([length] * max(1, (seq_len // 2) // length))
    # Two mixed bins near the top, where the cubic term matters most.
    three_quarters = max(1, 3 * seq_len // 4)
    bins.append([three_quarters, max(1, seq_len - three_quarters)])
    bins.append([max(1, 3 * seq_len // 8)] * 2)
    return bins


def time_bins(model: TinyCausalLM, bins: Sequence[Sequence[int]], *, repeats: int) -> list[float]:
    """CPU seconds of forward + backward of each packed bin (the least of ``repeats``).

    Each bin is random tokens laid out as training lays them out (positions restarting per
    sample, -100 at sample starts) and goes through the same summed loss. One untimed pass of
    the largest bin first, so no timing pays for lazy initialisation. Gradients are
    discarded. The time is the calling thread's CPU time (torch runs one intra-op thread in
    the demo, so that is all of the work): another process taking the core delays a timing
    but does not lengthen it, and the least of several is the one least disturbed by
    processes sharing the caches.
    """
    check_int("repeats", repeats, minimum=1)
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for lengths in bins:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"Every bin needs samples of >= 1 token, but got {list(lengths)!r}.")
        if max(lengths) > model.config.max_positions:
            raise ValueError(
                f"A calibration sample of {max(lengths)} tokens exceeds the model's "
                f"max_positions={model.config.max_positions}."
            )
        total = sum(lengths)
        ids = torch.randint(0, model.config.vocab_size, (1, total), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
        tensors.append((ids, positions, cu, ids.masked_fill(positions == 0, IGNORE_INDEX)))

    def one(ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, lab: torch.Tensor) -> float:
        start = time.thread_time()
        loss, _ = packed_loss(model(ids, pos, cu), lab)
        loss.backward()
        elapsed = time.thread_time() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    if tensors:
        one(*max(tensors, key=lambda t: int(t[0].shape[1])))
    best = [math.inf] * len(tensors)
    for _ in range(repeats):  # rounds, so a slow moment spoils one timing of each, not all
        for i, t in enumerate(tensors):
            best[i] = min(best[i], one(*t))
    return best


_TERMS = ("per_bin", "per_sample", "per_token", "per_token_pair", "per_token_cube")


def _features(lengths: Sequence[int]) -> list[float]:
    n = [float(x) for x in lengths]
    return [
        1.0,
        float(len(n)),
        sum(n),
        sum(x * x for x in n),
        sum(x * x * x for x in n),
    ]


class CubicTerm:
    """``L³``: the one term the demo's cost adds to :class:`CalibratedCost`'s own features
    (per bin, per sample, ``L``, ``L²``), so that the five terms of :class:`FittedCost` are
    the calibrated model's features, in the same order."""

    model_id = "demo-tokens-cubed-v1"
    term_names: tuple[str, ...] = ("per_token_cube",)

    def cost_terms(self, meta: SampleMetadata) -> tuple[float]:
        n = float(meta.tokens)
        return (n * n * n,)

    def __call__(self, meta: SampleMetadata) -> float:
        return self.cost_terms(meta)[0]


class FittedCost:
    """Seconds of forward + backward of a sample of ``L`` tokens, fitted to timed bins.

    ``per_sample + per_token·L + per_token_pair·L² + per_token_cube·L³``: a fixed part (the
    per-sample attention call), a part per token (the linear layers, the LM head), a part per
    query-key pair (attention) and a cubic part, because on a CPU attention's ``L x L`` scores
    outgrow the caches as ``L`` grows, so the cost of a pair itself rises with ``L`` (without
    it the fit misses a full-length sample by ~15%). A packed bin also pays ``per_bin`` once,
    which :meth:`bin_seconds` adds (the planner leaves it out: every rank trains the same
    number of bins). :meth:`fit` finds the non-negative coefficients from timed bins by least
    squares on relative error.
    """

    def __init__(
        self,
        *,
        per_bin: float,
        per_sample: float,
        per_token: float,
        per_token_pair: float,
        per_token_cube: float = 0.0,
    ) -> None:
        values = (per_bin, per_sample, per_token, per_token_pair, per_token_cube)
        if any(not (math.isfinite(v) and v >= 0) for v in values) or not any(values[1:]):
            raise ValueError(
                f"FittedCost coefficients must be finite and >= 0, with a positive sample "
                f"term, but got {dict(zip(_TERMS, values, strict=True))!r}."
            )
        self._values = values
        digest = hashlib.sha256(repr(values).encode()).hexdigest()[:16]
        self.model_id = f"demo-fitted-{digest}"

    @classmethod
    def fit(cls, bins: Sequence[Sequence[int]], seconds: Sequence[float]) -> FittedCost:
        """The library's robust non-negative fit on ``seconds`` (relative error)."""
        if len(bins) != len(seconds) or len(bins) < len(_TERMS):
            raise ValueError(
                f"fit needs one timing per bin and at least {len(_TERMS)} bins, but got "
                f"{len(bins)} bins and {len(seconds)} timings."
            )
        if any(not (s > 0 and math.isfinite(s)) for s in seconds):
            raise ValueError(f"seconds must be positive and finite, but got {list(seconds)!r}.")
        t = np.asarray(seconds, dtype=np.float64)
        x = np.array([_features(b) for b in bins], dtype=np.float64)
        result = fit_coefficients(x, t)
        if result is None:
            raise ValueError(f"The timed bins {list(bins)!r:.120} determine no coefficient.")
        return cls(**dict(zip(_TERMS, result.coefficients, strict=True)))

    def calibrated(self, *, refit_every: int = 10) -> CalibratedCost:
        """A :class:`CalibratedCost` that starts from this fit and keeps calibrating online
        from the compute the training loop reports (``BalancedLoader.record_compute``)."""
        return CalibratedCost(CubicTerm(), initial=self._values, refit_every=refit_every)

    def __call__(self, meta: SampleMetadata) -> float:
        n = float(meta.tokens)
        _, c, a, b, d = self._values
        return c + n * (a + n * (b + n * d))

    def bin_seconds(self, lengths: Sequence[int]) -> float:
        """Predicted seconds of one packed bin holding samples of ``lengths``."""
        return float(np.dot(_features(lengths), self._values))

    def coefficients(self) -> tuple[float, ...]:
        """``(per_bin, per_sample, per_token, per_token_pair, per_token_cube)``."""
        return self._values

    def as_dict(self) -> dict[str, float]:
        """The coefficients by name, in seconds (per token, per pair, ...)."""
        return dict(zip(_TERMS, self._values, strict=True))

    def describe(self) -> str:
        """The formula with its fitted numbers, in milliseconds."""
        per_bin, c, a, b, d = (v * 1e3 for v in self._values)
        return (
            f"{c:.3g} ms + {a:.3g} ms·L + {b:.3g} ms·L² + {d:.3g} ms·L³ per sample, "
            f"+ {per_bin:.3g} ms per packed sequence"
        )

    def __repr__(self) -> str:
        terms = ", ".join(f"{k}={v:.4g}" for k, v in self.as_dict().items())
        return f"FittedCost({terms})"
