"""Online calibration in a loader: measurements ride the metadata round, every rank fits alike.

A rank measures its own bins only (``BalancedLoader.record_compute``). A calibrated plan
needs the whole group's measurements, and every rank of the group must hold the same
coefficients from the same step on, or plans differ. So no new collective is added: a rank's
measured rows ride in the next metadata message it sends (``msg["calib"]``), which every rank
of the group receives, and every rank feeds the same rows to the same pure
:class:`~evenflow.engine._planning.calibration.Calibrator` at the same step.

**When a row counts.** Which message carries a row depends on timing (when the caller
recorded it, how far the pipeline read ahead). What it changes must not: a row measured at
step ``t`` enters the fit at step ``t + lag`` exactly — it waits, received but pending, until
then — with ``lag = prefetch_depth + balance_window + 1``, the latest round by which a row
recorded before the next ``next()`` is guaranteed to have been sent (a later round's message
is built only after the step after ``t`` was delivered). A row that arrives after its step
is *late*: every rank drops it alike and counts it. Due rows enter in ``(step, rank, bin)``
order, whatever order they arrived in, so the calibrator's input — and the coefficients, and
the plans — are a function of the measurements alone. Refits happen at steps that are
multiples of ``refit_every``, after the step's due rows are in, before the step is planned.

**Resume.** The state holds the group's calibration as it was before the first step a
restore reads again (identical on every rank, like the shared fields) and, per rank, the rows
it had recorded but not yet sent by then: a restored run sends them again and fits exactly as
the uninterrupted run did.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._model import SampleMetadata
from evenflow.engine._pipeline.resume import decode_state
from evenflow.engine._pipeline.routes import RankRoutes
from evenflow.engine._planning.calibration import (
    CalibratedCost,
    Calibrator,
    best_scale,
    relative_errors,
)
from evenflow.engine.errors import ConfigError, LoaderStateError, ResumeError
from evenflow.transports import encode

__all__ = [
    "CalibrationStats",
    "GroupCalibration",
    "calibration_state",
    "group_calibration",
    "load_calibration",
]

_KEEP_ERRORS = 4096


@dataclass(frozen=True, slots=True)
class CalibrationStats:
    """How well the cost model predicts the clock (the same on every rank of a group).

    ``coefficients`` (one per ``feature_names``) are those in force. Errors are relative,
    per measured row, of predictions made *before* the row was measured (the coefficients in
    force then, times the best common scale, since only ratios steer the planner):
    ``median_error`` and ``p90_error`` over the last ``window`` rows of the current pass.
    ``measured_imbalance`` and ``predicted_imbalance`` are the slowest rank over the mean
    rank, measured and predicted, averaged over the last ``window`` steps every rank measured
    whole. Counts: ``num_rows`` measured bins entered the fit in this pass, ``num_refused``
    were refused (non-finite, zero or negative seconds), ``num_late`` arrived after their
    step; ``num_fits`` refits ran and ``num_accepted`` passed the guard. ``errors`` lists
    ``(step, error)`` per row and ``imbalance`` ``(step, measured, predicted)`` per complete
    step, for plots over time.
    """

    feature_names: tuple[str, ...]
    coefficients: tuple[float, ...]
    median_error: float
    p90_error: float
    measured_imbalance: float
    predicted_imbalance: float
    num_rows: int
    num_refused: int
    num_late: int
    num_fits: int
    num_accepted: int
    errors: tuple[tuple[int, float], ...]
    imbalance: tuple[tuple[int, float, float], ...]


def group_calibration(
    planner: Any, *, rank: int, num_ranks: int, bins_per_rank: int, lag: int
) -> GroupCalibration | None:
    """The loader's calibration when its planner's cost model calibrates, else None."""
    model = getattr(planner, "cost_model", None)
    if not isinstance(model, CalibratedCost):
        return None
    return GroupCalibration(
        model, rank=rank, num_ranks=num_ranks, bins_per_rank=bins_per_rank, lag=lag
    )


class GroupCalibration:
    """One rank's side of its group's calibration (see the module docstring).

    Called from three threads: the caller (:meth:`record`, :meth:`stats`, state), the event
    loop (:meth:`outgoing`, :meth:`note_plan`) and the planning thread (:meth:`ingest`); one
    lock keeps each call whole.
    """

    def __init__(
        self, model: CalibratedCost, *, rank: int, num_ranks: int, bins_per_rank: int, lag: int
    ) -> None:
        self.model = model
        self.calibrator = Calibrator(model)
        self.rank = rank
        self.num_ranks = num_ranks
        self.bins_per_rank = bins_per_rank
        self.lag = lag
        self._width = 3 + model.num_features  # step, bin, seconds, features
        self._lock = threading.Lock()
        # This rank: per-bin features of its planned steps, its rows and the round that sent
        # each (None: not yet sent), and which (step, bin) it has recorded.
        self._bins: dict[int, np.ndarray] = {}
        self._rows: list[tuple[np.ndarray, int | None]] = []
        self._recorded: set[tuple[int, int]] = set()
        # The group: rows received but not yet due, the last round ingested, the state before
        # each recent round (for checkpoints), and statistics.
        self._pending: list[np.ndarray] = []
        self._ingested = -1
        self._snapshots: dict[int, dict[str, Any]] = {}
        self.num_late = 0
        # Statistics, each entry tagged with the round that produced it, so that ranks which
        # ingested different numbers of rounds ahead still report alike for a delivered step.
        self._errors: list[tuple[int, int, float]] = []  # (round, step, error)
        self._steps: dict[int, np.ndarray] = {}  # step -> per rank [seconds, predicted, bins]
        self._imbalance: list[tuple[int, int, float, float]] = []

    @property
    def _keep(self) -> int:
        return 4 * self.lag + 16

    # -- this rank ------------------------------------------------------------------------------

    def note_plan(
        self, step: int, routes: RankRoutes, messages: Mapping[int, list[dict[str, Any]]]
    ) -> None:
        """Features of this rank's bins under ``step``'s plan, from the gathered metadata."""
        k = self.model.num_features
        bins = np.zeros((len(routes.bins), k), dtype=np.float64)
        bins[:, 0] = 1.0
        for b, keys in enumerate(routes.bins):
            for source_rank, key_step, index in keys:
                message = messages[key_step][source_rank]
                features = message.get("features")
                meta = SampleMetadata(
                    tokens=int(message["tokens"][index]),
                    features=(features[index] or {}) if features is not None else {},
                )
                bins[b, 1:] += self.model.sample_features(meta)
        with self._lock:
            self._bins[step] = bins
            for old in [s for s in self._bins if s < step - self._keep]:
                del self._bins[old]

    def record(self, step: int, seconds: object, bin: int | None) -> None:
        """A measurement of this rank's ``step``: one bin, or all of them (``bin=None``)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(
                f"record_compute(seconds=...) must be a number of seconds, but got "
                f"{seconds!r:.80} ({type(seconds).__name__})."
            )
        if bin is not None and (
            isinstance(bin, bool) or not isinstance(bin, int) or not 0 <= bin < self.bins_per_rank
        ):
            raise ConfigError(
                f"record_compute(bin={bin!r}) must be None (the whole step) or a bin index in "
                f"[0, {self.bins_per_rank}) (bins_per_rank)."
            )
        with self._lock:
            features = self._bins.get(step)
            if features is None:
                raise LoaderStateError(
                    f"record_compute() found no planned step {step} on this rank; call it "
                    "after next() returned the step it measures, within a few steps."
                )
            which = -1 if bin is None else bin
            # A whole step overlaps each of its bins, and a bin the whole step.
            overlapping = (
                {(step, b) for b in range(-1, self.bins_per_rank)}
                if which == -1
                else {(step, which), (step, -1)}
            )
            if any(item in self._recorded for item in overlapping):
                raise LoaderStateError(
                    f"record_compute() already holds a measurement of step {step} that overlaps "
                    f"bin={bin!r}; record each bin once, or the whole step once."
                )
            self._recorded.add((step, which))
            row = np.empty(self._width, dtype=np.float64)
            row[:3] = (step, which, float(seconds))
            row[3:] = features.sum(axis=0) if bin is None else features[bin]
            self._rows.append((row, None))
            for old in [item for item in self._recorded if item[0] < step - self._keep]:
                self._recorded.discard(old)

    def outgoing(self, round_: int) -> np.ndarray | None:
        """The rows this rank sends in ``round_``'s message (those not sent yet)."""
        with self._lock:
            fresh = [row for row, sent in self._rows if sent is None]
            if not fresh:
                return None
            keep_from = round_ - self._keep
            self._rows = [
                (row, round_ if sent is None else sent)
                for row, sent in self._rows
                if sent is None or sent >= keep_from
            ]
            return np.stack(fresh)

    # -- the group ------------------------------------------------------------------------------

    def ingest(self, round_: int, messages: list[dict[str, Any]]) -> None:
        """Round ``round_``'s rows from every rank; refit when the round calls for it."""
        with self._lock:
            if round_ <= self._ingested:
                return
            self._snapshots[round_] = self._shared()
            for old in [r for r in self._snapshots if r < round_ - self._keep]:
                del self._snapshots[old]
            for sender, message in enumerate(messages):
                self._receive(round_, sender, message.get("calib"))
            due = [row for row in self._pending if row[0] + self.lag <= round_]
            self._pending = [row for row in self._pending if row[0] + self.lag > round_]
            if due:
                due.sort(key=lambda row: (row[0], row[1], row[2]))
                rows = np.stack(due)
                self._observe(round_, rows)
                self.calibrator.add_rows(rows)
            if round_ > 0 and round_ % self.model.refit_every == 0:
                self.calibrator.refit(round_)
            self._ingested = round_

    def _receive(self, round_: int, sender: int, rows: Any) -> None:
        if rows is None:
            return
        try:
            array = np.asarray(rows, dtype=np.float64)
        except (TypeError, ValueError):
            array = np.zeros(0)
        if array.ndim != 2 or array.shape[1] != self._width:
            # Peer data of the wrong shape is refused alike on every rank (all see it).
            self.calibrator.num_refused += int(array.shape[0]) if array.ndim == 2 else 1
            return
        for row in array:
            if not math.isfinite(row[0]) or row[0] >= round_ or row[0] < 0:
                self.calibrator.num_refused += 1
            elif row[0] + self.lag < round_:
                self.num_late += 1
            else:
                self._pending.append(np.concatenate([row[:1], [sender], row[1:]]))

    def _observe(self, round_: int, rows: np.ndarray) -> None:
        """Prediction errors of rows about to enter the fit, under the coefficients in force."""
        coef = self.model.coefficients
        seconds, features = rows[:, 3], rows[:, 4:]
        good = np.isfinite(rows).all(axis=1) & (seconds > 0.0)
        if not good.any():
            return
        held = self.calibrator.rows
        scale = (
            best_scale(held[:, 4:], held[:, 3], coef)
            if len(held)
            else best_scale(features[good], seconds[good], coef)
        )
        scaled = [scale * c for c in coef]
        errors = relative_errors(features[good], seconds[good], scaled)
        steps = rows[good, 0].astype(int).tolist()
        self._errors.extend((round_, s, e) for s, e in zip(steps, errors.tolist(), strict=True))
        del self._errors[:-_KEEP_ERRORS]
        predicted = features[good] @ np.asarray(scaled)
        for row, guess in zip(rows[good], predicted.tolist(), strict=True):
            step, rank = int(row[0]), int(row[1])
            if not 0 <= rank < self.num_ranks:
                continue
            table = self._steps.setdefault(step, np.zeros((self.num_ranks, 3)))
            table[rank] += (row[3], guess, row[4])
            if (table[:, 2] == self.bins_per_rank).all():
                measured, predicted_ranks = table[:, 0], table[:, 1]
                self._imbalance.append(
                    (
                        round_,
                        step,
                        float(measured.max() / measured.mean()),
                        float(predicted_ranks.max() / predicted_ranks.mean()),
                    )
                )
                del self._imbalance[:-_KEEP_ERRORS]
                del self._steps[step]
        for old in [s for s in self._steps if s < int(rows[-1, 0]) - self._keep]:
            del self._steps[old]

    def stats(self, step: int, window: int = 64) -> CalibrationStats:
        """Statistics as of ``step`` (the last delivered): what every rank had fitted by then."""
        with self._lock:
            errors = tuple((s, e) for r, s, e in self._errors if r <= step)
            imbalance = tuple((s, m, p) for r, s, m, p in self._imbalance if r <= step)
            state = self._snapshots.get(step + 1) or self._shared()
            fitted = state["calibrator"]
            recent = np.array([e for _, e in errors[-window:]], dtype=np.float64)
            steps = np.array([(m, p) for _, m, p in imbalance[-window:]], dtype=np.float64)
            return CalibrationStats(
                feature_names=self.model.feature_names,
                coefficients=tuple(fitted["coefficients"]),
                median_error=float(np.median(recent)) if recent.size else math.nan,
                p90_error=float(np.quantile(recent, 0.9)) if recent.size else math.nan,
                measured_imbalance=float(steps[:, 0].mean()) if steps.size else math.nan,
                predicted_imbalance=float(steps[:, 1].mean()) if steps.size else math.nan,
                num_rows=len(errors),
                num_refused=int(fitted["refused"]),
                num_late=int(state["late"]),
                num_fits=int(fitted["fits"]),
                num_accepted=int(fitted["accepted"]),
                errors=errors,
                imbalance=imbalance,
            )

    # -- state ----------------------------------------------------------------------------------

    def new_pass(self) -> None:
        """A new pass counts steps from 0 again: forget this pass's rounds, rows and error
        history (statistics are per pass); keep the fitted coefficients and the rows already
        in the fit."""
        with self._lock:
            self._bins, self._rows, self._recorded = {}, [], set()
            self._pending, self._ingested, self._snapshots = [], -1, {}
            self._steps, self._errors, self._imbalance = {}, [], []

    def _shared(self) -> dict[str, Any]:
        """The group's state now (before the next round). Cheap: arrays are referenced, not
        copied (no array here is ever changed in place); :meth:`state` makes plain data."""
        return {
            "calibrator": self.calibrator.snapshot(),
            "pending": list(self._pending),
            "late": self.num_late,
        }

    def state(self, read_from: int) -> dict[str, Any]:
        """The state a checkpoint records when a restore reads again from ``read_from``."""
        with self._lock:
            if read_from > self._ingested:
                shared = self._shared()
            elif read_from in self._snapshots:
                shared = self._snapshots[read_from]
            else:
                raise LoaderStateError(
                    f"The calibration state before step {read_from} is no longer held (the "
                    f"last round ingested is {self._ingested}); save the state right after a "
                    "step is delivered."
                )
            unsent = [
                row.tolist() for row, sent in self._rows if sent is None or sent >= read_from
            ]
        plain = {
            "calibrator": {**shared["calibrator"], "rows": shared["calibrator"]["rows"].tolist()},
            "pending": [row.tolist() for row in shared["pending"]],
            "late": shared["late"],
        }
        return {"shared": encode_blob(plain), "rank": encode_blob({"rows": unsent})}

    def load_state(self, shared: Any, rank: Any) -> None:
        """Restore what :meth:`state` saved (``rank`` None: this rank saved no entry)."""
        try:
            data = decode_blob(shared, "state['calibration']['shared']")
            self.calibrator.load_state(data["calibrator"])
            pending = [np.asarray(r, dtype=np.float64) for r in data["pending"]]
            late = int(data["late"])
            rows = [] if rank is None else decode_blob(rank, "the rank's calibration")["rows"]
            restored = [(np.asarray(r, dtype=np.float64), None) for r in rows]
        except ResumeError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeError(
                f"The loader state's calibration does not fit this cost model "
                f"({self.model.model_id}): {exc}"
            ) from exc
        if any(r.shape != (self._width + 1,) for r in pending) or any(
            r.shape != (self._width,) for r, _ in restored
        ):
            raise ResumeError(
                "The loader state's calibration rows have the wrong width for this cost model "
                f"({self.model.model_id}); restore a state saved with the same cost model."
            )
        with self._lock:
            self._pending = pending
            self.num_late = late
            self._rows = restored
            self._recorded = {(int(r[0]), int(r[1])) for r, _ in restored}


