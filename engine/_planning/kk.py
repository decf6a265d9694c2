"""The default algorithm's whole-bin starts: the source bins, each kept whole, over ranks.

Two starts of the default algorithm for several bins per rank (``refine.py``, ``"dealt bins"``
and ``"kk bins"``): bins move whole, so the layout is feasible whatever the packing
constraints, and when the source bins are nearly full, moving whole bins is about all that is
possible. Both give every rank exactly ``bins_per_rank`` bins.

- :func:`deal_bins`: largest first, each bin to the least loaded rank that still lacks a bin.
- :func:`kk_bins`: Karmarkar-Karp differencing. Largest-first dealing places each bin on the
  lightest rank; differencing instead keeps partial partitions of the bins and repeatedly
  merges the two whose loads are spread widest, pairing the heaviest part of one with the
  lightest of the other, which cancels large differences against each other. It starts from
  ``bins_per_rank`` partial partitions of ``num_ranks`` bins each (the bins in descending
  order of cost, one slice each), so each merge adds one bin to every rank. Cost:
  ``bins_per_rank - 1`` merges of ``num_ranks`` parts, O(B R log R) in all.

Ties go to the lower bin index, the lower rank and the earlier partition, so each start is a
pure function of the step. Both run in the compiled core (``_whole_bins.c``);
``tests/oracles/whole_bins.py`` specifies them in Python and tests hold the two to identical
layouts. Computed in Python they were a tenth of a plan at 8 ranks x 16 bins.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout

__all__ = ["deal_bins", "kk_bins"]


def deal_bins(problem: BalanceProblem, source: FlatLayout) -> FlatLayout:
    """Whole bins dealt heaviest first to the least-loaded rank that still lacks a bin."""
    return _whole_bins(problem, source, native.deal_bins)


def kk_bins(problem: BalanceProblem, source: FlatLayout) -> FlatLayout:
    """The source layout's bins over ranks by Karmarkar-Karp (each rank gets ``B`` bins)."""
    return _whole_bins(problem, source, native.kk_bins)


# The core's dealer: (bin costs, bins by cost descending, ranks, bins per rank) -> the source
# bin at every new position.
_Dealer = Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]


def _whole_bins(problem: BalanceProblem, source: FlatLayout, dealer: _Dealer) -> FlatLayout:
    flat, sizes = source.flat, source.sizes
    num_bins = sizes.size
    bin_ids = np.repeat(np.arange(num_bins, dtype=np.int64), sizes)
    bin_costs = np.bincount(bin_ids, weights=problem.costs[flat], minlength=num_bins)
    order = np.lexsort((np.arange(num_bins), -bin_costs))  # by cost descending, then index
    dealt = dealer(bin_costs, order, problem.num_ranks, problem.bins_per_rank)
    position = np.empty(num_bins, dtype=np.int64)
    position[dealt] = np.arange(num_bins, dtype=np.int64)
    # Samples keep their order within a bin; bins move as wholes.
    moved = np.argsort(position[bin_ids], kind="stable")
    return FlatLayout(flat[moved], sizes[dealt])
