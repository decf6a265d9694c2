"""Slow reference implementation of the compiled whole-bin starts (``_whole_bins.c``).

The core's ``deal_bins`` and ``kk_bins`` are the only production implementations (called by
``engine/_planning/kk.py``); this is their specification in plain Python over heaps and
lists, as the planner ran them before they were compiled. Each returns ``dealt``: the source
bin at every new position (rank-major). ``tests/test_plan_whole_bins.py`` holds the core to
identical results.
"""

from __future__ import annotations

import heapq

__all__ = ["deal_bins", "kk_bins"]

# A partial partition: per part (rank to be), its load and its source bins.
_Parts = list[tuple[float, list[int]]]


def deal_bins(bin_costs: list[float], order: list[int], ranks: int, per: int) -> list[int]:
    """The bins in ``order``, each to the least loaded rank that still lacks a bin (lowest
    rank on equal loads)."""
    heap = [(0.0, r) for r in range(ranks)]
    held: list[list[int]] = [[] for _ in range(ranks)]
    for b in order:
        load, r = heapq.heappop(heap)
        held[r].append(b)
        if len(held[r]) < per:
            heapq.heappush(heap, (load + bin_costs[b], r))
    return [b for rank_bins in held for b in rank_bins]


def kk_bins(bin_costs: list[float], order: list[int], ranks: int, per: int) -> list[int]:
    """Karmarkar-Karp differencing of ``per`` slices of ``ranks`` bins of ``order``."""
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
    return [b for _, bins in parts for b in sorted(bins)]


def _spread(parts: _Parts) -> float:
    loads = [p[0] for p in parts]
    return max(loads) - min(loads)
