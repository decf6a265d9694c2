"""Slow reference implementations of the planner's compiled kernels (tests only).

The compiled core (``engine/_planning/_native.c``) is the only production implementation of
the reference greedy and of the default algorithm's local search. These are their
specifications, written as the planner ran them before the core became mandatory: the greedy
as plain Python over heaps (``lpt_assign``), the search as whole-array numpy expressions
(``OracleSearch``). Tests hold the core to identical layouts, ties and packing budgets
included. ``OracleRefine`` is the default algorithm with these kernels in place of the
compiled ones (same starts, same final choice).

The search's tuning constants are read from the compiled module, where they are defined;
the tolerance ``1e-12 * |top| + 1e-300`` is written out here and in ``attempt_tolerance``
in ``_drive.h``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.objectives import balance
from evenflow.engine._planning.schedule import NEAR_OPTIMAL
from evenflow.engine.planning import BalanceProblem, FlatLayout, RefineAlgorithm

__all__ = [
    "OracleRefine",
    "OracleSearch",
    "PolishOracle",
    "heavy_bound",
    "lpt_assign",
    "lpt_layout",
]

_core = native._core
NEAR_TARGETS: int = _core.NEAR_TARGETS
WIDE_TARGETS: int = _core.WIDE_TARGETS
FULL_SWAP_PAIRS: int = _core.FULL_SWAP_PAIRS
SWAP_NEIGHBOURS: int = _core.SWAP_NEIGHBOURS
EXCHANGE_CANDIDATES: int = _core.EXCHANGE_CANDIDATES
POLISH_PARTNERS: int = _core.POLISH_PARTNERS
SUBSET_CANDIDATES: int = _core.SUBSET_CANDIDATES
# Room of a bin holding a single sample: anything may join it when that sample leaves, since
# a sample alone in its bin may be oversized.
UNBOUNDED = np.iinfo(np.int64).max
# The first phase's table (PHASE1 in _search.c): (family, partner set) in the order tried; the
# first entry that finds a change applies it. Partner sets: the NEAR_TARGETS lightest ranks,
# the next WIDE_TARGETS, every other lighter rank (see OracleSearch._improve).
PHASE1 = (
    ("move", "near"),
    ("swap", "near"),
    ("exchange", "near"),
    ("shifted move", "near"),
    ("shifted move", "wide"),
    ("exchange", "wide"),
    ("move", "far"),
)
# The second phase's table (PHASE2 in _polish.c).
PHASE2 = ("group-wide move", "subset exchange")


# ---------------------------------------------------------------------------- the greedy


def lpt_assign(problem: BalanceProblem) -> list[list[int]] | None:
    """The reference greedy (see ``lpt.lpt_assign`` for the rule); None on a dead end."""
    if problem.num_samples < problem.num_bins:
        return None
    return _lpt(problem, np.lexsort((-problem.tokens, -problem.costs)))


def lpt_layout(problem: BalanceProblem) -> FlatLayout | None:
    bins = lpt_assign(problem)
    return None if bins is None else FlatLayout.of_bins(bins)


def sample_lpt_layout(problem: BalanceProblem) -> FlatLayout | None:
    """The greedy sample LPT (``lpt.sample_lpt_layout``), as plainly as it can be said: each
    sample in the reference greedy's order goes to the least-loaded rank (the lowest on ties)
    that has a bin with room and budget for it, into the fullest such bin (the first on
    ties). None when a sample fits no bin or a bin ends empty."""
    if problem.num_samples < problem.num_bins:
        return None
    ranks, per = problem.num_ranks, problem.bins_per_rank
    seq_len = problem.constraints.seq_len
    budgets = list(problem.constraints.budgets.values())
    rows: list[list[float]] = problem.budget_costs.tolist()
    load = [0.0] * ranks
    fill = [[0] * per for _ in range(ranks)]
    spent = [[[0.0] * len(budgets) for _ in range(per)] for _ in range(ranks)]
    bins: list[list[int]] = [[] for _ in range(ranks * per)]
    for i in np.lexsort((-problem.tokens, -problem.costs)).tolist():
        t, c = int(problem.tokens[i]), float(problem.costs[i])
        for r in sorted(range(ranks), key=lambda q: (load[q], q)):
            fits = [
                b
                for b in range(per)
                if fill[r][b] + t <= seq_len
                and all(spent[r][b][k] + rows[i][k] <= lim for k, lim in enumerate(budgets))
            ]
            if fits:
                b = max(fits, key=lambda x: (fill[r][x], -x))
                break
        else:
            return None
        bins[r * per + b].append(i)
        fill[r][b] += t
        load[r] += c
        for k in range(len(budgets)):
            spent[r][b][k] += rows[i][k]
    return FlatLayout.of_bins(bins) if all(bins) else None


def _lpt(problem: BalanceProblem, order_array: np.ndarray) -> list[list[int]] | None:
    """The greedy given the placement order: lists of sample indices, or None."""
    num_ranks, per_rank = problem.num_ranks, problem.bins_per_rank
    num_bins = num_ranks * per_rank
    seq_len = problem.constraints.seq_len
    # Phase 1 reads its own samples only; phase 2 takes its own lists.
    opening = order_array[:num_bins]
    order: list[int] = opening.tolist()
    costs = dict(zip(order, problem.costs[opening].tolist(), strict=True))
    tokens = dict(zip(order, problem.tokens[opening].tolist(), strict=True))
    budgets = list(problem.constraints.budgets.values())
    budget_rows: list[list[float]] = problem.budget_costs.tolist() if budgets else []

    bins: list[list[int]] = [[] for _ in range(num_bins)]
    bin_tokens = [[0] * per_rank for _ in range(num_ranks)]
    bin_budget = (
        [[[0.0] * len(budgets) for _ in range(per_rank)] for _ in range(num_ranks)]
        if budgets
        else []
    )

    # Phase 1: every bin is empty, so the capacity term is equal for all candidates and the
    # choice is the rank minimising (load, tokens, rank), then its first empty bin.
    heap: list[tuple[float, int, int]] = [(0.0, 0, r) for r in range(num_ranks)]
    opened = [0] * num_ranks
    full: list[tuple[float, int, int]] = []
    for i in order[:num_bins]:
        load, rank_tok, r = heapq.heappop(heap)
        p = opened[r]
        opened[r] = p + 1
        bins[r * per_rank + p].append(i)
        t = tokens[i]
        bin_tokens[r][p] = t
        if budgets:
            bin_budget[r][p] = list(budget_rows[i])
        entry = (load + costs[i], rank_tok + min(t, seq_len), r)
        if p + 1 < per_rank:
            heapq.heappush(heap, entry)
        else:
            full.append(entry)  # no empty bin left: ineligible until phase 2
    heap.extend(full)
    heapq.heapify(heap)

    # Phase 2: every bin is eligible. The least-loaded rank with a feasible bin wins; ranks
    # tied on load compare (capacity left, tokens, rank, bin), so all of them are examined.
    # A rank whose emptiest bin cannot take the sample's tokens is *parked*, keyed by that
    # room, and returns to the heap only for a sample short enough to fit it: bins only fill
    # up, so this never hides a feasible rank, and with costs that grow with length (tokens
    # then only shrink along the order) each rank is parked and released a bounded number of
    # times instead of being re-examined for every sample.
    rest_index = order_array[num_bins:]
    if rest_index.size == 0:
        return bins
    if int(problem.tokens[rest_index].max()) > seq_len:
        return None  # an oversized sample needs an empty bin; none is left after phase 1
    rest_tokens: list[int] = problem.tokens[rest_index].tolist()
    rest_costs: list[float] = problem.costs[rest_index].tolist()
    rest: list[int] = rest_index.tolist()
    appenders = [b.append for b in bins]
    parked: list[tuple[int, tuple[float, int, int]]] = []
    if not budgets:
        placed = _place_plain(
            heap,
            rest=rest,
            rest_tokens=rest_tokens,
            rest_costs=rest_costs,
            bin_tokens=bin_tokens,
            appenders=appenders,
            per_rank=per_rank,
            seq_len=seq_len,
        )
        return bins if placed else None
    # With budgets: a heap of (load, tokens, rank) tuples, whose order is the rule's own.
    # Two sentinel ranks of infinite load sit below every real entry, so heap[1] and
    # heap[2] always exist and popping a sentinel means no real rank is feasible.
    heap.extend([(math.inf, 0, num_ranks), (math.inf, 0, num_ranks + 1)])
    skipped: list[tuple[float, int, int]] = []
    heappop, heappush = heapq.heappop, heapq.heappush
    for i, t, c in zip(rest, rest_tokens, rest_costs, strict=True):
        if parked:
            while parked and -parked[0][0] >= t:
                heappush(heap, heappop(parked)[1])
        limit = seq_len - t
        row = budget_rows[i]
        # The first rank (in load order) with a feasible bin, and its best bin.
        while True:
            entry = heappop(heap)
            r = entry[2]
            if r >= num_ranks:
                return None  # a sentinel: every real rank is parked or skipped
            emptiest = min(bin_tokens[r])
            if emptiest > limit:
                heappush(parked, (emptiest - seq_len, entry))
                continue
            slot = _best_bin(bin_tokens[r], limit, row, bin_budget[r], budgets)
            if slot >= 0:
                break
            skipped.append(entry)  # tokens fit but a budget does not
        if heap[0][0] == entry[0]:
            # Ranks tied on load: the smallest (capacity left, tokens, rank, bin) wins.
            best = (limit - bin_tokens[r][slot], entry[1], r, slot)
            best_entry = entry
            while heap[0][0] == best_entry[0]:
                other = heappop(heap)
                q = other[2]
                other_slot = (
                    _best_bin(bin_tokens[q], limit, row, bin_budget[q], budgets)
                    if q < num_ranks
                    else -1
                )
                candidate = (limit - bin_tokens[q][other_slot], other[1], q, other_slot)
                if other_slot >= 0 and candidate < best:
                    skipped.append(best_entry)
                    best, best_entry = candidate, other
                else:
                    skipped.append(other)
            entry, r, slot = best_entry, best[2], best[3]
        appenders[r * per_rank + slot](i)
        bin_tokens[r][slot] += t
        acc = bin_budget[r][slot]
        for k, value in enumerate(row):
            acc[k] += value
        heappush(heap, (entry[0] + c, entry[1] + t, r))
        if skipped:
            for other in skipped:
                heappush(heap, other)
            skipped.clear()
    return bins


def _place_plain(
    heap: list[tuple[float, int, int]],
    *,
    rest: list[int],
    rest_tokens: list[int],
    rest_costs: list[float],
    bin_tokens: list[list[int]],
    appenders: list[Callable[[int], None]],
    per_rank: int,
    seq_len: int,
) -> bool:
    """Phase 2 of the greedy without budgets; ``False`` on a dead end.

    The heap holds bare float loads, one per rank not parked: comparing floats is about twice
    as fast as comparing ``(load, tokens, rank)`` tuples, and heap work is most of the cost
    per sample. ``owner`` maps a load held by one rank to that rank, and a load several
    ranks share to ``-1`` (their ranks are in ``shared``). The usual sample meets a root held
    by one rank: best fit in that rank, one ``heapreplace``. At a shared root, every tied rank
    in the heap is examined and the smallest (capacity left, rank tokens, rank, bin) wins,
    exactly as the tuple heap orders them. Rank tokens are summed on the side.
    """
    num_ranks = len(bin_tokens)
    owner: dict[float, int] = {}
    shared: dict[float, list[int]] = {}
    rank_tokens = [0] * num_ranks
    loads: list[float] = []
    for load, tokens, r in heap:
        rank_tokens[r] = tokens
        loads.append(load)
        _register(owner, shared, load, r)
    heapq.heapify(loads)
    parked = [False] * num_ranks
    waiting: list[tuple[int, float, int]] = []  # (fill of emptiest bin - seq_len, load, rank)
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i, t, c in zip(rest, rest_tokens, rest_costs, strict=True):
        if waiting and -waiting[0][0] >= t:
            while waiting and -waiting[0][0] >= t:
                _, load, r = heappop(waiting)
                parked[r] = False
                heappush(loads, load)
        limit = seq_len - t
        while True:
            if not loads:
                return False  # every rank is parked: no bin can take the sample
            load = loads[0]
            r = owner[load]
            if r >= 0:
                row_tokens = bin_tokens[r]
                fill = -1
                slot = 0
                for p, v in enumerate(row_tokens):
                    if limit >= v > fill:
                        fill = v
                        slot = p
                if fill >= 0:
                    row_tokens[slot] = fill + t
                    appenders[r * per_rank + slot](i)
                    rank_tokens[r] += t
                    new = load + c
                    del owner[load]
                    if new in owner:
                        _register(owner, shared, new, r)
                    else:
                        owner[new] = r
                    heapreplace(loads, new)
                    break
                heappop(loads)
                parked[r] = True
                heappush(waiting, (min(row_tokens) - seq_len, load, r))
                continue
            # Ranks tied on load: take every one of them off the heap and compare.
            best: tuple[int, int, int, int] | None = None
            tied = [q for q in shared[load] if not parked[q]]
            for q in tied:
                heappop(loads)
                row_tokens = bin_tokens[q]
                fill = -1
                slot = 0
                for p, v in enumerate(row_tokens):
                    if limit >= v > fill:
                        fill = v
                        slot = p
                if fill < 0:
                    parked[q] = True
                    heappush(waiting, (min(row_tokens) - seq_len, load, q))
                    continue
                candidate = (limit - fill, rank_tokens[q], q, slot)
                if best is None or candidate < best:
                    best = candidate
            if best is None:
                continue  # none of them has room: they are parked, look further
            _, _, r, slot = best
            for q in tied:
                if q != r and not parked[q]:
                    heappush(loads, load)
            bin_tokens[r][slot] += t
            appenders[r * per_rank + slot](i)
            rank_tokens[r] += t
            new = load + c
            _unregister(owner, shared, load, r)
            _register(owner, shared, new, r)
            heappush(loads, new)
            break
    return True


def _register(owner: dict[float, int], shared: dict[float, list[int]], load: float, r: int) -> None:
    """Record that rank ``r`` now has ``load`` (see :func:`_place_plain`)."""
    other = owner.get(load)
    if other is None:
        owner[load] = r
    elif other >= 0:
        owner[load] = -1
        shared[load] = [other, r]
    else:
        shared[load].append(r)


def _unregister(
    owner: dict[float, int], shared: dict[float, list[int]], load: float, r: int
) -> None:
    """Record that rank ``r`` no longer has ``load``."""
    if owner[load] >= 0:
        del owner[load]
        return
    ranks = shared[load]
    ranks.remove(r)
    if len(ranks) == 1:
        owner[load] = ranks[0]
        del shared[load]


def _best_bin(
    fills: list[int],
    limit: int,
    row: list[float] | None,
    sums: list[list[float]],
    budgets: list[float],
) -> int:
    """The fullest bin that can still take ``limit``-bounded tokens (first on ties), or -1."""
    fill = -1
    slot = -1
    for p, v in enumerate(fills):
        if limit >= v > fill and (row is None or _budget_fits(sums[p], row, budgets)):
            fill = v
            slot = p
    return slot


def _budget_fits(acc: list[float], row: list[float], budgets: list[float]) -> bool:
    return all(acc[k] + row[k] <= budget for k, budget in enumerate(budgets))


# ---------------------------------------------------------------------------- the search


class OracleRefine(RefineAlgorithm):
    """The default algorithm around the reference kernels instead of the compiled ones."""

    def _greedy(self, problem: BalanceProblem) -> FlatLayout | None:
        return lpt_layout(problem)

    def _sample_greedy(self, problem: BalanceProblem) -> FlatLayout | None:
        return sample_lpt_layout(problem)

    def _search(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray]:
        search = OracleSearch(problem, start)
        layout = search.run(budget, stop_at=stop_at)
        return layout, search.rank_of()

    def _polish(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        cells: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray, int]:
        polish = PolishOracle(problem, start, cells)
        load = np.asarray(polish.load)
        bound = max(float(load.sum()) / problem.num_ranks, float(problem.costs.max(initial=0.0)))
        if stop_at is not None:
            layout = polish.run(budget, stop_at, sumsq=problem.objective is balance)
            return layout, polish.rank_of(), polish.changes
        layout = polish.run(
            budget, bound * (1.0 + NEAR_OPTIMAL), sumsq=problem.objective is balance
        )
        return layout, polish.rank_of(), polish.changes


def lightest(load: np.ndarray, reach: int) -> np.ndarray:
    """The ``reach`` ranks first by (load, rank), in linear time (``reach < load.size``).

    Ties at the boundary go to the lowest ranks, so the set is a function of the loads
    alone (``argpartition`` may pick any of the tied ranks).
    """
    level = np.partition(load, reach - 1)[reach - 1]
    below = np.flatnonzero(load < level)
    tied = np.flatnonzero(load == level)[: reach - below.size]
    return np.concatenate([below, tied])


class OracleSearch:
    """Mutable layout state plus the improvement families (``refine.py`` describes them)."""

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
        # Bins as lists, built when the search runs.
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
        # Entries of PHASE1 in use (bit e for entry e), as the core's ``families``.
        self.families = native.ALL_FAMILIES
        # Sample arrays of ranks whose bins did not change since they were built.
        self._rank_cache: dict[int, np.ndarray] = {}
        # The same samples by ascending (cost, index), for the swap windows.
        self._sorted_cache: dict[int, np.ndarray] = {}

    def rank_of(self) -> np.ndarray:
        """Destination rank of every sample in the current layout."""
        ranks: np.ndarray = self.bin_of // self.per_rank
        return ranks

    # ------------------------------------------------------------------ driver

    def run(self, budget: int, *, stop_at: float | None = None) -> FlatLayout:
        """Search for at most ``budget`` attempts (or until the most loaded rank is at or
        below ``stop_at``, when given); the layout reached."""
        num_ranks = self.p.num_ranks
        # No layout beats the larger of the mean rank load and the costliest sample; within
        # NEAR_OPTIMAL of it the remaining gain is not worth the planning time.
        bound = max(float(self.load.sum()) / num_ranks, float(self.cost.max(initial=0.0)))
        good_enough = bound * (1.0 + NEAR_OPTIMAL) if stop_at is None else stop_at
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

    def _improve(self, a: int) -> int:
        """Apply the best improving change between rank ``a`` and a lighter rank."""
        load = self.load
        top = float(load[a])
        tol = 1e-12 * abs(top) + 1e-300
        count = load.size
        reach = NEAR_TARGETS + (0 if self.sumsq_mode else WIDE_TARGETS)
        pool = lightest(load, reach) if count - 1 > reach else np.arange(count)
        pool = pool[load[pool] < top - tol]
        if pool.size == 0:
            return -1
        order = pool[np.lexsort((pool, load[pool]))]
        heavy = self._rank_samples(a)
        partners = {"near": order[:NEAR_TARGETS], "wide": order[NEAR_TARGETS:]}
        if count - 1 > reach and order.size == reach:
            # Every other lighter rank, in rank order.
            outside = np.ones(count, dtype=bool)
            outside[order] = False
            partners["far"] = np.flatnonzero(outside & (load < top - tol))[: self.cost.size]
        else:
            partners["far"] = order[:0]
        for e, (name, partner_set) in enumerate(PHASE1):
            targets = partners[partner_set]
            if targets.size == 0 or not (self.families >> e) & 1:
                continue
            found = getattr(self, self._FAMILIES[name])(a, heavy, targets, tol)
            if found is not None:
                return found()
        return -1

    _FAMILIES = {
        "move": "_move",
        "swap": "_swap",
        "exchange": "_exchange",
        "shifted move": "_cheap",
    }

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

        On larger ranks only the ``2 * SWAP_NEIGHBOURS`` samples of each partner rank whose
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
        if heavy.size * light.size <= FULL_SWAP_PAIRS:
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
            window = np.arange(-SWAP_NEIGHBOURS, SWAP_NEIGHBOURS)
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
        room_y = np.where(single_y, UNBOUNDED, seq_len - self.bin_tok[yl_l] + tl_l)
        lload = lload_l[cand]
        delta = ch[:, None] - cl[cand]
        ok = (delta > tol) & (delta < ((top - lload_l) - tol)[cand])
        if not ok.any():
            return None
        xh = self.bin_of[heavy]
        th = self.tok[heavy]
        single_x = self.bin_cnt[xh] == 1
        room_x = np.where(single_x, UNBOUNDED, seq_len - self.bin_tok[xh] + th)
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
        if heavy.size > EXCHANGE_CANDIDATES:
            pick = np.lexsort((heavy, -ch))[:EXCHANGE_CANDIDATES]
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


# ---------------------------------------------------------------------------- the polish


class PolishOracle:
    """The second search phase (``_polish.c``) as plain Python and numpy: its specification.

    Same families, candidate orders, knapsack and tie rules as the core (see the comment at
    the top of ``_polish.c``); tests hold the two to identical layouts. No packing budgets.
    """

    def __init__(self, problem: BalanceProblem, start: FlatLayout, cells: int) -> None:
        self.p = problem
        self.per = problem.bins_per_rank
        self.seq_len = problem.constraints.seq_len
        self.cost = problem.costs
        self.tok = problem.tokens
        self.members = [list(b) for b in start.bins]
        nb = len(self.members)
        self.bin_of = np.empty(problem.num_samples, dtype=np.int64)
        for b, items in enumerate(self.members):
            self.bin_of[items] = b
        sizes = np.array([len(b) for b in self.members], dtype=np.int64)
        bin_ids = np.repeat(np.arange(nb, dtype=np.int64), sizes)
        flat = start.flat
        self.bin_tok = [int(v) for v in np.bincount(bin_ids, weights=self.tok[flat], minlength=nb)]
        self.bin_cnt = sizes.tolist()
        bin_cost = np.bincount(bin_ids, weights=self.cost[flat], minlength=nb)
        self.load: list[float] = bin_cost.reshape(problem.num_ranks, self.per).sum(axis=1).tolist()
        self.cells_left = cells
        self.changes = 0
        # Entries of PHASE2 in use (bit e for entry e), as the core's ``families``.
        self.families = native.ALL_FAMILIES

    def rank_of(self) -> np.ndarray:
        ranks: np.ndarray = self.bin_of // self.per
        return ranks

    def run(self, budget: int, good_enough: float, *, sumsq: bool) -> FlatLayout:
        num_ranks = self.p.num_ranks
        stuck = [False] * num_ranks
        for _ in range(budget):
            top = max(range(num_ranks), key=lambda r: (self.load[r], -r))
            if not sumsq and (stuck[top] or self.load[top] <= good_enough):
                break
            free = [r for r in range(num_ranks) if not stuck[r]]
            if not free:
                break
            a = max(free, key=lambda r: (self.load[r], -r))
            partner = self._improve(a)
            if partner < 0:
                stuck[a] = True
            else:
                self.changes += 1
                stuck[a] = stuck[partner] = False
        return FlatLayout.of_bins(self.members)

    def _improve(self, a: int) -> int:
        top = self.load[a]
        tol = 1e-12 * abs(top) + 1e-300
        move = self._wide_move(a, tol) if self.families & 1 else None
        if move is not None:
            i, y = move
            self._relocate(i, y)
            return y // self.per
        exchange = self._subset_exchange(a, tol) if (self.families >> 1) & 1 else None
        if exchange is not None:
            i, y, subset = exchange
            x = int(self.bin_of[i])
            self._relocate(i, y)
            for j in subset:
                self._relocate(j, x)
            return y // self.per
        return -1

    def _relocate(self, i: int, dst: int) -> None:
        src = int(self.bin_of[i])
        self.members[src].remove(i)
        self.members[dst].append(i)
        self.bin_of[i] = dst
        t, c = int(self.tok[i]), float(self.cost[i])
        self.bin_tok[src] -= t
        self.bin_tok[dst] += t
        self.bin_cnt[src] -= 1
        self.bin_cnt[dst] += 1
        self.load[src // self.per] -= c
        self.load[dst // self.per] += c

    def _wide_move(self, a: int, tol: float) -> tuple[int, int] | None:
        per, seq_len = self.per, self.seq_len
        num_ranks = self.p.num_ranks
        room = [
            max(seq_len - self.bin_tok[r * per + p] for p in range(per)) for r in range(num_ranks)
        ]
        order = sorted(range(num_ranks), key=lambda r: (-room[r], r))
        prefarg: list[int] = []
        for k, r in enumerate(order):
            if k == 0 or self.load[r] < self.load[prefarg[-1]]:
                prefarg.append(r)
            else:
                prefarg.append(prefarg[-1])
        top = self.load[a]
        best: tuple[float, int, int] | None = None
        for b in range(a * per, (a + 1) * per):
            if len(self.members[b]) < 2:
                continue
            for i in self.members[b]:
                ci, ti = float(self.cost[i]), int(self.tok[i])
                if not ci > tol or ti > seq_len:
                    continue
                count = sum(1 for r in order if room[r] >= ti)  # a prefix of the order
                if count == 0:
                    continue
                r = prefarg[count - 1]
                lr = self.load[r]
                if not ci < (top - lr) - tol:
                    continue
                score = max(top - ci, lr + ci)
                if best is None or score < best[0]:
                    best = (score, i, r)
        if best is None:
            return None
        _, i, r = best
        ti = int(self.tok[i])
        fits = [r * per + p for p in range(per) if self.bin_tok[r * per + p] + ti <= seq_len]
        y = max(fits, key=lambda q: (self.bin_tok[q], -q))
        return i, y

    def _knapsack(
        self, items: list[int], cap: int
    ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """Least and largest cost of a subset with exactly T tokens, T <= cap, and which item
        last improved each entry (vectorised: each item updates from the previous arrays)."""
        minc = np.full(cap + 1, np.inf)
        maxc = np.full(cap + 1, -np.inf)
        minc[0] = maxc[0] = 0.0
        took_min: list[np.ndarray] = []
        took_max: list[np.ndarray] = []
        for j in items:
            t, c = int(self.tok[j]), float(self.cost[j])
            low = np.full(cap + 1, np.inf)
            high = np.full(cap + 1, -np.inf)
            low[t:] = minc[: cap + 1 - t] + c
            high[t:] = maxc[: cap + 1 - t] + c
            better_min = low < minc
            better_max = high > maxc
            minc = np.where(better_min, low, minc)
            maxc = np.where(better_max, high, maxc)
            took_min.append(better_min)
            took_max.append(better_max)
        return minc, maxc, took_min, took_max

    def _subset_exchange(self, a: int, tol: float) -> tuple[int, int, list[int]] | None:
        per, seq_len = self.per, self.seq_len
        top = self.load[a]
        mine = [i for b in range(a * per, (a + 1) * per) for i in self.members[b]]
        mine = [i for i in mine if int(self.tok[i]) <= seq_len]
        heavy = sorted(mine, key=lambda i: (-float(self.cost[i]), i))[:SUBSET_CANDIDATES]
        if not heavy:
            return None

        def admissible_max(i: int) -> int:
            x = int(self.bin_of[i])
            if self.bin_cnt[x] == 1:
                return seq_len
            return seq_len - self.bin_tok[x] + int(self.tok[i])

        cap = max(admissible_max(i) for i in heavy)
        lighter = [r for r in range(self.p.num_ranks) if self.load[r] < top - tol]
        partners = sorted(lighter, key=lambda r: (self.load[r], r))[:POLISH_PARTNERS]
        best: tuple[float, int, int, int, int] | None = None
        for r in partners:
            lr = self.load[r]
            gap = top - lr
            for y in range(r * per, (r + 1) * per):
                items = sorted(j for j in self.members[y] if int(self.tok[j]) <= cap)
                if not items:
                    continue
                cells = len(items) * (cap + 1)
                if cells > self.cells_left:
                    return self._take(best)
                self.cells_left -= cells
                minc, maxc, _, _ = self._knapsack(items, cap)
                room_y = seq_len - self.bin_tok[y]
                for i in heavy:
                    ci, ti = float(self.cost[i]), int(self.tok[i])
                    lo = max(ti - room_y, 1)
                    for t in range(lo, admissible_max(i) + 1):
                        for which, values in enumerate((minc, maxc)):
                            v = float(values[t])
                            if not math.isfinite(v):
                                continue
                            delta = ci - v
                            if not (delta > tol and delta < gap - tol):
                                continue
                            score = max(top - delta, lr + delta)
                            if best is None or score < best[0]:
                                best = (score, i, y, t, which)
        return self._take(best)

    def _take(
        self, best: tuple[float, int, int, int, int] | None
    ) -> tuple[int, int, list[int]] | None:
        if best is None:
            return None
        _, i, y, t, which = best
        items = sorted(j for j in self.members[y] if int(self.tok[j]) <= t)
        _, _, took_min, took_max = self._knapsack(items, t)
        took = took_max if which else took_min
        subset: list[int] = []
        remaining = t
        for k in range(len(items) - 1, -1, -1):
            if remaining <= 0:
                break
            if took[k][remaining]:
                subset.append(items[k])
                remaining -= int(self.tok[items[k]])
        return i, y, subset[::-1]


# ---------------------------------------------------------------------------- bound 5


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """The piecewise-linear function through (xs[j], ys[j]) at x, clamped at both ends."""
    m = len(xs) - 1
    if x <= xs[0]:
        return ys[0]
    if x >= xs[m]:
        return ys[m]
    lo, hi = 0, m
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    return ys[lo] + (x - xs[lo]) * ((ys[hi] - ys[lo]) / (xs[hi] - xs[lo]))


class _Relaxation:
    """One heavy set's relaxation: whether a makespan passes its test."""

    def __init__(
        self,
        *,
        k: float,
        spare: float,
        heavy_cost: float,
        least: float,
        most: float,
        floor: float,
        f_tok: list[float],
        f_cost: list[float],
        g_cost: list[float],
        g_tok: list[float],
    ) -> None:
        self.k, self.spare, self.heavy_cost = k, spare, heavy_cost
        self.least, self.most, self.floor = least, most, floor
        self.f_tok, self.f_cost, self.g_cost, self.g_tok = f_tok, f_cost, g_cost, g_tok

    def passes(self, m: float) -> bool:
        rounding = 1e-9
        afford = self.k * m - self.heavy_cost
        must = self.g_cost[-1] - self.spare * m
        taken = _interp(self.g_cost, self.g_tok, must) if must > 0.0 else 0.0
        taken = max(taken, self.least)
        cheapest = _interp(self.f_tok, self.f_cost, taken)
        slack = rounding * (abs(afford) if abs(afford) > self.floor else self.floor)
        return taken <= self.most * (1.0 + rounding) + rounding and cheapest <= afford + slack


