"""How a pass ended: what the ranks still had when their sources ended unevenly, and the summary
of a whole pass (``BalancedLoader.last_pass``).

When one rank's source ends while others still have data, the group stops at that step
(``on_uneven_end="stop"``) or raises (``"raise"``); either way the data the other ranks still
held is not trained on. That is a drop, and drops are never silent: every rank learns from the
final metadata round what each rank still had — the samples of the step it had read, and the
steps after it where its source knows its length — logs it at WARNING and counts it in the
pass summary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._pipeline.loss_tokens import LossTokens
from evenflow.engine._pipeline.stats import BalanceTally
from evenflow.engine._pipeline.step import StepState
from evenflow.engine._sources._common import SourceReport
from evenflow.engine._sources.transform_pool import TransformReport

__all__ = [
    "PassSummary",
    "PassTally",
    "RankUnread",
    "UnevenEnd",
    "transform_report",
    "uneven_end",
]

logger = logging.getLogger("evenflow")


@dataclass(frozen=True, slots=True)
class RankUnread:
    """What one rank still had when the pass ended at another rank's end.

    ``samples``/``tokens``: the step it had read at the end step. ``more_steps``: the steps its
    source still had after that one, when the source has a ``len()`` (``None`` if unknown).
    """

    rank: int
    samples: int
    tokens: int
    more_steps: int | None

    def describe(self) -> str:
        more = (
            "an unknown number of further steps"
            if self.more_steps is None
            else f"{self.more_steps} further step{'' if self.more_steps == 1 else 's'}"
        )
        return f"rank {self.rank}: {self.samples} samples ({self.tokens} tokens) read, and {more}"


@dataclass(frozen=True, slots=True)
class UnevenEnd:
    """The end of a pass at ``step`` because the sources of ``ended_ranks`` ended first."""

    step: int
    ended_ranks: tuple[int, ...]
    unread: tuple[RankUnread, ...]

    @property
    def num_unread_samples(self) -> int:
        """Samples read at the end step by the ranks that still had data, none delivered."""
        return sum(r.samples for r in self.unread)

    @property
    def num_unread_tokens(self) -> int:
        return sum(r.tokens for r in self.unread)

    def message(self, policy: str) -> str:
        """The WARNING every rank logs (or, under ``"raise"``, the error's text)."""
        what = "; ".join(r.describe() for r in self.unread)
        action = (
            "raising SourceExhaustedError on every rank"
            if policy == "raise"
            else "stopping every rank here (on_uneven_end='stop')"
        )
        return (
            f"The sources of ranks {list(self.ended_ranks)} ended at step {self.step} while the "
            f"other ranks of the group still had data, {action}. Not delivered: {what} — "
            f"{self.num_unread_samples} samples in all at this step. Give every rank the same "
            "number of steps (DatasetSource does by construction), or set "
            "on_uneven_end='raise' to fail instead of dropping."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ended_ranks": list(self.ended_ranks),
            "unread": [
                {
                    "rank": r.rank,
                    "samples": r.samples,
                    "tokens": r.tokens,
                    "more_steps": r.more_steps,
                }
                for r in self.unread
            ],
            "num_unread_samples": self.num_unread_samples,
            "num_unread_tokens": self.num_unread_tokens,
        }


def uneven_end(
    step: int, messages: Sequence[dict[str, Any]], global_ranks: tuple[int, ...]
) -> UnevenEnd | None:
    """The uneven end described by a final metadata round, or ``None`` if it is even.

    A pure function of the gathered messages, so every rank describes it identically. ``left``
    is peer data: anything but a non-negative integer reads as unknown.
    """
    statuses = [m.get("status") for m in messages]
    if "end" not in statuses or all(s == "end" for s in statuses):
        return None
    unread = []
    for r, m in enumerate(messages):
        if m.get("status") != "ok":
            continue
        tokens = np.asarray(m.get("tokens", ()), dtype=np.int64)
        left = m.get("left")
        more = left if isinstance(left, int) and not isinstance(left, bool) and left >= 0 else None
        unread.append(RankUnread(global_ranks[r], int(tokens.size), int(tokens.sum()), more))
    ended = tuple(global_ranks[r] for r, s in enumerate(statuses) if s == "end")
    return UnevenEnd(step=step, ended_ranks=ended, unread=tuple(unread))


@dataclass(frozen=True, slots=True)
class PassSummary:
    """One finished pass (an epoch, or the part of it before ``set_epoch``/``max_steps``).

    ``end_reason``: ``"exhausted"`` (every source ended together), ``"uneven"`` (some sources
    ended first: see ``uneven``), ``"limit"`` (``max_steps``) or ``"restart"`` (``set_epoch``
    before the end). ``steps``: steps delivered in the pass, a restored position included;
    ``samples``/``tokens``: what this rank trained on in the steps delivered in this process.
    ``source``: the source's own report of the epoch (``DatasetSource``/``IterableSource``:
    the remainder it leaves unread, by design), when it has one. ``num_discarded_samples``:
    samples this rank would have trained in steps that were prepared (read, planned, packed)
    but not delivered because ``set_epoch()`` ended the pass early — up to
    ``balance_window + prefetch_depth`` steps' worth. ``num_outlier_bound_steps``: the steps
    delivered in this process whose costliest sample cost more than their mean rank;
    ``outlier_cost_fraction``: the share of the pass's planned cost (the sum over its steps
    of the slowest rank's cost) that those outliers add above perfectly balanced steps — what
    no per-step plan can remove, and what ``balance_window`` works on.
    ``num_zero_loss_steps``: delivered steps whose world held no loss target at all (every
    label ``-100``): they train nothing, and ``LossTokens.loss_scale`` is 0.0 for them; each
    is also logged as a WARNING. ``transform``: this rank's transform time in the pass
    (``DatasetSource(transform=...)``: seconds transforming, seconds the reads waited for the
    workers, the workers' busy share), when the source has a transform.
    """

    epoch: int
    steps: int
    end_reason: str
    samples: int
    tokens: int
    uneven: UnevenEnd | None = None
    source: SourceReport | None = None
    num_discarded_samples: int = 0
    num_outlier_bound_steps: int = 0
    outlier_cost_fraction: float = 0.0
    num_zero_loss_steps: int = 0
    transform: TransformReport | None = None

    @property
    def num_dropped_samples(self) -> int:
        """Samples of the pass that no rank trained on and that the summary can count: those
        left at an uneven end plus the source's reported remainder."""
        left = self.uneven.num_unread_samples if self.uneven is not None else 0
        return left + (self.source.num_dropped_samples if self.source is not None else 0)

    def log_line(self) -> str:
        line = (
            f"pass of epoch {self.epoch} ended ({self.end_reason}) after {self.steps} steps; "
            f"this rank trained on {self.samples} samples ({self.tokens} tokens)"
        )
        if self.uneven is not None:
            line += (
                f"; {self.uneven.num_unread_samples} samples left unread at the uneven end "
                f"(step {self.uneven.step})"
            )
        if self.num_outlier_bound_steps:
            line += (
                f"; {self.num_outlier_bound_steps} steps outlier-bound, their outliers adding "
                f"{self.outlier_cost_fraction:.1%} of the planned cost"
            )
        if self.num_discarded_samples:
            line += (
                f"; {self.num_discarded_samples} samples of steps prepared ahead were "
                "discarded by the restart"
            )
        if self.num_zero_loss_steps:
            line += f"; {self.num_zero_loss_steps} steps held no loss target in the world"
        if self.transform is not None:
            line += (
                f"; transforms took {self.transform.busy_s:.1f} s on this rank (reads waited "
                f"{self.transform.wait_s:.1f} s for {self.transform.workers} worker(s))"
            )
        if self.source is not None:
            line += (
                f"; the source left {self.source.num_dropped_samples} samples of the epoch "
                "unread by design"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        source = self.source
        return {
            "epoch": self.epoch,
            "steps": self.steps,
            "end_reason": self.end_reason,
            "samples": self.samples,
            "tokens": self.tokens,
            "num_dropped_samples": self.num_dropped_samples,
            "num_discarded_samples": self.num_discarded_samples,
            "num_outlier_bound_steps": self.num_outlier_bound_steps,
            "outlier_cost_fraction": self.outlier_cost_fraction,
            "num_zero_loss_steps": self.num_zero_loss_steps,
            "uneven": None if self.uneven is None else self.uneven.to_dict(),
            "transform": None if self.transform is None else self.transform.to_dict(),
            "source": None
            if source is None
            else {
                "num_steps": source.num_steps,
                "num_samples": source.num_samples,
                "num_dropped_samples": source.num_dropped_samples,
                "num_dropped_tokens": source.num_dropped_tokens,
                "num_oversized_dropped": source.num_oversized_dropped,
            },
        }


def transform_report(source: Any) -> TransformReport | None:
    """The pass's transform time on this rank, from a source with a transform."""
    report = getattr(source, "transform_report", None)
    return report if isinstance(report, TransformReport) else None


#: Steps of one pass whose world holds no loss target that are logged one by one.
ZERO_LOSS_WARNINGS = 3


class PassTally:
    """What the steps a loader delivered add up to on this rank: in the current pass, the
    samples and tokens it trained on, the steps with no loss target in the whole world and the
    balance of their plans (``pass_balance``); over the loader's life, the balance
    (``balance``). A step with no loss target is never silent: the first few of a pass are
    logged (on ``warn`` ranks), the rest counted."""

    def __init__(self, *, warn: bool) -> None:
        self._warn = warn
        self.balance = BalanceTally()
        self.new_pass()

    def new_pass(self) -> None:
        self.samples = 0
        self.tokens = 0
        self.zero_loss = 0
        self.pass_balance = BalanceTally()

    def add(self, state: StepState, loss_tokens: LossTokens | None) -> None:
        """Count a delivered step (with its loss targets, ``None`` when unknown)."""
        if loss_tokens is not None and loss_tokens.world == 0:
            # The loss recipe's scale is 0.0 and the step trains nothing.
            self.zero_loss += 1
            if self._warn and self.zero_loss <= ZERO_LOSS_WARNINGS:
                logger.warning(
                    "evenflow: step %d holds no loss target in the whole data-parallel world "
                    "(every label is -100): it trains nothing, and LossTokens.loss_scale() is "
                    "0.0. Check the labels (or the chat template's masking) of its samples.%s",
                    state.step,
                    " Further such steps of this pass are counted in "
                    "last_pass.num_zero_loss_steps, not logged."
                    if self.zero_loss == ZERO_LOSS_WARNINGS
                    else "",
                )
        routes, plan = state.routes, state.plan
        if routes is not None and plan is not None:
            per = plan.layout.bins_per_rank
            rank = routes.rank
            self.samples += sum(map(len, routes.bins))
            self.tokens += int(plan.layout.tokens[rank * per : (rank + 1) * per].sum())
        if state.stats is not None:
            self.balance.add(state.stats)
            self.pass_balance.add(state.stats)
