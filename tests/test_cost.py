from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.models import mla_config

from evenflow.engine import SampleMetadata
from evenflow.engine._planning.cost import (
    cost_model_id,
    evaluate_components,
    evaluate_costs,
    resolve_cost_model,
)
from evenflow.engine.errors import ConfigError, PlanningError
from evenflow.engine.planning import (
    ComponentCost,
    CostModel,
    FlopsCost,
    QuadraticCost,
    SampleKey,
    TokenCost,
)

_MLA_CONFIG: dict[str, Any] = mla_config()


def _metas(*tokens: int) -> list[SampleMetadata]:
    return [SampleMetadata(tokens=n) for n in tokens]


def _media(meta: SampleMetadata) -> float:
    return float(meta.features.get("media", 0))


# --- built-in models ----------------------------------------------------------------------


def test_token_cost() -> None:
    cost = TokenCost()
    assert cost(SampleMetadata(tokens=7)) == 7.0
    assert type(cost(SampleMetadata(tokens=7))) is float
    assert cost.model_id == "tokens-v1"
    assert isinstance(cost, CostModel)


def test_quadratic_cost_defaults_and_values() -> None:
    cost = QuadraticCost()
    assert (cost.linear, cost.quadratic) == (24576.0, 1.0)
    assert cost(SampleMetadata(tokens=10)) == 24576.0 * 10 + 100
    custom = QuadraticCost(linear=2, quadratic=0.5)
    assert custom(SampleMetadata(tokens=4)) == 2 * 4 + 0.5 * 16
    assert QuadraticCost(linear=0.0)(SampleMetadata(tokens=3)) == 9.0
    assert QuadraticCost(quadratic=0)(SampleMetadata(tokens=3)) == 3 * 24576.0


def test_quadratic_model_id_names_the_coefficients() -> None:
    assert QuadraticCost(linear=2, quadratic=0.5).model_id == (
        "quadratic-v1(linear=2.0,quadratic=0.5)"
    )
    assert QuadraticCost().model_id != QuadraticCost(linear=4096).model_id
    assert QuadraticCost(linear=4096) == QuadraticCost(linear=4096.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"linear": -1.0}, r"QuadraticCost\.linear must be >= 0"),
        ({"quadratic": math.nan}, r"QuadraticCost\.quadratic must be finite"),
        ({"linear": math.inf}, r"QuadraticCost\.linear must be finite"),
        ({"quadratic": True}, r"QuadraticCost\.quadratic must be a number"),
        ({"linear": "1"}, r"QuadraticCost\.linear must be a number"),
        ({"linear": 0, "quadratic": 0.0}, "both 0"),
    ],
)
def test_quadratic_cost_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        QuadraticCost(**kwargs)


# --- components ---------------------------------------------------------------------------


def test_component_cost_sum_and_weights() -> None:
    cost = ComponentCost({"encoder": _media, "llm": TokenCost()}, weights={"encoder": 2.0})
    meta = SampleMetadata(tokens=5, features={"media": 3})
    assert cost.components == ("encoder", "llm")
    assert cost.weights == (2.0, 1.0)
    assert cost.evaluate(meta) == (3.0, 5.0)
    assert cost.combine([3.0, 5.0]) == 11.0
    assert cost(meta) == 11.0
    assert cost.combine(np.array([1.0, 0.5])) == 2.5


def test_component_cost_max_bounds_by_slowest_stage() -> None:
    cost = ComponentCost({"encoder": _media, "llm": TokenCost()}, reduce="max")
    a = SampleMetadata(tokens=10, features={"media": 1})
    b = SampleMetadata(tokens=1, features={"media": 8})
    assert cost(a) == 10.0
    assert cost(b) == 8.0
    # The rank cost combines per-component sums: max(9, 11) = 11, not 10 + 8.
    sums = np.asarray(cost.evaluate(a)) + np.asarray(cost.evaluate(b))
    assert cost.combine(sums) == 11.0
    weighted = ComponentCost(
        {"encoder": _media, "llm": TokenCost()}, reduce="max", weights={"llm": 0.5}
    )
    assert weighted(a) == 5.0


