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
   until the others fail). Every candidate is checked against ``seq_len``, the
   packing budgets, the oversized rule (an oversized sample stays alone) and non-empty bins.
3. **Final choice**: the best of the searched layout, the source and LPT under the problem's
   own objective (``problem.score``), so the result is never worse than either even when the
   objective is not what the search optimises (``balance``, or a component cost model whose
   rank cost is not a sum).

Budget: the search stops after ``max_iterations`` improvement attempts (by default
proportional to the number of samples) or when the most loaded rank admits no improving
change (``makespan``) / no rank does (``balance``). Deterministic: no randomness, ties go to
the lowest index, and the budget counts attempts, never time.

Two implementations, one result: this module evaluates candidates in bulk with numpy (a few
dozen array operations per attempt) and is the specification; ``evenflow.engine._planning._native``
runs the same search compiled, candidate for candidate, when the extension is built and the
step has no packing budgets (see :meth:`_Search.run`). Tests hold the two to identical
layouts.

Limits: moves are between two ranks at a time (no ejection chains), runs in one-for-many
exchanges are contiguous in token order within a bin, and the search optimises the sum of
scalar sample costs, which is only a proxy when a component cost model takes the maximum of
its components.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from evenflow.engine._planning.objectives import balance
from evenflow.engine._validate import check_optional_int

if TYPE_CHECKING:
    from evenflow.engine._planning.algorithms import BalanceProblem, FlatLayout

__all__ = ["RefineAlgorithm"]

# Number of lightest ranks examined as partners of the most loaded rank, then the wider set
# tried once before declaring the rank stuck.
_NEAR_TARGETS = 4
_WIDE_TARGETS = 32
# Problems up to this many samples are searched from every start, to convergence. Beyond
# it an attempt costs ~0.5 ms, so a converged search would dominate a step (a 4-rank step
# of ~160 samples took ~80 ms): the budget below applies.
_MULTI_START_SAMPLES = 48
# Swaps: pair matrices up to this size are searched in full; beyond it, each heavy sample
# meets the partner samples nearest in cost to the ideal, this many on each side.
_FULL_SWAP_PAIRS = 4096
_SWAP_NEIGHBOURS = 4
# Makespan search stops once the most loaded rank is this close to the lower bound.
_NEAR_OPTIMAL = 2e-4
# Improvement attempts: one per this many samples, within [_MIN_BUDGET, _MAX_BUDGET]. The
# first few attempts bring most of the gain (at 8 ranks x 4 bins, 8 attempts close ~70% of
# what 100 do; one per 120 samples instead of per 80 changes the benchmark's mean reduction
# against LPT from 1.20% to 1.16% and takes ~0.4 ms off its slowest 8-rank plans).
# Compiled, an attempt costs 50-150 us there, so the cap matters mostly for the numpy search
# (~1 ms an attempt at 1,024 ranks); at that scale attempts beyond the old cap of 96 still cut
# the makespan by ~1% (a = 4,096, first-fit sources).
_SAMPLES_PER_ATTEMPT = 120
_MIN_BUDGET = 6
_MAX_BUDGET = 512
# Heavy-side samples considered by the one-for-many exchange (most expensive first).
_EXCHANGE_CANDIDATES = 8
# Room of a bin holding a single sample: anything may join it when that sample leaves, since
# a sample alone in its bin may be oversized.
_UNBOUNDED = np.iinfo(np.int64).max


