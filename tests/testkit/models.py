"""Model configurations the cost-model tests share."""

from __future__ import annotations

from typing import Any


def mla_config(**overrides: Any) -> dict[str, Any]:
    """The worked example: hidden 8, 1 layer, 2 heads, dense SwiGLU 16, latent attention."""
    config: dict[str, Any] = {
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "kv_lora_rank": 4,
        "q_lora_rank": None,
        "qk_nope_head_dim": 2,
        "qk_rope_head_dim": 2,
        "v_head_dim": 4,
    }
    config.update(overrides)
    return config
