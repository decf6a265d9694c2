"""A FLOPs cost model built from a Hugging Face-style model configuration.

``FlopsCost`` predicts the training FLOPs of one sample of a decoder backbone: the linear layers
(attention projections, dense or mixture-of-experts MLPs) scale with the token count, attention
scales with the number of query-key pairs. All coefficients are resolved once in ``__init__``;
a call reads the sample's token split and does a handful of float operations.

Conventions (MAC = 2 FLOPs; ``L`` layers, ``H`` hidden size, ``A`` query heads):

* projections per token per layer — grouped-query attention: ``H·A·d + 2·H·KV·d + A·d·H`` MACs;
  latent attention (``kv_lora_rank`` set): ``Q + H·(Rkv + d_r) + Rkv·A·(d_n + d_v) + A·d_v·H``
  with ``Q = H·A·(d_n + d_r)`` or ``H·Rq + Rq·A·(d_n + d_r)``.
* MLP per token — dense SwiGLU ``3·H·I``; sparse ``3·H·I_e·k + shared + H·E_r`` (router).
* attention ``2·A·(d_qk + d_v)`` FLOPs per pair per layer.
* ``forward = linear_flops_per_token·(P + D') + Σ_layers pair_flops·pairs(layer)`` where a sample
  is a causal prefix of ``P`` tokens followed by ``D`` generated tokens that attend to the whole
  prefix and to each other (``D' = D + 1`` with a prepended timestep token):
  ``pairs = P²/2 + D'·(P + D')`` (+ ``½·Σ r_j²`` for bidirectional image blocks).

Limits, on purpose: norms, activations, softmax, kernel tiling and padding, the LM head, vision
or audio encoders and communication are not modelled. It is a relative proxy for balancing,
not a latency predictor. Fields are never guessed: a missing or ambiguous field is an error.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from evenflow.engine._model import SampleMetadata
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError

__all__ = ["FlopsCost"]

_DIFF_TIME_EMBED_MODES: tuple[str, ...] = ("add", "prepend", "adaln")
_ATTN_BLOCK_MODES: tuple[str, ...] = ("tail", "blockmask")
_EXPERT_KEYS: tuple[str, ...] = ("n_routed_experts", "num_experts", "num_local_experts")
_MLP_KINDS: tuple[str, ...] = ("dense", "sparse")
_ATTENTION_KINDS: tuple[str, ...] = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
)
#: Backbone ``model_type`` values whose fields this model reads (a config without one is read
#: by the generic rules). Any other value is refused: its cost may hide in fields not read here.
MODEL_TYPES: tuple[str, ...] = (
    "deepseek_v2",
    "deepseek_v3",
    "gemma3_text",
    "gpt_oss",
    "llama",
    "llama4_text",
    "mistral",
    "mixtral",
    "phi3",
    "phimoe",
    "qwen2",
    "qwen2_5_vl_text",
    "qwen2_moe",
    "qwen3",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_vl_moe_text",
    "qwen3_vl_text",
)
#: Top-level ``model_type`` values whose ``text_config`` is the backbone (the vision tower is
#: :class:`~evenflow.engine.VisionLanguageCost`'s business).
WRAPPER_TYPES: tuple[str, ...] = (
    "gemma3",
    "llama4",
    "qwen2_5_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
)
# Full attention layers whose query projection also produces an output gate (2·A·d wide).
_GATED_QUERY: tuple[str, ...] = ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
# Mixture-of-experts models whose expert width is ``intermediate_size``.
_EXPERT_WIDTH_IS_INTERMEDIATE: tuple[str, ...] = ("gpt_oss", "llama4_text", "mixtral", "phimoe")
# Models whose ``sliding_window``, when set, applies to every layer.
_EVERY_LAYER_SLIDES: tuple[str, ...] = ("mistral", "mixtral", "phi3", "phimoe")


def _config_dict(value: object, name: str, error: type[Exception]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        result = to_dict()
        if isinstance(result, Mapping):
            return dict(result)
        raise error(f"{name}.to_dict() must return a mapping, but returned {result!r:.80}.")
    raise error(
        f"{name} must be a mapping (e.g. a loaded config.json) or a configuration object "
        f"exposing to_dict(), but got {type(value).__name__}: {value!r:.80}."
    )


class _Fields:
    """One configuration level; error messages name each field by its path."""

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data = data
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}[{key!r}]"

    def has(self, key: str) -> bool:
        """A field counts as set when present and not None (HF configs write unset as null)."""
        return self.data.get(key) is not None

    def require(self, *keys: str, why: str) -> None:
        missing = [key for key in keys if key not in self.data]
        if missing:
            raise ConfigError(
                f"{self.path} is missing {missing!r}, required {why}; add them to the "
                "configuration."
            )

    def integer(self, key: str, *, minimum: int) -> int:
        return check_int(self.name(key), self.data.get(key), minimum=minimum)

    def optional_int(self, key: str, *, minimum: int, default: int) -> int:
        return self.integer(key, minimum=minimum) if self.has(key) else default

    def choices(self, key: str, allowed: tuple[str, ...], length: int) -> tuple[str, ...]:
        value = self.data[key]
        if not isinstance(value, (list, tuple)) or len(value) != length:
            raise ConfigError(
                f"{self.name(key)} must be a list with one entry per layer ({length}), but got "
                f"{value!r:.120}."
            )
        for i, item in enumerate(value):
            if item not in allowed:
                raise ConfigError(
                    f"{self.name(key)}[{i}] must be one of {allowed!r}, but got {item!r}; other "
                    "layer kinds are not modelled."
                )
        return tuple(value)


def _attention(f: _Fields, hidden: int, heads: int) -> tuple[int, int, int, dict[str, Any]]:
    """Projection MACs per token per layer, query-key and value head sizes, resolved fields."""
    if f.has("kv_lora_rank"):
        f.require(
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            why="by multi-head latent attention (kv_lora_rank is set); set q_lora_rank to None "
            "for a full-rank query projection",
        )
        kv_rank = f.integer("kv_lora_rank", minimum=1)
        q_rank = f.optional_int("q_lora_rank", minimum=1, default=0) or None
        d_nope = f.integer("qk_nope_head_dim", minimum=0)
        d_rope = f.integer("qk_rope_head_dim", minimum=0)
        d_v = f.integer("v_head_dim", minimum=1)
        d_qk = d_nope + d_rope
        if d_qk == 0:
            raise ConfigError(
                f"{f.name('qk_nope_head_dim')} + {f.name('qk_rope_head_dim')} must be > 0, but "
                "both are 0; set the query-key head sizes."
            )
        if f.has("qk_head_dim") and f.data["qk_head_dim"] != d_qk:
            raise ConfigError(
                f"{f.name('qk_head_dim')} must equal qk_nope_head_dim + qk_rope_head_dim = "
                f"{d_qk}, but got {f.data['qk_head_dim']!r}; fix or remove it."
            )
        # A low-rank query goes hidden -> q_lora_rank -> heads; otherwise hidden -> heads.
        query = hidden * heads * d_qk if q_rank is None else hidden * q_rank + q_rank * heads * d_qk
        proj = (
            query
            + hidden * (kv_rank + d_rope)
            + kv_rank * heads * (d_nope + d_v)
            + heads * d_v * hidden
        )
        fields = {
            "attention": "mla",
            "kv_lora_rank": kv_rank,
            "q_lora_rank": q_rank,
            "qk_nope_head_dim": d_nope,
            "qk_rope_head_dim": d_rope,
            "v_head_dim": d_v,
        }
        return proj, d_qk, d_v, fields
    kv_heads = f.optional_int("num_key_value_heads", minimum=1, default=heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{f.name('num_attention_heads')}={heads} must be a multiple of "
            f"{f.name('num_key_value_heads')}={kv_heads} for grouped-query attention; fix "
            "either field."
        )
    if f.has("head_dim"):
        head_dim = f.integer("head_dim", minimum=1)
    elif hidden % heads:
        raise ConfigError(
            f"{f.name('hidden_size')}={hidden} is not divisible by "
            f"{f.name('num_attention_heads')}={heads}, so head_dim cannot be derived; set "
            "head_dim explicitly."
        )
    else:
        head_dim = hidden // heads
    proj = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    fields = {"attention": "gqa", "num_key_value_heads": kv_heads, "head_dim": head_dim}
    return proj, head_dim, head_dim, fields


def _num_experts(f: _Fields) -> int:
    found = {key: f.integer(key, minimum=0) for key in _EXPERT_KEYS if f.has(key)}
    if len(set(found.values())) > 1:
        raise ConfigError(
            f"{f.path} sets the routed expert count inconsistently: {found!r}; keep one of "
            f"{list(_EXPERT_KEYS)!r} or make them equal."
        )
    return next(iter(found.values()), 0)


def _mlp_pattern(f: _Fields, layers: int, experts: int) -> tuple[str, ...]:
    """Per-layer "dense"/"sparse", following the first rule the configuration states."""
    if f.has("mlp_layer_types"):
        return f.choices("mlp_layer_types", _MLP_KINDS, layers)
    if experts == 0:
        return ("dense",) * layers
    if f.has("moe_layers"):  # Llama 4: the sparse layers' indices
        sparse = set(_layer_indices(f, "moe_layers", layers))
        return tuple("sparse" if i in sparse else "dense" for i in range(layers))
    if f.has("first_k_dense_replace"):
        first_dense = f.integer("first_k_dense_replace", minimum=0)
        freq = f.optional_int("moe_layer_freq", minimum=1, default=1)
        return tuple(
            "sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(layers)
        )
    step = f.optional_int("decoder_sparse_step", minimum=1, default=1)
    dense_only: set[int] = set()
    if f.has("mlp_only_layers"):
        dense_only = set(_layer_indices(f, "mlp_only_layers", layers))
    return tuple(
        "sparse" if (i + 1) % step == 0 and i not in dense_only else "dense" for i in range(layers)
    )


def _layer_indices(f: _Fields, key: str, layers: int) -> list[int]:
    value = f.data[key]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{f.name(key)} must be a list of layer indices, got {value!r:.80}.")
    for i, index in enumerate(value):
        name = f"{f.name(key)}[{i}]"
        if check_int(name, index, minimum=0) >= layers:
            raise ConfigError(f"{name}={index} is not a layer index below {layers}.")
    return list(value)


def _mlp(f: _Fields, hidden: int, layers: int) -> tuple[int, dict[str, Any]]:
    """Total MLP MACs per token over all layers, and the resolved fields."""
    experts = _num_experts(f)
    pattern = _mlp_pattern(f, layers, experts)
    num_dense = pattern.count("dense")
    num_sparse = layers - num_dense
    fields: dict[str, Any] = {"mlp_layer_types": list(pattern)}
    macs = 0
    model_type = f.data.get("model_type")
    llama4 = model_type == "llama4_text"
    if num_dense:
        # Llama 4's dense layers have their own width; its experts use intermediate_size.
        dense_key = "intermediate_size_mlp" if llama4 else "intermediate_size"
        f.require(dense_key, why="by the dense MLP layers")
        intermediate = f.integer(dense_key, minimum=1)
        fields["intermediate_size"] = intermediate
        macs += num_dense * 3 * hidden * intermediate
    if num_sparse:
        if experts == 0:
            raise ConfigError(
                f"{f.name('mlp_layer_types')} marks {num_sparse} layer(s) sparse, but no routed "
                f"experts are configured; set one of {list(_EXPERT_KEYS)!r}."
            )
        width_key = (
            "intermediate_size"
            if model_type in _EXPERT_WIDTH_IS_INTERMEDIATE and not f.has("moe_intermediate_size")
            else "moe_intermediate_size"
        )
        f.require("num_experts_per_tok", width_key, why="by the sparse MLP layers")
        top_k = f.integer("num_experts_per_tok", minimum=1)
        if top_k > experts:
            raise ConfigError(
                f"{f.name('num_experts_per_tok')}={top_k} exceeds the {experts} routed experts; "
                "a token cannot be routed to more experts than exist."
            )
        expert_size = f.integer(width_key, minimum=1)
        # Shared experts: DeepSeek counts experts of the routed size (n_shared_experts); Qwen-MoE
        # gives one shared expert its own width (shared_expert_intermediate_size).
        shared_size = f.optional_int(
            "shared_expert_intermediate_size", minimum=0, default=expert_size
        )
        shared_count = f.optional_int(
            "n_shared_experts",
            minimum=0,
            # Llama 4 runs one shared expert of the routed width beside its routed experts.
            default=1 if f.has("shared_expert_intermediate_size") or llama4 else 0,
        )
        sparse = 3 * hidden * (expert_size * top_k + shared_size * shared_count) + hidden * experts
        macs += num_sparse * sparse
        fields.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=shared_size,
            n_shared_experts=shared_count,
        )
    return macs, fields


def _layer_kinds(f: _Fields, layers: int) -> tuple[str, ...]:
    """Every layer's attention kind, from ``layer_types`` or the sliding-window fields."""
    if f.has("layer_types"):
        return f.choices("layer_types", _ATTENTION_KINDS, layers)
    if f.has("use_sliding_window"):
        flag = f.data["use_sliding_window"]
        if not isinstance(flag, bool):
            raise ConfigError(
                f"{f.name('use_sliding_window')} must be True or False, but got {flag!r}."
            )
        # Limit: every layer slides; a max_window_layers split needs an explicit layer_types.
        return ("sliding_attention" if flag else "full_attention",) * layers
    if f.has("sliding_window") and f.data.get("model_type") in _EVERY_LAYER_SLIDES:
        return ("sliding_attention",) * layers
    if f.has("sliding_window"):
        raise ConfigError(
            f"{f.name('sliding_window')}={f.data['sliding_window']!r} is set but neither "
            "layer_types nor use_sliding_window says which layers use it; set "
            "use_sliding_window=True (every layer) or layer_types (per layer), or set "
            "sliding_window to None."
        )
    return ("full_attention",) * layers