def heavy_bound(
    costs: list[float],
    tokens: list[int],
    density: list[int],
    thresholds: list[float],
    *,
    num_ranks: int,
    bins_per_rank: int,
    seq_len: int,
    floor: float,
    upper: float | None,
) -> float:
    """Bound 5 of ``bounds.py`` (heavy ranks and tokens) as ``_bound.c`` computes it, in the
    same order of float operations, so the two agree exactly."""
    resolution = 1e-10
    n = len(costs)
    room = float(bins_per_rank) * float(seq_len)
    best, previous = 0.0, -1
    for threshold in thresholds:
        heavy = [c > threshold for c in costs]
        k = sum(heavy)
        heavy_cost = heavy_tokens = 0.0
        cheapest = second = math.inf
        for i in range(n):
            if heavy[i]:
                heavy_cost += costs[i]
                heavy_tokens += float(tokens[i])
                if costs[i] < cheapest:
                    cheapest, second = costs[i], cheapest
                elif costs[i] < second:
                    second = costs[i]
        if k < 1 or k > num_ranks or k == previous:
            continue
        previous = k
        cap = cheapest + second if k >= 2 else math.inf
        f_tok, f_cost, g_cost, g_tok = [0.0], [0.0], [0.0], [0.0]
        rest_tokens = 0.0
        for i in density:
            if heavy[i]:
                continue
            rest_tokens += float(tokens[i])
            if tokens[i] > 0:
                f_tok.append(f_tok[-1] + float(tokens[i]))
                f_cost.append(f_cost[-1] + costs[i])
        for i in reversed(density):
            if heavy[i] or not costs[i] > 0.0:
                continue
            g_cost.append(g_cost[-1] + costs[i])
            g_tok.append(g_tok[-1] + float(tokens[i]))
        spare = float(num_ranks - k)
        least = max(rest_tokens - spare * room, 0.0)
        most = min(float(k) * room - heavy_tokens, rest_tokens)
        if least > most:
            continue
        relax = _Relaxation(
            k=float(k),
            spare=spare,
            heavy_cost=heavy_cost,
            least=least,
            most=most,
            floor=floor,
            f_tok=f_tok,
            f_cost=f_cost,
            g_cost=g_cost,
            g_tok=g_tok,
        )
        lo = floor
        hi = max(upper, lo) if upper is not None and upper > 0.0 else 2.0 * lo + heavy_cost
        hi = min(hi, cap)
        if relax.passes(lo):
            continue
        if not relax.passes(hi):
            best = max(best, hi)
            continue
        for _ in range(64):
            if not hi - lo > resolution * floor:
                break
            mid = lo + (hi - lo) / 2.0
            if relax.passes(mid):
                hi = mid
            else:
                lo = mid
        best = max(best, lo)
    return best