class RefineAlgorithm:
    """Best of source, LPT and bin-level LPT, then capacity-aware local search (the default).

    ``max_iterations`` bounds the number of improvement attempts; ``None`` uses 256 for tiny
    problems and ``num_samples // 120`` within [6, 512] otherwise. See the module documentation for
    the method and its guarantees: its objective is never above that of the source layout or
    of :class:`LPTAlgorithm`.
    """

    name = "refine"
    algorithm_id = "refine-v4"

    def __init__(self, *, max_iterations: int | None = None) -> None:
        self.max_iterations = check_optional_int("max_iterations", max_iterations, minimum=0)

    def __repr__(self) -> str:
        return f"RefineAlgorithm(max_iterations={self.max_iterations!r})"

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None:
        """The refined layout (a ``FlatLayout``), or ``None`` when nothing beats the source."""
        from evenflow.engine._planning.algorithms import FlatLayout, _flatten, lpt_layout

        if problem.num_ranks < 2:
            return None
        # Layouts travel as (flat, sizes) arrays, each scored once: at 100,000 samples a pass
        # over nested lists costs ~10 ms, more than a dozen compiled search attempts.
        starts = [FlatLayout(*_flatten(problem.source_bins))]
        lpt = lpt_layout(problem)
        if lpt is not None:
            starts.append(lpt)
        if problem.bins_per_rank > 1:
            starts.append(_deal_bins(problem, starts[0]))
        scores = [_score_of(problem, problem._rank_of_flat(s.flat, s.sizes)) for s in starts]
        budget = _default_budget(problem) if self.max_iterations is None else self.max_iterations
        if problem.num_samples <= _MULTI_START_SAMPLES:
            searches = [_Search(problem, s) for s in starts]
        else:
            best = min(range(len(starts)), key=scores.__getitem__)
            searches = [_Search(problem, starts[best])]
        # Same candidates, order and strict comparison as scoring every layout afresh: the
        # searched layouts first, then LPT and the dealt bins; ties keep the earlier one.
        candidates: list[tuple[FlatLayout, float]] = []
        for search in searches:
            layout = search.run(budget)
            candidates.append((layout, _score_of(problem, search.rank_of())))
        candidates.extend(zip(starts[1:], scores[1:], strict=True))
        best_layout: FlatLayout | None = None
        best_score = scores[0]
        for layout, score in candidates:
            if score < best_score and _budgets_hold(problem, layout):
                # The budget replay is exact where incremental sums may round.
                best_layout, best_score = layout, score
        return best_layout


def _score_of(problem: BalanceProblem, rank_of: np.ndarray) -> float:
    """``problem.score`` of the layout whose samples go to ranks ``rank_of``."""
    return float(problem.objective(problem.rank_costs_of(rank_of)))


def _default_budget(problem: BalanceProblem) -> int:
    """Improvement attempts allowed: proportional to the step, within fixed bounds.

    An attempt's work grows with the samples of the ranks it examines, so attempts
    proportional to the step keep the search a bounded share of the plan (measured with
    ``evenflow bench planner``). Counting attempts rather than reading a clock keeps plans a
    pure function of the step: every rank must stop at the same attempt.
    """
    if problem.num_samples <= _MULTI_START_SAMPLES:
        return 256  # tiny problems: search to convergence
    attempts = problem.num_samples // _SAMPLES_PER_ATTEMPT
    return min(max(attempts, _MIN_BUDGET), _MAX_BUDGET)


def _lightest(load: np.ndarray, reach: int) -> np.ndarray:
    """The ``reach`` ranks first by (load, rank), in linear time (``reach < load.size``).

    Ties at the boundary go to the lowest ranks, so the set is a function of the loads
    alone (``argpartition`` may pick any of the tied ranks).
    """
    level = np.partition(load, reach - 1)[reach - 1]
    below = np.flatnonzero(load < level)
    tied = np.flatnonzero(load == level)[: reach - below.size]
    return np.concatenate([below, tied])


def _deal_bins(problem: BalanceProblem, source: FlatLayout) -> FlatLayout:
    """Whole bins dealt heaviest first to the least-loaded rank that still lacks a bin."""
    from evenflow.engine._planning.algorithms import FlatLayout

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
    from evenflow.engine._planning.algorithms import first_infeasible_bin

    if not problem.constraints.budgets:
        return True
    return first_infeasible_bin(problem, bins) < 0


