"""The result of planning one step: which samples each rank packs into each of its bins."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from evenflow.engine._model import SampleKey

__all__ = ["BalanceDecision", "BinPlan", "Plan", "plan_digest"]


@dataclass(frozen=True, slots=True)
class BinPlan:
    """One packed sequence: its samples in pack order and their token count."""

    sample_keys: tuple[SampleKey, ...]
    tokens: int
    oversized: bool = False


@dataclass(frozen=True, slots=True)
class BalanceDecision:
    """Why the planner kept or replaced the source layout.

    ``relative_gain = (original - candidate) / original`` (0 when ``original`` is 0); the
    candidate is accepted only when ``relative_gain > min_balance_gain`` (strictly).
    """

    objective: str
    algorithm: str
    original_objective: float
    candidate_objective: float
    relative_gain: float
    min_balance_gain: float
    accepted: bool

    @property
    def accepted_objective(self) -> float:
        return self.candidate_objective if self.accepted else self.original_objective


@dataclass(frozen=True, slots=True)
class Plan:
    """The layout of one step across a balance group.

    ``local_batches[rank][bin]`` is a :class:`BinPlan`. ``rank_costs`` are the predicted costs
    of the accepted layout, ``source_rank_costs`` those of the source layout (same units).
    ``num_moved`` counts samples whose rank changes. ``digest`` is identical on every rank that
    planned the same step; ranks compare it to detect divergence.
    """

    step: int
    seq_len: int
    local_batches: tuple[tuple[BinPlan, ...], ...]
    rank_costs: tuple[float, ...]
    source_rank_costs: tuple[float, ...]
    decision: BalanceDecision
    num_moved: int
    digest: str

    @property
    def num_ranks(self) -> int:
        return len(self.local_batches)

    @property
    def bins_per_rank(self) -> int:
        return len(self.local_batches[0]) if self.local_batches else 0

    @property
    def accepted(self) -> bool:
        return self.decision.accepted

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
