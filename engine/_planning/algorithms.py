"""Balancing algorithms: the problem they solve, their contract, and the reference greedy.

A :class:`BalanceProblem` is one step of one balance group in canonical form: the samples in
ascending key order (so no result can depend on the order in which metadata was gathered),
their scalar costs, token counts and packing-budget footprints, and the source layout. An
algorithm returns a new layout of the same samples into the same number of non-empty bins per
rank; the planner validates it and decides whether to use it.

:class:`LPTAlgorithm` reproduces the reference greedy exactly (longest processing time first
with best-fit bins, falling back to the source layout when a sample fits nowhere). The default
algorithm, :class:`~evenflow.engine._planning.refine.RefineAlgorithm`, lives in its own module.
"""

from __future__ import annotations

import heapq
import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleKey
from evenflow.engine._planning.objectives import Objective, makespan
from evenflow.engine._planning.refine import RefineAlgorithm
from evenflow.engine.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "BalanceProblem",
    "BalancingAlgorithm",
    "FlatLayout",
    "LPTAlgorithm",
    "RefineAlgorithm",
    "first_infeasible_bin",
    "lpt_assign",
    "resolve_algorithm",
]

RankCostFn = Callable[[np.ndarray], np.ndarray]


def _load_native() -> Any:
    """The compiled inner loops (``evenflow.engine._planning._native``), or None when not built."""
    try:  # optional: see pyproject.toml
        return importlib.import_module("evenflow.engine._planning._native")
    except ImportError:  # pragma: no cover - depends on how the package was built
        return None


_native: Any = _load_native()
# Tests switch this off to run the pure-Python specification on the same problems.
_use_native = True


def _compiled() -> Any:
    """The compiled core when it is built and switched on, else None."""
    return _native if _use_native else None


