"""Cost models: predicted compute of one sample, the quantity the planner balances.

A cost model is any callable ``SampleMetadata -> float`` returning a finite number ``>= 0``.
Costs are additive: a rank's predicted work is the sum of its samples' costs (a
:class:`ComponentCost` sums per component, then combines). A model should be deterministic,
cheap, CPU-only and must never mutate the metadata it reads. An optional ``model_id`` string
names its configuration; it enters build fingerprints, so ranks with differently configured
models refuse to run together.

The planner calls :func:`evaluate_costs` once per step, so evaluation errors are reported with
the sample they came from.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._planning.flops import FlopsCost
from evenflow.engine._validate import check_choice, check_number
from evenflow.engine.errors import ConfigError, PlanningError

__all__ = [
    "ComponentCost",
    "CostModel",
    "QuadraticCost",
    "TokenCost",
    "cost_model_id",
    "evaluate_components",
    "evaluate_costs",
    "resolve_cost_model",
]


@runtime_checkable
class CostModel(Protocol):
    """Predicted compute of one sample: ``model(meta) -> float``, finite and ``>= 0``.

    Implementations may expose ``model_id: str``, an identity that changes whenever the
    configuration changes (see :func:`cost_model_id`). ``isinstance(x, CostModel)`` only checks
    that ``x`` is callable.
    """

    def __call__(self, meta: SampleMetadata, /) -> float: ...


@dataclass(frozen=True, slots=True)
class TokenCost:
    """Cost = token count. Right when every token costs the same (short sequences, or models
    whose attention is a small share of the work)."""

    model_id = "tokens-v1"

    def __call__(self, meta: SampleMetadata) -> float:
        return float(meta.tokens)


@dataclass(frozen=True, slots=True)
class QuadraticCost:
    """Cost = ``linear·L + quadratic·L²`` with ``L`` the sample's token count.

    A dense transformer spends about ``12·hidden_size`` FLOPs-units per token in its linear
    layers for every unit a query-key pair costs in attention, so with ``quadratic=1`` the
    default ``linear=24576`` models a model about 2,048 wide. Only the ratio matters for
    balancing; use :class:`~evenflow.engine.FlopsCost` for a specific architecture.
    """

    linear: float = 24576.0
    quadratic: float = 1.0

    def __post_init__(self) -> None:
        linear = check_number("QuadraticCost.linear", self.linear, minimum=0.0)
        quadratic = check_number("QuadraticCost.quadratic", self.quadratic, minimum=0.0)
        if linear == 0.0 and quadratic == 0.0:
            raise ConfigError(
                "QuadraticCost.linear and QuadraticCost.quadratic are both 0, so every sample "
                "would cost 0; make at least one of them positive."
            )
        object.__setattr__(self, "linear", linear)
        object.__setattr__(self, "quadratic", quadratic)

    @property
    def model_id(self) -> str:
        return f"quadratic-v1(linear={self.linear!r},quadratic={self.quadratic!r})"

    def __call__(self, meta: SampleMetadata) -> float:
        length = float(meta.tokens)
        return self.linear * length + self.quadratic * length * length


class ComponentCost:
    """A cost with named components, e.g. ``{"encoder": ..., "llm": ...}``.

    ``reduce="sum"``: the components run one after another, so a rank's cost is the weighted
    sum. ``reduce="max"``: they run as parallel stages, so the slowest one bounds the rank and
    the rank cost is the largest weighted per-component sum — not the sum of per-sample
    scalars. ``weights`` maps component names to finite factors ``>= 0`` (missing names weigh
    1). The planner sums :meth:`evaluate` over a rank's samples and applies :meth:`combine`.
    """

    def __init__(
        self,
        components: Mapping[str, CostModel],
        *,
        reduce: Literal["sum", "max"] = "sum",
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if not isinstance(components, Mapping) or not components:
            raise ConfigError(
                "ComponentCost.components must be a non-empty mapping of component names to "
                f"cost models, but got {components!r:.80}."
            )
        for name, model in components.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"ComponentCost.components keys must be non-empty strings, but got {name!r}."
                )
            if not callable(model):
                raise TypeError(
                    f"ComponentCost.components[{name!r}] must be a cost model (a callable "
                    f"SampleMetadata -> float), but got {model!r:.80}."
                )
        self.reduce: str = check_choice("ComponentCost.reduce", reduce, ("sum", "max"))
        self.components: tuple[str, ...] = tuple(components)
        self._models: tuple[CostModel, ...] = tuple(components.values())
        given = {} if weights is None else _check_weights(weights, self.components)
        self.weights: tuple[float, ...] = tuple(given.get(name, 1.0) for name in self.components)
        if not any(self.weights):
            raise ConfigError(
                f"ComponentCost.weights are all 0 ({weights!r}), so every sample would cost 0; "
                "give at least one component a positive weight."
            )

    @property
    def models(self) -> tuple[CostModel, ...]:
        """The component models, in the order of :attr:`components`."""
        return self._models

    @property
    def model_id(self) -> str:
        parts = ",".join(
            f"{name}*{weight!r}={cost_model_id(model)}"
            for name, weight, model in zip(self.components, self.weights, self._models, strict=True)
        )
        return f"components-v1[{self.reduce}]({parts})"

    def evaluate(self, meta: SampleMetadata) -> tuple[float, ...]:
        """One unweighted cost per component, in the order of :attr:`components`."""
        return tuple(float(model(meta)) for model in self._models)

    def combine(self, values: Sequence[float] | np.ndarray) -> float:
        """Weighted sum, or maximum of weighted values, of one value per component."""
        if len(values) != len(self.weights):
            raise ConfigError(
                f"ComponentCost.combine expects {len(self.weights)} values (one per component "
                f"{self.components!r}), but got {len(values)}: {values!r:.80}."
            )
        weighted = [w * float(v) for w, v in zip(self.weights, values, strict=True)]
        return max(weighted) if self.reduce == "max" else sum(weighted)

    def __call__(self, meta: SampleMetadata) -> float:
        return self.combine(self.evaluate(meta))

    def __repr__(self) -> str:
        return f"ComponentCost({self.model_id})"


def _check_weights(weights: object, names: tuple[str, ...]) -> dict[str, float]:
    if not isinstance(weights, Mapping):
        raise ConfigError(
            f"ComponentCost.weights must be a mapping of component names to numbers, but got "
            f"{weights!r:.80}."
        )
    result: dict[str, float] = {}
    for name, weight in weights.items():
        if name not in names:
            raise ConfigError(
                f"ComponentCost.weights names an unknown component {name!r}; the components "
                f"are {names!r}."
            )
        result[name] = check_number(f"ComponentCost.weights[{name!r}]", weight, minimum=0.0)
    return result


_NAMED: dict[str, type[TokenCost] | type[QuadraticCost]] = {
    "tokens": TokenCost,
    "quadratic": QuadraticCost,
}
# Attributes every Hugging Face configuration object (or its text part) carries.
_HF_CONFIG_ATTRIBUTES: tuple[str, ...] = ("hidden_size", "num_hidden_layers", "text_config")


def resolve_cost_model(value: object) -> CostModel:
    """Turn the ``cost_model`` argument into a cost model.

    ``None`` → :class:`QuadraticCost` with defaults; ``"tokens"`` / ``"quadratic"`` → the named
    model; a mapping or a configuration object with ``to_dict()`` (a Hugging Face model
    config) → :class:`~evenflow.engine.FlopsCost`; a :class:`~evenflow.engine.CalibratedCost`
    → a fresh copy of it (its coefficients change as it calibrates, so every planner owns
    one); any other callable → itself.
    """
    if getattr(type(value), "_evenflow_calibrated", False):
        return value.for_planner()  # type: ignore[no-any-return, union-attr]
    if value is None:
        return QuadraticCost()
    if isinstance(value, str):
        factory = _NAMED.get(value)
        if factory is None:
            raise ConfigError(
                f"cost_model={value!r} is not a known name; use one of {list(_NAMED)!r}, a "
                "model config, or a callable SampleMetadata -> float."
            )
        return factory()
    if isinstance(value, Mapping):
        return FlopsCost(value)
    if callable(getattr(value, "to_dict", None)) and any(
        hasattr(value, name) for name in _HF_CONFIG_ATTRIBUTES
    ):
        return FlopsCost(value)
    if callable(value):
        return value
    raise TypeError(
        f"cost_model must be None, 'tokens', 'quadratic', a model config (a mapping or an "
        f"object with to_dict()), or a callable SampleMetadata -> float, but got "
        f"{type(value).__name__}: {value!r:.80}."
    )


def cost_model_id(model: object) -> str:
    """The identity of a cost model for fingerprints: its ``model_id``, else its qualified name.

    The fallback names only the code, not its configuration: a stateful model without a
    ``model_id`` cannot be told apart from a differently configured instance.
    """
    model_id = getattr(model, "model_id", None)
    if model_id is not None:
        if not isinstance(model_id, str) or not model_id:
            raise TypeError(
                f"cost_model.model_id must be a non-empty string, but got {model_id!r} on "
                f"{model!r:.80}."
            )
        return model_id
    # Functions carry their own qualified name; instances are named by their class.
    owner: Any = model if hasattr(model, "__qualname__") else type(model)
    return f"{owner.__module__}.{owner.__qualname__}"


def _describe(index: int, metas: Sequence[SampleMetadata], keys: Sequence[SampleKey] | None) -> str:
    where = f"sample {index}" if keys is None else f"sample {index} ({keys[index]})"
    return f"{where} with {metas[index].tokens} tokens"


def _check_value(value: object) -> float | None:
    """``float(value)`` for a finite real number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if number >= 0.0 and number < float("inf") else None


