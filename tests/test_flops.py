from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testkit.models import mla_config

from evenflow.engine import SampleMetadata
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import FlopsCost


def _gqa(**overrides: Any) -> dict[str, Any]:
    """A small grouped-query model: hidden 8, 2 heads of size 4, dense SwiGLU 16."""
    config: dict[str, Any] = {
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    config.update(overrides)
    return config


def _meta(tokens: int, **features: Any) -> SampleMetadata:
    return SampleMetadata(tokens=tokens, features=features)


class _HFConfig:
    """Stands in for a transformers configuration object."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data
        self.hidden_size = data.get("hidden_size")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)


def test_reference_vector() -> None:
    cost = FlopsCost(mla_config())
    assert cost.linear_flops_per_token == 1216
    assert cost.attention_flops_per_pair == 32
    meta = _meta(4, P=2, D=2)
    # pairs = P*P/2 + D*(P + D) = 2 + 8 = 10
    assert cost.forward_flops(meta) == 1216 * 4 + 32 * 10 == 5184
    assert cost(meta) == 15552
    assert cost.training_multiplier == 3.0


@pytest.mark.parametrize(("multiplier", "expected"), [(1.0, 5184.0), (4, 20736.0), (0.5, 2592.0)])
def test_training_multiplier_scales_forward(multiplier: float, expected: float) -> None:
    assert FlopsCost(mla_config(), training_multiplier=multiplier)(_meta(4, P=2, D=2)) == expected


def test_without_split_the_whole_sample_is_a_causal_prefix() -> None:
    cost = FlopsCost(mla_config())
    assert cost.forward_flops(_meta(4)) == 1216 * 4 + 32 * 8
    assert cost.forward_flops(_meta(4, P=4, D=0)) == cost.forward_flops(_meta(4))
    assert cost.forward_flops(_meta(4, other="ignored")) == cost.forward_flops(_meta(4))


def test_low_rank_query_projection() -> None:
    # Q = H*Rq + Rq*A*(d_n+d_r) = 24 + 24; Proj = 48 + 8*6 + 4*2*6 + 2*4*8 = 208.
    cost = FlopsCost(mla_config(q_lora_rank=3))
    assert cost.linear_flops_per_token == 2 * (208 + 3 * 8 * 16)
    assert cost.attention_flops_per_pair == 32


def test_latent_attention_accepts_consistent_qk_head_dim_and_ignores_head_dim() -> None:
    base = FlopsCost(mla_config())
    other = FlopsCost(mla_config(qk_head_dim=4, head_dim=2, num_key_value_heads=2))
    assert other.linear_flops_per_token == base.linear_flops_per_token
    assert other.model_id == base.model_id


def test_multi_head_attention_defaults() -> None:
    # KV = A = 2, d = 8/2 = 4: four 8x8 projections (256 MACs) + SwiGLU 384.
    cost = FlopsCost(_gqa())
    assert cost.linear_flops_per_token == 2 * (256 + 384)
    assert cost.attention_flops_per_pair == 2 * 2 * (4 + 4)
    assert cost.forward_flops(_meta(6)) == 1280 * 6 + 32 * 18


def test_grouped_query_attention_two_layers() -> None:
    cost = FlopsCost(
        _gqa(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        | {"intermediate_size": 32}
    )
    # d = 4: q 16*4*4 + k,v 2*16*2*4 + o 4*4*16 = 768 MACs; SwiGLU 3*16*32 = 1536.
    assert cost.linear_flops_per_token == 2 * 2 * (768 + 1536)
    assert cost.attention_flops_per_pair == 2 * 2 * 4 * (4 + 4)


def test_explicit_head_dim_need_not_divide_hidden() -> None:
    cost = FlopsCost(_gqa(hidden_size=10, num_attention_heads=4, num_key_value_heads=1, head_dim=8))
    # q 10*4*8 + k,v 2*10*1*8 + o 4*8*10 = 800; SwiGLU 3*10*16 = 480.
    assert cost.linear_flops_per_token == 2 * (800 + 480)
    assert cost.attention_flops_per_pair == 2 * 4 * 16


def test_explicit_defaults_give_the_same_identity() -> None:
    plain = FlopsCost(_gqa())
    spelled = FlopsCost(
        _gqa(num_key_value_heads=2, head_dim=4, sliding_window=None, attn_block_mode=None)
    )
    assert spelled.model_id == plain.model_id
    assert spelled.linear_flops_per_token == plain.linear_flops_per_token


# --- mixture of experts -------------------------------------------------------------------


def _moe(**overrides: Any) -> dict[str, Any]:
    config = _gqa(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    config.update(overrides)
    return config


def test_explicit_mlp_layer_types_with_shared_experts() -> None:
    cost = FlopsCost(
        _moe(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], n_shared_experts=1)
    )
    sparse = 3 * 8 * 6 * (2 + 1) + 8 * 4  # routed top-2 + 1 shared + router
    assert cost.linear_flops_per_token == 2 * (3 * 256 + 384 + 2 * sparse)
    assert cost.resolved_fields["mlp_layer_types"] == ["dense", "sparse", "sparse"]


def test_all_layers_sparse_by_default_and_dense_size_not_needed() -> None:
    config = _moe(num_hidden_layers=2)
    del config["intermediate_size"]
    cost = FlopsCost(config)
    assert cost.linear_flops_per_token == 2 * (2 * 256 + 2 * (3 * 8 * 6 * 2 + 8 * 4))
    assert cost.resolved_fields["mlp_layer_types"] == ["sparse", "sparse"]


def test_first_k_dense_replace_with_layer_frequency() -> None:
    cost = FlopsCost(_moe(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2))
    assert cost.resolved_fields["mlp_layer_types"] == [
        "dense",
        "dense",
        "sparse",
        "dense",
        "sparse",
    ]
    sparse = 3 * 8 * 6 * 2 + 8 * 4
    assert cost.linear_flops_per_token == 2 * (5 * 256 + 3 * 384 + 2 * sparse)


def test_decoder_sparse_step_and_mlp_only_layers() -> None:
    config = _gqa(
        num_hidden_layers=6,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        shared_expert_intermediate_size=10,
    )
    cost = FlopsCost(config)
    kinds = cost.resolved_fields["mlp_layer_types"]
    assert [i for i, kind in enumerate(kinds) if kind == "sparse"] == [1, 5]
    sparse = 3 * 8 * (6 * 1 + 10) + 8 * 4  # one shared expert of its own width
    assert cost.linear_flops_per_token == 2 * (6 * 256 + 4 * 384 + 2 * sparse)


def test_mlp_layer_types_take_precedence_over_derived_patterns() -> None:
    cost = FlopsCost(
        _moe(num_hidden_layers=2, mlp_layer_types=["sparse", "dense"], first_k_dense_replace=2)
    )
    assert cost.resolved_fields["mlp_layer_types"] == ["sparse", "dense"]


def test_no_experts_means_dense_even_with_moe_pattern_keys() -> None:
    plain = FlopsCost(_gqa(num_hidden_layers=2))
    cost = FlopsCost(
        _gqa(num_hidden_layers=2, n_routed_experts=None, first_k_dense_replace=1, num_experts=0)
    )
    assert cost.linear_flops_per_token == plain.linear_flops_per_token


def test_equal_expert_counts_under_several_names_are_accepted() -> None:
    one = FlopsCost(_moe())
    both = FlopsCost(_moe(num_local_experts=4))
    assert both.linear_flops_per_token == one.linear_flops_per_token


# --- sliding window -----------------------------------------------------------------------


def _window_pairs(n: float, w: float) -> float:
    return n * n / 2 if n <= w else w * n - w * w / 2


def test_sliding_layers_cap_pairs_from_layer_types() -> None:
    cost = FlopsCost(
        _gqa(
            num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
        )
    )
    linear = 2 * 2 * (256 + 384)
    assert cost.linear_flops_per_token == linear
    assert cost.attention_flops_per_pair == 2 * 32
    # n=10 > w=4: full layer 50 pairs, sliding layer 4*10 - 8 = 32 pairs.
    assert cost.forward_flops(_meta(10)) == linear * 10 + 32 * 50 + 32 * 32
    # n=3 <= w: both layers see 4.5 pairs.
    assert cost.forward_flops(_meta(3)) == linear * 3 + 2 * 32 * 4.5


def test_use_sliding_window_applies_to_every_layer() -> None:
    cost = FlopsCost(_gqa(num_hidden_layers=3, use_sliding_window=True, sliding_window=5))
    linear = cost.linear_flops_per_token
    for n in (1, 4, 5, 6, 100):
        assert cost.forward_flops(_meta(n)) == pytest.approx(
            linear * n + 3 * 32 * _window_pairs(n, 5)
        )
    off = FlopsCost(_gqa(num_hidden_layers=3, use_sliding_window=False, sliding_window=5))
    assert off.forward_flops(_meta(100)) == linear * 100 + 3 * 32 * 5000


def test_window_with_generated_tokens() -> None:
    cost = FlopsCost(_gqa(use_sliding_window=True, sliding_window=4))
    # Prefix P=6 is causal under the window (16 pairs); each of D=4 queries sees min(10, 4).
    assert cost.forward_flops(_meta(10, P=6, D=4)) == 1280 * 10 + 32 * (16 + 4 * 4)


@given(
    prefix=st.integers(0, 300),
    generated=st.integers(0, 300),
    extra=st.integers(0, 50),
)
def test_window_covering_the_sample_changes_nothing(
    prefix: int, generated: int, extra: int
) -> None:
    tokens = prefix + generated
    if tokens == 0:
        return
    meta = _meta(tokens, P=prefix, D=generated)
    full = FlopsCost(_gqa(num_hidden_layers=2))
    sliding = FlopsCost(
        _gqa(num_hidden_layers=2, use_sliding_window=True, sliding_window=tokens + extra)
    )
    narrow = FlopsCost(_gqa(num_hidden_layers=2, use_sliding_window=True, sliding_window=1))
    assert sliding.forward_flops(meta) == pytest.approx(full.forward_flops(meta))
    assert narrow.forward_flops(meta) <= full.forward_flops(meta)


# --- multimodal split ---------------------------------------------------------------------


def test_prepend_adds_one_timestep_token_only_with_generated_tokens() -> None:
    cost = FlopsCost(mla_config(diff_time_embed_mode="prepend"))
    # D' = 3: pairs = 2 + 3*5 = 17 over 5 positions.
    assert cost.forward_flops(_meta(4, P=2, D=2)) == 1216 * 5 + 32 * 17
    assert cost.forward_flops(_meta(4, P=4, D=0)) == 1216 * 4 + 32 * 8
    for mode in ("add", "adaln"):
        assert (
            FlopsCost(mla_config(diff_time_embed_mode=mode)).forward_flops(_meta(4, P=2, D=2))
            == 5184
        )


def test_blockmask_adds_bidirectional_image_blocks() -> None:
    cost = FlopsCost(mla_config(attn_block_mode="blockmask"))
    meta = _meta(8, P=6, D=2, cond_image_token_lengths=[2, 3])
    pairs = 6 * 6 / 2 + 2 * 8 + 0.5 * (4 + 9)
    assert cost.forward_flops(meta) == 1216 * 8 + 32 * pairs
    no_images = _meta(8, P=6, D=2, cond_image_token_lengths=[])
    assert cost.forward_flops(no_images) == 1216 * 8 + 32 * (18 + 16)
    # In the default "tail" mode the run lengths are not used.
    assert FlopsCost(mla_config()).forward_flops(meta) == cost.forward_flops(no_images)


def test_modes_are_read_from_the_top_level_and_backbone_from_text_config() -> None:
    nested = {
        "hidden_size": 999,
        "attn_block_mode": "blockmask",
        "diff_time_embed_mode": "prepend",
        "text_config": mla_config(),
    }
    cost = FlopsCost(nested)
    assert cost.linear_flops_per_token == 1216
    meta = _meta(4, P=2, D=2, cond_image_token_lengths=[2])
    assert cost.forward_flops(meta) == 1216 * 5 + 32 * (17 + 2)
    inner_modes = FlopsCost({"text_config": mla_config(attn_block_mode="blockmask")})
    assert inner_modes.forward_flops(meta) == 5184


def test_configuration_objects_with_to_dict() -> None:
    direct = FlopsCost(mla_config())
    assert FlopsCost(_HFConfig(mla_config())).model_id == direct.model_id
    wrapped = FlopsCost({"text_config": _HFConfig(mla_config())})
    assert wrapped.model_id == direct.model_id
    assert wrapped(_meta(4, P=2, D=2)) == 15552


# --- identity -----------------------------------------------------------------------------


def test_model_id_format_and_sensitivity() -> None:
    base = FlopsCost(mla_config())
    assert re.fullmatch(r"flops-v1-[0-9a-f]{16}", base.model_id)
    reordered = FlopsCost(dict(reversed(list(mla_config().items()))))
    assert reordered.model_id == base.model_id
    assert FlopsCost(mla_config(), training_multiplier=1.0).model_id != base.model_id
    assert FlopsCost(mla_config(intermediate_size=17)).model_id != base.model_id
    assert FlopsCost(mla_config(q_lora_rank=3)).model_id != base.model_id
    assert FlopsCost(mla_config(diff_time_embed_mode="prepend")).model_id != base.model_id
    assert base.model_id in repr(base)


def test_resolved_fields_is_a_copy() -> None:
    cost = FlopsCost(_moe(num_hidden_layers=2))
    fields = cost.resolved_fields
    fields["mlp_layer_types"].append("dense")
    fields["hidden_size"] = 1
    assert cost.resolved_fields["mlp_layer_types"] == ["sparse", "sparse"]
    assert cost.resolved_fields["hidden_size"] == 8


def test_metadata_and_config_are_never_mutated() -> None:
    config = {"attn_block_mode": "blockmask", "text_config": mla_config()}
    config_before = copy.deepcopy(config)
    cost = FlopsCost(config)
    runs = [1, 2]
    meta = _meta(7, P=5, D=2, cond_image_token_lengths=runs, extra={"a": [1, 2]})
    before = copy.deepcopy(meta.features)
    cost(meta)
    cost.forward_flops(meta)
    assert meta.features == before
    assert meta.features["cond_image_token_lengths"] is runs
    assert runs == [1, 2]
    assert config == config_before


# --- validation ---------------------------------------------------------------------------


def _without(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in keys}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_without(mla_config(), "hidden_size"), r"missing \['hidden_size'\]"),
        (_without(_gqa(), "num_hidden_layers", "num_attention_heads"), "num_hidden_layers"),
        (mla_config(hidden_size=True), r"\['hidden_size'\] must be an integer >= 1.*True"),
        (mla_config(hidden_size=8.0), r"\['hidden_size'\].*8\.0"),
        (mla_config(num_hidden_layers=0), r"num_hidden_layers'\] must be an integer >= 1"),
        (mla_config(num_attention_heads=None), "num_attention_heads"),
        (_without(mla_config(), "qk_rope_head_dim"), r"missing \['qk_rope_head_dim'\].*latent"),
        (_without(mla_config(), "q_lora_rank"), r"missing \['q_lora_rank'\].*None"),
        (_without(mla_config(), "v_head_dim", "qk_nope_head_dim"), "qk_nope_head_dim.*v_head_dim"),
        (mla_config(q_lora_rank=0), r"q_lora_rank'\] must be an integer >= 1"),
        (mla_config(kv_lora_rank=-1), r"kv_lora_rank'\] must be an integer >= 1"),
        (mla_config(qk_nope_head_dim=0, qk_rope_head_dim=0), "must be > 0"),
        (mla_config(qk_head_dim=5), r"qk_head_dim'\] must equal .* = 4, but got 5"),
        (mla_config(v_head_dim=2.5), "v_head_dim"),
        (_gqa(num_attention_heads=3, num_key_value_heads=2, head_dim=4), "multiple of"),
        (_gqa(hidden_size=10, num_attention_heads=4), "set head_dim explicitly"),
        (_gqa(head_dim=0), r"head_dim'\] must be an integer >= 1"),
        (_gqa(num_key_value_heads=False), "num_key_value_heads"),
        (_without(_gqa(), "intermediate_size"), r"missing \['intermediate_size'\].*dense"),
        (_gqa(intermediate_size="16"), "intermediate_size"),
        (_gqa(mlp_layer_types=["dense", "dense"]), r"one entry per layer \(1\)"),
        (_gqa(mlp_layer_types="dense"), "mlp_layer_types"),
        (_gqa(mlp_layer_types=["moe"]), r"mlp_layer_types'\]\[0\] must be one of"),
        (_gqa(mlp_layer_types=["sparse"]), "no routed experts are configured"),
        (_without(_moe(), "moe_intermediate_size"), r"missing \['moe_intermediate_size'\]"),
        (_without(_moe(), "num_experts_per_tok"), r"missing \['num_experts_per_tok'\]"),
        (_moe(num_experts_per_tok=5), "num_experts_per_tok'\\]=5 exceeds the 4 routed experts"),
        (_moe(num_experts_per_tok=0), r"num_experts_per_tok'\] must be an integer >= 1"),
        (_moe(num_experts=8), "inconsistently"),
        (_moe(n_shared_experts=-1), "n_shared_experts"),
        (_moe(decoder_sparse_step=0), "decoder_sparse_step"),
        (_moe(first_k_dense_replace=0, moe_layer_freq=0), "moe_layer_freq"),
        (_moe(mlp_only_layers=[1]), r"mlp_only_layers'\]\[0\]=1 is not a layer index below 1"),
        (_moe(mlp_only_layers=3), "must be a list of layer indices"),
        (_gqa(layer_types=["mamba"]), r"layer_types'\]\[0\] must be one of"),
        (_gqa(layer_types=["linear_attention"]), r"missing \['linear_num_key_heads'"),
        (_gqa(layer_types=["sliding_attention"]), r"missing \['sliding_window'\]"),
        (
            _gqa(layer_types=["sliding_attention"], sliding_window=0),
            r"sliding_window'\] must be an integer >= 1",
        ),
        (_gqa(use_sliding_window="yes", sliding_window=4), "must be True or False"),
        (_gqa(sliding_window=4096), "neither layer_types nor use_sliding_window"),
        (_gqa(attn_block_mode="causal"), r"attn_block_mode'\] must be one of"),
        (_gqa(diff_time_embed_mode="append"), r"diff_time_embed_mode'\] must be one of"),
        (
            _gqa(attn_block_mode="blockmask", use_sliding_window=True, sliding_window=4),
            "not modelled",
        ),
        ({"text_config": 5}, r"model_config\['text_config'\] must be a mapping"),
        ({"text_config": _without(mla_config(), "hidden_size")}, r"model_config\['text_config'\]"),
    ],
)
def test_invalid_configs_are_rejected(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FlopsCost(config)


def test_model_config_must_be_a_mapping_or_expose_to_dict() -> None:
    with pytest.raises(TypeError, match="model_config must be a mapping"):
        FlopsCost(["hidden_size", 8])

    class _Broken:
        def to_dict(self) -> list[int]:
            return [1]

    with pytest.raises(TypeError, match=r"to_dict\(\) must return a mapping"):
        FlopsCost(_Broken())


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "3"])
def test_training_multiplier_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="training_multiplier"):
        FlopsCost(mla_config(), training_multiplier=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("features", "match"),
    [
        ({"P": 4}, "only one of 'P' and 'D'"),
        ({"D": 0}, "only one of 'P' and 'D'"),
        ({"P": True, "D": 3}, r"features\['P'\] must be an integer >= 0"),
        ({"P": 5, "D": -1}, r"features\['D'\] must be an integer >= 0"),
        ({"P": 2.0, "D": 2}, r"features\['P'\]"),
        ({"P": 1, "D": 2}, r"P \+ D must equal tokens.*P=1 \+ D=2 != tokens=4"),
    ],
)
def test_invalid_token_splits_are_rejected(features: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FlopsCost(mla_config())(SampleMetadata(tokens=4, features=features))


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        (None, r"requires metadata.features\['cond_image_token_lengths'\]"),
        ("2,3", "list of image block lengths"),
        ([2, 0], r"cond_image_token_lengths'\]\[1\] must be an integer >= 1"),
        ([True], r"cond_image_token_lengths'\]\[0\]"),
        ([3, 4], "sums to 7, more than the prefix token count P=6"),
    ],
)
def test_blockmask_runs_are_validated(runs: object, match: str) -> None:
    cost = FlopsCost(mla_config(attn_block_mode="blockmask"))
    features: dict[str, Any] = {"P": 6, "D": 2}
    if runs is not None:
        features["cond_image_token_lengths"] = runs
    with pytest.raises(ConfigError, match=match):
        cost(SampleMetadata(tokens=8, features=features))
