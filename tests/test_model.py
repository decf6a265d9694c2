from __future__ import annotations

import pytest

from evenflow.engine import SampleMetadata
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import PackingConstraints, SampleKey


def test_sample_key_is_ordered_by_rank_step_index() -> None:
    keys = [SampleKey(1, 0, 0), SampleKey(0, 2, 1), SampleKey(0, 2, 0)]
    assert sorted(keys) == [SampleKey(0, 2, 0), SampleKey(0, 2, 1), SampleKey(1, 0, 0)]
    assert SampleKey.from_tuple(SampleKey(3, 4, 5).as_tuple()) == SampleKey(3, 4, 5)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "0", None])
@pytest.mark.parametrize("field", ["source_rank", "step", "index"])
def test_sample_key_rejects_non_natural_fields(field: str, bad: object) -> None:
    args: dict[str, object] = {"source_rank": 0, "step": 0, "index": 0, field: bad}
    with pytest.raises(ConfigError, match=f"SampleKey.{field} must be a non-negative integer"):
        SampleKey(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_metadata_tokens_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"SampleMetadata\.tokens"):
        SampleMetadata(tokens=bad)  # type: ignore[arg-type]


def test_metadata_features_accept_plain_trees() -> None:
    meta = SampleMetadata(tokens=3, features={"P": 1, "D": 2, "runs": [1, (2, 3)], "x": None})
    assert SampleMetadata.from_wire(meta.to_wire()) == meta


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ({"t": object()}, "CPU basic types"),
        ({1: 2}, "keys must be strings"),
        ({"f": float("nan")}, "must be finite"),
        ({"a": {"b": [1, 2.5, {"c": b"x"}]}}, r"\['a'\]\['b'\]\[2\]\['c'\]"),
    ],
)
def test_metadata_features_reject_non_plain_values(features: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SampleMetadata(tokens=1, features=features)  # type: ignore[arg-type]


def test_metadata_features_reject_cycles() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="reference cycles"):
        SampleMetadata(tokens=1, features={"loop": loop})


def test_metadata_features_reject_tensors() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match="Tensor"):
        SampleMetadata(tokens=1, features={"t": torch.zeros(1)})


@pytest.mark.parametrize("bad", [{"": 1.0}, {"img": -1.0}, {"img": float("inf")}, {"img": True}])
def test_packing_costs_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="packing_costs"):
        SampleMetadata(tokens=1, packing_costs=bad)  # type: ignore[arg-type]


def test_constraints_validate_their_fields() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        PackingConstraints(seq_len=0)
    with pytest.raises(ConfigError, match="oversized_policy"):
        PackingConstraints(seq_len=8, oversized_policy="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="packing_budgets"):
        PackingConstraints(seq_len=8, packing_budgets={"img": -2})


def test_fits_respects_tokens_budgets_and_oversized_policy() -> None:
    key = SampleKey(0, 0, 0)
    strict = PackingConstraints(seq_len=10, packing_budgets={"img": 4})
    small = SampleMetadata(tokens=4, packing_costs={"img": 2})
    assert strict.fits(6, {"img": 1}, small)
    assert not strict.fits(7, {}, small)
    assert not strict.fits(0, {"img": 3}, small)
    big = SampleMetadata(tokens=12, packing_costs={"img": 0})
    with pytest.raises(ConfigError, match="requires 12 tokens, exceeding seq_len=10"):
        strict.validate_sample(key, big)
    single = PackingConstraints(seq_len=10, oversized_policy="single", packing_budgets={"img": 4})
    assert single.fits(0, {}, big)
    assert not single.fits(1, {}, big)
    with pytest.raises(ConfigError, match="missing packing_costs"):
        single.validate_sample(key, SampleMetadata(tokens=1))
    with pytest.raises(ConfigError, match="exceeding packing_budgets"):
        single.validate_sample(key, SampleMetadata(tokens=1, packing_costs={"img": 5}))
    assert strict.validate_bin([(key, small), (SampleKey(0, 0, 1), small)]) == 8
    with pytest.raises(ConfigError, match="cannot admit sample"):
        strict.validate_bin([(SampleKey(0, 0, i), small) for i in range(3)])
