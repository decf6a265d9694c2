"""The fail-together verdict: what every rank concludes from one metadata round.

Each rank's metadata message carries its status for the step being read (``ok``/``end``/
``error``) and for the previous step (its plan digest, or the error its later stages hit). Every
rank runs the same pure functions below on the same gathered messages, so every rank reaches the
same verdict for the same step: stop together, raise the same group-wide error together, or go
on. Nothing here issues a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from evenflow.engine._pipeline.pass_report import uneven_end
from evenflow.engine._pipeline.step import StepState, check_digests, error_info, remote_error
from evenflow.engine.errors import GroupMismatchError, ResumeError, SourceExhaustedError

__all__ = ["confirm_prev", "confirm_reports", "judge_round", "prev_status", "window_reports"]


def prev_status(prev: StepState | None, rank: int) -> dict[str, Any] | None:
    """This rank's report on the previous step, for the next metadata message."""
    if prev is None:
        return None
    info = None if prev.error is None else error_info(rank, prev.error_stage, prev.step, prev.error)
    digest = prev.plan.digest if prev.plan is not None else None
    # This rank's loss targets of the step: the group's total is the sum of the reports.
    loss = None if prev.loss is None else prev.loss.rank
    return {"step": prev.step, "error": info, "digest": digest, "loss": loss}


def confirm_prev(
    prev: StepState | None,
    prevs: Sequence[dict[str, Any] | None],
    rank: int,
    global_ranks: tuple[int, ...],
) -> None:
    """Confirm ``prev`` with every rank's report on it: a peer's error or a plan digest that
    differs becomes the step's group-wide error; the step may then be delivered (or raised)."""
    if prev is None or prev.confirmed is None:
        return
    losses = [p.get("loss") if isinstance(p, dict) else None for p in prevs]
    counts = [v for v in losses if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(counts) == len(losses) and prev.loss is not None:
        # (Complete only when this rank's own report held a count, so ``prev.loss`` is set.)
        prev.loss.group = sum(counts)
    if prev.error is None:
        for sender, p in enumerate(prevs):
            info = p.get("error") if isinstance(p, dict) else None
            if info is not None and sender != rank:
                prev.remote = remote_error(info, global_ranks, sender=sender)
                break
    if prev.error is None and prev.remote is None:
        try:
            check_digests(list(prevs), prev.step, global_ranks)
        except GroupMismatchError as exc:
            prev.remote = exc
    if not prev.confirmed.done():
        prev.confirmed.set_result(None)


def window_reports(settled: Sequence[StepState], rank: int) -> list[dict[str, Any]] | None:
    """This rank's reports on the steps of a balance window settled since the last round
    (the ``prev`` of a message when ``balance_window > 1``: a list, one report per step)."""
    reports = [prev_status(state, rank) for state in settled]
    return [r for r in reports if r is not None] or None


def confirm_reports(
    settled: Sequence[StepState],
    reports: Sequence[Any],
    rank: int,
    global_ranks: tuple[int, ...],
) -> None:
    """:func:`confirm_prev` for each of ``settled`` with every rank's report on its step
    (``reports[r]``: rank ``r``'s list from :func:`window_reports`; peer data, so anything
    that is not a list of reports counts as no report)."""
    by_rank: list[dict[int, dict[str, Any]]] = []
    for sent in reports:
        found: dict[int, dict[str, Any]] = {}
        if isinstance(sent, list):
            for r in sent:
                step = r.get("step") if isinstance(r, dict) else None
                if isinstance(step, int) and not isinstance(step, bool):
                    found[step] = r
        by_rank.append(found)
    for state in settled:
        confirm_prev(state, [f.get(state.step) for f in by_rank], rank, global_ranks)


def judge_round(
    state: StepState,
    messages: Sequence[dict[str, Any]],
    *,
    first_step: int,
    global_ranks: tuple[int, ...],
    on_uneven_end: str,
) -> None:
    """Decide the step ``state`` from every rank's message: mismatched restarts, a rank's error
    and a rank's end make the step terminal on every rank alike."""
    statuses = [m["status"] for m in messages]
    if state.step == first_step:
        firsts = [int(m["first"]) for m in messages]
        if any(f != firsts[0] for f in firsts):
            odd = [global_ranks[r] for r, f in enumerate(firsts) if f != firsts[0]]
            state.remote = ResumeError(
                f"Ranks of the group start at different steps: rank "
                f"{global_ranks[0]} at step {firsts[0]}, ranks {odd} elsewhere "
                f"(starts {firsts}). Restore every rank from states saved at the same step."
            )
            state.terminal = True
            return
    if "error" in statuses:
        state.terminal = True
        if state.error is None:
            sender = statuses.index("error")
            state.remote = remote_error(messages[sender].get("error"), global_ranks, sender=sender)
        return
    if "end" in statuses:
        state.terminal = True
        restart = any(m.get("end_reason") == "restart" for m in messages)
        uneven = None if restart else uneven_end(state.step, messages, global_ranks)
        if uneven is not None:
            state.uneven = uneven
            if on_uneven_end == "raise":
                state.remote = SourceExhaustedError(uneven.message("raise"))
        state.status = "end"
