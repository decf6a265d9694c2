"""The balancing problem: what an algorithm is given, what it returns, and what is feasible.

A :class:`BalanceProblem` is one step of one balance group in canonical form: the samples in
ascending key order (so no result can depend on the order in which metadata was gathered),
their scalar costs, token counts and packing-budget footprints, and the source layout. A
:class:`BalancingAlgorithm` returns a new layout of the same samples into the same number of
non-empty bins per rank, as lists or as a :class:`FlatLayout`; the planner validates it (with
:func:`first_infeasible_bin`) and decides whether to use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleKey
from evenflow.engine._planning.objectives import Objective, makespan
from evenflow.engine.errors import ConfigError

__all__ = [
    "BalanceProblem",
    "BalancingAlgorithm",
    "FlatLayout",
    "first_infeasible_bin",
]

# ``fn(rank_of)`` per rank; the planner's accepts ``fn(group_of, num_groups)`` as well.
RankCostFn = Callable[..., np.ndarray]


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

    def ranks_of(self, layout: FlatLayout) -> np.ndarray:
        """:meth:`rank_of` of a layout of this problem, computed once per layout (the
        planner scores and compares each of its layouts several times). Read-only."""
        ranks = layout._ranks
        if ranks is None:
            ranks = self._rank_of_flat(layout.flat, layout.sizes)
            ranks.setflags(write=False)
            layout._ranks = ranks
        return ranks

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

    __slots__ = ("_bins", "_ranks", "flat", "settled", "sizes")

    def __init__(self, flat: np.ndarray, sizes: np.ndarray, *, settled: bool = False) -> None:
        self.flat = flat
        self.sizes = sizes
        # True when the layout already went through ``settle.settle`` against this problem's
        # source: the planner then does not settle it again.
        self.settled = settled
        self._bins: list[list[int]] | None = None
        # The destination rank of every sample, once a planning step has needed it (a plan
        # scores and compares its layouts several times; see ``ranks_of``).
        self._ranks: np.ndarray | None = None

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