@dataclass(frozen=True, eq=False)
class BalanceProblem:
    """One step of one balance group, in canonical order (built by the planner).

    Sample ``i`` is ``keys[i]``; keys are sorted ascending, so index order is key order and
    breaking ties by index is breaking them by key. ``costs[i]`` is the scalar cost used for
    every greedy decision, ``tokens[i]`` its packed length and ``budget_costs[i, k]`` its
    footprint for the ``k``-th name of ``constraints.budgets``. ``source_bins`` is the source
    layout, rank-major: bins ``r * bins_per_rank`` to ``(r + 1) * bins_per_rank - 1`` belong to
    rank ``r``. The arrays are read-only; an algorithm must not try to change them.

    ``rank_cost_fn``, when set, maps the destination rank of every sample (an int64 vector of
    length ``num_samples``) to the per-rank costs. The planner sets it for cost models whose
    rank cost is not the plain sum of sample costs (e.g. the slowest of several components);
    :meth:`rank_costs` uses it, so every layout is scored in the planner's units.
    """

    keys: tuple[SampleKey, ...]
    costs: np.ndarray
    tokens: np.ndarray
    budget_costs: np.ndarray
    source_bins: tuple[tuple[int, ...], ...]
    num_ranks: int
    bins_per_rank: int
    constraints: PackingConstraints
    objective: Objective = makespan
    rank_cost_fn: RankCostFn | None = None

    def __post_init__(self) -> None:
        n = len(self.keys)
        costs = np.asarray(self.costs, dtype=np.float64)
        tokens = np.asarray(self.tokens, dtype=np.int64)
        budget_costs = np.asarray(self.budget_costs, dtype=np.float64)
        if budget_costs.size == 0:
            budget_costs = budget_costs.reshape(n, len(self.constraints.budgets))
        if costs.shape != (n,) or tokens.shape != (n,):
            raise ConfigError(
                f"BalanceProblem.costs and .tokens must have shape ({n},) (one entry per key), "
                f"but got {costs.shape} and {tokens.shape}."
            )
        expected = (n, len(self.constraints.budgets))
        if budget_costs.shape != expected:
            raise ConfigError(
                f"BalanceProblem.budget_costs must have shape {expected} (one column per "
                f"packing budget), but got {budget_costs.shape}."
            )
        if len(self.source_bins) != self.num_ranks * self.bins_per_rank:
            raise ConfigError(
                f"BalanceProblem.source_bins must hold num_ranks * bins_per_rank = "
                f"{self.num_ranks * self.bins_per_rank} bins, but got {len(self.source_bins)}."
            )
        # Read-only views: the caller's arrays stay as they were, algorithms cannot write.
        for name, array in (("costs", costs), ("tokens", tokens), ("budget_costs", budget_costs)):
            view = array.view()
            view.setflags(write=False)
            object.__setattr__(self, name, view)

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    @property
    def num_bins(self) -> int:
        return self.num_ranks * self.bins_per_rank

    def rank_of(self, bins: Sequence[Sequence[int]]) -> np.ndarray:
        """Destination rank of every sample under the rank-major layout ``bins``."""
        flat, sizes = _flatten(bins)
        return self._rank_of_flat(flat, sizes)

    def _rank_of_flat(self, flat: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """:meth:`rank_of` for a layout already flattened by :func:`_flatten`."""
        ranks = np.repeat(np.arange(sizes.size, dtype=np.int64) // self.bins_per_rank, sizes)
        out = np.full(self.num_samples, -1, dtype=np.int64)
        out[flat] = ranks
        return out

    def rank_costs_of(self, rank_of: np.ndarray) -> np.ndarray:
        """Per-rank costs given the destination rank of every sample."""
        if self.rank_cost_fn is not None:
            return np.asarray(self.rank_cost_fn(rank_of), dtype=np.float64)
        return np.bincount(rank_of, weights=self.costs, minlength=self.num_ranks)

    def rank_costs(self, bins: Sequence[Sequence[int]]) -> np.ndarray:
        """Per-rank costs of the layout ``bins`` (float64, one entry per rank)."""
        return self.rank_costs_of(self.rank_of(bins))

    def score(self, bins: Sequence[Sequence[int]]) -> float:
        """The problem's objective applied to :meth:`rank_costs`."""
        return float(self.objective(self.rank_costs(bins)))


class FlatLayout(Sequence[list[int]]):
    """A layout held as arrays: ``flat`` (every sample index, bin after bin) and ``sizes``.

    What the compiled algorithms return, and any algorithm may: the planner validates the
    arrays directly instead of converting nested lists (~50 ms saved per 100,000 samples).
    It is also a read-only sequence of bins (lists of indices, built on first access) that
    compares equal to the same layout given as lists.
    """

    __slots__ = ("_bins", "flat", "sizes")

    def __init__(self, flat: np.ndarray, sizes: np.ndarray) -> None:
        self.flat = flat
        self.sizes = sizes
        self._bins: list[list[int]] | None = None

    @classmethod
    def of_bins(cls, bins: list[list[int]]) -> FlatLayout:
        """The layout of ``bins``, keeping the lists themselves as :attr:`bins`."""
        layout = cls(*_flatten(bins))
        layout._bins = bins
        return layout

    @property
    def bins(self) -> list[list[int]]:
        """The layout as lists (built once)."""
        if self._bins is None:
            self._bins = _split(self.flat, self.sizes)
        return self._bins

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, index: Any) -> Any:
        return self.bins[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FlatLayout):
            return bool(
                np.array_equal(self.sizes, other.sizes) and np.array_equal(self.flat, other.flat)
            )
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self.bins == [list(b) for b in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FlatLayout({self.bins!r})"


def _flatten(bins: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A layout as ``(flat, sizes)``: every index in bin order, and each bin's length."""
    if isinstance(bins, FlatLayout):
        return bins.flat, bins.sizes
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(
        itertools.chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum(dtype=np.int64))
    )
    return flat, sizes


def _split(flat: np.ndarray, sizes: np.ndarray) -> list[list[int]]:
    """Inverse of :func:`_flatten`: the layout as lists (one C-level slice per bin)."""
    values: list[int] = flat.tolist()
    ends: list[int] = np.cumsum(sizes).tolist()
    return [values[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def first_infeasible_bin(problem: BalanceProblem, bins: Sequence[Sequence[int]]) -> int:
    """Index of the first bin that breaks the packing constraints, or -1 when all hold.

    A bin holds when its tokens fit ``seq_len`` (or it is one oversized sample alone under
    ``oversized_policy="single"``) and every budget sum fits its budget. Budget sums are added
    sample by sample in bin order, exactly as :meth:`PackingConstraints.validate_bin` does,
    so this vectorised check and that replay never disagree on a bin at the edge of a
    budget. Bins must be non-empty and hold valid indices (checked by the caller).
    """
    flat, sizes = _flatten(bins)
    return _first_infeasible_flat(problem, flat, sizes)


def _first_infeasible_flat(problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray) -> int:
    """:func:`first_infeasible_bin` for a layout already flattened by :func:`_flatten`."""
    constraints = problem.constraints
    num_bins = sizes.size
    starts = np.cumsum(sizes) - sizes
    # Bins are non-empty, so reduceat sums each bin exactly, in int64.
    totals = np.add.reduceat(problem.tokens[flat], starts) if flat.size else np.zeros(num_bins)
    over = totals > constraints.seq_len
    if constraints.oversized_policy == "single":
        over &= sizes != 1
    bad = over
    limits = np.array(list(constraints.budgets.values()), dtype=np.float64)
    if limits.size:
        # Column by column (the p-th sample of every bin at once) keeps the per-bin
        # summation order sequential; prefix sums of non-negative values only grow, so the
        # final sum decides.
        bin_ids = np.repeat(np.arange(num_bins, dtype=np.int64), sizes)
        position = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, sizes)
        order = np.argsort(position, kind="stable")
        bounds = np.searchsorted(position[order], np.arange(int(sizes.max()) + 1))
        sums = np.zeros((num_bins, limits.size), dtype=np.float64)
        values = problem.budget_costs
        for p in range(bounds.size - 1):
            chunk = order[bounds[p] : bounds[p + 1]]
            sums[bin_ids[chunk]] += values[flat[chunk]]
        bad = bad | np.any(sums > limits, axis=1)
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else -1


@runtime_checkable
class BalancingAlgorithm(Protocol):
    """A pluggable balancing policy.

    ``assign(problem)`` returns ``problem.num_bins`` rank-major bins of sample indices (every
    index exactly once, every bin non-empty and feasible under ``problem.constraints``), as
    lists or as a :class:`FlatLayout`, or ``None`` to keep the source layout. It must be
    deterministic (a pure function of the problem), do no I/O and not mutate the problem.
    The planner validates the result, raising ``PlanningError`` on a bad one, and applies the
    acceptance gate. ``algorithm_id`` is a versioned identity that enters configuration
    fingerprints: change it whenever a change of code can change a plan.
    """

    name: str
    algorithm_id: str

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None: ...


def lpt_assign(problem: BalanceProblem) -> list[list[int]] | None:
    """The reference greedy; ``None`` when some sample fits no bin (a dead end).

    Samples go in order of (-cost, -tokens, key). The first ``num_bins`` samples each open a
    distinct empty bin, so every bin ends non-empty; afterwards a sample goes to the feasible
    bin minimising (rank load, capacity left after insertion, rank tokens, rank, bin). Rank
    tokens add ``min(tokens, seq_len)``. Loads are Python floats summed in the same order as
    the reference, so ties resolve identically. Steps without packing budgets run compiled
    (``evenflow.engine._planning._native``, ~50 ns per sample) when the extension is built;
    :func:`_lpt_python` is its specification (phase 2 by :func:`_place_plain`, 1-2 us per
    sample). Steps with budgets use a heap of ``(load, tokens, rank)`` tuples and check
    budgets per bin.
    """
    layout = lpt_layout(problem)
    return None if layout is None else layout.bins


def lpt_layout(problem: BalanceProblem) -> FlatLayout | None:
    """:func:`lpt_assign` as a :class:`FlatLayout` (no lists when compiled), or None."""
    if problem.num_samples < problem.num_bins:
        return None
    order = np.lexsort((-problem.tokens, -problem.costs))
    core = _compiled()
    if core is not None and not problem.constraints.budgets:
        return _lpt_compiled(core, problem, order)
    bins = _lpt_python(problem, order)
    return None if bins is None else FlatLayout.of_bins(bins)


def _lpt_python(problem: BalanceProblem, order_array: np.ndarray) -> list[list[int]] | None:
    """:func:`lpt_assign` in Python (the specification), given the placement order."""
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


def _lpt_compiled(core: Any, problem: BalanceProblem, order: np.ndarray) -> FlatLayout | None:
    """The whole greedy without budgets, compiled, or None on a dead end.

    Same rule and float sums as :func:`_lpt_python` (phase 1 included), so the same layout;
    the arrays feed the default algorithm without re-flattening.
    """
    flat = np.empty(problem.num_samples, dtype=np.int64)
    sizes = np.empty(problem.num_bins, dtype=np.int64)
    placed = core.lpt_plain(
        np.ascontiguousarray(problem.costs),
        np.ascontiguousarray(problem.tokens),
        np.ascontiguousarray(order, dtype=np.int64),
        flat,
        sizes,
        problem.num_ranks,
        problem.bins_per_rank,
        problem.constraints.seq_len,
    )
    return FlatLayout(flat, sizes) if placed else None


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
    """Phase 2 of :func:`lpt_assign` without budgets; ``False`` on a dead end.

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


class LPTAlgorithm:
    """Longest processing time first with best-fit bins: the reference behaviour, exactly.

    Fast (one heap operation per sample) and good when bins have room, but it dead-ends when
    bins are nearly full (a long sample late in the order fits nowhere) and then keeps the
    source layout. See :func:`lpt_assign` for the precise rule.
    """

    name = "lpt"
    algorithm_id = "lpt-v1"

    def assign(self, problem: BalanceProblem) -> list[list[int]] | None:
        """The greedy layout, or ``None`` (keep the source) on a dead end."""
        return lpt_assign(problem)

    def __repr__(self) -> str:
        return "LPTAlgorithm()"


ALGORITHMS: dict[str, Callable[[], BalancingAlgorithm]] = {
    "default": RefineAlgorithm,
    "refine": RefineAlgorithm,
    "lpt": LPTAlgorithm,
}


def resolve_algorithm(value: object) -> BalancingAlgorithm:
    """A balancing algorithm from a name (``"default"``, ``"refine"``, ``"lpt"``) or object."""
    if isinstance(value, str):
        factory = ALGORITHMS.get(value)
        if factory is None:
            known = ", ".join(repr(name) for name in ALGORITHMS)
            raise ConfigError(
                f"algorithm must be one of {known} or an object with an assign(problem) "
                f"method, but got {value!r}."
            )
        return factory()
    if callable(getattr(value, "assign", None)):
        return value  # type: ignore[return-value]
    raise TypeError(
        f"algorithm must be a name ('default', 'refine', 'lpt') or an object with a callable "
        f"assign(problem) method, but got {value!r} ({type(value).__name__})."
    )
