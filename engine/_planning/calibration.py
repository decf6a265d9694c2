"""A cost model that learns its coefficients from measured compute, and the fit behind it.

Any cost model is a guess at the clock. :class:`CalibratedCost` turns one into a linear model
over a few per-sample features — a constant (per-sample overhead), ``L``, ``L²`` and the base
model's own terms — whose coefficients start at the base model and are refitted to measured
seconds. A measurement is one *row*: the seconds one rank spent on one bin (or on all its bins
of a step) and the summed features of the samples in it, plus a per-bin constant (kernel
launches, fixed overheads: it cancels between ranks, which all hold the same number of bins,
but it must be fitted or the other coefficients absorb it).

:class:`Calibrator` holds the rows and decides. Everything it does is a pure function of the
rows it is given, in a canonical order, with exactly rounded sums (``math.fsum``) and a
pure-Python solve, so every rank of a balance group that is given the same rows holds the
same coefficients, bit for bit, even on different CPUs:

* **Fit** — non-negative least squares on *relative* residuals (a 10 ms bin and a 1 s bin
  count alike), iteratively reweighted with Huber weights so a few outliers lose their pull.
* **Guard** — every fourth row is held out; the candidate replaces the coefficients in force
  only when its median relative error on the held-out rows is strictly lower than theirs
  (after the best common scale, since only ratios steer the planner). Non-finite, zero or
  negative seconds never enter; a candidate whose per-sample part is all zero is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._planning import cost as _cost
from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError, PlanningError

__all__ = ["CalibratedCost", "Calibrator", "FitResult", "fit_coefficients"]

#: Names of the features every calibrated model has, before the base model's own terms.
BASE_FEATURES: tuple[str, ...] = ("bins", "samples", "tokens", "tokens_squared")
_HUBER = 1.345
_RIDGE = 1e-9


class CalibratedCost:
    """``base`` (any cost model) made linear in fitted coefficients and refitted to measurements.

    A sample costs ``c_samples + c_tokens·L + c_tokens_squared·L² + Σ_k c_k·term_k`` where the
    terms are the base model's own (``base.cost_terms(meta)`` with names ``base.term_names``
    when it has them; a sum-reduced :class:`ComponentCost`'s components; otherwise the base
    cost itself as one term). :class:`TokenCost` and :class:`QuadraticCost` (and ``None``,
    the default quadratic) bring no term of their own: they *are* ``L`` and ``L²``.

    The coefficients start at the base model (so the first plans are the base model's), or
    at ``initial`` (one per :attr:`feature_names` entry, e.g. from timings taken at start-up),
    and change only when a loader refits them: every ``refit_every`` steps from the last
    ``history`` measured rows, once at least ``min_rows`` are held (see
    :meth:`BalancedLoader.record_compute`). The configuration enters :attr:`model_id`; the
    coefficients do not (they travel in the loader's state instead), so ranks and restores
    agree on identity while the coefficients move.
    """

    # Recognised by resolve_cost_model and evaluate_costs (which cannot import this module).
    _evenflow_calibrated = True

    def __init__(
        self,
        base: object = None,
        *,
        refit_every: int = 10,
        history: int = 512,
        min_rows: int = 32,
        initial: Sequence[float] | None = None,
    ) -> None:
        if isinstance(base, CalibratedCost):
            raise ConfigError(
                "CalibratedCost(base=...) was given a CalibratedCost; calibrate the base model "
                "once (pass its base instead)."
            )
        self.base: Any = _cost.resolve_cost_model(base)
        self.refit_every = check_int("CalibratedCost.refit_every", refit_every, minimum=1)
        self.history = check_int("CalibratedCost.history", history, minimum=8)
        self.min_rows = check_int("CalibratedCost.min_rows", min_rows, minimum=8)
        if self.min_rows > self.history:
            raise ConfigError(
                f"CalibratedCost.min_rows={min_rows} exceeds history={history}: a refit could "
                "never hold enough rows; lower min_rows or raise history."
            )
        self._terms, from_base = _base_terms(self.base)
        self.feature_names: tuple[str, ...] = (*BASE_FEATURES, *self._terms)
        self._given = initial is not None
        start = (
            from_base
            if initial is None
            else check_coefficients(initial, len(self.feature_names), "CalibratedCost.initial")
        )
        self.initial: tuple[float, ...] = start
        self._coefficients: tuple[float, ...] = start
        self._vector = np.asarray(start[1:], dtype=np.float64)

    # -- identity and coefficients --------------------------------------------------------------

    @property
    def model_id(self) -> str:
        start = f",initial={list(self.initial)!r}" if self._given else ""
        return (
            f"calibrated-v1(base={_cost.cost_model_id(self.base)},refit_every={self.refit_every},"
            f"history={self.history},min_rows={self.min_rows}{start})"
        )

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The coefficients in force, one per :attr:`feature_names` entry."""
        return self._coefficients

    def set_coefficients(self, values: Sequence[float]) -> None:
        """Install coefficients (what a refit or a restored state decided)."""
        checked = check_coefficients(values, self.num_features, "coefficients")
        self._coefficients = checked
        self._vector = np.asarray(checked[1:], dtype=np.float64)

    def for_planner(self) -> CalibratedCost:
        """A fresh copy with the initial coefficients: each planner owns its own, so loaders
        built from one configured object (e.g. ranks as threads) never share coefficients."""
        return CalibratedCost(
            self.base,
            refit_every=self.refit_every,
            history=self.history,
            min_rows=self.min_rows,
            initial=self.initial if self._given else None,
        )

    # -- evaluation -----------------------------------------------------------------------------

    def sample_features(self, meta: SampleMetadata) -> np.ndarray:
        """One sample's features without the per-bin constant: ``[1, L, L², terms...]``."""
        length = float(meta.tokens)
        head = [1.0, length, length * length]
        if not self._terms:
            return np.array(head, dtype=np.float64)
        return np.array([*head, *_terms_of(self.base, meta, len(self._terms))], dtype=np.float64)

    def feature_matrix(
        self,
        metas: Sequence[SampleMetadata],
        *,
        keys: Sequence[SampleKey] | None = None,
        tokens: np.ndarray | None = None,
    ) -> np.ndarray:
        """Features of ``metas`` as an ``(n, num_features - 1)`` float64 matrix."""
        lengths = _cost._token_vector(metas, tokens)
        out = np.empty((len(metas), self.num_features - 1), dtype=np.float64)
        out[:, 0] = 1.0
        out[:, 1] = lengths
        out[:, 2] = lengths * lengths
        if self._terms:
            if len(self._terms) == 1 and not _has_terms(self.base):
                column = np.empty(len(metas), dtype=np.float64)
                _cost._fill(column, self.base, metas, keys, "the base of CalibratedCost")
                out[:, 3] = column
            else:
                for i, meta in enumerate(metas):
                    out[i, 3:] = _terms_of(self.base, meta, len(self._terms))
        return out

    def evaluate(
        self,
        metas: Sequence[SampleMetadata],
        *,
        keys: Sequence[SampleKey] | None = None,
        tokens: np.ndarray | None = None,
    ) -> np.ndarray:
        """Costs of ``metas`` under the coefficients in force (vectorised)."""
        costs: np.ndarray = self.feature_matrix(metas, keys=keys, tokens=tokens) @ self._vector
        # Coefficients are >= 0 and features finite, so only an overflow can break a cost.
        if not np.isfinite(costs).all():
            bad = int(np.flatnonzero(~np.isfinite(costs))[0])
            raise PlanningError(
                f"CalibratedCost overflowed on sample {bad} ({metas[bad].tokens} tokens) with "
                f"coefficients {self._coefficients!r}; a cost must be a finite number."
            )
        return np.maximum(costs, 0.0)

    def __call__(self, meta: SampleMetadata) -> float:
        return max(float(self.sample_features(meta) @ self._vector), 0.0)

    def __repr__(self) -> str:
        return f"CalibratedCost({self.model_id}, coefficients={self._coefficients!r})"


def _has_terms(base: object) -> bool:
    return callable(getattr(base, "cost_terms", None)) and bool(getattr(base, "term_names", ()))


def _base_terms(base: Any) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The base model's own term names and the initial coefficients that reproduce it."""
    if type(base) is _cost.TokenCost:
        return (), (0.0, 0.0, 1.0, 0.0)
    if type(base) is _cost.QuadraticCost:
        return (), (0.0, 0.0, base.linear, base.quadratic)
    if _has_terms(base):
        names = tuple(str(name) for name in base.term_names)
        return names, (0.0, 0.0, 0.0, 0.0, *(1.0,) * len(names))
    if isinstance(base, _cost.ComponentCost) and base.reduce == "sum":
        return base.components, (0.0, 0.0, 0.0, 0.0, *base.weights)
    return ("base",), (0.0, 0.0, 0.0, 0.0, 1.0)


def _terms_of(base: Any, meta: SampleMetadata, count: int) -> tuple[float, ...]:
    if _has_terms(base):
        values = tuple(float(v) for v in base.cost_terms(meta))
    elif isinstance(base, _cost.ComponentCost) and base.reduce == "sum":
        values = base.evaluate(meta)
    else:
        values = (float(base(meta)),)
    if len(values) != count or not all(math.isfinite(v) and v >= 0.0 for v in values):
        raise ConfigError(
            f"The base cost model of CalibratedCost returned terms {values!r:.120} for a sample "
            f"of {meta.tokens} tokens; it must return {count} finite numbers >= 0."
        )
    return values


def check_coefficients(values: object, count: int, name: str) -> tuple[float, ...]:
    """``values`` as a tuple of ``count`` finite floats >= 0, else ``ConfigError``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ConfigError(f"{name} must be a sequence of {count} numbers, but got {values!r:.80}.")
    items = [float(v) for v in values]
    if len(items) != count or not all(math.isfinite(v) and v >= 0.0 for v in items):
        raise ConfigError(
            f"{name} must be {count} finite numbers >= 0, but got {items!r:.160}; the state or "
            "the fit that produced them does not match this cost model."
        )
    if not any(items[1:]):
        raise ConfigError(
            f"{name} {items!r:.160} give every sample a cost of 0; at least one per-sample "
            "coefficient must be positive."
        )
    return tuple(items)


# ---------------------------------------------------------------------------------- the fit


@dataclass(frozen=True, slots=True)
class FitResult:
    """A robust fit: coefficients, and the median relative error on the rows it was fitted to."""

    coefficients: tuple[float, ...]
    median_error: float
    iterations: int


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting, in Python floats (deterministic)."""
    n = len(rhs)
    a = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0.0:
            return [0.0] * n
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            if factor:
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - math.fsum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


def _nnls(gram: list[list[float]], rhs: list[float]) -> list[float]:
    """Lawson-Hanson non-negative least squares on the normal equations ``G β = h``."""
    n = len(rhs)
    beta = [0.0] * n
    passive: list[int] = []
    tol = 1e-12 * max(1.0, max((abs(v) for v in rhs), default=0.0))
    for _ in range(3 * n + 3):
        grad = [rhs[j] - math.fsum(gram[j][i] * beta[i] for i in range(n)) for j in range(n)]
        free = [j for j in range(n) if j not in passive and grad[j] > tol]
        if not free:
            break
        passive.append(max(free, key=lambda j: grad[j]))
        for _ in range(3 * n + 3):
            idx = sorted(passive)
            sub = _solve([[gram[i][j] for j in idx] for i in idx], [rhs[i] for i in idx])
            z = [0.0] * n
            for i, value in zip(idx, sub, strict=True):
                z[i] = value
            if all(z[i] > 0.0 for i in idx):
                beta = z
                break
            # Step from beta towards z until the first coefficient reaches zero.
            blocking = [beta[i] / (beta[i] - z[i]) for i in idx if z[i] <= 0.0 < beta[i] - z[i]]
            alpha = min(blocking, default=0.0)
            beta = [b + alpha * (zz - b) for b, zz in zip(beta, z, strict=True)]
            passive = [i for i in idx if beta[i] > 0.0]
            if not passive:
                break
    return [max(b, 0.0) for b in beta]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def relative_errors(features: np.ndarray, seconds: np.ndarray, coef: Sequence[float]) -> np.ndarray:
    """``|seconds - features @ coef| / seconds`` per row."""
    predicted = features @ np.asarray(coef, dtype=np.float64)
    return np.abs(seconds - predicted) / seconds


def fit_coefficients(
    features: np.ndarray, seconds: np.ndarray, *, iterations: int = 12
) -> FitResult | None:
    """Robust non-negative fit of ``seconds ≈ features @ c`` on relative residuals.

    ``features`` is ``(n, k)``, ``seconds`` ``(n,)``, both finite with ``seconds > 0`` (the
    caller filters). Columns are scaled to unit size before solving and a tiny ridge keeps
    collinear features (``L²`` beside an attention term) from making the solve ill-posed.
    ``None`` when the rows cannot determine a model (every column zero).
    """
    n, k = features.shape
    if n == 0:
        return None
    relative = features / seconds[:, None]  # exact per element: IEEE division
    scales = [math.sqrt(math.fsum((relative[:, j] ** 2).tolist()) / n) for j in range(k)]
    used = [j for j in range(k) if scales[j] > 0.0 and math.isfinite(scales[j])]
    if not used:
        return None
    a = relative[:, used] / np.asarray([scales[j] for j in used])
    columns = [a[:, i] for i in range(len(used))]
    weights = np.ones(n, dtype=np.float64)
    beta = [0.0] * len(used)
    done = 0
    for done in range(1, iterations + 1):
        weighted = [c * weights for c in columns]
        gram = [
            [math.fsum((wi * cj).tolist()) for cj in columns] for wi in weighted
        ]
        ridge = _RIDGE * max(1.0, max((gram[i][i] for i in range(len(used))), default=0.0))
        for i in range(len(used)):
            gram[i][i] += ridge
        rhs = [math.fsum(w.tolist()) for w in weighted]
        new = _nnls(gram, rhs)
        residual = 1.0 - a @ np.asarray(new, dtype=np.float64)
        scale = 1.4826 * _median(np.abs(residual).tolist())
        cut = _HUBER * max(scale, 1e-9)
        magnitude = np.abs(residual)
        weights = np.where(magnitude <= cut, 1.0, cut / np.maximum(magnitude, 1e-300))
        if new == beta:
            break
        beta = new
    coef = [0.0] * k
    for i, j in enumerate(used):
        coef[j] = beta[i] / scales[j]
    median = _median(relative_errors(features, seconds, coef).tolist())
    return FitResult(coefficients=tuple(coef), median_error=median, iterations=done)


def best_scale(features: np.ndarray, seconds: np.ndarray, coef: Sequence[float]) -> float:
    """The common factor that best maps ``features @ coef`` onto ``seconds`` (median ratio)."""
    predicted = features @ np.asarray(coef, dtype=np.float64)
    ratios = [s / p for s, p in zip(seconds.tolist(), predicted.tolist(), strict=True) if p > 0.0]
    scale = _median(ratios)
    return scale if math.isfinite(scale) and scale > 0.0 else 1.0


# ---------------------------------------------------------------------------- the calibrator


@dataclass(frozen=True, slots=True)
class Decision:
    """What one refit decided (for statistics)."""

    step: int
    accepted: bool
    candidate_error: float
    current_error: float
    rows: int


class Calibrator:
    """The rows a balance group measured, and the coefficients they justify.

    Rows are ``[step, rank, bin, seconds, features...]`` (``bin = -1`` for a whole step).
    :meth:`add_rows` appends rows in the order given (callers pass a canonical order),
    keeping the last ``model.history``; :meth:`refit` fits, guards and installs. Both are
    pure functions of their inputs and of the calibrator's state, which :meth:`state` /
    :meth:`load_state` save and restore exactly.
    """

    def __init__(self, model: CalibratedCost) -> None:
        self.model = model
        self.rows = np.zeros((0, 4 + model.num_features), dtype=np.float64)
        self.num_refused = 0
        self.num_fits = 0
        self.num_accepted = 0
        self.decisions: list[Decision] = []

    @property
    def width(self) -> int:
        return 4 + self.model.num_features

    def add_rows(self, rows: np.ndarray) -> int:
        """Append valid rows; return how many were refused (non-finite, or seconds <= 0)."""
        if rows.size == 0:
            return 0
        finite = np.isfinite(rows).all(axis=1)
        valid = finite & (rows[:, 3] > 0.0) & (rows[:, 4:] >= 0.0).all(axis=1)
        refused = int(np.count_nonzero(~valid))
        self.num_refused += refused
        kept = rows[valid]
        if kept.size:
            self.rows = np.concatenate([self.rows, kept])[-self.model.history :]
        return refused

    def refit(self, step: int) -> Decision | None:
        """Fit the held rows; install the candidate if the guard accepts it."""
        rows = self.rows
        if len(rows) < self.model.min_rows:
            return None
        features, seconds = rows[:, 4:], rows[:, 3]
        held = np.arange(len(rows)) % 4 == 3
        train = ~held
        candidate = fit_coefficients(features[train], seconds[train])
        self.num_fits += 1
        current = self.model.coefficients
        # The model in force gets its best scale on the held-out rows themselves: an edge
        # that a candidate must overcome, so a change happens only on clear evidence.
        scale = best_scale(features[held], seconds[held], current)
        current_error = _median(
            relative_errors(features[held], seconds[held], [scale * c for c in current]).tolist()
        )
        accepted = False
        candidate_error = math.inf
        if candidate is not None:
            candidate_error = _median(
                relative_errors(features[held], seconds[held], candidate.coefficients).tolist()
            )
            usable = all(math.isfinite(c) for c in candidate.coefficients) and any(
                candidate.coefficients[1:]
            )
            accepted = usable and candidate_error < current_error
        if accepted:
            assert candidate is not None
            self.model.set_coefficients(candidate.coefficients)
            self.num_accepted += 1
        decision = Decision(step, accepted, candidate_error, current_error, len(rows))
        self.decisions = [*self.decisions[-63:], decision]
        return decision

    def snapshot(self) -> dict[str, Any]:
        """:meth:`state` with ``rows`` as the array itself (never changed in place: adding
        rows makes a new one), for cheap snapshots."""
        return {
            "coefficients": list(self.model.coefficients),
            "rows": self.rows,
            "refused": self.num_refused,
            "fits": self.num_fits,
            "accepted": self.num_accepted,
        }

    def state(self) -> dict[str, Any]:
        """Plain data that :meth:`load_state` restores exactly."""
        return {**self.snapshot(), "rows": self.rows.tolist()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.set_coefficients(state["coefficients"])
        rows = np.asarray(state["rows"], dtype=np.float64).reshape(-1, self.width)
        self.rows = rows[-self.model.history :]
        self.num_refused = int(state["refused"])
        self.num_fits = int(state["fits"])
        self.num_accepted = int(state["accepted"])
