"""The one place Python meets the planner's compiled core (``_native.c``).

The core is the only production implementation of the reference greedy and of the default
algorithm's local search, with and without packing budgets; ``pip install`` builds it and
fails without a C compiler. This module loads it (with an error that names the fix when it is
missing), reports its identity, and hands it contiguous arrays of the types it reads.

:data:`CORE_VERSION` is defined in the C source and bumped with every change that can change
a plan; :func:`core_identity` puts it into :meth:`Planner.identity`, so ranks that would plan
differently are refused before their first step instead of failing the per-step digest check.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from evenflow.engine._planning.problem import BalanceProblem

__all__ = [
    "ALL_FAMILIES",
    "CORE_VERSION",
    "core_identity",
    "cost_order",
    "deal_bins",
    "grouped_search",
    "heavy_bound",
    "kk_bins",
    "lpt",
    "polish",
    "refine_search",
    "search_state",
    "settle",
]

_MODULE = "evenflow.engine._planning._native"
# Every entry of a search phase's table of move families (a bit per entry).
ALL_FAMILIES = (1 << 64) - 1


def _load() -> Any:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"{_MODULE} (the planner's compiled core) is not built or cannot be loaded: {exc}. "
            "evenflow needs it and has no pure-Python fallback. Install a C compiler "
            "(e.g. gcc, or the Xcode command line tools) and reinstall evenflow with "
            "'pip install .' (or 'pip install -e .'), or build it in place with "
            "'python -c \"from setuptools import setup; setup()\" build_ext --inplace'."
        ) from exc


_core: Any = _load()

CORE_VERSION: int = int(_core.CORE_VERSION)


def core_identity() -> dict[str, Any]:
    """What the planner's identity records about the core (plans depend on it)."""
    return {"core": "compiled", "core_version": CORE_VERSION}


def _f64(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float64)


def _i64(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int64)


def _limits(problem: BalanceProblem) -> np.ndarray:
    return np.array(list(problem.constraints.budgets.values()), dtype=np.float64)


def lpt(
    problem: BalanceProblem, order: np.ndarray, *, open_first: bool = True
) -> tuple[np.ndarray, np.ndarray] | None:
    """The greedy's layout as ``(flat, sizes)`` given the placement order, or None (dead end).

    ``open_first``: the first ``num_bins`` samples each open a bin (the reference greedy);
    False places every sample by the same rule from empty bins (the greedy sample LPT), where
    a bin left empty is a dead end too."""
    flat = np.empty(problem.num_samples, dtype=np.int64)
    sizes = np.empty(problem.num_bins, dtype=np.int64)
    placed = _core.lpt(
        _f64(problem.costs),
        _i64(problem.tokens),
        _f64(problem.budget_costs),
        _limits(problem),
        _i64(order),
        flat,
        sizes,
        problem.num_ranks,
        problem.bins_per_rank,
        problem.constraints.seq_len,
        open_first,
    )
    return (flat, sizes) if placed else None


