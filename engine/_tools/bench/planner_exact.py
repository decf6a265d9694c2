"""The planner benchmark's exact optimum on small instances (``scipy.optimize.milp``).

On small steps (4 ranks x 2 bins, <= 24 samples; and 2 ranks x 1 nearly full bin, <= 12) the
minimum makespan over every feasible layout is solved as a MILP and each algorithm's plan is
compared with it. scipy comes with the ``bench`` extra; without it the table says so.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from evenflow.engine._tools.bench.planner_cases import (
    _LINEAR,
    _TOLERANCE,
    ALGORITHMS,
    _planners,
    _quantiles,
)
from evenflow.engine.workloads import PACKERS, make_step

__all__ = ["_run_exact", "_solve_exact"]

_EXACT_RANKS = 4
_EXACT_BINS = 2
_EXACT_MAX_SAMPLES = 24
# ~2 samples per bin (8-17 samples a step) on sft and pretrain, where HiGHS proves nearly every
# optimum in ~0.3 s; at 3,072 tokens (~20 samples) near-linear costs turn the step into a hard
# number-partitioning problem and many instances hit the time limit. longctx is left out: at
# this seq_len nearly all its samples are clipped to one length.
_EXACT_SEQ_LEN = 2048
_EXACT_DISTRIBUTIONS = ("pretrain", "sft")
# One bin per rank, nearly full: only exchanges of equal token totals are possible, the case
# a one-for-many exchange of any subset is for (2 ranks x 1 bin, <= 12 samples).
_EXACT_SINGLE_BIN = (2, 1, 4096, 12)
_EXACT_TIME_LIMIT_S = 2.0
# Optimality is proven to this relative gap (0.1%): closing the last hundredths of a percent
# above the bound total/num_ranks can take HiGHS minutes on near-linear costs.
_EXACT_REL_GAP = 1e-3


def _solve_exact(
    tokens: list[int],
    costs: list[float],
    seq_len: int,
    *,
    num_ranks: int = _EXACT_RANKS,
    num_bins: int = _EXACT_BINS,
    time_limit: float = _EXACT_TIME_LIMIT_S,
) -> tuple[float, bool]:
    """Minimum makespan of ``costs`` over all feasible layouts; ``(makespan, proven)``
    (``proven`` is false when the solver stopped at ``time_limit`` seconds).

    Variables: binary ``x[s, r, b]`` (sample ``s`` in bin ``b`` of rank ``r``) and ``T``. Each
    sample in one bin, each bin non-empty, bin tokens <= seq_len, rank cost <= T; minimise T.
    Ranks are interchangeable and so are the bins of a rank, which leaves the solver
    ``R! * (B!)^R`` copies of every layout to search; symmetry cuts keep only the canonical copy
    (ranks ordered by their lowest sample index, and bins within a rank likewise): sample ``s``
    may join rank ``r`` only if rank ``r - 1`` holds a sample ``< s``, and bin ``b`` only if bin
    ``b - 1`` of the same rank does. Samples are indexed by decreasing cost so the cuts bite on
    the samples that matter. Costs are scaled to <= 1 for the solver's tolerances and the
    makespan is recomputed from the rounded assignment.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    order = sorted(range(len(costs)), key=lambda s: (-costs[s], -tokens[s], s))
    tok = [tokens[s] for s in order]
    cost = np.asarray([costs[s] for s in order], dtype=np.float64)
    num_samples = len(tok)
    num_vars = num_samples * num_ranks * num_bins + 1
    scaled = cost / cost.max()

    def var(s: int, r: int, b: int) -> int:
        return (s * num_ranks + r) * num_bins + b

    rows: list[dict[int, float]] = []
    lower: list[float] = []
    upper: list[float] = []

    def add(row: dict[int, float], lo: float, hi: float) -> None:
        rows.append(row)
        lower.append(lo)
        upper.append(hi)

    bins = [(r, b) for r in range(num_ranks) for b in range(num_bins)]
    for s in range(num_samples):  # each sample in exactly one bin
        add({var(s, r, b): 1.0 for r, b in bins}, 1, 1)
    for r, b in bins:  # non-empty, within seq_len
        add({var(s, r, b): 1.0 for s in range(num_samples)}, 1, np.inf)
        add({var(s, r, b): float(tok[s]) for s in range(num_samples)}, -np.inf, seq_len)
    for r in range(num_ranks):  # rank cost <= T
        row = {var(s, r, b): scaled[s] for s in range(num_samples) for b in range(num_bins)}
        row[num_vars - 1] = -1.0
        add(row, -np.inf, 0)
    for s in range(num_samples):  # symmetry cuts: "x[s, r] <= sum_{s' < s} x[s', r - 1]"
        for r in range(1, num_ranks):
            row = {var(s, r, b): 1.0 for b in range(num_bins)}
            row.update({var(q, r - 1, b): -1.0 for q in range(s) for b in range(num_bins)})
            add(row, -np.inf, 0)
        for r in range(num_ranks):
            for b in range(1, num_bins):
                row = {var(s, r, b): 1.0}
                row.update({var(q, r, b - 1): -1.0 for q in range(s)})
                add(row, -np.inf, 0)
    matrix = np.zeros((len(rows), num_vars))
    for k, row in enumerate(rows):
        for column, value in row.items():
            matrix[k, column] = value
    ub = np.ones(num_vars)
    ub[-1] = np.inf
    objective = np.zeros(num_vars)
    objective[-1] = 1
    integrality = np.ones(num_vars)
    integrality[-1] = 0
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(num_vars), ub),
        options={"time_limit": time_limit, "mip_rel_gap": _EXACT_REL_GAP},
    )
    if result.x is None:
        raise RuntimeError(f"The exact solver found no layout: {result.message}")
    x = np.rint(result.x[:-1]).reshape(num_samples, num_ranks * num_bins)
    rank_of = np.argmax(x, axis=1) // num_bins
    rank_costs = np.bincount(rank_of, weights=cost, minlength=num_ranks)
    return float(rank_costs.max()), bool(result.status == 0)


