"""FlopsCost and VisionLanguageCost on the architectures people train now.

Each configuration is built with the real ``transformers`` configuration class (small sizes,
no download), and its cost for one sample is checked against FLOPs counted by hand here:
MACs per token per layer for the projections and MLPs (x2 FLOPs), 2·A·(d_qk + d_v) FLOPs
per query-key pair per attention layer, times 3 for training.
"""

from __future__ import annotations

from typing import Any

import pytest

from evenflow.engine import SampleMetadata
from evenflow.engine.errors import ConfigError
from evenflow.engine.planning import FlopsCost, VisionLanguageCost

T = pytest.importorskip("transformers")

L = 100  # the sample's tokens
H, A, KV, D, I = 64, 4, 2, 16, 128  # hidden, heads, kv heads, head dim, dense MLP width
SMALL = {
    "hidden_size": H,
    "num_attention_heads": A,
    "num_key_value_heads": KV,
    "intermediate_size": I,
    "num_hidden_layers": 4,
    "vocab_size": 128,
}


def gqa(gate: bool = False) -> int:
    """Attention projection MACs per token: q (x2 with an output gate), k, v, o."""
    return H * A * D * (2 if gate else 1) + 2 * H * KV * D + A * D * H


def swiglu(width: int = I) -> int:
    return 3 * H * width


def moe(width: int, top_k: int, experts: int, shared: int = 0) -> int:
    return 3 * H * (width * top_k + shared) + H * experts


def delta_rule(kh: int = 2, dk: int = 8, vh: int = 4, dv: int = 8, kernel: int = 4) -> int:
    """A linear-attention layer: input projections, depthwise conv, recurrence, output."""
    return (
        H * (2 * kh * dk + 2 * vh * dv + 2 * vh)
        + (2 * kh * dk + vh * dv) * kernel
        + 3 * vh * dk * dv
        + vh * dv * H
    )


LINEAR_ATTENTION = {
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}


def causal(n: int = L) -> float:
    return n * n / 2


def window(w: int, n: int = L) -> float:
    return n * n / 2 if n <= w else w * n - w * w / 2


def chunked(c: int, n: int = L) -> float:
    full, rest = divmod(n, c)
    return full * c * c / 2 + rest * rest / 2


def train(macs: int, pairs: float, pair_flops: int = 4 * A * D) -> float:
    """Training FLOPs: 3 x (2 x MACs x tokens + attention FLOPs)."""
    return 3.0 * (2 * macs * L + pair_flops * pairs)