def test_component_model_id_lists_components() -> None:
    cost = ComponentCost({"encoder": _media, "llm": QuadraticCost()}, weights={"llm": 3})
    assert cost.model_id == (
        "components-v1[sum](encoder*1.0=tests.test_cost._media,"
        "llm*3.0=quadratic-v1(linear=24576.0,quadratic=1.0))"
    )
    assert (
        ComponentCost({"llm": TokenCost()}, reduce="max").model_id
        != ComponentCost({"llm": TokenCost()}).model_id
    )
    assert cost_model_id(cost) == cost.model_id


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (({},), {}, ConfigError, "non-empty mapping"),
        (([("llm", TokenCost())],), {}, ConfigError, "non-empty mapping"),
        (({"": TokenCost()},), {}, ConfigError, "non-empty strings"),
        (({1: TokenCost()},), {}, ConfigError, "non-empty strings"),
        (({"llm": 3.0},), {}, TypeError, r"components\['llm'\] must be a cost model"),
        (({"llm": TokenCost()},), {"reduce": "mean"}, ConfigError, "reduce must be one of"),
        (({"llm": TokenCost()},), {"weights": [1.0]}, ConfigError, "weights must be a mapping"),
        (
            ({"llm": TokenCost()},),
            {"weights": {"vit": 1.0}},
            ConfigError,
            "unknown component 'vit'",
        ),
        (({"llm": TokenCost()},), {"weights": {"llm": -1}}, ConfigError, r"weights\['llm'\]"),
        (({"llm": TokenCost()},), {"weights": {"llm": math.nan}}, ConfigError, "finite"),
        (({"llm": TokenCost()},), {"weights": {"llm": True}}, ConfigError, "a number"),
        (({"llm": TokenCost()},), {"weights": {"llm": 0}}, ConfigError, "all 0"),
    ],
)
def test_component_cost_validation(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ComponentCost(*args, **kwargs)


def test_combine_checks_the_number_of_values() -> None:
    cost = ComponentCost({"a": TokenCost(), "b": TokenCost()})
    with pytest.raises(ConfigError, match="expects 2 values"):
        cost.combine([1.0])


# --- resolution and identity --------------------------------------------------------------


class _HFConfig:
    def __init__(self) -> None:
        self.hidden_size = 8
        self.num_hidden_layers = 1

    def to_dict(self) -> dict[str, Any]:
        return dict(_MLA_CONFIG)


class _Stateful:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.model_id = f"stateful-v1({scale})"

    def __call__(self, meta: SampleMetadata) -> float:
        return self.scale * meta.tokens


def test_resolve_cost_model() -> None:
    assert resolve_cost_model(None) == QuadraticCost()
    assert resolve_cost_model("tokens") == TokenCost()
    assert resolve_cost_model("quadratic") == QuadraticCost()
    flops = resolve_cost_model(_MLA_CONFIG)
    assert isinstance(flops, FlopsCost)
    assert flops(SampleMetadata(tokens=4, features={"P": 2, "D": 2})) == 15552
    from_object = resolve_cost_model(_HFConfig())
    assert isinstance(from_object, FlopsCost)
    assert from_object.model_id == flops.model_id
    custom = _Stateful(2.0)
    assert resolve_cost_model(custom) is custom
    assert resolve_cost_model(_media) is _media


def test_resolve_rejects_unknown_names_and_non_callables() -> None:
    with pytest.raises(ConfigError, match=r"cost_model='flops' is not a known name.*'tokens'"):
        resolve_cost_model("flops")
    with pytest.raises(TypeError, match=r"cost_model must be None, 'tokens'.*int: 5"):
        resolve_cost_model(5)

    class _OnlyToDict:
        def to_dict(self) -> dict[str, int]:
            return {}

    with pytest.raises(TypeError, match="cost_model must be"):
        resolve_cost_model(_OnlyToDict())


def test_cost_model_id() -> None:
    assert cost_model_id(TokenCost()) == "tokens-v1"
    assert cost_model_id(_Stateful(2.0)) == "stateful-v1(2.0)"
    assert cost_model_id(_media) == "tests.test_cost._media"

    class _Plain:
        def __call__(self, meta: SampleMetadata) -> float:
            return 1.0

    assert cost_model_id(_Plain()) == f"{__name__}.{_Plain.__qualname__}"
    assert cost_model_id(lambda m: 1.0).endswith("<lambda>")
    bad = _Stateful(1.0)
    bad.model_id = ""
    with pytest.raises(TypeError, match="model_id must be a non-empty string"):
        cost_model_id(bad)


# --- evaluation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [TokenCost(), QuadraticCost(), QuadraticCost(linear=3, quadratic=0.25), _Stateful(0.5)],
)
def test_evaluate_costs_matches_per_sample_calls(model: Callable[[SampleMetadata], float]) -> None:
    metas = _metas(1, 7, 4096, 3, 100_000)
    costs = evaluate_costs(model, metas)
    assert costs.dtype == np.float64
    assert costs.shape == (5,)
    assert costs.tolist() == [float(model(m)) for m in metas]
    assert evaluate_costs(model, []).shape == (0,)


@given(st.lists(st.integers(1, 10**7), max_size=30), st.floats(0, 1e6), st.floats(0.001, 10))
def test_vectorised_quadratic_equals_scalar(tokens: list[int], linear: float, quad: float) -> None:
    model = QuadraticCost(linear=linear, quadratic=quad)
    metas = _metas(*tokens)
    assert evaluate_costs(model, metas).tolist() == [model(m) for m in metas]


