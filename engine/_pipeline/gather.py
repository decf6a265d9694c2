"""The gather stage: one metadata round per step, and the verdict every rank draws from it.

Each step read is announced to the group in one all-gather (:func:`~evenflow.engine.
_pipeline.step.build_message`: its status, its samples' token counts, loss counts, packing
costs and frame sizes, this rank's reports on the steps settled since the last round, and the
rows a calibrated cost model measured). The same round confirms the steps it reports on
(:mod:`~evenflow.engine._pipeline.verdict`): a step is delivered only after the round that
follows its settle, so every rank knows that every rank finished it.

Needs from the step: what the read stage added (``status``, samples, metadata, frames).
Adds: ``messages`` (every rank's message), ``confirmed`` (a future the next round completes),
and the round's verdict: ``terminal`` with ``status="end"`` and ``uneven``, or ``remote`` (a
peer's error, a mismatched restart or dataset). A pass that ends in the middle of a balance
window marks the ending step with a :class:`~evenflow.engine._pipeline.records.PassEdge`
(``final_round``): after the window's last settle, :meth:`GatherStage.final_round` confirms the
window's steps. A failed all-gather is reported to the pipeline (``Hooks.group_failed``), which
ends the pass; nothing is raised.

The pack stage hands each settled step back (:meth:`GatherStage.settled`) for the next round's
reports.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from evenflow.engine._pipeline.calibration import GroupCalibration
from evenflow.engine._pipeline.progress import Hooks, Progress
from evenflow.engine._pipeline.read_assigned import dataset_mismatch
from evenflow.engine._pipeline.records import PassEdge
from evenflow.engine._pipeline.sequencer import Sequencer, WindowSequencer
from evenflow.engine._pipeline.step import StepState, build_message
from evenflow.engine._pipeline.verdict import (
    confirm_prev,
    confirm_reports,
    judge_round,
    prev_status,
    window_reports,
)
from evenflow.transports import Transport

__all__ = ["GatherStage"]

logger = logging.getLogger("evenflow")


class GatherStage:
    """Runs each step's metadata round in step order (see the module)."""

    def __init__(
        self,
        *,
        transport: Transport,
        sequencer: Sequencer,
        progress: Progress,
        hooks: Hooks,
        first_step: int,
        read_from: int,
        window: int,
        budget_names: tuple[str, ...],
        on_uneven_end: str,
        shared: bool,
        dataset: dict[str, Any] | None,
        calibration: GroupCalibration | None,
    ) -> None:
        self._transport = transport
        self._sequencer = sequencer
        self._progress = progress
        self._hooks = hooks
        self._rank = transport.rank
        self._global_ranks = transport.global_ranks
        self._first_step = first_step
        self._read_from = read_from
        self._window = window
        self._budget_names = budget_names
        self._on_uneven_end = on_uneven_end
        # Shared-dataset mode: the reader of assigned samples, and the dataset identity the
        # first metadata round compares (None in payload mode on every rank).
        self._shared = shared
        self._dataset = dataset
        self._calibration = calibration
        # Steps settled since the last metadata round (their reports go in the next one),
        # and those whose reports are in the round under way, awaiting its result.
        self._settled: list[StepState] = []
        self._reporting: list[StepState] = []

    def settled(self, state: StepState) -> None:
        """``state`` is packed (or failed): report on it in the next round."""
        self._settled.append(state)

    def confirm_all_pending(self, exc: BaseException) -> None:
        """The pass stopped: release every step awaiting its confirmation, with ``exc``."""
        pending = [*self._reporting, *self._settled]
        self._reporting, self._settled = [], []
        for prev in pending:
            if prev.confirmed is not None and not prev.confirmed.done():
                prev.remote = prev.remote or exc
                prev.confirmed.set_result(None)

    async def run(self, state: StepState) -> None:
        progress = self._progress
        if progress.ended:
            # A step read ahead of the round that ended the pass: it has no turn (a window's
            # steps after that round would come before the window's exchanges). It waits,
            # never announced, until the pass is closed.
            await asyncio.get_running_loop().create_future()
        await self._sequencer.turn(state.step, "gather")
        messages = await self._round(state)
        if messages is None:
            return
        mismatch = None
        if state.step == self._read_from:
            mismatch = dataset_mismatch(
                [m.get("dataset") for m in messages],
                self._global_ranks,
                where=f"Step {state.step}",
            )
        if mismatch is not None:
            state.remote, state.terminal = mismatch, True
        else:
            judge_round(
                state,
                messages,
                first_step=self._read_from,
                global_ranks=self._global_ranks,
                on_uneven_end=self._on_uneven_end,
            )
        sequencer = self._sequencer
        if (
            state.terminal
            and isinstance(sequencer, WindowSequencer)
            and not sequencer.starts_window(state.step)
            and progress.fatal is None
        ):
            # The pass ends in the middle of a window: the window's earlier steps are planned,
            # delivered and confirmed by a final round first.
            sequencer.end_window(state.step)
            state.edge = PassEdge(final_round=True)
        await self._sequencer.advance(state.step, "gather")
        progress.gathered_step = state.step
        progress.ended = state.terminal
        if state.terminal and state.status == "end":
            progress.final_round = state
            if state.uneven is not None and state.remote is None:
                logger.warning("%s", state.uneven.message("stop"))
        progress.gather_done = state.terminal and state.edge is None
        progress.notify()
        if not state.terminal:
            state.confirmed = asyncio.get_running_loop().create_future()
            if state.error is None:
                state.messages = messages

    async def final_round(self, state: StepState) -> None:
        """The round after the last settle of a window the pass ended in: it confirms the
        window's steps (the pass's end was judged in ``state``'s first round)."""
        await self._sequencer.turn(state.step, "final")
        if await self._round(state) is None:
            return
        await self._sequencer.advance(state.step, "final")
        self._progress.gather_done = True
        self._progress.notify()

    async def _round(self, state: StepState) -> list[dict[str, Any]] | None:
        """One metadata round for ``state`` (its turn taken): announce it with the reports on
        the steps settled since the last round, and confirm those steps with every rank's
        reports. ``None`` when the group failed."""
        self._reporting, self._settled = self._settled, []
        if self._window == 1:
            prev: Any = prev_status(self._reporting[0], self._rank) if self._reporting else None
        else:
            prev = window_reports(self._reporting, self._rank)
        msg = build_message(state, self._rank, self._first_step, self._budget_names, prev)
        if state.step == self._read_from:
            msg["dataset"] = self._dataset
        if self._calibration is not None and state.status == "ok":
            # Measured rows ride the round every rank gathers anyway (no collective of their own).
            rows = self._calibration.outgoing(state.step)
            if rows is not None:
                msg["calib"] = rows
        if state.prepared is not None and state.status == "ok":
            # Frame sizes: every receiver sizes its exchange buffer from them and the plan.
            msg["nbytes"] = np.fromiter(
                (p.nbytes for p in state.prepared), dtype=np.int64, count=len(state.prepared)
            )
        if self._shared and state.status == "ok" and state.samples is not None:
            msg["indices"] = np.fromiter(
                (s.dataset_index for s in state.samples), dtype=np.int64, count=len(state.samples)
            )
        elif state.indices is not None and state.status == "ok":
            # Payload mode over a source that knows them: errors at the pack name the sample
            # by its dataset index on whichever rank packs it.
            msg["indices"] = state.indices
        try:
            messages = await self._transport.all_gather(msg)
        except BaseException as exc:
            await self._hooks.group_failed(state, exc, "gather")
            return None
        reporting, self._reporting = self._reporting, []
        prevs = [m.get("prev") for m in messages]
        if self._window == 1:
            confirm_prev(reporting[0] if reporting else None, prevs, self._rank, self._global_ranks)
        else:
            confirm_reports(reporting, prevs, self._rank, self._global_ranks)
        return messages
