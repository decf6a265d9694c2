"""The result of planning one step: which samples each rank packs into each of its bins.

The planner makes a plan from arrays (:class:`PlanLayout`: every slot's key fields in bin
order, the number of samples and tokens per bin). ``Plan.local_batches`` — per-bin tuples of
:class:`SampleKey` — is built from them only when someone reads it; the pipeline routes,
counts and digests a plan from the arrays alone. This module also holds the plan's wire form,
used when group rank 0 plans and broadcasts the layout.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from evenflow.engine._model import SampleKey
from evenflow.engine.errors import GroupMismatchError

__all__ = ["AT_BOUND", "BalanceDecision", "BinPlan", "Plan", "PlanLayout", "plan_digest"]

# A plan within this relative distance of its lower bound is "at bound". Float sums of
# different orders differ by far less; the search itself stops within 2e-4 of the bound.
AT_BOUND = 1e-3

Batches = tuple[tuple["BinPlan", ...], ...]


@dataclass(frozen=True, slots=True)
class BinPlan:
    """One packed sequence: its samples in pack order and their token count."""

    sample_keys: tuple[SampleKey, ...]
    tokens: int
    oversized: bool = False


@dataclass(frozen=True, slots=True)
class BalanceDecision:
    """Why the planner kept or replaced the source layout, and how far the result can be from
    the best possible one.

    ``relative_gain = (original - candidate) / original`` (0 when ``original`` is 0); the
    candidate is accepted only when ``relative_gain > min_balance_gain`` (strictly).

    How good the accepted layout is, in cost-model units: ``makespan`` is its largest rank
    cost, ``lower_bound`` a cost no layout of the step can go below (proven; see
    ``evenflow.engine._planning.bounds``), ``mean_cost`` the mean rank cost and
    ``largest_cost`` the costliest sample. Derived: ``gap = makespan / lower_bound - 1``,
    ``at_bound`` (``gap <= 0.001``: no layout is meaningfully faster) and ``outlier_bound``
    (one sample costs more than the mean rank: that sample's rank sets the step time, and a
    wide spread between ranks is unavoidable). All four are 0 on plans that carry no bound.
    """

    objective: str
    algorithm: str
    original_objective: float
    candidate_objective: float
    relative_gain: float
    min_balance_gain: float
    accepted: bool
    makespan: float = 0.0
    lower_bound: float = 0.0
    mean_cost: float = 0.0
    largest_cost: float = 0.0

    @property
    def accepted_objective(self) -> float:
        return self.candidate_objective if self.accepted else self.original_objective

    @property
    def gap(self) -> float:
        """``makespan / lower_bound - 1`` (>= 0; 0 when there is no bound)."""
        if self.lower_bound <= 0.0:
            return 0.0
        return max(self.makespan / self.lower_bound - 1.0, 0.0)

    @property
    def at_bound(self) -> bool:
        """The makespan is within 0.1% of the lower bound: no layout is meaningfully better."""
        return self.gap <= AT_BOUND

    @property
    def outlier_bound(self) -> bool:
        """One sample costs more than the mean rank cost (its rank bounds the step)."""
        return self.largest_cost > self.mean_cost

    def verdict(self) -> str:
        """How to read the plan's quality in a few words (what ``log_line`` shows)."""
        if self.lower_bound <= 0.0:
            return "no bound"
        where = "at bound" if self.at_bound else f"{self.gap:.1%} above bound"
        if self.outlier_bound:
            ratio = self.largest_cost / self.mean_cost if self.mean_cost > 0 else float("inf")
            where += f", outlier-bound (largest sample {ratio:.2f}x mean rank)"
        return where

    def to_wire(self) -> list[Any]:
        return [
            self.objective,
            self.algorithm,
            self.original_objective,
            self.candidate_objective,
            self.relative_gain,
            self.min_balance_gain,
            self.accepted,
            self.makespan,
            self.lower_bound,
            self.mean_cost,
            self.largest_cost,
        ]

    @classmethod
    def from_wire(cls, d: Sequence[Any]) -> BalanceDecision:
        return cls(
            str(d[0]),
            str(d[1]),
            float(d[2]),
            float(d[3]),
            float(d[4]),
            float(d[5]),
            bool(d[6]),
            *(float(v) for v in d[7:11]),
        )


