"""A synthetic clock for calibration tests: bins whose measured seconds follow known
coefficients (with seeded noise), over a long-tailed mix of sample lengths."""

from __future__ import annotations

from typing import Any

import numpy as np

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine.planning import CalibratedCost, QuadraticCost

#: Seconds per bin, per sample, per token and per token²: the clock the tests measure.
TRUE = (1e-3, 2e-4, 7e-6, 2e-9)
SEQ_LEN = 4096


def sizes(rank: int, step: int, epoch: int = 0) -> list[list[int]]:
    """Two bins of 1-4 samples with Pareto-tailed lengths (deterministic in rank and step)."""
    rng = np.random.default_rng([rank, step, epoch])
    out = []
    for _ in range(2):
        n = int(rng.integers(1, 5))
        lengths = np.minimum((rng.pareto(1.2, n) * 200 + 20).astype(int), 1000)
        out.append([int(v) for v in lengths])
    return out


def lengths_pack(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    return [len(s["input_ids"]) for s in samples]


def seconds(lengths: list[int], rank: int, step: int, b: int, noise: float = 0.05) -> float:
    """What the clock says for one bin, with seeded relative noise."""
    values = np.asarray(lengths, dtype=np.float64)
    features = np.array([1.0, len(values), values.sum(), (values * values).sum()])
    jitter = np.random.default_rng([7, rank, step, b]).normal(0.0, noise)
    return float(features @ np.asarray(TRUE) * (1.0 + jitter))


def calibrated(**kwargs: Any) -> CalibratedCost:
    """A model misspecified 3.5x in its linear term (by quadratic-to-linear ratio)."""
    options: dict[str, Any] = {"refit_every": 5, "min_rows": 16}
    options.update(kwargs)
    return CalibratedCost(QuadraticCost(linear=200.0, quadratic=1.0), **options)


def gloo_rank(rank: int, num_ranks: int, steps: int) -> dict[str, Any]:
    """One rank of a Gloo group: train ``steps`` synthetic steps, measuring every bin."""
    from evenflow.transports import GlooTransport

    source = IdLengths(rank, steps)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False)
    loader = BalancedLoader(
        source,
        config=config,
        transport=GlooTransport(timeout=10.0),
        pack_fn=lengths_pack,
        collate_fn=lambda bins: bins,
        cost_model=calibrated(),
    )
    digests, coefficients = [], []
    with loader:
        for step, batch in enumerate(loader):
            for b, lengths in enumerate(batch):
                loader.record_compute(seconds(lengths, rank, step, b), bin=b)
            digests.append(loader.last_stats.digest)
            coefficients.append(list(loader.calibration_stats.coefficients))
        stats = loader.calibration_stats
    return {
        "digests": digests,
        "coefficients": coefficients,
        "late": stats.num_late,
        "accepted": stats.num_accepted,
    }


class IdLengths:
    """A rank-local source of :func:`sizes` samples (re-iterable, so it rewinds on restore)."""

    def __init__(self, rank: int, steps: int) -> None:
        self.rank, self.steps = rank, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for step in range(self.steps):
            yield [
                [{"input_ids": np.zeros(n, dtype=np.int32)} for n in b]
                for b in sizes(self.rank, step)
            ]
