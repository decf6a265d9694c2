"""Lower bounds on a step's (or a window's) cost, and the outlier-bound test.

All bounds read scalar sample costs and hold for additive cost models (a rank's or a bin's cost
is the sum of its samples'). They ignore packing except for one fact: two samples longer than
half of ``seq_len`` (or one oversized sample) can never share a bin.

``makespan``: no layout beats ``max(total / R, largest sample)``.

``lockstep`` (``Σ_b max_r``): besides the makespan bound (a rank's bins are summed by the
positions), sort the samples that need a bin of their own by cost, descending, ``h_1 ≥ h_2 ≥
…``. Sort the positions by their maxima ``m_1 ≥ … ≥ m_B``; the bins at positions ``k..B`` cost
at most ``m_k``, and positions ``1..k-1`` hold only ``(k-1)·R`` bins, so ``m_k ≥ h_{(k-1)R+1}``
and the cost is at least ``Σ_k h_{(k-1)R+1}``.

A window of ``W`` steps is the same argument with ``W`` groups of ``R·B`` bins (makespan: each
step's slowest rank) or ``W·B`` groups of ``R`` bins (lockstep: each position of each step).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "lockstep_lower_bound",
    "makespan_lower_bound",
    "outlier_bound",
    "window_lower_bound",
]


def makespan_lower_bound(costs: np.ndarray, num_ranks: int) -> float:
    """``max(total / num_ranks, largest sample)``; 0 for no samples."""
    values = np.asarray(costs, dtype=np.float64)
    if values.size == 0:
        return 0.0
    return max(math.fsum(values.tolist()) / num_ranks, float(values.max()))


def _alone_bound(
    costs: np.ndarray, tokens: np.ndarray, seq_len: int, per_group: int, num_groups: int
) -> float:
    """``Σ_k h_{(k-1)·per_group + 1}`` over ``num_groups`` groups (see the module docstring)."""
    alone = np.asarray(costs, dtype=np.float64)[2 * np.asarray(tokens) > seq_len]
    if alone.size == 0:
        return 0.0
    ordered = -np.sort(-alone)
    return math.fsum(ordered[::per_group][:num_groups].tolist())


def lockstep_lower_bound(
    costs: np.ndarray, tokens: np.ndarray, num_ranks: int, bins_per_rank: int, seq_len: int
) -> float:
    """No layout of these samples has a lower ``Σ_b max_r`` (see the module docstring)."""
    return max(
        makespan_lower_bound(costs, num_ranks),
        _alone_bound(costs, tokens, seq_len, num_ranks, bins_per_rank),
    )


def window_lower_bound(
    costs: np.ndarray,
    tokens: np.ndarray,
    *,
    num_ranks: int,
    bins_per_rank: int,
    num_steps: int,
    seq_len: int,
    objective: str,
) -> float:
    """No layout of a window's samples into ``num_steps`` steps has a lower sum of step costs.

    ``objective`` is ``"makespan"`` or ``"lockstep"`` (the step cost being summed).
    """
    base = makespan_lower_bound(costs, num_ranks)
    if objective == "lockstep":
        alone = _alone_bound(costs, tokens, seq_len, num_ranks, num_steps * bins_per_rank)
    else:
        alone = _alone_bound(costs, tokens, seq_len, num_ranks * bins_per_rank, num_steps)
    return max(base, alone)


def outlier_bound(costs: np.ndarray, num_ranks: int) -> bool:
    """Whether the costliest sample costs more than the mean rank: no plan can balance the step."""
    values = np.asarray(costs, dtype=np.float64)
    if values.size == 0:
        return False
    return float(values.max()) > math.fsum(values.tolist()) / num_ranks