def _linear_attention(f: _Fields, hidden: int) -> tuple[int, dict[str, Any]]:
    """MACs per token of one linear-attention (gated delta rule) layer, and its fields.

    Input projections ``H·(2·Kh·dk + 2·Vh·dv + 2·Vh)`` (q, k, v, the output gate z, and the
    per-head decay and step size), a depthwise causal convolution ``(2·Kh·dk + Vh·dv)·K``,
    the recurrence ``3·Vh·dk·dv`` (read, rank-one update and output of a ``dk x dv`` state
    per value head) and the output projection ``Vh·dv·H``. All linear in length.
    """
    keys = (
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    )
    f.require(*keys, why="by the linear_attention layers")
    kh, dk, vh, dv, kernel = (f.integer(key, minimum=1) for key in keys)
    macs = (
        hidden * (2 * kh * dk + 2 * vh * dv + 2 * vh)
        + (2 * kh * dk + vh * dv) * kernel
        + 3 * vh * dk * dv
        + vh * dv * hidden
    )
    return macs, dict(zip(keys, (kh, dk, vh, dv, kernel), strict=True))


def _chunked_pairs(n: float, chunk: float) -> float:
    """Query-key pairs of a causal sequence of ``n`` tokens attending within chunks."""
    full, rest = divmod(n, chunk)
    return full * 0.5 * chunk * chunk + 0.5 * rest * rest


