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
The search's tuning constants (partner ranks examined, swap windows, exchange candidates) are
defined once, in ``_native.c``.

Limits: moves are between two ranks at a time (no ejection chains), runs in one-for-many
exchanges are contiguous in token order within a bin, and the search optimises the sum of
scalar sample costs, which is only a proxy when a component cost model takes the maximum of
its components.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from evenflow.engine._planning.kk import kk_bins
from evenflow.engine._planning.lockstep import lockstep_assign
from evenflow.engine._planning.lpt import lpt_layout
from evenflow.engine._planning.objectives import lockstep, makespan
from evenflow.engine._planning.polish import polish, polish_cells
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

# Problems up to this many samples are searched from every start, to convergence. Beyond
# it an attempt costs far more than a greedy pass (a 4-rank step of ~160 samples took ~80 ms
# when the search ran in numpy), so the budget below applies.
_MULTI_START_SAMPLES = 48
# Improvement attempts: one per this many samples, within [_MIN_BUDGET, _MAX_BUDGET]. The
# first few attempts bring most of the gain (at 8 ranks x 4 bins, 8 attempts close ~70% of
# what 100 do; one per 120 samples instead of per 80 changes the benchmark's mean reduction
# against LPT from 1.20% to 1.16% and takes ~0.4 ms off its slowest 8-rank plans). An
# attempt costs 50-150 us there; at 1,024 ranks attempts beyond the old cap of 96 still cut
# the makespan by ~1% (a = 4,096, first-fit sources).
_SAMPLES_PER_ATTEMPT = 120
# ... and at least one per this many ranks: an attempt works one rank, and a step whose ranks
# hold few long samples (longctx, 256 x 2: ~8 a rank, so 16 attempts by samples) has most of
# its ranks above the bound; 128 attempts there take the benchmark's p90 max / bound from
# 1.105 to 1.072 (pretrain 1.062 to 1.052), and more changed nothing.
_RANKS_PER_ATTEMPT = 2
_MIN_BUDGET = 6
_MAX_BUDGET = 512
# The search from the source towards the best makespan (``_finish``) runs on steps up to this
# many samples, with _STAY_ATTEMPTS attempts plus one per _STAY_SAMPLES_PER_ATTEMPT samples
# (and one per _STAY_RANKS_PER_ATTEMPT ranks, below): each attempt changes one or two
# samples, and reaching a balanced layout from a source 1.3x above its bound takes ~1 per 25
# (p50 26 attempts at 8 x 4, 235 at 64 x 4, sft). A step that does not get there in time
# keeps the other layout, so the cap bounds the planning time (~2 ms at 8 x 4) and nothing
# else. Past ~20,000 samples it would cost more than the rest of the plan and rarely arrive.
_STAY_MAX_SAMPLES = 20_000
# Alternations of the second search phase with the first (see ``_refine``): two, one past
# _STAY_MAX_SAMPLES samples, where each round's fresh search state and search cost ~30 ms
# (1,024 x 4) and the third round gained < 0.1% of makespan on the benchmark's steps.
_POLISH_ROUNDS = 2
# ... plus one per this many ranks, at most _MAX_POLISH_ROUNDS: the first phase stalls once
# the most loaded rank has no change with the lightest ranks, and each round of group-wide
# moves lets it go on. At 256 x 2 (sft, a = 24,576) the third and fourth rounds took a step
# from 1.0158 to 1.0016 x bound; past four nothing changed on the benchmark's steps.
_RANKS_PER_ROUND = 128
_MAX_POLISH_ROUNDS = 4
# LPT is settled as a finalist too when its score is within this factor of the best one.
_CLOSE = 1.001
_STAY_ATTEMPTS = 24
_STAY_SAMPLES_PER_ATTEMPT = 64
# The second search from the source (``_finish``) runs where ranks hold at most _STAY_FEW
# samples on average (long documents: ~16 a rank on the benchmark's longctx steps, ~88 on its
# sft ones), with _STAY_WORK attempts-times-samples-per-rank: an attempt's work grows with the
# samples of the ranks it examines, so this is about the work of the first search on an sft
# step at 8 x 4 (35 attempts), ~190 attempts on longctx. There the first search often stops
# short of the best score (its 25 attempts end in a stalled layout) and the second brings the
# median moved fraction of longctx 8 x 4 steps from 0.50 to 0.45 (firstfit); past ~200
# attempts nothing changed.
_STAY_FEW = 48
_STAY_WORK = 3072
# ... and at most this many: one bin per rank of long documents (~4 samples a rank) would
# otherwise get ~770, where past ~200 nothing changed on the benchmark's steps.
_STAY_WIDEST = 256
# The first search from the source gets one attempt more per two ranks (each attempt works
# one rank: at 64 x 4, sft first-fit steps then reach the best score more often, median
# moved 0.58 -> 0.48), and when it stops within _STAY_CLOSE of that score it goes on from
# where it stopped for _STAY_MORE of its attempts again (sft first-fit 8 x 4: median moved
# 0.51 -> 0.36, at +0.3 ms p99 planning time; going on within 1% or for all the attempts
# again moved less still but cost ~1 ms more at p99).
_STAY_RANKS_PER_ATTEMPT = 2
_STAY_CLOSE = 0.003
_STAY_MORE = 0.5
# The search from the source alternates with the second phase once.
_STAY_ROUNDS = 1


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
        budget = _default_budget(problem) if self.max_iterations is None else self.max_iterations
        if problem.num_samples <= _MULTI_START_SAMPLES:
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
        if lpt is not None and lpt is not best_layout and scores[1] <= best_score * _CLOSE:
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
        first = _stay_first(n, problem.num_ranks)
        settler = Settler(problem, source.flat, source.sizes)
        score = settler.score
        layouts = [FlatLayout(*settler.plain(f.flat, f.sizes), settled=True) for f in finalists]
        scores = [score(lay.flat, lay.sizes) for lay in layouts]
        best = min(scores)
        if problem.objective is makespan and n <= _STAY_MAX_SAMPLES:
            chosen = layouts[scores.index(best)]
            rank_of = problem._rank_of_flat(chosen.flat, chosen.sizes)
            target = float(np.bincount(rank_of, weights=problem.costs).max(initial=0.0))
            stay, stay_rank_of = self._refine(
                problem, source, first, stop_at=target, rounds=_STAY_ROUNDS
            )
            reached = _score_of(problem, stay_rank_of)
            if best < reached <= best * (1.0 + _STAY_CLOSE):  # a near miss: go on
                stay, stay_rank_of = self._refine(
                    problem,
                    stay,
                    int(first * _STAY_MORE),
                    stop_at=target,
                    rounds=_STAY_ROUNDS,
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
        wider = _stay_budget(problem)
        if problem.objective is not makespan or n > _STAY_MAX_SAMPLES or wider <= first:
            return FlatLayout(*final, settled=True)
        # Ranks with few samples (long documents): the search above often stops short of the
        # best score within its attempts. A second one from the source, with attempts sized
        # to the step's work, aims at the final layout's score; settled the same way, it
        # replaces that layout when it scores no higher and moves fewer samples.
        target = score(*final)
        stay, stay_rank_of = self._refine(
            problem, source, wider, stop_at=target, rounds=_STAY_ROUNDS, knapsack=False
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
        ``_POLISH_ROUNDS``). ``stop_at``: a load at or below which the most loaded rank is
        good enough (default: near the bound). ``knapsack``: whether the second phase may
        spend its knapsack allowance on subset exchanges (one bin per rank only)."""
        layout, rank_of = self._search(problem, origin, budget, stop_at=stop_at)
        if problem.constraints.budgets:
            return layout, rank_of
        # The allowance is per round: two rounds spend it all, later ones as much again.
        cells = polish_cells(problem) // _POLISH_ROUNDS if knapsack else 0
        # Partners come from the whole group, so the attempts scale with it too.
        attempts = max(budget, problem.num_ranks // 2)
        if not rounds:
            rounds = _polish_rounds(problem)
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


def _default_budget(problem: BalanceProblem) -> int:
    """Improvement attempts allowed: proportional to the step (its samples, or its ranks
    where they hold few samples), within fixed bounds.

    An attempt's work grows with the samples of the ranks it examines, so attempts
    proportional to the step keep the search a bounded share of the plan (measured with
    ``evenflow bench planner``). Counting attempts rather than reading a clock keeps plans a
    pure function of the step: every rank must stop at the same attempt.
    """
    if problem.num_samples <= _MULTI_START_SAMPLES:
        return 256  # tiny problems: search to convergence
    attempts = max(
        problem.num_samples // _SAMPLES_PER_ATTEMPT, problem.num_ranks // _RANKS_PER_ATTEMPT
    )
    return min(max(attempts, _MIN_BUDGET), _MAX_BUDGET)


def _polish_rounds(problem: BalanceProblem) -> int:
    """Alternations of the two search phases: ``_POLISH_ROUNDS`` plus one per
    ``_RANKS_PER_ROUND`` ranks, at most ``_MAX_POLISH_ROUNDS``; one past
    ``_STAY_MAX_SAMPLES`` samples."""
    if problem.num_samples > _STAY_MAX_SAMPLES:
        return 1
    return min(_POLISH_ROUNDS + problem.num_ranks // _RANKS_PER_ROUND, _MAX_POLISH_ROUNDS)


def _stay_first(num_samples: int, num_ranks: int) -> int:
    """Attempts of the search from the source: ``_STAY_ATTEMPTS`` plus one per
    ``_STAY_SAMPLES_PER_ATTEMPT`` samples and one per ``_STAY_RANKS_PER_ATTEMPT`` ranks."""
    return (
        _STAY_ATTEMPTS
        + num_samples // _STAY_SAMPLES_PER_ATTEMPT
        + num_ranks // _STAY_RANKS_PER_ATTEMPT
    )


def _stay_budget(problem: BalanceProblem) -> int:
    """Attempts of the second search from the source (``_STAY_WORK`` over the samples per
    rank, at most ``_STAY_WIDEST``), or 0 where ranks hold more than ``_STAY_FEW`` samples
    and it does not run."""
    per_rank = max(1, problem.num_samples // max(1, problem.num_ranks))
    return min(_STAY_WORK // per_rank, _STAY_WIDEST) if per_rank <= _STAY_FEW else 0


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