def _run_exact(
    planner_cls: Any,
    *,
    num_instances: int,
    seed: int,
    shape: tuple[int, int, int, int] = (
        _EXACT_RANKS,
        _EXACT_BINS,
        _EXACT_SEQ_LEN,
        _EXACT_MAX_SAMPLES,
    ),
) -> dict[str, Any]:
    """Gap of each algorithm to the exact optimum on ``num_instances`` small steps of
    ``shape`` = (ranks, bins per rank, seq_len, most samples per step)."""
    exact_ranks, exact_bins, exact_seq_len, exact_max_samples = shape
    if num_instances == 0:
        return {"num_instances": 0, "skipped": "--exact-instances 0"}
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return {
            "num_instances": 0,
            "skipped": "scipy is not installed; install the bench extra: "
            "pip install 'evenflow[bench]'",
        }
    combos = [(d, p, a) for d in _EXACT_DISTRIBUTIONS for p in PACKERS for a in _LINEAR]
    gaps: dict[str, list[float]] = {name: [] for name in ALGORITHMS}
    num_proven = below = 0
    sizes: list[int] = []
    solve_s = 0.0
    step = -1
    while len(sizes) < num_instances:
        step += 1
        distribution, packer, linear = combos[len(sizes) % len(combos)]
        samples, reference_bins = make_step(
            distribution,
            packer,
            num_ranks=exact_ranks,
            bins_per_rank=exact_bins,
            seq_len=exact_seq_len,
            seed=seed,
            step=step,
        )
        if len(samples) > exact_max_samples:
            continue
        sizes.append(len(samples))
        tokens = [m.tokens for _, m in samples]
        costs = [linear * t + float(t) ** 2 for t in tokens]
        start = time.perf_counter()
        optimum, proven = _solve_exact(
            tokens, costs, exact_seq_len, num_ranks=exact_ranks, num_bins=exact_bins
        )
        solve_s += time.perf_counter() - start
        num_proven += proven
        planners = _planners(planner_cls, exact_ranks, exact_bins, exact_seq_len, linear)
        makespans = {
            name: max(planner.plan(samples, reference_bins, step).rank_costs)
            for name, (planner, _) in planners.items()
        }
        # Every layout bounds the optimum from above, so gaps are taken to the best one known;
        # a plan below a proven optimum (less the solver's gap) would mean a bug on either side.
        best = min(optimum, *makespans.values())
        for name, makespan in makespans.items():
            gaps[name].append(makespan / best - 1)
            below += proven and makespan < optimum * (1 - _EXACT_REL_GAP) * (1 - _TOLERANCE)
    return {
        "num_instances": num_instances,
        "shape": f"{exact_ranks} ranks x {exact_bins} bins, seq_len {exact_seq_len}",
        "distributions": list(_EXACT_DISTRIBUTIONS),
        "samples": {"min": min(sizes), "max": max(sizes)},
        "num_proven": num_proven,
        "relative_gap_tolerance": _EXACT_REL_GAP,
        "below_optimum": below,
        "solve_s": solve_s,
        "gap": {name: _quantiles(g, "p50", "p99", "max") for name, g in gaps.items()},
    }
