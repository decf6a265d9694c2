"""One step's journey through the pipeline, and the metadata message ranks exchange for it.

The metadata message is the only thing every rank sends every step, so it is compact (about
4 bytes per sample for token counts, plus features and packing costs only when present) and it
doubles as the fail-together channel: it carries this rank's status for the step being read
(ok / end / error) and for the previous step (its plan digest and whether packing succeeded).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evenflow.engine._model import SampleKey, SampleMetadata, _mint_keys
from evenflow.engine._pipeline.stats import StepStats
from evenflow.engine._plan import Plan
from evenflow.engine.errors import EvenflowError, GroupMismatchError, RemoteStageError
from evenflow.transports._remote import RemoteErrorInfo
from evenflow.transports.errors import WireFormatError

__all__ = ["ErrorInfo", "StepState", "build_message", "error_info", "peer_samples"]

ErrorInfo = dict[str, Any]
MESSAGE_VERSION = 1


def error_info(rank: int, stage: str, step: int, exc: BaseException) -> ErrorInfo:
    """Plain-data description of a failure, as announced to the group (the shared remote-error
    format of :mod:`evenflow.transports._remote`; ``rank`` is the group rank)."""
    return RemoteErrorInfo.from_exception(exc, rank=rank, stage=stage, step=step).to_wire()


def remote_error(info: object, global_ranks: tuple[int, ...], *, sender: int) -> EvenflowError:
    """The error this rank raises for group rank ``sender``'s announced failure ``info``.

    ``info`` is peer data: a malformed description, or one naming a rank outside the group,
    becomes a ``WireFormatError`` naming the sender instead of crashing the judgement.
    """
    where = f"rank {global_ranks[sender]}" if 0 <= sender < len(global_ranks) else "a peer"
    try:
        checked = RemoteErrorInfo.from_wire(info, sender=where)
        rank = checked.rank
        if rank is None or not 0 <= rank < len(global_ranks):
            raise WireFormatError(
                f"Malformed error report from {where}: it names group rank {rank!r}, but the "
                f"group has {len(global_ranks)} ranks. Every rank must run the same evenflow."
            )
        if checked.step is None:
            raise WireFormatError(f"Malformed error report from {where}: it names no step.")
    except WireFormatError as exc:
        return exc
    return RemoteStageError.from_info(checked, failed_rank=global_ranks[rank])


@dataclass(eq=False)
class StepState:
    """Everything the pipeline knows about one step on this rank."""

    step: int
    status: str = "ok"  # "ok" | "end" | "error"
    end_reason: str = ""  # "exhausted" | "limit" | "restart"
    bins: list[list[Any]] | None = None
    metas: list[SampleMetadata] | None = None
    source_state: Any = None
    error: BaseException | None = None
    error_stage: str = ""
    remote: BaseException | None = None  # a group-wide error to raise at this step
    terminal: bool = False  # no later step exists: raise or end here
    plan: Plan | None = None
    stats: StepStats | None = None
    messages: list[dict[str, Any]] | None = None  # every rank's metadata message
    received: dict[Any, Any] = field(default_factory=dict)
    host_batch: Any = None
    staged: Any = None
    confirmed: asyncio.Future[None] | None = None

    def fail(self, stage: str, exc: BaseException) -> None:
        if self.error is None:
            self.error, self.error_stage = exc, stage

    def release_payloads(self) -> None:
        self.bins = None
        self.messages = None
        self.received = {}


def build_message(
    state: StepState,
    rank: int,
    first_step: int,
    budget_names: tuple[str, ...],
    prev: dict[str, Any] | None,
) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "v": MESSAGE_VERSION,
        "step": state.step,
        "first": first_step,
        "status": state.status,
        "end_reason": state.end_reason,
        "prev": prev,
        "error": None,
    }
    if state.status == "error":
        assert state.error is not None
        msg["error"] = error_info(rank, state.error_stage, state.step, state.error)
    elif state.status == "ok":
        assert state.bins is not None and state.metas is not None
        metas = state.metas
        msg["sizes"] = np.fromiter(
            (len(b) for b in state.bins), dtype=np.int32, count=len(state.bins)
        )
        msg["tokens"] = np.fromiter((m.tokens for m in metas), dtype=np.int64, count=len(metas))
        if any(m.features for m in metas):
            msg["features"] = [dict(m.features) for m in metas]
        if budget_names:
            msg["costs"] = np.array(
                [[m.packing_costs.get(n, np.nan) for n in budget_names] for m in metas],
                dtype=np.float64,
            ).reshape(len(metas), len(budget_names))
    return msg


def _metadata(tokens: int, features: Any, costs: dict[str, float]) -> SampleMetadata:
    # Peers validated their metadata before sending it; rebuilding it here without a second
    # validation keeps a 100,000-sample step cheap. NaN marks a budget the peer's sample lacked,
    # which the planner then reports by name.
    meta = object.__new__(SampleMetadata)
    object.__setattr__(meta, "tokens", tokens)
    object.__setattr__(meta, "features", features if features is not None else {})
    object.__setattr__(meta, "packing_costs", costs)
    return meta


def peer_samples(
    messages: list[dict[str, Any]], step: int, budget_names: tuple[str, ...]
) -> tuple[list[tuple[SampleKey, SampleMetadata]], list[list[SampleKey]], dict[SampleKey, int]]:
    """The step's samples, source layout and key → reading rank, from every rank's message.

    Runs on every rank every step over the whole group's samples (100,000 at 1,024 ranks), so
    each pass is C-level where it can be: keys are minted without re-validation (their fields
    are this rank's own loop counters), metadata without re-validation (the peer validated
    it before sending), and the tuples and slices are built by ``map``/``zip``.
    """
    samples: list[tuple[SampleKey, SampleMetadata]] = []
    bins: list[list[SampleKey]] = []
    owner: dict[SampleKey, int] = {}
    for rank, msg in enumerate(messages):
        tokens: list[int] = np.asarray(msg["tokens"]).astype(np.int64, copy=False).tolist()
        count = len(tokens)
        features = msg.get("features")
        costs = msg.get("costs")
        keys = _mint_keys(rank, step, count)
        if costs is None:
            rows: Iterable[dict[str, float]] = map(dict, itertools.repeat((), count))
        else:
            rows = (
                {n: v for n, v in zip(budget_names, row, strict=True) if not math.isnan(v)}
                for row in np.asarray(costs, dtype=np.float64).tolist()
            )
        feature_rows = itertools.repeat(None, count) if features is None else features
        metas = list(map(_metadata, tokens, feature_rows, rows))
        samples.extend(zip(keys, metas, strict=True))
        owner.update(zip(keys, itertools.repeat(rank)))
        ends = np.cumsum(np.asarray(msg["sizes"], dtype=np.int64)).tolist()
        bins.extend(keys[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True))
    return samples, bins, owner


def check_digests(
    prevs: list[dict[str, Any] | None], step: int, global_ranks: tuple[int, ...]
) -> None:
    """Raise GroupMismatchError if ranks planned ``step`` differently."""
    digests = [None if p is None else p.get("digest") for p in prevs]
    known = [d for d in digests if d is not None]
    if known and any(d != known[0] for d in known):
        first = next(i for i, d in enumerate(digests) if d != digests[0])
        raise GroupMismatchError(
            f"Ranks planned step {step} differently: rank {global_ranks[0]} has plan digest "
            f"{digests[0]!r} but rank {global_ranks[first]} has {digests[first]!r}. Planning "
            "must be a pure function of the gathered step: check that every rank uses the "
            "same cost model, algorithm and configuration, and that they are deterministic."
        )