def test_evaluate_costs_accepts_numpy_and_integer_results() -> None:
    values: list[object] = [np.float32(1.5), np.int64(2), 3, Fraction(1, 2), 0.0]
    costs = evaluate_costs(lambda m: values[m.tokens - 1], _metas(1, 2, 3, 4, 5))  # type: ignore[arg-type, return-value]
    assert costs.tolist() == [1.5, 2.0, 3.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-1.0, "-1.0"),
        (-2, "-2"),
        ("3", "'3'"),
        (None, "None"),
        (True, "True"),
        (np.float64("nan"), r"np.float64\(nan\)"),
        ([1.0], r"\[1.0\]"),
    ],
)
def test_evaluate_costs_rejects_bad_values_naming_the_sample(bad: object, shown: str) -> None:
    def model(meta: SampleMetadata) -> Any:
        return bad if meta.tokens == 3 else 1.0

    metas = _metas(1, 2, 3, 4)
    with pytest.raises(PlanningError, match=rf"returned {shown} .* sample 2 with 3 tokens"):
        evaluate_costs(model, metas)
    keys = [SampleKey(0, 5, i) for i in range(4)]
    with pytest.raises(PlanningError, match=r"sample 2 \(SampleKey\(source_rank=0, step=5"):
        evaluate_costs(model, metas, keys=keys)


def test_model_exceptions_propagate_with_a_note() -> None:
    def model(meta: SampleMetadata) -> float:
        if meta.tokens == 2:
            raise KeyError("length")
        return 1.0

    with pytest.raises(KeyError) as info:
        evaluate_costs(model, _metas(1, 2))
    assert any("sample 1 with 2 tokens" in note for note in info.value.__notes__)
    flops = FlopsCost(_MLA_CONFIG)
    bad = [SampleMetadata(tokens=4, features={"P": 1, "D": 1})]
    with pytest.raises(ConfigError, match="P \\+ D must equal tokens") as config_info:
        evaluate_costs(flops, bad)
    assert any(flops.model_id in note for note in config_info.value.__notes__)


def test_evaluate_costs_checks_its_inputs() -> None:
    with pytest.raises(TypeError, match="metas must be a sequence"):
        evaluate_costs(TokenCost(), iter(_metas(1)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got 1 keys for 2 samples"):
        evaluate_costs(TokenCost(), _metas(1, 2), keys=[SampleKey(0, 0, 0)])


def test_quadratic_overflow_is_reported_not_returned() -> None:
    model = QuadraticCost(linear=0, quadratic=1e300)
    with pytest.raises(PlanningError, match=r"returned inf .* sample 1"):
        evaluate_costs(model, _metas(1, 10**6))


def test_evaluate_components() -> None:
    cost = ComponentCost({"encoder": _media, "llm": TokenCost()}, reduce="max")
    metas = [
        SampleMetadata(tokens=5, features={"media": 2}),
        SampleMetadata(tokens=1, features={"media": 9}),
        SampleMetadata(tokens=4),
    ]
    matrix = evaluate_components(cost, metas)
    assert matrix.dtype == np.float64
    assert matrix.shape == (3, 2)
    assert matrix.flags.c_contiguous
    assert matrix.tolist() == [[2.0, 5.0], [9.0, 1.0], [0.0, 4.0]]
    assert [cost.combine(row) for row in matrix] == [cost(m) for m in metas]
    assert evaluate_costs(cost, metas).tolist() == [5.0, 9.0, 4.0]
    assert evaluate_components(cost, []).shape == (0, 2)


def test_evaluate_components_validates() -> None:
    cost = ComponentCost({"encoder": lambda m: -float(m.tokens), "llm": TokenCost()})
    with pytest.raises(PlanningError, match=r"component 'encoder' .* returned -1.0 .* sample 0"):
        evaluate_components(cost, _metas(1))
    with pytest.raises(TypeError, match="needs a ComponentCost"):
        evaluate_components(TokenCost(), _metas(1))  # type: ignore[arg-type]


def test_evaluation_never_mutates_metadata() -> None:
    features = {"media": 3, "P": 4, "D": 0, "runs": [1, 2]}
    meta = SampleMetadata(tokens=4, features=features)
    models: list[Any] = [
        TokenCost(),
        QuadraticCost(),
        FlopsCost(_MLA_CONFIG),
        ComponentCost({"encoder": _media, "llm": TokenCost()}),
    ]
    for model in models:
        evaluate_costs(model, [meta])
    evaluate_components(models[-1], [meta])
    assert meta.features == {"media": 3, "P": 4, "D": 0, "runs": [1, 2]}
    assert meta.features is features


@pytest.mark.parametrize("model", [TokenCost(), QuadraticCost(linear=3.0, quadratic=0.5)])
def test_evaluate_costs_from_a_tokens_array_equals_reading_the_metadata(model: Any) -> None:
    metas = _metas(1, 7, 300, 2)
    tokens = np.array([m.tokens for m in metas], dtype=np.int64)
    expected = evaluate_costs(model, metas)
    given = evaluate_costs(model, metas, tokens=tokens)
    assert given.tolist() == expected.tolist() == [model(m) for m in metas]


def test_evaluate_costs_rejects_a_tokens_array_of_the_wrong_shape() -> None:
    with pytest.raises(ConfigError, match="tokens must be an integer vector"):
        evaluate_costs(TokenCost(), _metas(1, 2), tokens=np.array([1], dtype=np.int64))
    with pytest.raises(ConfigError, match="dtype float64"):
        evaluate_costs(TokenCost(), _metas(1, 2), tokens=np.array([1.0, 2.0]))
