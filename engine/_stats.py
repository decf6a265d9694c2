"""Balance statistics of one step, and the one-line-per-step log."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from evenflow.engine._plan import BalanceDecision, Plan

__all__ = ["StepStats", "step_stats"]

logger = logging.getLogger("evenflow")


def _spread(costs: tuple[float, ...]) -> float:
    if not costs:
        return 0.0
    mean = sum(costs) / len(costs)
    return (max(costs) - min(costs)) / mean if mean > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StepStats:
    """What balancing did to one step (identical on every rank of the group).

    Costs are in the cost model's units (e.g. FLOPs), per group rank. ``cost_before`` is what
    each rank read (the source layout); ``cost_after`` what it trains on (the accepted plan).
    ``relative_spread = (max - min) / mean``. ``sent[r]``/``received[r]`` count samples that
    leave/arrive at rank ``r``.
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
            "digest": self.digest,
        }

    def log_line(self) -> str:
        change = (
            (self.max_cost_after / self.max_cost_before - 1.0) * 100
            if self.max_cost_before > 0
            else 0.0
        )
        verdict = "accepted" if self.decision.accepted else "kept source"
        return (
            f"step {self.step}: max cost {self.max_cost_before:.4g} -> "
            f"{self.max_cost_after:.4g} ({change:+.1f}%), spread "
            f"{self.relative_spread_before:.3f} -> {self.relative_spread_after:.3f}, "
            f"moved {self.num_moved} samples, {verdict} "
            f"(gain {self.decision.relative_gain:.3f} vs min {self.decision.min_balance_gain:g})"
        )


def step_stats(plan: Plan, source_rank: dict[Any, int], group_ranks: tuple[int, ...]) -> StepStats:
    """Statistics of ``plan``; ``source_rank`` maps each key to the group rank that read it."""
    n = plan.num_ranks
    sent = [0] * n
    received = [0] * n
    for dest, bins in enumerate(plan.local_batches):
        for b in bins:
            for key in b.sample_keys:
                src = source_rank[key]
                if src != dest:
                    sent[src] += 1
                    received[dest] += 1
    return StepStats(
        step=plan.step,
        group_ranks=group_ranks,
        cost_before=plan.source_rank_costs,
        cost_after=plan.rank_costs,
        num_moved=plan.num_moved,
        sent=tuple(sent),
        received=tuple(received),
        decision=plan.decision,
        digest=plan.digest,
    )
