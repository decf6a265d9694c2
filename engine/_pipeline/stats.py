"""Balance statistics of one step, and the one-line-per-step log."""

from __future__ import annotations

import itertools
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._plan import BalanceDecision, Plan
from evenflow.engine._sources.transform_pool import StepTransform
from evenflow.engine.errors import ConfigError

__all__ = ["BalanceTally", "StepStats", "step_stats"]

logger = logging.getLogger("evenflow")

_SAMPLE_KEYS = operator.attrgetter("sample_keys")


def _spread(costs: tuple[float, ...]) -> float:
    if not costs:
        return 0.0
    mean = sum(costs) / len(costs)
    return (max(costs) - min(costs)) / mean if mean > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StepStats:
    """What balancing did to one step (identical on every rank of the group, except
    :attr:`transform`, which is each rank's own).

    Costs are in the cost model's units (e.g. FLOPs), per group rank. ``cost_before`` is what
    each rank read (the source layout); ``cost_after`` what it trains on (the accepted plan).
    ``relative_spread = (max - min) / mean``. ``sent[r]``/``received[r]`` count samples that
    leave/arrive at rank ``r``.

    How to read a step: ``at_bound`` means no layout is meaningfully faster (the plan is
    within 0.1% of ``lower_bound``); otherwise ``gap`` says how much faster one could at most
    be. ``outlier_bound`` means one sample costs more than the mean rank, so the spread after
    planning stays wide however well the step is balanced: judge such a step by its gap, not
    by its spread.
    """

    step: int
    group_ranks: tuple[int, ...]
    cost_before: tuple[float, ...]
    cost_after: tuple[float, ...]
    num_moved: int
    sent: tuple[int, ...]
    received: tuple[int, ...]
    decision: BalanceDecision
    digest: str
    #: This rank's transform work for the step (a source with ``transform=``; ``None``
    #: otherwise): the one field that differs between ranks, since each rank transforms
    #: its own samples.
    transform: StepTransform | None = None

    @property
    def max_cost_before(self) -> float:
        return max(self.cost_before, default=0.0)

    @property
    def max_cost_after(self) -> float:
        return max(self.cost_after, default=0.0)

    @property
    def relative_spread_before(self) -> float:
        return _spread(self.cost_before)

    @property
    def relative_spread_after(self) -> float:
        return _spread(self.cost_after)

    @property
    def lower_bound(self) -> float:
        """A max rank cost no layout of this step can go below (``decision.lower_bound``)."""
        return self.decision.lower_bound

    @property
    def gap(self) -> float:
        """How far the accepted plan's max rank cost is above :attr:`lower_bound` (0.05 = 5%)."""
        return self.decision.gap

    @property
    def at_bound(self) -> bool:
        """The plan is within 0.1% of :attr:`lower_bound`: no layout is meaningfully faster."""
        return self.decision.at_bound

    @property
    def outlier_bound(self) -> bool:
        """One sample costs more than the mean rank: its rank sets the step time whatever the
        layout, so the spread between ranks is the data's, not the planner's."""
        return self.decision.outlier_bound

    @property
    def outlier_excess(self) -> float:
        """On an outlier-bound step, the cost its costliest sample adds above a perfectly
        balanced step: ``min(largest_cost, max_cost_after) - mean_cost`` (0 on other steps).
        No layout of the step's own samples can remove it; only moving samples between steps
        can (``LoaderConfig.balance_window``)."""
        d = self.decision
        if not d.outlier_bound:
            return 0.0
        return max(0.0, min(d.largest_cost, self.max_cost_after) - d.mean_cost)

    @property
    def outlier_share(self) -> float:
        """The share of the step's cost above a perfectly balanced step
        (``max_cost_after - mean_cost``) that its outlier explains: 1.0 when the step sits
        at its costliest sample, 0.0 when the step is not outlier-bound."""
        excess = self.max_cost_after - self.decision.mean_cost
        return min(1.0, self.outlier_excess / excess) if excess > 0 else 0.0

    @property
    def predicted_speedup(self) -> float:
        """``max_cost_before / max_cost_after``: the step-time ratio the plan predicts."""
        after = self.max_cost_after
        return self.max_cost_before / after if after > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "step": self.step,
            "group_ranks": list(self.group_ranks),
            "cost_before": list(self.cost_before),
            "cost_after": list(self.cost_after),
            "max_cost_before": self.max_cost_before,
            "max_cost_after": self.max_cost_after,
            "relative_spread_before": self.relative_spread_before,
            "relative_spread_after": self.relative_spread_after,
            "num_moved": self.num_moved,
            "sent": list(self.sent),
            "received": list(self.received),
            "objective": d.objective,
            "algorithm": d.algorithm,
            "original_objective": d.original_objective,
            "candidate_objective": d.candidate_objective,
            "relative_gain": d.relative_gain,
            "min_balance_gain": d.min_balance_gain,
            "accepted": d.accepted,
            "lower_bound": d.lower_bound,
            "mean_cost": d.mean_cost,
            "largest_cost": d.largest_cost,
            "gap": d.gap,
            "at_bound": d.at_bound,
            "outlier_bound": d.outlier_bound,
            "outlier_excess": self.outlier_excess,
            "outlier_share": self.outlier_share,
            "digest": self.digest,
            "transform": None if self.transform is None else self.transform.to_dict(),
        }

    def log_line(self) -> str:
        change = (
            (self.max_cost_after / self.max_cost_before - 1.0) * 100
            if self.max_cost_before > 0
            else 0.0
        )
        verdict = "accepted" if self.decision.accepted else "kept source"
        outlier = (
            f" explaining {self.outlier_share:.0%} of the cost above balance"
            if self.outlier_bound
            else ""
        )
        return (
            f"step {self.step}: max cost {self.max_cost_before:.4g} -> "
            f"{self.max_cost_after:.4g} ({change:+.1f}%), {self.decision.verdict()}{outlier}, "
            f"moved {self.num_moved} samples, {verdict} "
            f"(gain {self.decision.relative_gain:.3f} vs min {self.decision.min_balance_gain:g})"
        )