class _Search:
    """Mutable layout state plus the improvement families (see the module docstring)."""

    def __init__(self, problem: BalanceProblem, start: FlatLayout) -> None:
        self.p = problem
        self.per_rank = problem.bins_per_rank
        self.seq_len = problem.constraints.seq_len
        self.cost = problem.costs
        self.tok = problem.tokens
        self.bud = problem.budget_costs
        self.limits = np.array(list(problem.constraints.budgets.values()), dtype=np.float64)
        self.has_budgets = self.limits.size > 0
        self.start = start
        # Bins as lists: the numpy search's state, built when it runs (the compiled search
        # works on the arrays).
        self.members: list[list[int]] = []
        nb = len(start)
        flat = start.flat
        sizes = start.sizes.copy()
        bin_ids = np.repeat(np.arange(nb, dtype=np.int64), sizes)
        self.bin_of = np.empty(problem.num_samples, dtype=np.int64)
        self.bin_of[flat] = bin_ids
        self.bin_cnt = sizes
        self.bin_tok = np.bincount(bin_ids, weights=self.tok[flat], minlength=nb).astype(np.int64)
        self.bin_cost = np.bincount(bin_ids, weights=self.cost[flat], minlength=nb)
        self.bin_bud = np.zeros((nb, self.limits.size), dtype=np.float64)
        for k in range(self.limits.size):
            self.bin_bud[:, k] = np.bincount(bin_ids, weights=self.bud[flat, k], minlength=nb)
        self.load = self.bin_cost.reshape(problem.num_ranks, self.per_rank).sum(axis=1)
        self.sumsq_mode = problem.objective is balance
        self.slots = np.arange(self.per_rank, dtype=np.int64)
        # Sample arrays of ranks whose bins did not change since they were built.
        self._rank_cache: dict[int, np.ndarray] = {}
        # The same samples by ascending (cost, index), for the swap windows.
        self._sorted_cache: dict[int, np.ndarray] = {}

    def rank_of(self) -> np.ndarray:
        """Destination rank of every sample in the current layout."""
        ranks: np.ndarray = self.bin_of // self.per_rank
        return ranks

    # ------------------------------------------------------------------ driver

    def run(self, budget: int) -> FlatLayout:
        """Search for at most ``budget`` attempts; the layout reached."""
        from evenflow.engine._planning import algorithms as _algorithms
        from evenflow.engine._planning.algorithms import FlatLayout

        num_ranks = self.p.num_ranks
        # No layout beats the larger of the mean rank load and the costliest sample; within
        # _NEAR_OPTIMAL of it the remaining gain is not worth the planning time.
        bound = max(float(self.load.sum()) / num_ranks, float(self.cost.max(initial=0.0)))
        good_enough = bound * (1.0 + _NEAR_OPTIMAL)
        core = _algorithms._compiled()
        if core is not None and not self.has_budgets:
            return self._run_compiled(core, budget, good_enough)
        if not self.members:
            self.members = [list(b) for b in self.start.bins]
        stuck = np.zeros(num_ranks, dtype=bool)
        masked = np.empty(num_ranks, dtype=np.float64)
        for _ in range(budget):
            top = int(np.argmax(self.load))
            if not self.sumsq_mode and (stuck[top] or self.load[top] <= good_enough):
                break  # the most loaded rank admits no improving change, or needs none
            np.copyto(masked, self.load)
            masked[stuck] = -np.inf
            a = int(np.argmax(masked))
            if stuck[a]:
                break
            partner = self._improve(a)
            if partner < 0:
                stuck[a] = True
            else:
                stuck[a] = stuck[partner] = False
        return FlatLayout.of_bins(self.members)

    def _run_compiled(self, core: Any, budget: int, good_enough: float) -> FlatLayout:
        """:meth:`run` by the compiled search: same steps, same layout, far fewer cycles."""
        from evenflow.engine._planning.algorithms import FlatLayout

        out_flat = np.empty_like(self.start.flat)
        out_sizes = np.empty_like(self.start.sizes)
        core.refine_search(
            np.ascontiguousarray(self.cost),
            np.ascontiguousarray(self.tok),
            np.ascontiguousarray(self.start.flat, dtype=np.int64),
            np.ascontiguousarray(self.start.sizes, dtype=np.int64),
            self.bin_of,
            self.bin_cnt,
            self.bin_tok,
            self.bin_cost,
            self.load,
            out_flat,
            out_sizes,
            self.per_rank,
            self.seq_len,
            budget,
            good_enough,
            self.sumsq_mode,
        )
        layout = FlatLayout(out_flat, out_sizes)
        self.members = []  # the lists no longer describe the layout
        self._rank_cache.clear()
        self._sorted_cache.clear()
        return layout

    def _improve(self, a: int) -> int:
        """Apply the best improving change between rank ``a`` and a lighter rank."""
        load = self.load
        top = float(load[a])
        tol = 1e-12 * abs(top) + 1e-300
        count = load.size
        reach = _NEAR_TARGETS + (0 if self.sumsq_mode else _WIDE_TARGETS)
        pool = _lightest(load, reach) if count - 1 > reach else np.arange(count)
        pool = pool[load[pool] < top - tol]
        if pool.size == 0:
            return -1
        order = pool[np.lexsort((pool, load[pool]))]
        heavy = self._rank_samples(a)
        near = order[:_NEAR_TARGETS]
        for family in (self._move, self._swap, self._exchange, self._cheap):
            found = family(a, heavy, near, tol)
            if found is not None:
                return found()
        if order.size > _NEAR_TARGETS:
            # Before giving up on ``a``: the cheap family against a wider set of ranks.
            found = self._cheap(a, heavy, order[_NEAR_TARGETS:], tol)
            if found is not None:
                return found()
        return -1

    def _rank_samples(self, r: int) -> np.ndarray:
        """Rank ``r``'s samples in bin order (read-only; cached until the rank changes)."""
        cached = self._rank_cache.get(r)
        if cached is not None:
            return cached
        per = self.per_rank
        members = self.members
        if per == 1:
            out = np.array(members[r], dtype=np.int64)
        else:
            out = np.array(
                [i for b in range(r * per, (r + 1) * per) for i in members[b]], dtype=np.int64
            )
        out.setflags(write=False)
        self._rank_cache[r] = out
        return out

    def _sorted_samples(self, r: int) -> np.ndarray:
        """Rank ``r``'s samples by ascending (cost, index) (read-only; cached likewise)."""
        cached = self._sorted_cache.get(r)
        if cached is not None:
            return cached
        samples = self._rank_samples(r)
        out = samples[np.lexsort((samples, self.cost[samples]))]
        out.setflags(write=False)
        self._sorted_cache[r] = out
        return out

    def _budget_ok(self, new_sums: np.ndarray) -> np.ndarray:
        """Rows of ``new_sums`` (last axis = budgets) within every budget."""
        fits: np.ndarray = np.all(new_sums <= self.limits, axis=-1)
        return fits

    # ------------------------------------------------------------------ families
    # Each family returns None (nothing improving) or a closure that applies its best
    # candidate and returns the partner rank. A candidate moving net cost ``d`` to rank ``b``
    # scores max(load[a] - d, load[b] + d), the larger of the two new loads; the smallest
    # score wins, ties to the first candidate in index order.

    def _move(self, a: int, heavy: np.ndarray, targets: np.ndarray, tol: float) -> _Apply | None:
        """Move one sample to a bin with room, or swap bins (no intra-rank shifts)."""
        return self._cheap(a, heavy, targets, tol, shift=False)

    def _cheap(
        self, a: int, heavy: np.ndarray, targets: np.ndarray, tol: float, *, shift: bool = True
    ) -> _Apply | None:
        """Move one sample to a bin with room (making room first if needed), or swap bins.

        The shift that makes room (:meth:`_move_with_room`) is costly and rarely succeeds on
        its first try, so the search tries it only after the other families (``shift``).
        """
        per = self.per_rank
        top = float(self.load[a])
        ybins = (targets[:, None] * per + self.slots).ravel()
        yload = self.load[ybins // per]
        gap = top - yload
        best_score = np.inf
        best: _Apply | None = None

        c = self.cost[heavy]
        movable = (self.bin_cnt[self.bin_of[heavy]] >= 2) & (c > tol)
        if movable.any():
            hi = heavy[movable]
            ch = c[movable]
            th = self.tok[hi]
            room = self.seq_len - self.bin_tok[ybins]
            ok = (th[:, None] <= room) & (ch[:, None] < gap - tol)
            if self.has_budgets:
                ok &= self._budget_ok(self.bin_bud[ybins][None, :, :] + self.bud[hi][:, None, :])
            if ok.any():
                score = np.maximum(top - ch[:, None], (yload + ch[:, None]))
                score[~ok] = np.inf
                flat = int(np.argmin(score))
                best_score = float(score.flat[flat])
                i = int(hi[flat // ybins.size])
                y = int(ybins[flat % ybins.size])
                best = _Apply(self._apply_move, i, y)
            elif shift and per > 1 and not self.has_budgets:
                best, best_score = self._move_with_room(hi, ch, th, targets=targets, tol=tol)

        xbins = a * per + self.slots
        delta = self.bin_cost[xbins][:, None] - self.bin_cost[ybins]
        ok = (delta > tol) & (delta < gap - tol)
        if ok.any():
            score = np.maximum(top - delta, yload + delta)
            score[~ok] = np.inf
            flat = int(np.argmin(score))
            if float(score.flat[flat]) < best_score:
                xb = int(xbins[flat // ybins.size])
                yb = int(ybins[flat % ybins.size])
                best = _Apply(self._apply_bin_swap, xb, yb)
        return best

    def _move_with_room(
        self, hi: np.ndarray, ch: np.ndarray, th: np.ndarray, *, targets: np.ndarray, tol: float
    ) -> tuple[_Apply | None, float]:
        """Move a sample to rank ``b`` after shifting one of b's samples to b's roomiest bin.

        Bins of a rank are interchangeable for its cost, so when no single bin has room but
        the rank as a whole does, one intra-rank shift (cost-neutral) makes the move possible.
        """
        per = self.per_rank
        top = float(self.load[int(self.bin_of[hi[0]]) // per])
        rooms = (self.seq_len - self.bin_tok[(targets[:, None] * per + self.slots)]).astype(
            np.int64
        )
        # A shift frees at most the room of the sample's own bin plus that of the bin it
        # goes to, so no move is possible unless some heavy sample fits the two largest
        # rooms of some target rank that it may go to: a cheap exact test for the usual miss.
        two_rooms = np.partition(rooms, per - 2, axis=1)[:, per - 2 :].sum(axis=1)
        tload = self.load[targets]
        possible = (th[:, None] <= two_rooms) & (ch[:, None] < (top - tload) - tol)
        if not possible.any():
            return None, np.inf
        light = np.concatenate([self._rank_samples(int(r)) for r in targets])
        yk = self.bin_of[light]
        # Position of each sample's rank in ``targets`` (searchsorted on a sorted copy).
        order = np.argsort(targets, kind="stable")
        slot = order[np.searchsorted(targets[order], yk // per)]
        first = np.argmax(rooms, axis=1)
        masked = rooms.copy()
        masked[np.arange(targets.size), first] = np.iinfo(np.int64).min
        second = np.argmax(masked, axis=1)
        own = yk % per
        dest = np.where(own == first[slot], second[slot], first[slot])
        dest_room = rooms[slot, dest]
        tk = self.tok[light]
        shiftable = (tk <= dest_room) & (self.bin_cnt[yk] >= 2)
        if not shiftable.any():
            return None, np.inf
        freed = np.where(shiftable, rooms[slot, own] + tk, -1)
        # Per target rank, the shift that frees the most room (first index on ties).
        by_rank = np.lexsort((np.arange(light.size), -freed, slot))
        firsts = by_rank[np.r_[True, slot[by_rank][1:] != slot[by_rank][:-1]]]
        best_k = np.full(targets.size, -1, dtype=np.int64)
        best_k[slot[firsts]] = firsts
        best_freed = np.where(best_k >= 0, freed[np.maximum(best_k, 0)], -1)
        ok = (th[:, None] <= best_freed) & (ch[:, None] < (top - tload) - tol)
        if not ok.any():
            return None, np.inf
        score = np.maximum(top - ch[:, None], tload + ch[:, None])
        score[~ok] = np.inf
        flat = int(np.argmin(score))
        row, col = divmod(flat, targets.size)
        k = int(best_k[col])
        shift_to = int(targets[col]) * per + int(dest[k])
        apply = _Apply(self._apply_shift_move, int(hi[row]), int(light[k]), shift_to)
        return apply, float(score.flat[flat])

    def _swap(self, a: int, heavy: np.ndarray, targets: np.ndarray, tol: float) -> _Apply | None:
        """Swap one sample of ``a`` with one sample of a lighter rank.

        On larger ranks only the ``2 * _SWAP_NEIGHBOURS`` samples of each partner rank whose
        cost is nearest to the ideal ``c_i - gap / 2`` are examined for each heavy sample
        ``i`` (the pair matrix would otherwise dominate the iteration).
        """
        per = self.per_rank
        top = float(self.load[a])
        parts = [self._rank_samples(int(r)) for r in targets]
        light = np.concatenate(parts)
        ch = self.cost[heavy]
        cl = self.cost[light]
        # Only pairs with 0 < c_i - c_j can improve: drop heavy samples cheaper than every
        # light one before building the pair matrix.
        keep = ch > cl.min() + tol
        if not keep.any():
            return None
        heavy = heavy[keep]
        ch = ch[keep]
        if heavy.size * light.size <= _FULL_SWAP_PAIRS:
            cand = np.broadcast_to(np.arange(light.size), (heavy.size, light.size))
        else:
            # The partners by (target, cost, index); per-rank orders are cached.
            sizes = np.array([part.size for part in parts], dtype=np.int64)
            slot = np.repeat(np.arange(targets.size), sizes)
            light = np.concatenate([self._sorted_samples(int(r)) for r in targets])
            cl = self.cost[light]
            span = 2.0 * float(max(cl.max(), ch.max())) + 1.0
            key = slot * span + cl
            begin = np.cumsum(sizes) - sizes
            half_gap = 0.5 * (top - self.load[targets])
            query = np.arange(targets.size) * span + np.maximum(ch[:, None] - half_gap, 0.0)
            pos = np.searchsorted(key, query)
            window = np.arange(-_SWAP_NEIGHBOURS, _SWAP_NEIGHBOURS)
            cand = np.minimum(
                np.maximum(pos[:, :, None] + window, begin[None, :, None]),
                (begin + sizes - 1)[None, :, None],
            ).reshape(heavy.size, -1)
        seq_len = self.seq_len
        # Per-sample terms are computed once over the partner samples (and the heavy ones),
        # then gathered through ``cand``: the pair matrix only sees gathers and comparisons.
        # A sample alone in its bin may leave it whatever the other sample's tokens (an
        # oversized sample alone is allowed), so such bins get unbounded room.
        yl_l = self.bin_of[light]
        lload_l = self.load[yl_l // per]
        tl_l = self.tok[light]
        single_y = self.bin_cnt[yl_l] == 1
        room_y = np.where(single_y, _UNBOUNDED, seq_len - self.bin_tok[yl_l] + tl_l)
        lload = lload_l[cand]
        delta = ch[:, None] - cl[cand]
        ok = (delta > tol) & (delta < ((top - lload_l) - tol)[cand])
        if not ok.any():
            return None
        xh = self.bin_of[heavy]
        th = self.tok[heavy]
        single_x = self.bin_cnt[xh] == 1
        room_x = np.where(single_x, _UNBOUNDED, seq_len - self.bin_tok[xh] + th)
        ok &= tl_l[cand] <= room_x[:, None]
        ok &= th[:, None] <= room_y[cand]
        if self.has_budgets and ok.any():
            yl = yl_l[cand]
            bh = self.bud[heavy]
            bl = self.bud[light][cand]
            ok &= self._budget_ok((self.bin_bud[xh] - bh)[:, None, :] + bl) | single_x[:, None]
            ok &= self._budget_ok(self.bin_bud[yl] - bl + bh[:, None, :]) | single_y[cand]
        if not ok.any():
            return None
        score = np.maximum(top - delta, lload + delta)
        score[~ok] = np.inf
        flat = int(np.argmin(score))
        row, col = divmod(flat, cand.shape[1])
        i = int(heavy[row])
        j = int(light[cand[row, col]])
        return _Apply(self._apply_swap, i, j)

    def _exchange(
        self, a: int, heavy: np.ndarray, targets: np.ndarray, tol: float
    ) -> _Apply | None:
        """One sample of ``a`` for a run of two or more samples of one lighter bin."""
        per = self.per_rank
        top = float(self.load[a])
        c_all = self.cost
        ch = c_all[heavy]
        if heavy.size > _EXCHANGE_CANDIDATES:
            pick = np.lexsort((heavy, -ch))[:_EXCHANGE_CANDIDATES]
            heavy = heavy[pick]
            ch = ch[pick]
        ybins = (targets[:, None] * per + self.slots).ravel()
        ybins = ybins[self.bin_cnt[ybins] >= 2]
        if ybins.size == 0:
            return None
        members = self.members
        light = np.array([i for y in ybins.tolist() for i in members[y]], dtype=np.int64)
        yl = self.bin_of[light]
        tl = self.tok[light]
        order = np.lexsort((light, tl, yl))
        light, yl, tl = light[order], yl[order], tl[order]
        cl = c_all[light]
        m = light.size
        # Prefix sums over the flattened, per-bin token-sorted runs; a run [s, e) must stay
        # inside the bin of s, which ends at ``stop[s]``.
        tp = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(tl, out=tp[1:])
        cp = np.zeros(m + 1, dtype=np.float64)
        np.cumsum(cl, out=cp[1:])
        new_bin = np.ones(m, dtype=bool)
        new_bin[1:] = yl[1:] != yl[:-1]
        first = np.flatnonzero(new_bin)
        ends_of_bins = np.append(first[1:], m)
        stop = np.repeat(ends_of_bins, np.diff(np.append(first, m)))
        starts = np.arange(m)
        xh = self.bin_of[heavy]
        th = self.tok[heavy]
        seq_len = self.seq_len
        # Run tokens must lie in [lo, hi]: bin y keeps room for i, bin x for the run.
        lo = th[:, None] - (seq_len - self.bin_tok[yl])
        hi = np.where(self.bin_cnt[xh] == 1, seq_len, seq_len - self.bin_tok[xh] + th)[:, None]
        base = tp[:-1]
        gap = top - self.load[yl // per]
        best_score = np.inf
        best: tuple[int, int, int] | None = None
        e_min = np.searchsorted(tp, base + np.maximum(lo, 1), side="left")
        e_max = np.searchsorted(tp, base + hi, side="right") - 1
        for candidate_ends in (e_min, np.minimum(e_max, stop)):
            ends = np.minimum(candidate_ends, m)
            run_tok = tp[ends] - base
            ok = (ends >= starts + 2) & (ends <= stop)
            ok &= (run_tok >= lo) & (run_tok <= hi)
            delta = ch[:, None] - (cp[ends] - cp[:-1])
            ok &= (delta > tol) & (delta < gap - tol)
            if not ok.any():
                continue
            if self.has_budgets:
                ok &= self._exchange_budgets(heavy, light, ends, ok)
                if not ok.any():
                    continue
            score = np.maximum(top - delta, top - gap + delta)
            score[~ok] = np.inf
            flat = int(np.argmin(score))
            if float(score.flat[flat]) < best_score:
                best_score = float(score.flat[flat])
                row, s = divmod(flat, m)
                best = (row, s, int(ends[row, s]))
        if best is None:
            return None
        row, s, e = best
        return _Apply(self._apply_exchange, int(heavy[row]), light[s:e].tolist())

    def _exchange_budgets(
        self, heavy: np.ndarray, light: np.ndarray, ends: np.ndarray, ok: np.ndarray
    ) -> np.ndarray:
        rows, cols = np.nonzero(ok)
        run = np.zeros((light.size + 1, self.limits.size), dtype=np.float64)
        np.cumsum(self.bud[light], axis=0, out=run[1:])
        run_bud = run[ends[rows, cols]] - run[cols]
        bh = self.bud[heavy[rows]]
        xh = self.bin_of[heavy[rows]]
        yl = self.bin_of[light[cols]]
        fine = self._budget_ok(self.bin_bud[xh] - bh + run_bud)
        fine &= self._budget_ok(self.bin_bud[yl] - run_bud + bh)
        out = np.zeros_like(ok)
        out[rows[fine], cols[fine]] = True
        return out

    # ------------------------------------------------------------------ updates

    def _relocate(self, i: int, src: int, dst: int) -> None:
        per = self.per_rank
        for cache in (self._rank_cache, self._sorted_cache):
            cache.pop(src // per, None)
            cache.pop(dst // per, None)
        self.members[src].remove(i)
        self.members[dst].append(i)
        self.bin_of[i] = dst
        t = int(self.tok[i])
        c = float(self.cost[i])
        self.bin_tok[src] -= t
        self.bin_tok[dst] += t
        self.bin_cnt[src] -= 1
        self.bin_cnt[dst] += 1
        self.bin_cost[src] -= c
        self.bin_cost[dst] += c
        self.load[src // per] -= c
        self.load[dst // per] += c

    def _refresh_budgets(self, *bins: int) -> None:
        if self.has_budgets:
            for b in bins:
                self.bin_bud[b] = self.bud[self.members[b]].sum(axis=0)

    def _apply_move(self, i: int, y: int) -> int:
        x = int(self.bin_of[i])
        self._relocate(i, x, y)
        self._refresh_budgets(x, y)
        return y // self.per_rank

    def _apply_shift_move(self, i: int, k: int, shift_to: int) -> int:
        y = int(self.bin_of[k])
        self._relocate(k, y, shift_to)
        return self._apply_move(i, y)

    def _apply_swap(self, i: int, j: int) -> int:
        x = int(self.bin_of[i])
        y = int(self.bin_of[j])
        self._relocate(i, x, y)
        self._relocate(j, y, x)
        self._refresh_budgets(x, y)
        return y // self.per_rank

    def _apply_exchange(self, i: int, run: list[int]) -> int:
        x = int(self.bin_of[i])
        y = int(self.bin_of[run[0]])
        self._relocate(i, x, y)
        for j in run:
            self._relocate(j, y, x)
        self._refresh_budgets(x, y)
        return y // self.per_rank

    def _apply_bin_swap(self, x: int, y: int) -> int:
        per = self.per_rank
        for cache in (self._rank_cache, self._sorted_cache):
            cache.pop(x // per, None)
            cache.pop(y // per, None)
        members = self.members
        members[x], members[y] = members[y], members[x]
        for b in (x, y):
            self.bin_of[members[b]] = b
        for array in (self.bin_tok, self.bin_cnt, self.bin_cost, self.bin_bud):
            array[[x, y]] = array[[y, x]]
        moved = float(self.bin_cost[y] - self.bin_cost[x])  # cost that went from x's rank to y's
        self.load[x // per] -= moved
        self.load[y // per] += moved
        return y // per


class _Apply:
    """A deferred change: the family's best candidate, applied only if chosen."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., int], *args: object) -> None:
        self.fn = fn
        self.args = args

    def __call__(self) -> int:
        return self.fn(*self.args)
