"""The planner: validate one gathered step, cost it, balance it, gate it, return a Plan.

The planner owns everything around the balancing algorithm that must be trusted: input
validation (every key once, every source bin feasible), cost evaluation (once per sample,
vectorised), canonical ordering (so a plan never depends on gather order), validation of the
algorithm's output (count, non-empty, conservation, capacity, budgets) and the acceptance gate
(the source layout is kept unless the candidate is strictly better by more than
``min_balance_gain``). The input is arrays (:class:`StepColumns`, what the gathered metadata
carries) and so is the result's layout; work per step is a handful of vectorised passes over
the samples. :meth:`Planner.plan` is the object-based entry over the same path.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleKey, SampleMetadata
from evenflow.engine._plan import BalanceDecision, Plan, PlanLayout
from evenflow.engine._planning import cost as _cost
from evenflow.engine._planning.bounds import step_bound
from evenflow.engine._planning.columns import (
    KeyView,
    MetadataView,
    StepColumns,
    budget_columns,
    check_columns,
    check_samples,
    columns_of_samples,
    raise_duplicate,
    strictly_increasing,
)
from evenflow.engine._planning.lockstep import bin_cost_matrix, order_bins
from evenflow.engine._planning.native import core_identity
from evenflow.engine._planning.objectives import lockstep, resolve_objective
from evenflow.engine._planning.problem import (
    BalanceProblem,
    BalancingAlgorithm,
    FlatLayout,
    _first_infeasible_flat,
)
from evenflow.engine._planning.registry import resolve_algorithm
from evenflow.engine._planning.settle import Settler
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError, PlanningError

__all__ = ["PlannedStep", "Planner"]

_pause_lock = threading.Lock()
_pause_depth = 0
_pause_restores = False


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while any plan runs in this process.

    ``gc.disable()`` is process-wide: two plans on two threads that each saved and restored the
    flag could interleave and leave the collector disabled for good. A counted pause re-enables
    it when the last overlapping plan ends, and only if it was enabled when the first began.
    """
    global _pause_depth, _pause_restores
    with _pause_lock:
        if _pause_depth == 0:
            _pause_restores = gc.isenabled()
            gc.disable()
        _pause_depth += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause_depth -= 1
            if _pause_depth == 0 and _pause_restores:
                gc.enable()


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One planned step: the plan, and the delivered layout in the planner's own terms.

    ``flat``/``sizes`` is the layout the plan delivers, in canonical sample indices of
    ``problem`` (the step's samples in ascending key order, with their costs), so that a
    planner built on this one (the window planner) continues from it without re-deriving
    costs or indices from the plan's keys.
    """

    plan: Plan
    problem: BalanceProblem
    flat: np.ndarray
    sizes: np.ndarray


class Planner:
    """Plans one step of one balance group at a time (see the module docstring).

    ``num_ranks`` ranks hold ``bins_per_rank`` packed sequences of ``seq_len`` tokens each.
    ``cost_model``: anything :func:`evenflow.engine._planning.cost.resolve_cost_model` accepts.
    ``algorithm``: ``"default"`` (= ``"refine"``), ``"lpt"`` or an object with
    ``assign(problem)``. ``objective``: ``"makespan"``, ``"lockstep"`` or ``"balance"``; under
    ``"lockstep"`` every rank's bins are delivered costliest first, the source's too.
    ``min_balance_gain`` in [0, 1): the candidate replaces the source layout only when
    ``(original - candidate) / original > min_balance_gain``. ``oversized_policy`` and
    ``packing_budgets`` define feasibility (see :class:`PackingConstraints`).
    """

    def __init__(
        self,
        *,
        num_ranks: int,
        bins_per_rank: int,
        seq_len: int,
        cost_model: object = None,
        algorithm: object = "default",
        objective: str = "makespan",
        min_balance_gain: float = 0.0,
        oversized_policy: str = "error",
        packing_budgets: dict[str, float] | None = None,
    ) -> None:
        self.num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        self.bins_per_rank = check_int("bins_per_rank", bins_per_rank, minimum=1)
        self.constraints = PackingConstraints(
            seq_len=seq_len,
            oversized_policy=oversized_policy,  # type: ignore[arg-type]
            packing_budgets=packing_budgets,
        )
        self.seq_len = self.constraints.seq_len
        self.objective_name = objective
        self.objective = resolve_objective(objective)
        gain = check_number(
            "min_balance_gain", min_balance_gain, minimum=0.0, maximum=1.0, strict_maximum=True
        )
        self.min_balance_gain = gain
        self.cost_model: Any = _cost.resolve_cost_model(cost_model)
        self.cost_model_id = _cost.cost_model_id(self.cost_model)
        self._components = isinstance(self.cost_model, _cost.ComponentCost)
        self.algorithm: BalancingAlgorithm = resolve_algorithm(algorithm)
        self.algorithm_name = str(getattr(self.algorithm, "name", type(self.algorithm).__name__))
        self.algorithm_id = str(
            getattr(self.algorithm, "algorithm_id", type(self.algorithm).__qualname__)
        )
        self._last_keys: Sequence[SampleKey] = ()
        self._last_values: np.ndarray = np.zeros(0, dtype=np.float64)
        self._last_costs: dict[SampleKey, float] | None = {}

    def __repr__(self) -> str:
        return (
            f"Planner(num_ranks={self.num_ranks}, bins_per_rank={self.bins_per_rank}, "
            f"seq_len={self.seq_len}, algorithm={self.algorithm_name!r}, "
            f"objective={self.objective_name!r})"
        )

    @property
    def num_bins(self) -> int:
        return self.num_ranks * self.bins_per_rank

    @property
    def last_costs(self) -> dict[SampleKey, float]:
        """Predicted cost of every sample of the last planned step (built on first access)."""
        if self._last_costs is None:
            values: list[float] = self._last_values.tolist()
            self._last_costs = dict(zip(self._last_keys, values, strict=True))
        return self._last_costs

    def identity(self) -> dict[str, Any]:
        """Plain data that determines every plan this planner makes (for fingerprints).

        It includes the compiled core's version: ``build_loader`` compares identities across
        ranks before the first step, so a group whose builds would plan differently is
        refused there rather than by the per-step digest check.
        """
        return {
            "num_ranks": self.num_ranks,
            "bins_per_rank": self.bins_per_rank,
            "seq_len": self.seq_len,
            "oversized_policy": self.constraints.oversized_policy,
            "packing_budgets": dict(sorted(self.constraints.budgets.items())),
            "objective": self.objective_name,
            "min_balance_gain": self.min_balance_gain,
            "cost_model": self.cost_model_id,
            "algorithm": self.algorithm_id,
            **core_identity(),
        }

    # ------------------------------------------------------------------ planning

    def plan(
        self,
        samples: Iterable[tuple[SampleKey, SampleMetadata]],
        reference_bins: Sequence[Sequence[SampleKey]],
        step: int,
    ) -> Plan:
        """Plan ``step``: the samples re-assigned to ``num_ranks * bins_per_rank`` bins.

        ``samples`` are the step's ``(key, metadata)`` pairs in any order; ``reference_bins``
        is the source layout, rank-major (the first ``bins_per_rank`` bins belong to rank 0),
        listing every key exactly once. Raises ``ConfigError``/``TypeError`` on bad input and
        ``PlanningError`` when the algorithm returns an invalid layout. The objects are turned
        into :class:`StepColumns` and planned by :meth:`plan_arrays`.
        """
        step = check_int("step", step, minimum=0)
        # A step holds ~5 objects per sample (100,000 samples at 1,024 ranks), so a full
        # collection triggered by the planner's own allocations would walk them all, costing
        # 50-100 ms at a random point of the plan. The planner builds no reference cycles, so
        # nothing is lost by collecting after it. The switch is process-wide, so overlapping
        # plans (several loaders, several threads) share one pause: see _collector_paused.
        with _collector_paused():
            columns, keys = columns_of_samples(
                samples,
                reference_bins,
                num_ranks=self.num_ranks,
                bins_per_rank=self.bins_per_rank,
                constraints=self.constraints,
            )
            return self._plan(columns, step, keys).plan

    def plan_arrays(self, columns: StepColumns, step: int) -> Plan:
        """Plan ``step`` from per-sample arrays (what the gathered metadata messages carry).

        Gives the plan :meth:`plan` gives for the same samples and source layout, digest
        included; no key or metadata object is built unless a cost model, an algorithm or
        an error message asks for one.
        """
        return self.plan_step(columns, step).plan

    def plan_step(self, columns: StepColumns, step: int) -> PlannedStep:
        """:meth:`plan_arrays`, with the delivered layout in canonical indices beside the plan
        (what the window planner continues from)."""
        step = check_int("step", step, minimum=0)
        check_columns(columns, self.num_bins)
        with _collector_paused():
            return self._plan(columns, step, None)

    def _plan(
        self, columns: StepColumns, step: int, given_keys: tuple[SampleKey, ...] | None
    ) -> PlannedStep:
        fields, order, source_flat = _canonical_order(columns, step)
        keys: Sequence[SampleKey] = KeyView(fields) if given_keys is None else given_keys
        metas = MetadataView(columns, order)
        tokens = np.ascontiguousarray(columns.tokens[order], dtype=np.int64)
        budget_costs = budget_columns(columns, self.constraints, order)
        check_samples(self.constraints, tokens, budget_costs, keys, metas)
        source_sizes = np.asarray(columns.sizes, dtype=np.int64)
        bounds: list[int] = [0, *np.cumsum(source_sizes).tolist()]
        values: list[int] = source_flat.tolist()
        source = tuple(tuple(values[bounds[b] : bounds[b + 1]]) for b in range(self.num_bins))
        costs, rank_cost_fn = self._costs(keys, metas, tokens)
        problem = BalanceProblem(
            keys=cast("tuple[SampleKey, ...]", keys),
            costs=costs,
            tokens=tokens,
            budget_costs=budget_costs,
            source_bins=source,
            num_ranks=self.num_ranks,
            bins_per_rank=self.bins_per_rank,
            constraints=self.constraints,
            objective=self.objective,
            rank_cost_fn=rank_cost_fn,
        )
        self._check_feasible(problem, source_flat, source_sizes, keys, metas, who="reference_bins")
        self._last_keys, self._last_values, self._last_costs = keys, costs, None

        source_rank = problem._rank_of_flat(source_flat, source_sizes)
        source_costs = problem.rank_costs_of(source_rank)
        original = self._score(source_costs, problem, source_flat, source_sizes)
        candidate = self.algorithm.assign(problem)
        flat, sizes, dest_rank = source_flat, source_sizes, source_rank
        if candidate is None:
            candidate_costs = source_costs
            candidate_score = original
        else:
            flat, sizes = self._check_candidate(problem, candidate, keys, metas)
            dest_rank = problem._rank_of_flat(flat, sizes)
            candidate_costs = problem.rank_costs_of(dest_rank)
            candidate_score = self._score(candidate_costs, problem, flat, sizes)
        gain = (original - candidate_score) / original if original > 0 else 0.0
        accepted = candidate is not None and gain > self.min_balance_gain
        if not accepted:
            flat, sizes, dest_rank = source_flat, source_sizes, source_rank
            candidate_final_costs = source_costs
        else:
            # Free in balance: keep as many samples as possible where they were read.
            if not (isinstance(candidate, FlatLayout) and candidate.settled):
                settler = Settler(problem, source_flat, source_sizes, self._layout_score(problem))
                flat, sizes = settler.plain(flat, sizes)
                dest_rank = problem._rank_of_flat(flat, sizes)
                candidate_costs = problem.rank_costs_of(dest_rank)
                # Settling never scores worse but may score better (a sample sent home can
                # lower a position's maximum under lockstep): report what is delivered.
                candidate_score = self._score(candidate_costs, problem, flat, sizes)
                gain = (original - candidate_score) / original if original > 0 else 0.0
            candidate_final_costs = candidate_costs
        if self.objective is lockstep:
            # Positions align across ranks: every rank's bins costliest first (the source's
            # too, which moves nothing and is what its score above assumed).
            flat, sizes = order_bins(flat, sizes, bin_cost_matrix(problem, flat, sizes))
        makespan = float(candidate_final_costs.max(initial=0.0))
        bound = step_bound(problem, upper=makespan)
        decision = BalanceDecision(
            objective=self.objective_name,
            algorithm=self.algorithm_name,
            original_objective=original,
            candidate_objective=candidate_score,
            relative_gain=gain,
            min_balance_gain=self.min_balance_gain,
            accepted=accepted,
            makespan=makespan,
            lower_bound=bound.lower_bound,
            mean_cost=bound.mean_cost,
            largest_cost=bound.largest_cost,
        )
        ends = np.cumsum(sizes)
        layout = PlanLayout(
            key_fields=fields[flat],
            sizes=sizes,
            tokens=np.add.reduceat(tokens[flat], ends - sizes),
            bins_per_rank=self.bins_per_rank,
            keys=given_keys,
            order=flat if given_keys is not None else None,
        )
        plan = Plan.of_layout(
            layout,
            step=step,
            seq_len=self.seq_len,
            rank_costs=tuple(candidate_final_costs.tolist()),
            source_rank_costs=tuple(source_costs.tolist()),
            decision=decision,
            num_moved=int(np.count_nonzero(dest_rank != source_rank)),
            digest=layout.digest(step, self.seq_len),
        )
        return PlannedStep(plan, problem, flat, sizes)

    # ------------------------------------------------------------------ steps of plan()

    def _costs(
        self, keys: Sequence[SampleKey], metas: Sequence[SampleMetadata], tokens: np.ndarray
    ) -> tuple[np.ndarray, Any]:
        if not self._components:
            costs = _cost.evaluate_costs(self.cost_model, metas, keys=keys, tokens=tokens)
            return costs, None
        model = self.cost_model
        parts = _cost.evaluate_components(model, metas, keys=keys)
        weights = np.asarray(model.weights, dtype=np.float64)
        weighted = parts * weights
        reduce_max = model.reduce == "max"
        scalar = weighted.max(axis=1) if reduce_max else weighted.sum(axis=1)
        num_ranks = self.num_ranks

        def rank_costs(rank_of: np.ndarray, num: int = num_ranks) -> np.ndarray:
            # Per-rank component sums, then the model's own combination of them: with
            # reduce="max" a rank costs its slowest component, not the sum of sample scalars.
            # ``num`` groups other than ranks (bins, under lockstep) the same way.
            sums = np.stack(
                [
                    np.bincount(rank_of, weights=parts[:, c], minlength=num)
                    for c in range(parts.shape[1])
                ],
                axis=1,
            )
            return np.array([model.combine(row) for row in sums], dtype=np.float64)

        return scalar, rank_costs

    def _check_feasible(
        self,
        problem: BalanceProblem,
        flat: np.ndarray,
        sizes: np.ndarray,
        keys: Sequence[SampleKey],
        metas: Sequence[SampleMetadata],
        *,
        who: str,
    ) -> None:
        bad = _first_infeasible_flat(problem, flat, sizes)
        if bad < 0:
            return
        where = f"{who}[{bad}] (rank {bad // self.bins_per_rank}, bin {bad % self.bins_per_rank})"
        start = int(sizes[:bad].sum())
        members = flat[start : start + int(sizes[bad])].tolist()
        try:
            self.constraints.validate_bin((keys[i], metas[i]) for i in members)
        except ConfigError as exc:
            if who == "reference_bins":
                raise ConfigError(f"{where} is not a feasible packed bin: {exc}") from exc
            raise PlanningError(
                f"Algorithm {self.algorithm_name!r} returned an infeasible layout: {where}: "
                f"{exc} Every bin must respect seq_len and packing_budgets."
            ) from exc
        raise AssertionError("unreachable: validate_bin must reject an infeasible bin")

    def _check_candidate(
        self,
        problem: BalanceProblem,
        candidate: object,
        keys: Sequence[SampleKey],
        metas: Sequence[SampleMetadata],
    ) -> tuple[np.ndarray, np.ndarray]:
        """The algorithm's layout as ``(flat, sizes)``, or ``PlanningError`` naming the fault."""
        nb = self.num_bins
        n = problem.num_samples
        name = self.algorithm_name
        if (
            isinstance(candidate, (str, bytes))
            or not isinstance(candidate, Sequence)
            or len(candidate) != nb
        ):
            raise PlanningError(
                f"Algorithm {name!r} must return num_ranks * bins_per_rank = {nb} bins "
                f"(or None), but returned {candidate!r:.120}."
            )
        flat_or_none = (
            _flat_arrays(candidate) if isinstance(candidate, FlatLayout) else None
        ) or _flatten_int_lists(candidate)
        if flat_or_none is None:
            # Slow path, also the one that names a malformed bin: one array per bin.
            arrays: list[np.ndarray] = []
            for b, items in enumerate(candidate):
                array = np.asarray(items)
                if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
                    raise PlanningError(
                        f"Algorithm {name!r} returned bin {b} = {items!r:.80}; every bin must "
                        f"be a non-empty sequence of sample indices (integers in [0, {n}))."
                    )
                arrays.append(array.astype(np.int64, copy=False))
            flat = np.concatenate(arrays)
            sizes = np.fromiter(map(len, arrays), dtype=np.int64, count=nb)
        else:
            flat, sizes = flat_or_none
        if flat.min() < 0 or flat.max() >= n:
            bad = int(flat[(flat < 0) | (flat >= n)][0])
            raise PlanningError(
                f"Algorithm {name!r} returned sample index {bad}, outside [0, {n})."
            )
        counts = np.bincount(flat, minlength=n)
        if flat.size != n or not np.all(counts == 1):
            wrong = int(np.flatnonzero(counts != 1)[0])
            raise PlanningError(
                f"Algorithm {name!r} must conserve every sample key exactly once, but key "
                f"{keys[wrong]} appears {int(counts[wrong])} times in its layout."
            )
        self._check_feasible(problem, flat, sizes, keys, metas, who="bins")
        return flat, sizes

    def _layout_score(self, problem: BalanceProblem) -> Any:
        def score(flat: np.ndarray, sizes: np.ndarray) -> float:
            rank_costs = problem.rank_costs_of(problem._rank_of_flat(flat, sizes))
            return self._score(rank_costs, problem, flat, sizes)

        return score

    def _score(
        self, rank_costs: np.ndarray, problem: BalanceProblem, flat: np.ndarray, sizes: np.ndarray
    ) -> float:
        if self.objective is lockstep:
            value = lockstep(bin_cost_matrix(problem, flat, sizes))
        else:
            value = float(self.objective(rank_costs))
        if not math.isfinite(value) or value < 0:
            raise PlanningError(
                f"objective {self.objective_name!r} returned {value!r}; it must be finite and >= 0."
            )
        return value


def _canonical_order(columns: StepColumns, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Key fields in ascending key order, the row of each, and the canonical index of each row.

    Planning works in ascending key order, so no plan depends on the order in which the
    metadata was gathered. Rows of a gathered step are already in that order (rank by rank,
    index by index), which one vectorised comparison confirms.
    """
    n = columns.num_samples
    rows = np.empty((n, 3), dtype=np.int64)
    rows[:, 0] = columns.source_rank
    rows[:, 1] = step if columns.key_step is None else columns.key_step
    rows[:, 2] = columns.index
    if strictly_increasing(rows):
        identity = np.arange(n, dtype=np.int64)
        return rows, identity, identity
    order = np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))
    fields = rows[order]
    if not strictly_increasing(fields):
        raise_duplicate(KeyView(fields))
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n, dtype=np.int64)
    return fields, order, inverse


def _flat_arrays(layout: FlatLayout) -> tuple[np.ndarray, np.ndarray] | None:
    """A ``FlatLayout``'s arrays if they are 1-D integers that agree, else None (checked
    bin by bin by the slow path, which names the fault)."""
    flat, sizes = np.asarray(layout.flat), np.asarray(layout.sizes)
    if (
        flat.ndim != 1
        or sizes.ndim != 1
        or flat.dtype.kind not in "iu"
        or sizes.dtype.kind not in "iu"
    ):
        return None
    if sizes.size == 0 or sizes.min() < 1 or int(sizes.sum()) != flat.size:
        return None
    return flat.astype(np.int64, copy=False), sizes.astype(np.int64, copy=False)


def _flatten_int_lists(candidate: Sequence[object]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(flat, sizes)`` of non-empty lists of Python ints, or ``None`` for anything else."""
    if not set(map(type, candidate)) <= {list, tuple}:
        return None
    bins = cast("Sequence[Sequence[object]]", candidate)
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    if sizes.size == 0 or sizes.min() == 0:
        return None
    values: list[object] = list(itertools.chain.from_iterable(bins))
    if set(map(type, values)) != {int}:
        return None  # numpy integers, floats, bools: the slow path checks them one by one
    try:
        return np.array(values, dtype=np.int64), sizes
    except OverflowError:
        return None