def _fill(
    out: np.ndarray,
    model: Any,
    metas: Sequence[SampleMetadata],
    keys: Sequence[SampleKey] | None,
    label: str,
) -> None:
    """Evaluate ``model`` into ``out``; name the model and the sample in every failure."""
    for i, meta in enumerate(metas):
        try:
            value = model(meta)
        except Exception as exc:
            exc.add_note(f"raised by {label} on {_describe(i, metas, keys)}")
            raise
        # Fast path: a plain finite non-negative float needs no further checks.
        if type(value) is float and 0.0 <= value < float("inf"):
            out[i] = value
            continue
        number = _check_value(value)
        if number is None:
            raise PlanningError(
                f"{label} returned {value!r:.80} ({type(value).__name__}) for "
                f"{_describe(i, metas, keys)}; a cost must be a finite number >= 0."
            )
        out[i] = number


def _check_inputs(metas: object, keys: Sequence[SampleKey] | None) -> Sequence[SampleMetadata]:
    if not isinstance(metas, Sequence):
        raise TypeError(f"metas must be a sequence of SampleMetadata, but got {metas!r:.80}.")
    if keys is not None and len(keys) != len(metas):
        raise ConfigError(
            f"keys must name every sample: got {len(keys)} keys for {len(metas)} samples."
        )
    return metas


