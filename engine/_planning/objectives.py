"""Objectives: how good a layout is, from its per-rank predicted costs (lower is better).

An objective maps a float64 vector of rank costs (one entry per rank of the balance group) to a
finite, non-negative float. The planner scores the source layout and the candidate with the
same objective and owns the acceptance gate; algorithms use it to pick between their own
candidates.

``makespan``
    The largest rank cost: a synchronous step waits for its slowest rank, so this is the
    predicted step time in cost units.
``lockstep``
    ``Σ_b max_r cost(r, b)``: ranks that synchronise at every microbatch (FSDP, pipeline
    schedules, tensor parallelism across the data-parallel group) wait at each position ``b``
    for the slowest rank's ``b``-th bin. It reads an ``(R, B)`` matrix of bin costs and sorts
    each rank's bins by cost, descending, first: the order the planner delivers them in, and
    the best order for a fixed assignment of bins to ranks. A vector (one bin per rank) scores
    as its maximum, like ``makespan``.
``balance``
    The squared coefficient of variation ``mean((c / mean(c) - 1) ** 2)``. The costs are first
    divided by their maximum so that FLOPs-sized values (1e15 and more) cannot overflow when
    squared; the sums use compensated summation so that a perfectly balanced layout scores
    exactly 0 rather than rounding noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from evenflow.engine.errors import ConfigError

__all__ = [
    "OBJECTIVES",
    "Objective",
    "balance",
    "lockstep",
    "makespan",
    "objective_name",
    "resolve_objective",
]

Objective = Callable[[np.ndarray], float]


def makespan(rank_costs: np.ndarray) -> float:
    """The largest rank cost; 0 for an empty vector."""
    if rank_costs.size == 0:
        return 0.0
    return float(np.max(rank_costs))


def lockstep(bin_costs: np.ndarray) -> float:
    """Sum over bin positions of the costliest bin there, each rank's bins sorted descending.

    ``bin_costs[r, b]`` is the cost of rank ``r``'s ``b``-th bin; a 1-D vector is one bin per
    rank. 0 for an empty matrix.
    """
    costs = np.asarray(bin_costs, dtype=np.float64)
    if costs.size == 0:
        return 0.0
    if costs.ndim == 1:
        return float(np.max(costs))
    ordered = -np.sort(-costs, axis=1)
    return math.fsum(ordered.max(axis=0).tolist())


def balance(rank_costs: np.ndarray) -> float:
    """Squared coefficient of variation of the rank costs; 0 when all are zero (or empty)."""
    if rank_costs.size == 0:
        return 0.0
    peak = float(np.max(rank_costs))
    if peak <= 0.0:
        return 0.0
    scaled = np.asarray(rank_costs, dtype=np.float64) / peak
    count = scaled.size
    mean = math.fsum(scaled.tolist()) / count
    # mean >= 1/count here because the largest scaled entry is exactly 1.
    deviations = scaled / mean - 1.0
    return math.fsum((deviations * deviations).tolist()) / count


OBJECTIVES: dict[str, Objective] = {"makespan": makespan, "balance": balance, "lockstep": lockstep}


def resolve_objective(name: object) -> Objective:
    """Return the objective function registered under ``name``."""
    if not isinstance(name, str) or name not in OBJECTIVES:
        known = ", ".join(repr(key) for key in OBJECTIVES)
        raise ConfigError(
            f"objective must be one of {known}, but got {name!r}; pick one of these names."
        )
    return OBJECTIVES[name]


def objective_name(objective: Objective) -> str:
    """The registered name of ``objective``, or its qualified name for a custom callable."""
    for name, function in OBJECTIVES.items():
        if function is objective:
            return name
    return getattr(objective, "__qualname__", type(objective).__qualname__)