def _check_model_type(f: _Fields, top: _Fields) -> str | None:
    wrapped = top.data is not f.data
    if wrapped and top.has("model_type") and top.data["model_type"] not in WRAPPER_TYPES:
        raise ConfigError(
            f"{top.name('model_type')}={top.data['model_type']!r} is not a model this cost "
            f"knows; known multimodal wrappers are {list(WRAPPER_TYPES)!r}. Pass the language "
            "model's own config (or remove model_type to read the fields generically)."
        )
    if not f.has("model_type"):
        return None
    model_type = f.data["model_type"]
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{f.name('model_type')}={model_type!r} is not a model this cost knows; known "
            f"backbones are {list(MODEL_TYPES)!r}. Remove model_type to read the fields "
            "generically only if the architecture adds no cost beyond them."
        )
    if f.data.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{f.name('use_bidirectional_attention')}=True is not modelled (every query would "
            "see the whole sample); set it to False or use another cost model."
        )
    return str(model_type)


def _windowed_pairs(n: float, window: float) -> float:
    """Query-key pairs of a causal sequence of ``n`` tokens under a sliding window."""
    return 0.5 * n * n if n <= window else window * n - 0.5 * window * window


class FlopsCost:
    """Training FLOPs of one sample, from a Hugging Face-style model configuration.

    ``model_config`` is a mapping (a loaded ``config.json``) or an object with ``to_dict()``;
    backbone fields are read from a nested ``text_config`` when present, while
    ``attn_block_mode`` (``"tail"``/``"blockmask"``) and ``diff_time_embed_mode``
    (``"add"``/``"prepend"``/``"adaln"``) are read from the top level.
    Attention is latent (MLA) when ``kv_lora_rank`` is set (not None), else grouped-query;
    MoE layers follow ``mlp_layer_types``, else ``first_k_dense_replace``/``moe_layer_freq``,
    else ``decoder_sparse_step``/``mlp_only_layers``; sliding-window layers follow
    ``layer_types``, else ``use_sliding_window``. :attr:`resolved_fields` shows the outcome.
    ``training_multiplier`` scales the forward FLOPs (3 = forward + backward, 1 = forward only,
    4 = with full recomputation); it never changes balancing decisions.

    Per sample, ``features["P"]`` (prefix tokens) and ``features["D"]`` (generated tokens)
    default to ``P = tokens, D = 0``; in blockmask mode ``features["cond_image_token_lengths"]``
    lists the image blocks of the prefix (empty for none). The metadata is only read.
    """

    def __init__(self, model_config: object, *, training_multiplier: float = 3.0) -> None:
        top = _config_dict(model_config, "model_config", TypeError)
        multiplier = check_number(
            "training_multiplier", training_multiplier, minimum=0.0, strict_minimum=True
        )
        if top.get("text_config") is not None:
            backbone = _config_dict(top["text_config"], "model_config['text_config']", ConfigError)
            f = _Fields(backbone, "model_config['text_config']")
        else:
            f = _Fields(top, "model_config")
        top_fields = _Fields(top, "model_config")
        model_type = _check_model_type(f, top_fields)
        f.require(
            "hidden_size", "num_hidden_layers", "num_attention_heads", why="by every backbone"
        )
        hidden = f.integer("hidden_size", minimum=1)
        layers = f.integer("num_hidden_layers", minimum=1)
        heads = f.integer("num_attention_heads", minimum=1)
        proj, d_qk, d_v, attention_fields = _attention(f, hidden, heads)
        if model_type in _GATED_QUERY:
            proj += hidden * heads * d_qk  # the query projection also yields an output gate
        mlp_macs, mlp_fields = _mlp(f, hidden, layers)
        kinds = _layer_kinds(f, layers)
        num_sliding = kinds.count("sliding_attention")
        num_chunked = kinds.count("chunked_attention")
        num_linear = kinds.count("linear_attention")
        window = chunk = None
        if num_sliding:
            f.require("sliding_window", why="by the sliding-attention layers")
            window = f.integer("sliding_window", minimum=1)
        if num_chunked:
            f.require("attention_chunk_size", why="by the chunked-attention layers")
            chunk = f.integer("attention_chunk_size", minimum=1)
        linear_macs, linear_fields = _linear_attention(f, hidden) if num_linear else (0, {})
        modes: dict[str, str] = {}
        for key, allowed, default in (
            ("attn_block_mode", _ATTN_BLOCK_MODES, "tail"),
            ("diff_time_embed_mode", _DIFF_TIME_EMBED_MODES, "add"),
        ):
            value = top[key] if top_fields.has(key) else default
            if value not in allowed:
                raise ConfigError(
                    f"{top_fields.name(key)} must be one of {allowed!r}, but got {value!r}."
                )
            modes[key] = value
        if (num_sliding or num_chunked) and modes["attn_block_mode"] == "blockmask":
            raise ConfigError(
                "model_config['attn_block_mode']='blockmask' together with sliding-window or "
                "chunked layers is not modelled; use attn_block_mode='tail' or full attention."
            )

        pair_flops = 2 * heads * (d_qk + d_v)
        num_softmax = layers - num_linear
        self._linear = float(2 * (num_softmax * proj + num_linear * linear_macs + mlp_macs))
        self._attention = float(num_softmax * pair_flops)
        self._full_coef = float((num_softmax - num_sliding - num_chunked) * pair_flops)
        self._sliding_coef = float(num_sliding * pair_flops)
        self._chunked_coef = float(num_chunked * pair_flops)
        self._window = float(window) if window is not None else math.inf
        self._chunk = float(chunk) if chunk is not None else math.inf
        self._prepend = modes["diff_time_embed_mode"] == "prepend"
        self._blockmask = modes["attn_block_mode"] == "blockmask"
        self.training_multiplier = multiplier
        self._fields: dict[str, Any] = {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            **attention_fields,
            **mlp_fields,
            "num_sliding_layers": num_sliding,
            "sliding_window": window,
            **modes,
        }
        # Added only when used, so the identity of a model without them is unchanged.
        if model_type is not None:
            self._fields["model_type"] = model_type
        if num_chunked:
            self._fields.update(num_chunked_layers=num_chunked, attention_chunk_size=chunk)
        if num_linear:
            self._fields.update(num_linear_attention_layers=num_linear, **linear_fields)
        blob = json.dumps(
            {"fields": self._fields, "training_multiplier": multiplier}, sort_keys=True
        )
        self._model_id = "flops-v1-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of the linear layers per token, summed over layers."""
        return self._linear

    @property
    def attention_flops_per_pair(self) -> float:
        """Forward attention FLOPs per query-key pair, summed over the softmax-attention layers
        (``2·L_a·A·(d_qk+d_v)``; linear-attention layers have no pairs)."""
        return self._attention

    #: The two terms :meth:`cost_terms` returns (what :class:`CalibratedCost` fits apart).
    term_names: tuple[str, ...] = ("linear", "attention")

    def cost_terms(self, meta: SampleMetadata) -> tuple[float, float]:
        """The cost split into its linear-layer and attention parts (they sum to the cost)."""
        linear, attention = self._forward_parts(meta)
        return self.training_multiplier * linear, self.training_multiplier * attention

    @property
    def model_id(self) -> str:
        """``"flops-v1-"`` + 16 hex digits identifying the resolved fields and the multiplier."""
        return self._model_id

    @property
    def resolved_fields(self) -> dict[str, Any]:
        """The configuration fields the coefficients were computed from (a copy)."""
        return copy.deepcopy(self._fields)

    def forward_flops(self, meta: SampleMetadata) -> float:
        """Forward FLOPs of one sample."""
        linear, attention = self._forward_parts(meta)
        return linear + attention

    def _forward_parts(self, meta: SampleMetadata) -> tuple[float, float]:
        features = meta.features
        prefix, generated = _token_split(features, meta.tokens) if features else (meta.tokens, 0)
        if generated and self._prepend:
            generated += 1  # the timestep token joins the generated block
        total = prefix + generated
        full_pairs = 0.5 * prefix * prefix + generated * total
        if self._blockmask:
            full_pairs += 0.5 * _block_squares(features, prefix)
        attention = self._full_coef * full_pairs
        if self._sliding_coef:
            # The window caps the keys each query sees: prefix queries are causal, generated
            # queries see the whole sample; with a window >= total this equals full_pairs.
            sliding_pairs = _windowed_pairs(prefix, self._window) + generated * min(
                total, self._window
            )
            attention += self._sliding_coef * sliding_pairs
        if self._chunked_coef:
            # Limit: chunked layers are modelled causal over the whole sample (prefix and
            # generated tokens alike), each query seeing its own chunk.
            attention += self._chunked_coef * _chunked_pairs(total, self._chunk)
        return self._linear * total, attention

    def __call__(self, meta: SampleMetadata) -> float:
        return self.training_multiplier * self.forward_flops(meta)

    def __repr__(self) -> str:
        return (
            f"FlopsCost(model_id={self._model_id!r}, "
            f"training_multiplier={self.training_multiplier!r})"
        )