def evaluate_costs(
    model: CostModel,
    metas: Sequence[SampleMetadata],
    *,
    keys: Sequence[SampleKey] | None = None,
    tokens: np.ndarray | None = None,
) -> np.ndarray:
    """Costs of ``metas`` as a float64 vector, validated.

    A result that is not a real number, or is NaN, infinite or negative, raises
    ``PlanningError`` naming the sample (its index, and its key when ``keys`` is given). An
    exception raised by the model propagates unchanged with a note naming the sample.

    ``tokens``, when given, must be the token counts of ``metas`` (an integer array of the
    same length, e.g. read once by the caller for other uses); :class:`TokenCost` and
    :class:`QuadraticCost` then compute from it without reading the metadata again. Other
    models ignore it.
    """
    metas = _check_inputs(metas, keys)
    if getattr(type(model), "_evenflow_calibrated", False):
        # A calibrated model evaluates its feature matrix in one pass.
        calibrated: Any = model
        return calibrated.evaluate(metas, keys=keys, tokens=tokens)  # type: ignore[no-any-return]
    if type(model) is TokenCost or type(model) is QuadraticCost:
        # Exact built-in models: one vectorised pass, same arithmetic order as their __call__.
        lengths = _token_vector(metas, tokens)
        if not isinstance(model, QuadraticCost):
            return lengths
        with np.errstate(over="ignore"):
            costs: np.ndarray = model.linear * lengths + model.quadratic * lengths * lengths
        if np.isfinite(costs).all():
            return costs
        # Astronomical token counts overflow; the per-sample path below names the sample.
    out = np.empty(len(metas), dtype=np.float64)
    _fill(out, model, metas, keys, f"cost model {cost_model_id(model)!r}")
    return out


def _token_vector(metas: Sequence[SampleMetadata], tokens: np.ndarray | None) -> np.ndarray:
    """Token counts of ``metas`` as float64, from ``tokens`` when the caller has them."""
    if tokens is None:
        return np.fromiter((m.tokens for m in metas), dtype=np.float64, count=len(metas))
    given = np.asarray(tokens)
    if given.shape != (len(metas),) or given.dtype.kind not in "iu":
        raise ConfigError(
            f"tokens must be an integer vector with one entry per sample ({len(metas)}), but "
            f"got shape {given.shape} and dtype {given.dtype}; pass the samples' token counts "
            "or None."
        )
    return given.astype(np.float64)


def evaluate_components(
    model: ComponentCost,
    metas: Sequence[SampleMetadata],
    *,
    keys: Sequence[SampleKey] | None = None,
) -> np.ndarray:
    """Per-component costs of ``metas``: float64 array of shape ``(n, len(model.components))``,
    validated like :func:`evaluate_costs` (errors also name the component)."""
    if not isinstance(model, ComponentCost):
        raise TypeError(
            f"evaluate_components needs a ComponentCost, but got {model!r:.80}; use "
            "evaluate_costs for a scalar cost model."
        )
    metas = _check_inputs(metas, keys)
    out = np.empty((len(model.components), len(metas)), dtype=np.float64)
    for row, name, component in zip(out, model.components, model.models, strict=True):
        _fill(row, component, metas, keys, f"component {name!r} ({cost_model_id(component)!r})")
    return np.ascontiguousarray(out.T)
