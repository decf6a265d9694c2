"""Where a loader stands in its epochs, and what a checkpoint of that position records.

The position counts the steps *delivered* to the caller (never the prefetched ones), so a
restored loader re-reads and re-delivers exactly what was not consumed. With a balance window a
checkpoint records the source state at the first step of the window that holds the next step:
a restored loader reads the window again from there (``read_from``), plans it identically and
skips the steps already delivered (``first_step`` is the first one it delivers). A window the
pass ended early (at ``max_steps`` or the source's end) is closed once delivered: the
checkpoint then records the state after its last step, so that a longer run (or other ranks)
continues after it and never plans its steps with later ones.
"""

from __future__ import annotations

import logging
from typing import Any

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.calibration import (
    GroupCalibration,
    calibration_state,
    load_calibration,
)
from evenflow.engine._pipeline.resume import (
    Restore,
    earlier_epoch_error,
    loader_state,
    process_rank,
    read_state,
    window_first,
)
from evenflow.engine._pipeline.step import StepState
from evenflow.transports import Transport

__all__ = ["LoaderPosition"]

logger = logging.getLogger("evenflow")


class LoaderPosition:
    """The epoch, and the current pass's steps (see the module)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.first_step = 0  # the first step the pass delivers (a restored position)
        self.read_from = 0  # the first step the pass reads: its first window's first step
        self.delivered = 0  # steps delivered in this pass, counting restored ones
        # The source's state at the first step a restore would read again (the step's own
        # window start), and right after the last delivered step (for a closed window).
        self.source_state: Any = None
        self.source_after: Any = None
        self.restored: Restore | None = None  # a restored position whose pass has not started

    def save(
        self,
        *,
        identity: dict[str, Any],
        source: Any,
        transport: Transport,
        config: LoaderConfig,
        finished: bool,
        calibration: GroupCalibration | None,
    ) -> dict[str, Any]:
        """The loader's state at this position (``BalancedLoader.state_dict``; ``finished``:
        the pass has ended)."""
        read_from, source_state = self.checkpoint(
            window=config.balance_window, max_steps=config.max_steps, finished=finished
        )
        state = loader_state(
            epoch=self.epoch,
            step=self.delivered,
            identity=identity,
            source=source,
            source_state=source_state,
            process_rank=process_rank(transport),
            group_rank=transport.rank,
            group=list(transport.global_ranks),
            read_from=read_from,
        )
        if calibration is not None:
            state["calibration"] = calibration_state(
                calibration, read_from, process_rank(transport)
            )
        return state

    def load(
        self,
        state: dict[str, Any],
        *,
        identity: dict[str, Any],
        source: Any,
        transport: Transport,
        config: LoaderConfig,
        calibration: GroupCalibration | None,
    ) -> None:
        """Restore the position ``state`` records (``BalancedLoader.load_state_dict``): the
        next pass starts there, and ``source`` (if it has ``set_epoch``) is at its epoch."""
        restore = read_state(
            state,
            identity=identity,
            source=source,
            process_rank=process_rank(transport),
            group_rank=transport.rank,
            group=list(transport.global_ranks),
            max_steps=config.max_steps,
            window=config.balance_window,
        )
        self.epoch = restore.epoch
        set_epoch = getattr(source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(restore.epoch)
        if calibration is not None:
            load_calibration(calibration, state, process_rank(transport))
        self.restore(restore)

    def deliver(self, state: StepState) -> None:
        """``state``'s step was delivered."""
        self.delivered = state.step + 1
        self.source_state = state.resume_source
        self.source_after = state.source_state

    def new_pass(self, epoch: int) -> None:
        """A pass of ``epoch`` starts from its beginning."""
        self.restored = None
        self.epoch = epoch
        self.first_step = self.read_from = 0
        self.delivered = 0
        self.source_state = self.source_after = None

    def restore(self, restore: Restore) -> None:
        """The next pass starts at a restored position."""
        self.epoch = restore.epoch
        self.restored = restore
        self.first_step = self.delivered = restore.step
        self.read_from = restore.read_from
        self.source_state = restore.source
        self.source_after = restore.source if restore.read_from == restore.step else None

    def keeps_restored(self, epoch: int) -> bool:
        """Whether ``set_epoch(epoch)`` keeps a restored position whose pass has not started:
        the usual loop restores, then calls ``set_epoch()`` at the top of its epoch loop, with
        the restored epoch. A later epoch skips the rest of the restored one (with a WARNING);
        an earlier one is refused."""
        restored = self.restored
        if restored is None:
            return False
        if epoch == restored.epoch:
            return True
        if epoch < restored.epoch:
            raise earlier_epoch_error(epoch, restored.epoch, restored.step)
        logger.warning(
            "evenflow: set_epoch(%d) after restoring a state at epoch %d step %d: the rest "
            "of epoch %d is skipped.",
            epoch,
            restored.epoch,
            restored.step,
            restored.epoch,
        )
        return False

    def checkpoint(self, *, window: int, max_steps: int | None, finished: bool) -> tuple[int, Any]:
        """The step a restore of this position reads from, and the source state there
        (``finished``: the pass has ended)."""
        step = self.delivered
        read_from = max(window_first(step, window), self.read_from)
        if (
            read_from < step
            and step > self.first_step  # a step of this pass was delivered
            and (finished or (max_steps is not None and step >= max_steps))
        ):
            # The last window ended early and every step of it was delivered.
            return step, self.source_after
        return read_from, self.source_state