CASES: dict[str, tuple[Any, float]] = {
    "llama3": (
        T.LlamaConfig(**SMALL, head_dim=D),
        train(4 * (gqa() + swiglu()), 4 * causal()),
    ),
    "llama4": (
        T.Llama4Config(
            text_config={
                **SMALL,
                "head_dim": D,
                "intermediate_size": 96,  # the experts' width
                "intermediate_size_mlp": I,  # the dense layers' width
                "num_local_experts": 4,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "attention_chunk_size": 40,
            }
        ),
        # Layers 0-2 attend in chunks of 40, layer 3 fully; layers 1 and 3 are MoE with one
        # shared expert of the routed width.
        train(
            4 * gqa() + 2 * swiglu() + 2 * moe(96, 1, 4, shared=96),
            3 * chunked(40) + causal(),
        ),
    ),
    "mistral": (
        T.MistralConfig(**SMALL, head_dim=D, sliding_window=32),
        train(4 * (gqa() + swiglu()), 4 * window(32)),
    ),
    "mixtral": (
        T.MixtralConfig(
            **{**SMALL, "intermediate_size": 96}, head_dim=D, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=None,
        ),
        train(4 * (gqa() + moe(96, 2, 4)), 4 * causal()),
    ),
    "qwen2.5": (T.Qwen2Config(**SMALL), train(4 * (gqa() + swiglu()), 4 * causal())),
    "qwen2.5-moe": (
        T.Qwen2MoeConfig(
            **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        train(4 * (gqa() + moe(32, 2, 8, shared=48)), 4 * causal()),
    ),
    "qwen3": (T.Qwen3Config(**SMALL, head_dim=D), train(4 * (gqa() + swiglu()), 4 * causal())),
    "qwen3-moe": (
        T.Qwen3MoeConfig(
            **SMALL, head_dim=D, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
        ),
        train(4 * (gqa() + moe(32, 2, 8)), 4 * causal()),
    ),
    "qwen3-next": (
        T.Qwen3NextConfig(
            **SMALL, head_dim=D, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, **LINEAR_ATTENTION,
        ),
        # Three linear-attention layers, one gated full-attention layer; every MLP sparse.
        train(3 * delta_rule() + gqa(gate=True) + 4 * moe(32, 2, 8, shared=48), causal()),
    ),
    "qwen3.5": (
        T.Qwen3_5TextConfig(**SMALL, head_dim=D, **LINEAR_ATTENTION),
        train(3 * delta_rule() + gqa(gate=True) + 4 * swiglu(), causal()),
    ),
    "qwen3.5-moe": (
        T.Qwen3_5MoeTextConfig(
            **SMALL, head_dim=D, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, **LINEAR_ATTENTION,
        ),
        train(3 * delta_rule() + gqa(gate=True) + 4 * moe(32, 2, 8, shared=48), causal()),
    ),
    "deepseek-v3": (
        T.DeepseekV3Config(
            **{**SMALL, "num_hidden_layers": 3}, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, n_group=1, topk_group=1,
        ),
        # MLA: low-rank query (24), latent kv (16) + rope key (4), up-projections, output.
        train(
            3 * (H * 24 + 24 * A * 12 + H * (16 + 4) + 16 * A * (8 + 8) + A * 8 * H)
            + swiglu()
            + 2 * moe(32, 2, 8, shared=32),
            3 * causal(),
            pair_flops=2 * A * (12 + 8),
        ),
    ),
    "gemma3": (
        T.Gemma3Config(text_config={**SMALL, "num_hidden_layers": 6, "head_dim": D,
                                    "sliding_window": 32}),
        # Five local layers to one global.
        train(6 * (gqa() + swiglu()), 5 * window(32) + causal()),
    ),
    "gpt-oss": (
        T.GptOssConfig(
            **{**SMALL, "intermediate_size": 96}, head_dim=D, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=32,
        ),
        # Sliding and full layers alternate; every layer is MoE; sinks add no pairs.
        train(4 * (gqa() + moe(96, 2, 4)), 2 * window(32) + 2 * causal()),
    ),
    "phi3": (
        T.Phi3Config(**SMALL, sliding_window=32),
        train(4 * (gqa() + swiglu()), 4 * window(32)),
    ),
    "phi4": (
        T.Phi3Config(**SMALL, sliding_window=None),
        train(4 * (gqa() + swiglu()), 4 * causal()),
    ),
    "phi3.5-moe": (
        T.PhimoeConfig(
            **{**SMALL, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None,
        ),
        train(4 * (gqa() + moe(96, 2, 4)), 4 * causal()),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cost_matches_flops_counted_by_hand(name: str) -> None:
    config, expected = CASES[name]
    cost = FlopsCost(config)
    meta = SampleMetadata(tokens=L)
    assert cost(meta) == pytest.approx(expected, rel=1e-12)
    assert cost(meta) == pytest.approx(sum(cost.cost_terms(meta)))


def test_at_least_twelve_architectures_are_covered() -> None:
    assert len(CASES) >= 12


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({**SMALL, "model_type": "mamba"}, r"model_config\['model_type'\]='mamba'"),
        ({"model_type": "llava", "text_config": {**SMALL}}, r"model_config\['model_type'\]"),
        (
            {"model_type": "gemma3", "text_config": {**SMALL, "model_type": "gemma9_text"}},
            r"model_config\['text_config'\]\['model_type'\]",
        ),
        (
            {**SMALL, "model_type": "gemma3_text", "use_bidirectional_attention": True},
            "use_bidirectional_attention",
        ),
        (
            {**SMALL, "layer_types": ["full_attention"] * 3 + ["mamba"]},
            r"layer_types'\]\[3\] must be one of",
        ),
        (
            {**SMALL, "layer_types": ["chunked_attention"] * 4},
            r"missing \['attention_chunk_size'\]",
        ),
        (
            {**SMALL, "model_type": "mixtral", "num_local_experts": 4},
            r"missing \['num_experts_per_tok'\]",
        ),
        ({**SMALL, "model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1,
          "moe_layers": [9]}, r"moe_layers'\]\[0\]=9 is not a layer index"),
    ],
)
def test_unknown_or_missing_fields_are_named(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FlopsCost(config)


# -- vision-language models -----------------------------------------------------------------------

VISION = {"hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 14,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
          "out_hidden_size": H}
TEXT = {**SMALL, "head_dim": D}


def _qwen25_vl() -> Any:
    return T.Qwen2_5_VLConfig(
        vision_config={**VISION, "depth": 4, "window_size": 56, "fullatt_block_indexes": [3]},
        text_config=TEXT,
    )


def _qwen3_vl() -> Any:
    return T.Qwen3VLConfig(
        vision_config={**VISION, "depth": 4, "deepstack_visual_indexes": [1, 2]},
        text_config=TEXT,
    )


def _encoder(p: int, *, matrices: int, mergers: int, full: int, windowed: int, w: int) -> float:
    per_patch = (
        3 * 2 * 14 * 14 * 32  # patch embedding
        + 4 * (4 * 32 * 32 + matrices * 32 * 48)  # 4 layers: q, k, v, o and the MLP
        + mergers * 32 * (4 * 32 + H)  # merger(s): 4 patches of 32 -> 128 -> H
    )
    pairs = full * p * p + windowed * p * min(p, w)
    return 3.0 * (2 * per_patch * p + 4 * 32 * pairs)


def test_qwen25_vl_encoder_term_per_image_plus_the_language_model() -> None:
    cost = VisionLanguageCost(_qwen25_vl())
    meta = SampleMetadata(tokens=200, features={"image_patches": [64, 16]})
    encoder = sum(
        _encoder(p, matrices=3, mergers=1, full=1, windowed=3, w=16) for p in (64, 16)
    )
    language = train(4 * (gqa() + swiglu()), 0.0) / L * 200 + 3.0 * 4 * 4 * A * D * causal(200)
    assert cost.encoder_flops(meta) == pytest.approx(encoder, rel=1e-12)
    assert cost.language_flops(meta) == pytest.approx(language, rel=1e-12)
    assert cost(meta) == pytest.approx(encoder + language, rel=1e-12)
    text_only = SampleMetadata(tokens=200)
    assert cost(text_only) == pytest.approx(language, rel=1e-12)


def test_qwen3_vl_encoder_is_p_times_p_plus_alpha() -> None:
    cost = VisionLanguageCost(_qwen3_vl())
    for p in (16, 64, 400):
        meta = SampleMetadata(tokens=p // 4 + 10, features={"image_patches": [p]})
        expected = _encoder(p, matrices=2, mergers=3, full=4, windowed=0, w=0)
        assert cost.encoder_flops(meta) == pytest.approx(expected, rel=1e-12)
        assert cost.encoder_flops(meta) == pytest.approx(
            3.0 * 4 * 32 * 4 * p * (p + cost.alpha), rel=1e-12
        )


def test_stages_can_be_balanced_by_the_slower_one() -> None:
    cost = VisionLanguageCost(_qwen3_vl())
    stages = cost.as_stages()
    meta = SampleMetadata(tokens=120, features={"image_patches": [400]})
    assert stages.evaluate(meta) == pytest.approx(cost.cost_terms(meta))
    assert stages.reduce == "max"
    # The stages' identity follows the configuration (ranks with other configs are refused).
    assert cost.model_id in stages.model_id
    assert VisionLanguageCost(_qwen25_vl()).as_stages().model_id != stages.model_id


@pytest.mark.parametrize(
    ("features", "match"),
    [
        ({"image_patches": [10]}, r"image_patches'\]\[0\]=10 is not a multiple of"),
        ({"image_patches": 64}, "must be a list of patch counts"),
        ({"image_patches": [4000]}, "more than the sample's 200 tokens"),
    ],
)
def test_bad_patch_counts_are_named(features: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        VisionLanguageCost(_qwen25_vl())(SampleMetadata(tokens=200, features=features))


def test_unknown_vision_tower_is_named() -> None:
    config = _qwen3_vl().to_dict()
    config["vision_config"]["model_type"] = "siglip_vision_model"
    with pytest.raises(ConfigError, match=r"vision_config'\]\['model_type'\]"):
        VisionLanguageCost(config)
    with pytest.raises(ConfigError, match="both 'vision_config' and 'text_config'"):
        VisionLanguageCost(T.Qwen3Config(**SMALL))