def _token_split(features: Mapping[str, Any], tokens: int) -> tuple[int, int]:
    prefix = features.get("P")
    generated = features.get("D")
    if prefix is None and generated is None:
        return tokens, 0
    if prefix is None or generated is None:
        raise ConfigError(
            f"metadata.features sets only one of 'P' and 'D' (P={prefix!r}, D={generated!r}); "
            "set both or neither (neither means P = tokens, D = 0)."
        )
    check_int("metadata.features['P']", prefix, minimum=0)
    check_int("metadata.features['D']", generated, minimum=0)
    if prefix + generated != tokens:
        raise ConfigError(
            f"metadata.features P + D must equal tokens (before any timestep token), but "
            f"P={prefix!r} + D={generated!r} != tokens={tokens!r}."
        )
    return prefix, generated


def _block_squares(features: Mapping[str, Any], prefix: int) -> int:
    runs = features.get("cond_image_token_lengths")
    if not isinstance(runs, (list, tuple)):
        raise ConfigError(
            "Blockmask attention requires metadata.features['cond_image_token_lengths'] as a "
            f"list of image block lengths (empty for no images), but got {runs!r:.80}."
        )
    total = 0
    squares = 0
    for i, run in enumerate(runs):
        check_int(f"metadata.features['cond_image_token_lengths'][{i}]", run, minimum=1)
        total += run
        squares += run * run
    if total > prefix:
        raise ConfigError(
            f"metadata.features['cond_image_token_lengths'] sums to {total}, more than the "
            f"prefix token count P={prefix}; image blocks must lie inside the prefix."
        )
    return squares