@dataclass(frozen=True, slots=True, eq=False)
class PlanLayout:
    """A step's layout as arrays, rank-major: bins ``r * bins_per_rank ...`` belong to rank r.

    ``key_fields[j]`` is ``(source_rank, step, index)`` of the ``j``-th slot, bins one after
    the other in pack order; ``sizes[b]`` and ``tokens[b]`` count the samples and tokens of
    bin ``b``. ``keys``, when the planner was given key objects, holds them in canonical
    order and ``order[j]`` is the canonical position of slot ``j``: reading
    ``Plan.local_batches`` then returns those very objects instead of new equal ones.
    """

    key_fields: np.ndarray
    sizes: np.ndarray
    tokens: np.ndarray
    bins_per_rank: int
    keys: Sequence[SampleKey] | None = None
    order: np.ndarray | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.sizes) // self.bins_per_rank if self.bins_per_rank else 0

    def slot_ranks(self) -> np.ndarray:
        """The destination rank of every slot."""
        bins = np.arange(len(self.sizes), dtype=np.int64) // self.bins_per_rank
        return np.repeat(bins, self.sizes)

    def rank_slots(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the slots of ``rank``'s bins."""
        ends = np.cumsum(self.sizes)
        first = rank * self.bins_per_rank
        start = int(ends[first - 1]) if first > 0 else 0
        return start, int(ends[first + self.bins_per_rank - 1])

    def digest(self, step: int, seq_len: int) -> str:
        return _digest_arrays(step, seq_len, self.sizes, self.key_fields, self.bins_per_rank)

    def batches(self, seq_len: int) -> Batches:
        """The layout as ``local_batches``: per rank, per bin, a :class:`BinPlan`."""
        n = len(self.key_fields)
        if self.keys is not None and self.order is not None:
            positions: list[int] = self.order.tolist()
            ordered: tuple[SampleKey, ...] = (
                operator.itemgetter(*positions)(self.keys) if n > 1 else (self.keys[positions[0]],)
            )
        else:
            ordered = tuple(itertools.starmap(SampleKey, self.key_fields.tolist()))
        bounds: list[int] = [0, *np.cumsum(self.sizes).tolist()]
        tokens: list[int] = self.tokens.tolist()
        bins = [
            BinPlan(ordered[bounds[b] : bounds[b + 1]], tokens[b], tokens[b] > seq_len)
            for b in range(len(tokens))
        ]
        per = self.bins_per_rank
        return tuple(tuple(bins[r * per : (r + 1) * per]) for r in range(self.num_ranks))

    @classmethod
    def of_batches(cls, local_batches: Batches) -> PlanLayout:
        """The arrays of a plan that was built from ``local_batches`` directly."""
        bins = [b for rank_bins in local_batches for b in rank_bins]
        sizes = np.fromiter((len(b.sample_keys) for b in bins), dtype=np.int64, count=len(bins))
        fields = np.fromiter(
            (v for b in bins for key in b.sample_keys for v in key.as_tuple()), dtype=np.int64
        ).reshape(-1, 3)
        tokens = np.fromiter((b.tokens for b in bins), dtype=np.int64, count=len(bins))
        per = len(local_batches[0]) if local_batches else 0
        return cls(fields, sizes, tokens, per)


@dataclass(frozen=True)
class Plan:
    """The layout of one step across a balance group.

    ``local_batches[rank][bin]`` is a :class:`BinPlan`. ``rank_costs`` are the predicted costs
    of the accepted layout, ``source_rank_costs`` those of the source layout (same units).
    ``num_moved`` counts samples whose rank changes. ``digest`` is identical on every rank that
    planned the same step; ranks compare it to detect divergence.
    """

    step: int
    seq_len: int
    local_batches: Batches
    rank_costs: tuple[float, ...]
    source_rank_costs: tuple[float, ...]
    decision: BalanceDecision
    num_moved: int
    digest: str

    @classmethod
    def of_layout(
        cls,
        layout: PlanLayout,
        *,
        step: int,
        seq_len: int,
        rank_costs: tuple[float, ...],
        source_rank_costs: tuple[float, ...],
        decision: BalanceDecision,
        num_moved: int,
        digest: str,
    ) -> Plan:
        """A plan whose ``local_batches`` are built from ``layout`` when first read."""
        plan = cls(
            step=step,
            seq_len=seq_len,
            local_batches=(),
            rank_costs=rank_costs,
            source_rank_costs=source_rank_costs,
            decision=decision,
            num_moved=num_moved,
            digest=digest,
        )
        del plan.__dict__["local_batches"]  # now found by __getattr__, from the layout
        plan.__dict__["_layout"] = layout
        return plan

    if not TYPE_CHECKING:  # only the missing field reaches it; mypy keeps checking names

        def __getattr__(self, name: str) -> Any:
            layout = self.__dict__.get("_layout")
            if name != "local_batches" or layout is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            batches = layout.batches(self.seq_len)
            self.__dict__["local_batches"] = batches
            return batches

    @property
    def num_ranks(self) -> int:
        layout = self.__dict__.get("_layout")
        return len(self.local_batches) if layout is None else layout.num_ranks

    @property
    def bins_per_rank(self) -> int:
        layout = self.__dict__.get("_layout")
        if layout is None:
            return len(self.local_batches[0]) if self.local_batches else 0
        return int(layout.bins_per_rank)

    @property
    def accepted(self) -> bool:
        return self.decision.accepted

    @property
    def layout(self) -> PlanLayout:
        """The plan as arrays (derived once from ``local_batches`` if built from them)."""
        layout: PlanLayout | None = self.__dict__.get("_layout")
        if layout is None:
            layout = PlanLayout.of_batches(self.local_batches)
            self.__dict__["_layout"] = layout
        return layout

    def rank_keys(self, rank: int) -> list[SampleKey]:
        """All keys planned for ``rank`` in bin order, then pack order."""
        return [key for b in self.local_batches[rank] for key in b.sample_keys]

    def rank_of(self) -> dict[SampleKey, int]:
        """Map every planned key to its destination rank."""
        return {
            key: r
            for r, bins in enumerate(self.local_batches)
            for b in bins
            for key in b.sample_keys
        }


def plan_digest(step: int, seq_len: int, bins: list[list[SampleKey]], bins_per_rank: int) -> str:
    """A 24-hex content digest of a layout; a pure function of its keys and shape."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(
        (v for b in bins for key in b for v in (key.source_rank, key.step, key.index)),
        dtype=np.int64,
    )
    return _digest_arrays(step, seq_len, sizes, flat, bins_per_rank)


def _digest_arrays(
    step: int, seq_len: int, sizes: np.ndarray, key_fields: np.ndarray, bins_per_rank: int
) -> str:
    """:func:`plan_digest` from arrays: ``sizes`` per bin, ``key_fields`` the keys' fields.

    ``key_fields`` holds ``(source_rank, step, index)`` of every key in bin order, as an
    ``(n, 3)`` or flat int64 array. Hashes exactly the bytes :func:`plan_digest` hashes, so
    the planner (which has the arrays) and a rank rebuilding a broadcast plan (which has
    keys) agree on the digest.
    """
    h = hashlib.sha256()
    h.update(np.array([step, seq_len, len(sizes), bins_per_rank], dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(sizes, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(key_fields, dtype=np.int64).tobytes())
    return h.hexdigest()[:24]


# -- wire form (planning="leader": group rank 0 broadcasts its plan) ----------------------------


def plan_to_wire(plan: Plan) -> dict[str, Any]:
    """Plain data (int64 arrays and numbers) for the broadcast of ``plan``."""
    layout = plan.layout
    d = plan.decision
    per = layout.bins_per_rank
    ends: list[int] = np.cumsum(layout.sizes).tolist()
    # One (k, 3) array per bin, grouped by rank: views into the layout, no copy.
    arrays = np.split(layout.key_fields.reshape(-1, 3), ends[:-1])
    tokens: list[int] = layout.tokens.tolist()
    return {
        "step": plan.step,
        "seq_len": plan.seq_len,
        "bins": [arrays[r * per : (r + 1) * per] for r in range(layout.num_ranks)],
        "tokens": [tokens[r * per : (r + 1) * per] for r in range(layout.num_ranks)],
        "rank_costs": list(plan.rank_costs),
        "source_rank_costs": list(plan.source_rank_costs),
        "decision": d.to_wire(),
        "num_moved": plan.num_moved,
        "digest": plan.digest,
    }


def plan_from_wire(data: dict[str, Any], step: int) -> Plan:
    """Rebuild the leader's plan of ``step``, checking its digest."""
    seq_len = int(data["seq_len"])
    rank_bins = list(data["bins"])
    bins_per_rank = len(rank_bins[0]) if rank_bins else 0
    bins = [np.asarray(keys, dtype=np.int64).reshape(-1, 3) for keys in itertools.chain(*rank_bins)]
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    fields = np.concatenate(bins) if bins else np.zeros((0, 3), dtype=np.int64)
    tokens = np.fromiter(itertools.chain(*data["tokens"]), dtype=np.int64)
    if len(tokens) != len(sizes):
        raise GroupMismatchError(
            f"The broadcast plan of step {step} lists {len(tokens)} bin token counts for "
            f"{len(sizes)} bins; the leader's plan was corrupted in transit."
        )
    layout = PlanLayout(fields, sizes, tokens, bins_per_rank)
    digest = layout.digest(step, seq_len)
    if digest != data["digest"]:
        raise GroupMismatchError(
            f"The broadcast plan of step {step} does not match its digest "
            f"({digest!r} != {data['digest']!r}); the leader's plan was corrupted in transit."
        )
    d = data["decision"]
    return Plan.of_layout(
        layout,
        step=step,
        seq_len=seq_len,
        rank_costs=tuple(float(c) for c in data["rank_costs"]),
        source_rank_costs=tuple(float(c) for c in data["source_rank_costs"]),
        decision=BalanceDecision.from_wire(d),
        num_moved=int(data["num_moved"]),
        digest=digest,
    )
