"""The default balancing algorithm: the best of several starts, then bounded local search.

Why not just the greedy: LPT (``lpt``) is good when bins have room, but when the source packs
bins to ~100% (best-fit-decreasing sources do) a long sample late in its order fits nowhere,
the run dead-ends and the step keeps its source layout, however unbalanced. This algorithm
never dead-ends and is never worse than either of them:

1. **Starts.** The source layout, the LPT layout (when it exists) and a bin-level LPT of the
   source bins (whole source bins dealt to ranks heaviest first; always feasible because the
   bins are). The best start under the problem's objective is searched from; small problems
   search from every start.
2. **Local search** on the scalar sample costs, always working on the most loaded rank ``a``
   against the lightest ranks ``b``. A change moves a net cost ``d`` from ``a`` to ``b``; it
   is accepted only when ``0 < d < load[a] - load[b]``, i.e. when both ranks end strictly
   below ``load[a]``. That condition strictly lowers the pair's maximum *and* the sum of
   squared loads, so the search improves lexicographically (the maximum, then the spread)
   and cannot cycle; ties at the maximum still make progress because the next tied rank is
   worked on next. Families, cheapest first: moving one sample to a bin with room, exchanging
   two whole bins, swapping two samples, and exchanging one sample for a run of samples of
   another bin with a compatible token total (what still works when every bin is full and
   costs are convex in length: one long sample for several short ones of the same length is
   a cost reduction at equal tokens); last, a move made possible by first shifting one of
   the partner's samples to another of its bins (costly, and it rarely succeeds, so it waits
   until the others fail; not tried under packing budgets). The families look at the 4
   lightest ranks; before giving up on ``a``, moves and run exchanges look at the next 32
   (at 256 ranks the partner with a fitting run is often past the fourth). Every candidate
   is checked against ``seq_len``, the packing budgets, the oversized rule (an oversized
   sample stays alone) and non-empty bins.
3. **Final choice**: the best of the searched layout, the source and LPT under the problem's
   own objective (``problem.score``), so the result is never worse than either even when the
   objective is not what the search optimises (``balance``, or a component cost model whose
   rank cost is not a sum).
4. **Second phase** (``polish.py``), when the first stops above the bound: moves to the least
   loaded rank with room anywhere in the group, and one sample for any subset of a partner
   bin (one bin per rank); alternated with the first phase while it finds changes. Multi-bin
   steps also start from whole bins split by Karmarkar-Karp differencing (``kk.py``).
5. **Finish**: the best layout is settled (ranks and bins relabelled towards the source,
   samples sent home where the makespan allows: ``settle.py``), with LPT too when it is
   within 0.1% (settling can lower a makespan). Under the makespan objective the search is
   also run from the source layout, stopping as soon as it is as good as the best; among
   equal scores the layout that moves fewest samples wins and is settled again, thoroughly:
   LPT, dealt and differenced bins start from scratch and move nearly every sample, a search
   from the source only what balance needs. Where ranks hold few samples, a second search
   from the source, with more attempts, aims at that final score and replaces the layout
   when it moves fewer samples.

Under the ``lockstep`` objective the same algorithm runs the method of ``lockstep.py``: it
balances the step as ``R·B`` one-bin ranks with the steps above, deals the bins into positions
by cost and searches position by position (see that module).

Budget: the search stops after ``max_iterations`` improvement attempts (by default
proportional to the number of samples) or when the most loaded rank admits no improving
change (``makespan``) / no rank does (``balance``). Deterministic: no randomness, ties go to
the lowest index, and the budget counts attempts, never time.

One implementation: the search runs in the compiled core (``native.py``, driven by
``search.py``), with or without packing budgets; ``tests/oracles/planning.py`` holds its
specification as whole-array numpy expressions, and tests hold the two to identical layouts.
Every tuning constant and budget is in ``schedule.py`` (the core's are listed there with the
rule that they must match their ``#define``).

Limits: moves are between two ranks at a time (no ejection chains), runs in one-for-many
exchanges are contiguous in token order within a bin, and the search optimises the sum of
scalar sample costs, which is only a proxy when a component cost model takes the maximum of
its components.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from evenflow.engine._planning import schedule
from evenflow.engine._planning.kk import kk_bins
from evenflow.engine._planning.lockstep import lockstep_assign
from evenflow.engine._planning.lpt import lpt_layout
from evenflow.engine._planning.objectives import lockstep, makespan
from evenflow.engine._planning.polish import polish
from evenflow.engine._planning.problem import (
    BalanceProblem,
    FlatLayout,
    _flatten,
    first_infeasible_bin,
)
from evenflow.engine._planning.search import search
from evenflow.engine._planning.settle import Settler
from evenflow.engine._validate import check_optional_int

__all__ = ["RefineAlgorithm"]

class RefineAlgorithm:
    """Best of source, LPT and bin-level LPT, then capacity-aware local search (the default).

    ``max_iterations`` bounds the number of improvement attempts; ``None`` uses 256 for tiny
    problems and ``num_samples // 120`` within [6, 512] otherwise. See the module documentation for
    the method and its guarantees: its objective is never above that of the source layout or
    of :class:`LPTAlgorithm`.
    """

    name = "refine"
    algorithm_id = "refine-v11"

    def __init__(self, *, max_iterations: int | None = None) -> None:
        self.max_iterations = check_optional_int("max_iterations", max_iterations, minimum=0)

    def __repr__(self) -> str:
        return f"RefineAlgorithm(max_iterations={self.max_iterations!r})"

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None:
        """The refined layout (a ``FlatLayout``), or ``None`` when nothing beats the source."""
        if problem.objective is lockstep:
            return lockstep_assign(problem, self.assign)
        if problem.num_ranks < 2:
            return None
        # Layouts travel as (flat, sizes) arrays, each scored once: at 100,000 samples a pass
        # over nested lists costs ~10 ms, more than a dozen compiled search attempts.
        starts = [FlatLayout(*_flatten(problem.source_bins))]
        lpt = self._greedy(problem)
        if lpt is not None:
            starts.append(lpt)
        if problem.bins_per_rank > 1:
            starts.append(_deal_bins(problem, starts[0]))
            starts.append(kk_bins(problem, starts[0]))
        scores = [_score_of(problem, problem._rank_of_flat(s.flat, s.sizes)) for s in starts]
        budget = (
            schedule.default_budget(problem)
            if self.max_iterations is None
            else self.max_iterations
        )
        if problem.num_samples <= schedule.MULTI_START_SAMPLES:
            origins = starts
        else:
            origins = [starts[min(range(len(starts)), key=scores.__getitem__)]]
        # Same candidates, order and strict comparison as scoring every layout afresh: the
        # searched layouts first, then LPT and the dealt bins; ties keep the earlier one.
        candidates: list[tuple[FlatLayout, float]] = []
        for origin in origins:
            layout, rank_of = self._refine(problem, origin, budget)
            candidates.append((layout, _score_of(problem, rank_of)))
        candidates.extend(zip(starts[1:], scores[1:], strict=True))
        best_layout: FlatLayout | None = None
        best_score = scores[0]
        for layout, score in candidates:
            if score < best_score and _budgets_hold(problem, layout):
                # The budget replay is exact where incremental sums may round.
                best_layout, best_score = layout, score
        if best_layout is None:
            return None
        finalists = [best_layout]
        if (
            lpt is not None
            and lpt is not best_layout
            and scores[1] <= best_score * schedule.CLOSE
        ):
            # Settling may lower a layout's makespan (a sample sent home can leave the most
            # loaded rank), so LPT settled could end below the best one settled.
            finalists.append(lpt)
        return self._finish(problem, starts[0], finalists)

    def _finish(
        self,
        problem: BalanceProblem,
        source: FlatLayout,
        finalists: list[FlatLayout],
    ) -> FlatLayout:
        """The finalists settled (``settle.py``), plus, under the makespan objective, a
        search from the source that stops once it is as good as the best of them: the best
        score wins, and among equal scores the layout that moves fewest samples. Where ranks
        hold few samples, a second search from the source then aims at the chosen layout's
        final score with more attempts (``_stay_budget``).

        Searching from the source changes only what balance needs, whereas LPT and dealt
        bins start from scratch and move nearly every sample.
        """
        n = problem.num_samples
        first = schedule.stay_budget(n, problem.num_ranks)
        settler = Settler(problem, source.flat, source.sizes)
        score = settler.score
        layouts = [FlatLayout(*settler.plain(f.flat, f.sizes), settled=True) for f in finalists]
        scores = [score(lay.flat, lay.sizes) for lay in layouts]
        best = min(scores)
        if problem.objective is makespan and schedule.stays_from_source(problem):
            chosen = layouts[scores.index(best)]
            rank_of = problem._rank_of_flat(chosen.flat, chosen.sizes)
            target = float(np.bincount(rank_of, weights=problem.costs).max(initial=0.0))
            stay, stay_rank_of = self._refine(
                problem, source, first, stop_at=target, rounds=schedule.STAY_ROUNDS
            )
            reached = _score_of(problem, stay_rank_of)
            if best < reached <= best * (1.0 + schedule.STAY_CLOSE):  # a near miss: go on
                stay, stay_rank_of = self._refine(
                    problem,
                    stay,
                    int(first * schedule.STAY_MORE),
                    stop_at=target,
                    rounds=schedule.STAY_ROUNDS,
                    knapsack=False,
                )
                reached = _score_of(problem, stay_rank_of)
            if reached <= best and _budgets_hold(problem, stay):
                settled = FlatLayout(*settler.plain(stay.flat, stay.sizes), settled=True)
                layouts.insert(0, settled)
                scores.insert(0, score(settled.flat, settled.sizes))
                best = min(scores)
        moved = settler.moved
        pick, fewest = 0, -1
        for k, lay in enumerate(layouts):
            if scores[k] > best:
                continue
            count = moved(lay.flat, lay.sizes)
            if fewest < 0 or count < fewest:
                pick, fewest = k, count
        # The winner, settled again with a wider homecoming: every rank stays at or below its
        # makespan, so the choice above and its score stand, and only movement can fall.
        chosen = layouts[pick]
        final = settler.thorough(chosen.flat, chosen.sizes)
        wider = schedule.second_stay_budget(problem)
        if (
            problem.objective is not makespan
            or not schedule.stays_from_source(problem)
            or wider <= first
        ):
            return FlatLayout(*final, settled=True)
        # Ranks with few samples (long documents): the search above often stops short of the
        # best score within its attempts. A second one from the source, with attempts sized
        # to the step's work, aims at the final layout's score; settled the same way, it
        # replaces that layout when it scores no higher and moves fewer samples.
        target = score(*final)
        stay, stay_rank_of = self._refine(
            problem, source, wider, stop_at=target, rounds=schedule.STAY_ROUNDS, knapsack=False
        )
        if _score_of(problem, stay_rank_of) <= target and _budgets_hold(problem, stay):
            again = settler.thorough(*settler.plain(stay.flat, stay.sizes))
            if score(*again) <= target and moved(*again) < moved(*final):
                final = again
        return FlatLayout(*final, settled=True)

    def _refine(
        self,
        problem: BalanceProblem,
        origin: FlatLayout,
        budget: int,
        *,
        stop_at: float | None = None,
        rounds: int = 0,
        knapsack: bool = True,
    ) -> tuple[FlatLayout, np.ndarray]:
        """The first search phase, then the second one (``polish.py``) and the first again
        while the second finds changes (at most ``rounds`` times, default
        ``schedule.polish_rounds``). ``stop_at``: a load at or below which the most loaded rank is
        good enough (default: near the bound). ``knapsack``: whether the second phase may
        spend its knapsack allowance on subset exchanges (one bin per rank only)."""
        layout, rank_of = self._search(problem, origin, budget, stop_at=stop_at)
        if problem.constraints.budgets:
            return layout, rank_of
        # The allowance is per round: two rounds spend it all, later ones as much again.
        cells = schedule.knapsack_cells(problem) // schedule.POLISH_ROUNDS if knapsack else 0
        # Partners come from the whole group, so the attempts scale with it too.
        attempts = max(budget, problem.num_ranks // 2)
        if not rounds:
            rounds = schedule.polish_rounds(problem)
        for _ in range(rounds):
            polished, _, changes = self._polish(problem, layout, attempts, cells, stop_at=stop_at)
            if changes == 0:
                break
            layout, rank_of = self._search(problem, polished, budget, stop_at=stop_at)
        return layout, rank_of

    # The kernels, compiled. Overridden only by the test oracle, which runs the same
    # starts and final choice around its slow reference kernels.

    def _greedy(self, problem: BalanceProblem) -> FlatLayout | None:
        return lpt_layout(problem)

    def _search(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray]:
        return search(problem, start, budget, stop_at=stop_at)

    def _polish(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        cells: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray, int]:
        return polish(problem, start, budget, cells, stop_at=stop_at)


def _score_of(problem: BalanceProblem, rank_of: np.ndarray) -> float:
    """``problem.score`` of the layout whose samples go to ranks ``rank_of``."""
    return float(problem.objective(problem.rank_costs_of(rank_of)))


def _deal_bins(problem: BalanceProblem, source: FlatLayout) -> FlatLayout:
    """Whole bins dealt heaviest first to the least-loaded rank that still lacks a bin."""
    flat, sizes = source.flat, source.sizes
    num_bins = sizes.size
    bin_ids = np.repeat(np.arange(num_bins, dtype=np.int64), sizes)
    bin_costs = np.bincount(bin_ids, weights=problem.costs[flat], minlength=num_bins)
    order = np.lexsort((np.arange(num_bins), -bin_costs)).tolist()
    costs: list[float] = bin_costs.tolist()
    per_rank = problem.bins_per_rank
    heap = [(0.0, r) for r in range(problem.num_ranks)]
    held: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for b in order:
        load, r = heapq.heappop(heap)
        held[r].append(b)
        if len(held[r]) < per_rank:
            heapq.heappush(heap, (load + costs[b], r))
    dealt = [b for rank_bins in held for b in rank_bins]  # new position -> source bin
    position = np.empty(num_bins, dtype=np.int64)
    position[dealt] = np.arange(num_bins, dtype=np.int64)
    # Samples keep their order within a bin; bins move as wholes.
    moved = np.argsort(position[bin_ids], kind="stable")
    return FlatLayout(flat[moved], sizes[dealt])


def _budgets_hold(problem: BalanceProblem, bins: Sequence[Sequence[int]]) -> bool:
    if not problem.constraints.budgets:
        return True
    return first_infeasible_bin(problem, bins) < 0