def step_stats(
    plan: Plan, source_rank: Mapping[Any, int] | None, group_ranks: tuple[int, ...]
) -> StepStats:
    """Statistics of ``plan``; ``source_rank`` maps each key to the group rank that read it.

    ``source_rank=None`` means every key's own ``source_rank`` field is that rank (true of a
    gathered step); the counts then come from the plan's arrays, without a lookup per sample.
    """
    n = plan.num_ranks
    if source_rank is None:
        # Keys of a gathered step carry the reading rank: count from the plan's arrays.
        layout = plan.layout
        dest = layout.slot_ranks()
        src = layout.key_fields[:, 0]
        keys: list[Any] = []
    else:
        per_rank = plan.bins_per_rank
        key_tuples = list(map(_SAMPLE_KEYS, itertools.chain.from_iterable(plan.local_batches)))
        keys = list(itertools.chain.from_iterable(key_tuples))
        sizes = np.fromiter(map(len, key_tuples), dtype=np.int64, count=len(key_tuples))
        per_rank_counts = sizes.reshape(n, per_rank).sum(axis=1) if n else sizes
        dest = np.repeat(np.arange(n, dtype=np.int64), per_rank_counts)
        src = np.fromiter(map(source_rank.__getitem__, keys), dtype=np.int64, count=len(keys))
    if src.size and (src.min() < 0 or src.max() >= n):
        bad = int(np.flatnonzero((src < 0) | (src >= n))[0])
        if not keys:  # the arrays found it; name it as the plan's key object
            keys = [k for bins in plan.local_batches for b in bins for k in b.sample_keys]
        raise ConfigError(
            f"source_rank maps key {keys[bad]} to rank {int(src[bad])}, outside the group's "
            f"{n} ranks; pass the group rank that read each key."
        )
    moved = src != dest
    sent = np.bincount(src[moved], minlength=n)
    received = np.bincount(dest[moved], minlength=n)
    return StepStats(
        step=plan.step,
        group_ranks=group_ranks,
        cost_before=plan.source_rank_costs,
        cost_after=plan.rank_costs,
        num_moved=plan.num_moved,
        sent=tuple(sent.tolist()),
        received=tuple(received.tolist()),
        decision=plan.decision,
        digest=plan.digest,
    )


class BalanceTally:
    """How close to their bounds the delivered steps were (``trace_summary()["balance"]``).

    Counts steps, steps at their bound, outlier-bound steps and steps whose plan stayed more
    than 5% above its bound, and keeps the mean and largest gap; sums the steps' planned cost
    (``max_cost_after``) and the part of it their outliers add (``outlier_excess``). Plain
    counters: a loader adds each delivered step once.
    """

    __slots__ = (
        "_at_bound",
        "_cost",
        "_gap_sum",
        "_max_gap",
        "_outlier",
        "_outlier_cost",
        "_steps",
        "_wide",
    )

    # A plan this far above its bound is counted as "wide": worth a look at the step.
    WIDE_GAP = 0.05

    def __init__(self) -> None:
        self._steps = self._at_bound = self._outlier = self._wide = 0
        self._gap_sum = self._max_gap = self._cost = self._outlier_cost = 0.0

    def add(self, stats: StepStats) -> None:
        gap = stats.gap
        self._steps += 1
        self._at_bound += stats.at_bound
        self._outlier += stats.outlier_bound
        self._wide += gap > self.WIDE_GAP
        self._gap_sum += gap
        self._max_gap = max(self._max_gap, gap)
        self._cost += stats.max_cost_after
        self._outlier_cost += stats.outlier_excess

    @property
    def outlier_fraction(self) -> float:
        """The share of the steps that were outlier-bound."""
        return self._outlier / self._steps if self._steps else 0.0

    @property
    def outlier_cost_fraction(self) -> float:
        """The share of the steps' planned cost (sum of ``max_cost_after``) that their
        outliers add above perfectly balanced steps (sum of ``outlier_excess``)."""
        return self._outlier_cost / self._cost if self._cost > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """``steps``, ``at_bound``, ``outlier_bound``, ``over_5_percent`` (counts),
        ``mean_gap`` and ``max_gap`` (fractions: 0.05 = 5% above the bound),
        ``outlier_fraction`` (share of steps outlier-bound), ``outlier_cost`` (the cost their
        outliers add, in cost-model units) and ``outlier_cost_fraction`` (its share of the
        steps' planned cost)."""
        return {
            "steps": self._steps,
            "at_bound": self._at_bound,
            "outlier_bound": self._outlier,
            "over_5_percent": self._wide,
            "mean_gap": self._gap_sum / self._steps if self._steps else 0.0,
            "max_gap": self._max_gap,
            "outlier_fraction": self.outlier_fraction,
            "outlier_cost": self._outlier_cost,
            "outlier_cost_fraction": self.outlier_cost_fraction,
        }
