"""One step's journey through the pipeline, and the metadata message ranks exchange for it.

The metadata message is the only thing every rank sends every step, so it is compact (about
4 bytes per sample for token counts, plus features and packing costs only when present) and it
doubles as the fail-together channel: it carries this rank's status for the step being read
(ok / end / error) and for the previous step (its plan digest and whether packing succeeded).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evenflow.engine._model import SampleMetadata
from evenflow.engine._pipeline.records import DeviceSlot, LossCount, PassEdge, WindowShare
from evenflow.engine._pipeline.routes import RankRoutes, rank_routes
from evenflow.engine._pipeline.stats import StepStats, step_stats
from evenflow.engine._plan import Plan
from evenflow.engine._planning.columns import StepColumns
from evenflow.engine.errors import EvenflowError, GroupMismatchError, RemoteStageError
from evenflow.transports.errors import WireFormatError
from evenflow.transports.internal import RemoteErrorInfo

__all__ = ["ErrorInfo", "StepState", "build_message", "error_info", "peer_columns", "plan_step"]

ErrorInfo = dict[str, Any]
MESSAGE_VERSION = 1


def error_info(rank: int, stage: str, step: int, exc: BaseException) -> ErrorInfo:
    """Plain-data description of a failure, as announced to the group (the shared
    remote-error format of :class:`~evenflow.transports.internal.RemoteErrorInfo`; ``rank``
    is the group rank)."""
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
    samples: list[Any] | None = None  # this rank's samples, bin after bin, as read
    sizes: list[int] | None = None  # samples per bin of ``samples``
    metas: list[SampleMetadata] | None = None
    prepared: list[Any] | None = None  # payload mode: each sample prepared for the wire
    source_state: Any = None  # the source's state right after this step was read
    resume_source: Any = None  # the source state a checkpoint taken after this step records
    steps_left: int | None = None  # source steps after this one, where the source has a len()
    indices: Any = None  # the samples' dataset indices (int64), where the source knows them
    transform: Any = None  # this rank's StepTransform for the step, when the source has one
    error: BaseException | None = None
    error_stage: str = ""
    remote: BaseException | None = None  # a group-wide error to raise at this step
    terminal: bool = False  # no later step exists: raise or end here
    uneven: Any = None  # the UnevenEnd when this final round found sources ending unevenly
    plan: Plan | None = None
    routes: RankRoutes | None = None
    stats: StepStats | None = None
    messages: list[dict[str, Any]] | None = None  # every rank's metadata message
    received: dict[Any, Any] = field(default_factory=dict)
    host_batch: Any = None
    staged: Any = None
    world_end: Any = None  # the UnevenEnd when another balance group ended at this step
    confirmed: asyncio.Future[None] | None = None
    # Feature records (see records.py): attached only where their feature is on.
    window: WindowShare | None = None  # a balance window's samples, frames and rounds
    edge: PassEdge | None = None  # replayed before a restore, or ending a window early
    loss: LossCount | None = None  # the loss targets known for this step
    device: DeviceSlot | None = None  # its place under the device-prefetch bound

    def local_samples(self) -> dict[int, list[Any]]:
        """This rank's samples a plan of this step may name, by the step that read them."""
        if self.window is not None:
            return self.window.samples
        assert self.samples is not None
        return {self.step: self.samples}

    def step_messages(self) -> dict[int, list[dict[str, Any]]]:
        """Every rank's metadata message of each step a plan of this step may name."""
        if self.window is not None:
            return self.window.messages
        assert self.messages is not None
        return {self.step: self.messages}

    @property
    def skip(self) -> bool:
        """Whether this step was delivered before the restore its pass started from."""
        return self.edge is not None and self.edge.skip

    def fail(self, stage: str, exc: BaseException) -> None:
        """Record the step's first failure and the stage (or part of one) where it happened;
        the failure is announced to the group in the next metadata round."""
        if self.error is None:
            self.error, self.error_stage = exc, stage

    @contextlib.contextmanager
    def failing(self, stage: str) -> Iterator[None]:
        """Record a failure inside the block as ``stage``'s (then let it propagate): how work
        that runs in parts off the loop says which part failed."""
        try:
            yield
        except Exception as exc:
            self.fail(stage, exc)
            raise

    def release_payloads(self) -> None:
        self.samples = None
        self.window = None
        self.prepared = None
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
        assert state.sizes is not None and state.metas is not None
        metas = state.metas
        msg["sizes"] = np.array(state.sizes, dtype=np.int32)
        msg["tokens"] = np.fromiter((m.tokens for m in metas), dtype=np.int64, count=len(metas))
        if all(m.loss_tokens is not None for m in metas):
            # Loss targets per sample (LossTokens); absent when any sample's count is unknown.
            msg["loss"] = np.fromiter(
                (m.loss_tokens for m in metas), dtype=np.int32, count=len(metas)
            )
        if state.steps_left is not None:
            msg["left"] = state.steps_left
        if any(m.features for m in metas):
            msg["features"] = [dict(m.features) for m in metas]
        if budget_names:
            msg["costs"] = np.array(
                [[m.packing_costs.get(n, np.nan) for n in budget_names] for m in metas],
                dtype=np.float64,
            ).reshape(len(metas), len(budget_names))
    return msg


