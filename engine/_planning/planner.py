"""The planner: validate one gathered step, cost it, balance it, gate it, return a Plan.

The planner owns everything around the balancing algorithm that must be trusted: input
validation (every key once, every source bin feasible), cost evaluation (once per sample,
vectorised), canonical ordering (so a plan never depends on gather order), validation of the
algorithm's output (count, non-empty, conservation, capacity, budgets) and the acceptance gate
(the source layout is kept unless the candidate is strictly better by more than
``min_balance_gain``). Work per step is a handful of passes over the samples; the only
per-sample Python is unpacking the input and building the result.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import operator
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleKey, SampleMetadata
from evenflow.engine._plan import BalanceDecision, BinPlan, Plan, _digest_arrays
from evenflow.engine._planning import cost as _cost
from evenflow.engine._planning.native import core_identity
from evenflow.engine._planning.objectives import resolve_objective
from evenflow.engine._planning.problem import (
    BalanceProblem,
    BalancingAlgorithm,
    FlatLayout,
    _first_infeasible_flat,
)
from evenflow.engine._planning.registry import resolve_algorithm
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError, PlanningError

__all__ = ["Planner"]

_KEY_COLUMNS = tuple(map(operator.attrgetter, ("source_rank", "step", "index")))
_TOKENS = operator.attrgetter("tokens")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_INT64_MAX = 2**63 - 1


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


class Planner:
    """Plans one step of one balance group at a time (see the module docstring).

    ``num_ranks`` ranks hold ``bins_per_rank`` packed sequences of ``seq_len`` tokens each.
    ``cost_model``: anything :func:`evenflow.engine._planning.cost.resolve_cost_model` accepts.
    ``algorithm``: ``"default"`` (= ``"refine"``), ``"lpt"`` or an object with
    ``assign(problem)``. ``objective``: ``"makespan"`` or ``"balance"``.
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
        self._last_keys: tuple[SampleKey, ...] = ()
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
        ``PlanningError`` when the algorithm returns an invalid layout.
        """
        step = check_int("step", step, minimum=0)
        # A step holds ~5 objects per sample (100,000 samples at 1,024 ranks), so a full
        # collection triggered by the planner's own allocations would walk them all, costing
        # 50-100 ms at a random point of the plan. The planner builds no reference cycles, so
        # nothing is lost by collecting after it. The switch is process-wide, so overlapping
        # plans (several loaders, several threads) share one pause: see _collector_paused.
        with _collector_paused():
            return self._plan(samples, reference_bins, step)

    def _plan(
        self,
        samples: Iterable[tuple[SampleKey, SampleMetadata]],
        reference_bins: Sequence[Sequence[SampleKey]],
        step: int,
    ) -> Plan:
        keys, metas, fields = self._canonical_samples(samples)
        tokens = np.fromiter(map(_TOKENS, metas), dtype=np.int64, count=len(metas))
        budget_costs = self._budget_costs(keys, metas, tokens)
        source, source_flat, source_sizes = self._source_bins(reference_bins, keys, fields)
        costs, rank_cost_fn = self._costs(keys, metas, tokens)
        problem = BalanceProblem(
            keys=keys,
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
        original = self._score(source_costs)
        candidate = self.algorithm.assign(problem)
        flat, sizes, dest_rank = source_flat, source_sizes, source_rank
        if candidate is None:
            candidate_costs = source_costs
            candidate_score = original
        else:
            flat, sizes = self._check_candidate(problem, candidate, keys, metas)
            dest_rank = problem._rank_of_flat(flat, sizes)
            candidate_costs = problem.rank_costs_of(dest_rank)
            candidate_score = self._score(candidate_costs)
        gain = (original - candidate_score) / original if original > 0 else 0.0
        accepted = candidate is not None and gain > self.min_balance_gain
        if not accepted:
            flat, sizes, dest_rank = source_flat, source_sizes, source_rank
            candidate_final_costs = source_costs
        else:
            candidate_final_costs = candidate_costs
        decision = BalanceDecision(
            objective=self.objective_name,
            algorithm=self.algorithm_name,
            original_objective=original,
            candidate_objective=candidate_score,
            relative_gain=gain,
            min_balance_gain=self.min_balance_gain,
            accepted=accepted,
        )
        return self._build_plan(
            step,
            problem,
            fields,
            flat=flat,
            sizes=sizes,
            rank_costs=candidate_final_costs,
            source_costs=source_costs,
            num_moved=int(np.count_nonzero(dest_rank != source_rank)),
            decision=decision,
        )

    # ------------------------------------------------------------------ steps of plan()

    def _canonical_samples(
        self, samples: Iterable[tuple[SampleKey, SampleMetadata]]
    ) -> tuple[tuple[SampleKey, ...], list[SampleMetadata], np.ndarray]:
        """Keys, metadata and key fields (an ``(n, 3)`` int64 array), in ascending key order."""
        given: object = samples
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise TypeError(
                f"samples must be an iterable of (SampleKey, SampleMetadata) pairs, but got "
                f"{samples!r:.80}."
            )
        items = samples if type(samples) is list else list(samples)
        if not items:
            raise ConfigError(
                f"samples is empty, but a step needs at least num_ranks * bins_per_rank = "
                f"{self.num_bins} samples (one per bin)."
            )
        # Type checks as C-level passes (a set of types, not a Python frame per sample).
        shapes_ok = set(map(type, items)) == {tuple} and set(map(len, items)) == {2}
        if shapes_ok:
            given_keys = list(map(_FIRST, items))
            given_metas = list(map(_SECOND, items))
            shapes_ok = _all_instances(given_keys, SampleKey) and _all_instances(
                given_metas, SampleMetadata
            )
        if not shapes_ok:
            bad = next(item for item in items if not _is_pair(item))
            raise TypeError(
                f"samples must contain (SampleKey, SampleMetadata) pairs, but got "
                f"{bad!r:.120}; pass one tuple per sample."
            )
        fields = _key_fields(given_keys, "samples")
        # Canonical order: ascending key. Gathered steps usually arrive sorted already
        # (rank by rank, index by index), which one vectorised comparison confirms.
        if _strictly_increasing(fields):
            return tuple(given_keys), given_metas, fields
        order = np.lexsort((fields[:, 2], fields[:, 1], fields[:, 0]))
        fields = fields[order]
        positions: list[int] = order.tolist()
        keys = tuple(map(given_keys.__getitem__, positions))
        if not _strictly_increasing(fields):
            self._raise_duplicate(keys)
        return keys, list(map(given_metas.__getitem__, positions)), fields

    @staticmethod
    def _raise_duplicate(keys: Sequence[SampleKey]) -> None:
        for a, b in itertools.pairwise(keys):
            if a == b:
                raise ConfigError(
                    f"samples lists key {a} more than once; every sample of a step needs a "
                    "distinct SampleKey."
                )
        raise AssertionError("unreachable: a duplicate key must be adjacent in sorted order")

    def _budget_costs(
        self, keys: Sequence[SampleKey], metas: Sequence[SampleMetadata], tokens: np.ndarray
    ) -> np.ndarray:
        """Footprints per budget; raises the canonical message for an impossible sample."""
        constraints = self.constraints
        names = list(constraints.budgets)
        out = np.zeros((len(metas), len(names)), dtype=np.float64)
        for k, name in enumerate(names):
            column = [m.packing_costs.get(name) for m in metas]
            if None in column:
                i = column.index(None)
                constraints.validate_sample(keys[i], metas[i])  # raises: missing name
            out[:, k] = column
        bad = np.zeros(len(metas), dtype=bool)
        if constraints.oversized_policy == "error":
            bad |= tokens > constraints.seq_len
        if names:
            bad |= np.any(out > np.array(list(constraints.budgets.values())), axis=1)
        hits = np.flatnonzero(bad)
        if hits.size:
            i = int(hits[0])
            constraints.validate_sample(keys[i], metas[i])  # raises the precise message
            raise AssertionError("unreachable: validate_sample must reject this sample")
        return out

    def _source_bins(
        self,
        reference_bins: Sequence[Sequence[SampleKey]],
        keys: Sequence[SampleKey],
        fields: np.ndarray,
    ) -> tuple[tuple[tuple[int, ...], ...], np.ndarray, np.ndarray]:
        """The source layout as canonical indices: per-bin tuples, and ``(flat, sizes)``."""
        nb = self.num_bins
        given: object = reference_bins
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise TypeError(
                f"reference_bins must be a sequence of {nb} bins (sequences of SampleKey), "
                f"but got {reference_bins!r:.80}."
            )
        if len(reference_bins) != nb:
            raise ConfigError(
                f"reference_bins must hold num_ranks * bins_per_rank = {nb} bins "
                f"({self.num_ranks} ranks x {self.bins_per_rank}), but got "
                f"{len(reference_bins)}; pass the source layout rank-major."
            )
        if not set(map(type, reference_bins)) <= {list, tuple} or 0 in map(len, reference_bins):
            for b, items in enumerate(reference_bins):
                bin_value: object = items
                if (
                    isinstance(bin_value, (str, bytes))
                    or not isinstance(bin_value, Sequence)
                    or not bin_value
                ):
                    raise ConfigError(
                        f"reference_bins[{b}] (rank {b // self.bins_per_rank}, bin "
                        f"{b % self.bins_per_rank}) must be a non-empty sequence of SampleKey, "
                        f"but got {items!r:.80}; every source bin holds at least one sample."
                    )
        sizes = np.fromiter(map(len, reference_bins), dtype=np.int64, count=nb)
        given_keys = list(itertools.chain.from_iterable(reference_bins))
        ends = np.cumsum(sizes)
        values: list[int]
        bounds: list[int] = [0, *ends.tolist()]
        if len(given_keys) == len(keys) and all(map(operator.is_, given_keys, keys)):
            # The usual case: the source layout lists the very key objects of samples, in
            # canonical order (ranks in order, indices ascending), so no lookup is needed.
            values = list(range(len(keys)))
            flat = np.arange(len(keys), dtype=np.int64)
            source = tuple(tuple(values[bounds[b] : bounds[b + 1]]) for b in range(nb))
            return source, flat, sizes
        if not _all_instances(given_keys, SampleKey):
            p = next(p for p, k in enumerate(given_keys) if not isinstance(k, SampleKey))
            b = int(np.searchsorted(ends, p, side="right"))
            raise TypeError(
                f"reference_bins[{b}] must contain SampleKey values, but got {given_keys[p]!r:.80}."
            )
        flat = _lookup(fields, _key_fields(given_keys, "reference_bins"))
        if flat.size and flat.min() < 0:
            p = int(np.flatnonzero(flat < 0)[0])
            b = int(np.searchsorted(ends, p, side="right"))
            raise ConfigError(
                f"reference_bins[{b}] lists key {given_keys[p]}, which is not among samples; "
                "reference_bins must list exactly the keys of samples."
            )
        seen = np.bincount(flat, minlength=len(keys))
        if not np.all(seen == 1):
            twice = np.flatnonzero(seen > 1)
            if twice.size:
                raise ConfigError(
                    f"reference_bins lists key {keys[int(twice[0])]} more than once; every "
                    "key must appear in exactly one source bin."
                )
            absent = int(np.flatnonzero(seen == 0)[0])
            raise ConfigError(
                f"reference_bins does not list key {keys[absent]} of samples; every key must "
                "appear in exactly one source bin."
            )
        values = flat.tolist()
        source = tuple(tuple(values[bounds[b] : bounds[b + 1]]) for b in range(nb))
        return source, flat, sizes

    def _costs(
        self, keys: tuple[SampleKey, ...], metas: list[SampleMetadata], tokens: np.ndarray
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

        def rank_costs(rank_of: np.ndarray) -> np.ndarray:
            # Per-rank component sums, then the model's own combination of them: with
            # reduce="max" a rank costs its slowest component, not the sum of sample scalars.
            sums = np.stack(
                [
                    np.bincount(rank_of, weights=parts[:, c], minlength=num_ranks)
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

    def _score(self, rank_costs: np.ndarray) -> float:
        value = float(self.objective(rank_costs))
        if not math.isfinite(value) or value < 0:
            raise PlanningError(
                f"objective {self.objective_name!r} returned {value!r}; it must be finite and >= 0."
            )
        return value

    def _build_plan(
        self,
        step: int,
        problem: BalanceProblem,
        fields: np.ndarray,
        *,
        flat: np.ndarray,
        sizes: np.ndarray,
        rank_costs: np.ndarray,
        source_costs: np.ndarray,
        num_moved: int,
        decision: BalanceDecision,
    ) -> Plan:
        keys = problem.keys
        per = self.bins_per_rank
        seq_len = self.seq_len
        ends = np.cumsum(sizes)
        bin_tokens: list[int] = np.add.reduceat(problem.tokens[flat], ends - sizes).tolist()
        # Every key once, in bin order, gathered in C; each bin is then one tuple slice.
        # (itemgetter builds the tuple in one call: about half the time of map at 100,000
        # keys, whose random order makes every reference a cache miss.)
        positions: list[int] = flat.tolist()
        ordered = (
            operator.itemgetter(*positions)(keys) if len(positions) > 1 else (keys[positions[0]],)
        )
        bounds: list[int] = [0, *ends.tolist()]
        bins = [
            BinPlan(
                sample_keys=ordered[bounds[b] : bounds[b + 1]],
                tokens=bin_tokens[b],
                oversized=bin_tokens[b] > seq_len,
            )
            for b in range(len(bin_tokens))
        ]
        local_batches = tuple(tuple(bins[r * per : (r + 1) * per]) for r in range(self.num_ranks))
        return Plan(
            step=step,
            seq_len=seq_len,
            local_batches=local_batches,
            rank_costs=tuple(rank_costs.tolist()),
            source_rank_costs=tuple(source_costs.tolist()),
            decision=decision,
            num_moved=num_moved,
            digest=_digest_arrays(step, seq_len, sizes, fields[flat], per),
        )


def _all_instances(values: Iterable[object], cls: type) -> bool:
    """Whether every value is a ``cls`` (one C-level pass over the distinct types)."""
    return all(issubclass(t, cls) for t in set(map(type, values)))


def _is_pair(item: object) -> bool:
    return (
        type(item) is tuple
        and len(item) == 2
        and isinstance(item[0], SampleKey)
        and isinstance(item[1], SampleMetadata)
    )


def _key_fields(keys: Sequence[SampleKey], who: str) -> np.ndarray:
    """``(source_rank, step, index)`` of every key, as an ``(n, 3)`` int64 array."""
    n = len(keys)
    out = np.empty((n, 3), dtype=np.int64)
    try:
        # One C-level pass per field (no tuple per key).
        for column, field in enumerate(_KEY_COLUMNS):
            out[:, column] = np.fromiter(map(field, keys), dtype=np.int64, count=n)
    except OverflowError:
        big = next(k for k in keys if max(k.as_tuple()) > _INT64_MAX)
        raise ConfigError(
            f"{who} holds key {big}, whose fields exceed 2**63 - 1; the planner encodes key "
            "fields as int64, so use smaller ranks, steps and indices."
        ) from None
    return out


def _strictly_increasing(fields: np.ndarray) -> bool:
    """Whether the rows of an ``(n, 3)`` array ascend strictly in lexicographic order."""
    if len(fields) < 2:
        return True
    d = np.diff(fields, axis=0)
    up = (d[:, 0] > 0) | ((d[:, 0] == 0) & ((d[:, 1] > 0) | ((d[:, 1] == 0) & (d[:, 2] > 0))))
    return bool(up.all())


def _lookup(table: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row of ``table`` (sorted, distinct rows) equal to each query row, or -1.

    Rows are packed into one int64 each by mixed radix over the table's value ranges, which
    keeps their order, so one ``searchsorted`` finds them all. A query outside those ranges
    cannot be in the table. When the ranges are too wide to pack (arbitrary huge indices)
    a dictionary of rows does the lookup instead.
    """
    low = table.min(axis=0)
    span = table.max(axis=0) - low + 1
    inside = np.all((queries >= low) & (queries < low + span), axis=1)
    if float(span[0]) * float(span[1]) * float(span[2]) < 2.0**62:
        pack = np.array([span[1] * span[2], span[2], 1], dtype=np.int64)
        codes = (table - low) @ pack
        wanted = (np.where(inside[:, None], queries, low) - low) @ pack
        pos = np.minimum(np.searchsorted(codes, wanted), len(codes) - 1)
        return np.where(inside & (codes[pos] == wanted), pos, -1)
    index = {row: i for i, row in enumerate(map(tuple, table.tolist()))}
    return np.fromiter(
        (index.get(row, -1) for row in map(tuple, queries.tolist())),
        dtype=np.int64,
        count=len(queries),
    )


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