def calibration_state(
    calibration: GroupCalibration, read_from: int, process_rank: int | None
) -> dict[str, Any]:
    """``state["calibration"]``: the group's part under one key every rank writes alike, this
    rank's unsent rows under its own key (``torch.distributed.checkpoint`` never mixes them)."""
    parts = calibration.state(read_from)
    entry: dict[str, Any] = {"shared": parts["shared"]}
    if process_rank is not None:
        entry["ranks"] = {str(process_rank): parts["rank"]}
    return entry


def load_calibration(
    calibration: GroupCalibration, state: dict[str, Any], process_rank: int | None
) -> None:
    """Restore ``state["calibration"]``; a state saved without one (an older evenflow, or
    before calibration was configured) leaves the initial coefficients."""
    saved = state.get("calibration")
    if saved is None:
        return
    if not isinstance(saved, dict) or "shared" not in saved:
        raise ResumeError(
            "state['calibration'] must be the mapping state_dict() wrote, but got "
            f"{type(saved).__name__}."
        )
    ranks = saved.get("ranks") or {}
    own = ranks.get(str(process_rank)) if process_rank is not None else None
    calibration.load_state(saved["shared"], own)


def encode_blob(value: Any) -> bytes:
    """Plain calibration data as bytes for the loader state (the wire format, no pickle)."""
    return bytes(encode(value))


def decode_blob(raw: Any, what: str) -> Any:
    """What :func:`encode_blob` wrote (the loader state's decoder and its errors)."""
    return decode_state(raw, what)
