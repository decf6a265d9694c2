"""Whole source bins split over ranks by the Karmarkar-Karp differencing method.

A start of the default algorithm for several bins per rank (``refine.py``): bins move whole,
so the layout is feasible whatever the packing constraints, and when the source bins are
nearly full, moving whole bins is about all that is possible. Largest-first dealing (the
other whole-bin start) places each bin on the lightest rank; differencing instead keeps
partial partitions of the bins and repeatedly merges the two whose loads are spread widest,
pairing the heaviest part of one with the lightest of the other, which cancels large
differences against each other. It gives every rank exactly ``bins_per_rank`` bins by
starting from ``bins_per_rank`` partial partitions of ``num_ranks`` bins each (the bins in
descending order of cost, one slice each), so each merge adds one bin to every rank.

Cost: ``bins_per_rank - 1`` merges of ``num_ranks`` parts, O(B R log R) in all. Ties go to
the lower bin index and the earlier partition, so the result is a pure function of the step.
"""

from __future__ import annotations

import heapq

import numpy as np

from evenflow.engine._planning.problem import BalanceProblem, FlatLayout

__all__ = ["kk_bins"]

# A partial partition: per part (rank to be), its load and its source bins.
_Parts = list[tuple[float, list[int]]]


def kk_bins(problem: BalanceProblem, source: FlatLayout) -> FlatLayout:
    """The source layout's bins over ranks by Karmarkar-Karp (each rank gets ``B`` bins)."""
    flat, sizes = source.flat, source.sizes
    ranks, per = problem.num_ranks, problem.bins_per_rank
    num_bins = sizes.size
    bin_ids = np.repeat(np.arange(num_bins, dtype=np.int64), sizes)
    bin_costs: list[float] = np.bincount(
        bin_ids, weights=problem.costs[flat], minlength=num_bins
    ).tolist()
    order = sorted(range(num_bins), key=lambda b: (-bin_costs[b], b))
    heap: list[tuple[float, int, _Parts]] = []
    for chunk in range(per):
        parts: _Parts = [(bin_costs[b], [b]) for b in order[chunk * ranks : (chunk + 1) * ranks]]
        heapq.heappush(heap, (-_spread(parts), chunk, parts))
    serial = per
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        heavy_first = sorted(first, key=lambda p: (-p[0], p[1][0]))
        light_first = sorted(second, key=lambda p: (p[0], p[1][0]))
        merged: _Parts = [
            (a[0] + b[0], a[1] + b[1]) for a, b in zip(heavy_first, light_first, strict=True)
        ]
        heapq.heappush(heap, (-_spread(merged), serial, merged))
        serial += 1
    parts = sorted(heap[0][2], key=lambda p: min(p[1]))
    dealt = [b for _, bins in parts for b in sorted(bins)]  # new position -> source bin
    position = np.empty(num_bins, dtype=np.int64)
    position[dealt] = np.arange(num_bins, dtype=np.int64)
    moved = np.argsort(position[bin_ids], kind="stable")
    return FlatLayout(flat[moved], sizes[dealt])


def _spread(parts: _Parts) -> float:
    loads = [p[0] for p in parts]
    return max(loads) - min(loads)
