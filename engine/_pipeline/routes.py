"""Where one rank's samples go under a plan, and where the samples of its bins come from.

Derived from the plan's arrays with a few vectorised passes; the only per-sample Python is
for this rank's own samples (the ones it sends and the ones it packs), never for the group's.
A sample is named by its key tuple ``(source_rank, step, index)``, which is also what the
transport routes, and found locally by ``index`` (its position in the rank's step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from evenflow.engine._plan import Plan

__all__ = ["RankRoutes", "rank_routes"]

KeyTuple = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class RankRoutes:
    """``send[dest]``: the keys of this rank's samples that rank ``dest`` packs, in its pack
    order. ``bins[b]``: the keys of this rank's bin ``b`` in pack order; a key whose
    ``source_rank`` is this rank is local (``index`` into the samples it read), any other
    arrives in the exchange."""

    rank: int
    send: dict[int, list[KeyTuple]]
    bins: tuple[list[KeyTuple], ...]


def rank_routes(plan: Plan, rank: int) -> RankRoutes:
    """The routes of group rank ``rank`` under ``plan``."""
    layout = plan.layout
    fields = layout.key_fields
    dest = layout.slot_ranks()
    leaving = np.flatnonzero((fields[:, 0] == rank) & (dest != rank))
    send: dict[int, list[KeyTuple]] = {}
    if leaving.size:
        # Slots are rank-major, so each destination's keys are one run, in its pack order.
        targets = dest[leaving]
        cuts = np.flatnonzero(np.diff(targets)) + 1
        keys: list[KeyTuple] = list(map(tuple, fields[leaving].tolist()))
        bounds: list[int] = [0, *cuts.tolist(), len(keys)]
        for a, b in itertools.pairwise(bounds):
            send[int(targets[a])] = keys[a:b]
    start, end = layout.rank_slots(rank)
    own: list[KeyTuple] = list(map(tuple, fields[start:end].tolist()))
    per = layout.bins_per_rank
    sizes: list[int] = layout.sizes[rank * per : (rank + 1) * per].tolist()
    edges = [0, *np.cumsum(sizes).tolist()]
    bins = tuple(own[edges[b] : edges[b + 1]] for b in range(per))
    return RankRoutes(rank=rank, send=send, bins=bins)