def peer_columns(messages: list[dict[str, Any]], budget_names: tuple[str, ...]) -> StepColumns:
    """The step's samples as planner columns, from every rank's message (rank order).

    Rows are the ranks' samples in the order each rank read them, which is the source layout
    (``sizes`` per bin, rank-major) and also ascending key order, so the planner needs no sort.
    """
    counts = [len(m["tokens"]) for m in messages]
    ranks = np.arange(len(messages), dtype=np.int64)
    starts = np.cumsum([0, *counts[:-1]], dtype=np.int64)
    total = int(sum(counts))
    features: list[Any] | None = None
    if any(m.get("features") is not None for m in messages):
        features = []
        for m, count in zip(messages, counts, strict=True):
            rows = m.get("features")
            features.extend(itertools.repeat(None, count) if rows is None else rows)
    costs = None
    if budget_names:
        # NaN marks a budget the peer's sample lacked, which the planner reports by name.
        costs = np.concatenate(
            [
                np.full((n, len(budget_names)), np.nan)
                if m.get("costs") is None
                else np.asarray(m["costs"], dtype=np.float64).reshape(n, len(budget_names))
                for m, n in zip(messages, counts, strict=True)
            ]
        )
    return StepColumns(
        sizes=np.concatenate([np.asarray(m["sizes"], dtype=np.int64) for m in messages]),
        source_rank=np.repeat(ranks, counts),
        index=np.arange(total, dtype=np.int64) - np.repeat(starts, counts),
        tokens=np.concatenate([np.asarray(m["tokens"], dtype=np.int64) for m in messages]),
        packing_costs=costs,
        budget_names=budget_names,
        features=features,
    )


def plan_step(
    planner: Any,
    messages: list[dict[str, Any]],
    step: int,
    *,
    budget_names: tuple[str, ...],
    rank: int,
    group_ranks: tuple[int, ...],
) -> tuple[Plan, StepStats, RankRoutes]:
    """The plan stage's work: every rank's message to the plan, its statistics and the routes
    of ``rank`` (what the exchange sends and the pack reads)."""
    plan = planner.plan_arrays(peer_columns(messages, budget_names), step)
    return with_routes(plan, rank, group_ranks)


def with_routes(
    plan: Plan, rank: int, group_ranks: tuple[int, ...]
) -> tuple[Plan, StepStats, RankRoutes]:
    # Rows of a gathered step carry the group rank that read them (source_rank=None).
    return plan, step_stats(plan, None, group_ranks), rank_routes(plan, rank)


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
