"""The planner benchmark's peers: the plans other systems would make, beside ``lpt``.

The benchmark runs each peer through the real planner, as it runs ``lpt`` and ``default``, so
every peer meets the same validation, gate and settle, and its makespan is what a loader using
it would deliver (a failed peer keeps the source layout and counts as a dead end):

* ``sample lpt``: a plain greedy over samples. Every sample of the step, costliest first
  (ties: more tokens first, then key order), goes to the least-loaded rank that has room for
  it in one of its bins (the lower rank on ties), into that rank's fullest bin that still
  fits (best fit on tokens; the first on ties). It fails when a sample fits no rank, or
  when a bin ends empty (a rank needs all its bins). Unlike ``lpt`` it does not first give
  every bin one of the ``R B`` costliest samples, so on nearly full steps it packs where
  ``lpt`` dead-ends.
* ``kk bins``: the source bins, whole, split over ranks by Karmarkar-Karp largest
  differencing with ``B`` bins a rank (what verl does with micro-batches); with one bin per
  rank it is the source layout.

The implementations here are written from those rules in plain Python (``sample lpt``) or
taken from the default algorithm's starts (``kk bins``, ``kk.py``); the default algorithm
starts from both, so it is never worse than either (the benchmark checks it on every step).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from evenflow.engine._planning.kk import kk_bins
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout, _flatten

__all__ = ["PEERS", "KKBins", "SampleLPT", "sample_lpt_bins"]


def sample_lpt_bins(problem: BalanceProblem) -> list[list[int]] | None:
    """The greedy sample LPT layout (rank-major bins, samples in placement order), or None.

    See the module documentation for the rule. Packing budgets are not part of this peer.
    """
    if problem.constraints.budgets:
        raise ValueError("The sample LPT peer does not take packing budgets.")
    ranks, per = problem.num_ranks, problem.bins_per_rank
    seq_len = problem.constraints.seq_len
    costs: list[float] = problem.costs.tolist()
    tokens: list[int] = problem.tokens.tolist()
    order = np.lexsort((-problem.tokens, -problem.costs)).tolist()
    load = [0.0] * ranks
    fills = [[0] * per for _ in range(ranks)]
    bins: list[list[int]] = [[] for _ in range(ranks * per)]
    heap = [(0.0, r) for r in range(ranks)]
    parked: list[tuple[int, int]] = []  # (-room of the emptiest bin, rank)
    for i in order:
        t = tokens[i]
        limit = seq_len - t
        while parked and -parked[0][0] >= t:
            _, r = heapq.heappop(parked)
            heapq.heappush(heap, (load[r], r))
        chosen, slot = -1, -1
        while heap:
            _, q = heapq.heappop(heap)  # least load, then lowest rank
            s = _best_fit(fills[q], limit)
            if s >= 0:
                chosen, slot = q, s
                break
            # No bin of q takes t tokens; bins only fill up, so q waits for a shorter sample.
            heapq.heappush(parked, (-(seq_len - min(fills[q])), q))
        if chosen < 0:
            return None  # the sample fits no rank
        fills[chosen][slot] += t
        load[chosen] += costs[i]
        bins[chosen * per + slot].append(i)
        heapq.heappush(heap, (load[chosen], chosen))
    if any(not b for b in bins):
        return None  # a rank left a bin empty
    return bins


def _best_fit(fills: list[int], limit: int) -> int:
    """The fullest bin whose fill is at most ``limit`` (the first on ties), or -1."""
    best, best_fill = -1, -1
    for s, fill in enumerate(fills):
        if best_fill < fill <= limit:
            best, best_fill = s, fill
    return best


class SampleLPT:
    """The greedy sample LPT peer as a balancing algorithm (None: it failed)."""

    name = "sample lpt"
    algorithm_id = "bench-sample-lpt-v1"

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None:
        return sample_lpt_bins(problem)


class KKBins:
    """Karmarkar-Karp over the source bins as a balancing algorithm."""

    name = "kk bins"
    algorithm_id = "bench-kk-bins-v1"

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None:
        return kk_bins(problem, FlatLayout(*_flatten(problem.source_bins)))


# The peers by the name the benchmark reports them under.
PEERS: dict[str, type[SampleLPT | KKBins]] = {"sample lpt": SampleLPT, "kk bins": KKBins}