def refine_search(
    problem: BalanceProblem,
    start: tuple[np.ndarray, np.ndarray],
    state: dict[str, np.ndarray],
    *,
    budget: int,
    good_enough: float,
    sumsq: bool,
    families: int = ALL_FAMILIES,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the local search from ``start`` = ``(flat, sizes)``; the layout reached.

    ``state`` holds the search state for the start (``bin_of``, ``bin_cnt``, ``bin_tok``,
    ``bin_cost``, ``bin_bud``, ``load``; see ``search.py``) as writable contiguous arrays of
    the right types; the core updates them in place. ``families``: the entries of the first
    phase's table in use, bit ``e`` for entry ``e`` (tests hold each to its oracle alone).
    """
    flat, sizes = _i64(start[0]), _i64(start[1])
    out_flat = np.empty_like(flat)
    out_sizes = np.empty_like(sizes)
    _core.refine_search(
        _f64(problem.costs),
        _i64(problem.tokens),
        _f64(problem.budget_costs),
        _limits(problem),
        flat,
        sizes,
        state["bin_of"],
        state["bin_cnt"],
        state["bin_tok"],
        state["bin_cost"],
        state["bin_bud"],
        state["load"],
        out_flat,
        out_sizes,
        problem.bins_per_rank,
        problem.constraints.seq_len,
        budget,
        good_enough,
        sumsq,
        families,
    )
    return out_flat, out_sizes


def search_state(
    problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray, state: dict[str, np.ndarray]
) -> None:
    """Fill ``state`` (``search.py``'s arrays, allocated by the caller) for the layout
    ``(flat, sizes)``; fewer than eight bins per rank."""
    _core.search_state(
        _f64(problem.costs),
        _i64(problem.tokens),
        _f64(problem.budget_costs),
        _i64(flat),
        _i64(sizes),
        state["bin_of"],
        state["bin_cnt"],
        state["bin_tok"],
        state["bin_cost"],
        state["bin_bud"],
        state["load"],
    )


def settle(
    problem: BalanceProblem,
    flat: np.ndarray,
    sizes: np.ndarray,
    home: np.ndarray,
    *,
    weights: np.ndarray,
    limit: float,
    order: np.ndarray | None = None,
    thorough: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Relabel ``(flat, sizes)`` towards the source bins ``home`` and, when ``limit >= 0``,
    bring samples home while every rank stays at or below ``limit`` (see ``settle.py``).
    ``order``: the samples by (cost, index) ascending (:func:`cost_order`), or None to have
    the core sort them. ``thorough``: more passes, more swap partners a sample."""
    flat = _i64(flat)
    sizes = _i64(sizes)
    out_flat = np.empty_like(flat)
    out_sizes = np.empty_like(sizes)
    _core.settle(
        _f64(problem.costs),
        _i64(problem.tokens),
        _i64(weights),
        _i64(home),
        flat,
        sizes,
        out_flat,
        out_sizes,
        problem.bins_per_rank,
        problem.constraints.seq_len,
        float(limit),
        _NO_ORDER if order is None else _i64(order),
        thorough,
    )
    return out_flat, out_sizes


_NO_ORDER = np.zeros(0, dtype=np.int64)


def deal_bins(bin_cost: np.ndarray, order: np.ndarray, ranks: int, per: int) -> np.ndarray:
    """The source bin at every new position when the bins, in ``order``, each go to the least
    loaded rank that still lacks a bin (``kk.deal_bins``)."""
    dealt = np.empty(bin_cost.size, dtype=np.int64)
    _core.deal_bins(_f64(bin_cost), _i64(order), dealt, ranks, per)
    return dealt


def kk_bins(bin_cost: np.ndarray, order: np.ndarray, ranks: int, per: int) -> np.ndarray:
    """The source bin at every new position when the bins, sliced in ``order``, are split by
    Karmarkar-Karp differencing (``kk.kk_bins``)."""
    dealt = np.empty(bin_cost.size, dtype=np.int64)
    _core.kk_bins(_f64(bin_cost), _i64(order), dealt, ranks, per)
    return dealt


def cost_order(problem: BalanceProblem) -> np.ndarray:
    """The samples by (cost, index) ascending: what :func:`settle` sorts unless given it."""
    return np.argsort(problem.costs, kind="stable")


def polish(
    problem: BalanceProblem,
    start: tuple[np.ndarray, np.ndarray],
    state: dict[str, np.ndarray],
    *,
    budget: int,
    good_enough: float,
    sumsq: bool,
    cells: int,
    families: int = ALL_FAMILIES,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Run the second search phase from ``start`` = ``(flat, sizes)`` (no packing budgets):
    the layout reached and the number of changes. ``state`` is the search state of the start
    (``search.py``), updated in place; ``cells`` the knapsack allowance (see ``polish.py``);
    ``families`` the entries of the phase's table in use, as for :func:`refine_search`.
    """
    flat, sizes = _i64(start[0]), _i64(start[1])
    out_flat = np.empty_like(flat)
    out_sizes = np.empty_like(sizes)
    changes = _core.polish(
        _f64(problem.costs),
        _i64(problem.tokens),
        flat,
        sizes,
        state["bin_of"],
        state["bin_cnt"],
        state["bin_tok"],
        state["bin_cost"],
        state["load"],
        out_flat,
        out_sizes,
        problem.bins_per_rank,
        problem.constraints.seq_len,
        budget,
        good_enough,
        sumsq,
        cells,
        families,
    )
    return out_flat, out_sizes, int(changes)


def heavy_bound(
    costs: np.ndarray,
    tokens: np.ndarray,
    density: np.ndarray,
    thresholds: np.ndarray,
    *,
    num_ranks: int,
    bins_per_rank: int,
    seq_len: int,
    floor: float,
    upper: float | None,
) -> float:
    """Bound 5 of ``bounds.py`` for the heavy sets above ``thresholds`` (ascending); 0:
    nothing above ``floor``. ``density`` orders the samples by cost per token, ascending."""
    return float(
        _core.heavy_bound(
            _f64(costs),
            _i64(tokens),
            _i64(density),
            _f64(thresholds),
            num_ranks,
            bins_per_rank,
            seq_len,
            float(floor),
            0.0 if upper is None else float(upper),
        )
    )


def grouped_search(
    state: Any,
    *,
    limits: np.ndarray,
    order: np.ndarray,
    group_size: int,
    seq_len: int,
    single: bool,
    budget: int,
    partner_units: int,
    families: int = ALL_FAMILIES,
) -> tuple[int, int]:
    """Run the grouped search (``grouped.py``) on ``state``, a ``grouped.UnitState`` whose
    arrays it updates in place, and ``order`` (every unit once), which it leaves listing the
    units by (cost descending, unit ascending): the attempts made and the changes applied.
    ``single``: the oversized policy is ``"single"``; ``families``: the entries of its table in
    use, as for :func:`refine_search`."""
    attempts, changes = _core.grouped_search(
        _f64(state.costs),
        _i64(state.tokens),
        _f64(state.budget_costs),
        _f64(limits),
        state.bin_of,
        state.bin_cnt,
        state.bin_tok,
        state.bin_bud,
        state.unit_cost,
        order,
        state.bins_per_unit,
        group_size,
        seq_len,
        single,
        budget,
        partner_units,
        families,
    )
    return int(attempts), int(changes)
