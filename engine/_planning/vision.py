"""A two-stage cost for vision-language models: the vision encoder, then the language model.

Between ranks the imbalance of a vision-language model is largest in its encoder: one rank's
samples may carry an order of magnitude more image patches than another's, and the encoder's
attention over an image is quadratic in the image's patches. :class:`VisionLanguageCost` adds
an encoder term per image to the language model's :class:`FlopsCost` over the sample's full
token length (image tokens included), from the model's Hugging Face configuration.

Per image of ``p`` patches (before the spatial merge; ``t·h·w`` of ``image_grid_thw``), with
``Hv`` the encoder width, ``Iv`` its MLP width, ``m`` the spatial merge size, ``O`` the
merger's output width, forward FLOPs are ``2·p·M + 4·Hv·pairs`` where

* ``M = C·T·s²·Hv`` (patch embedding: channels x temporal patch x patch size², per patch)
  ``+ depth·(4·Hv² + g·Hv·Iv)`` (attention projections q, k, v, o and the MLP with ``g = 3``
  gated matrices for Qwen2.5-VL, ``g = 2`` for Qwen3-VL)
  ``+ mergers·Hv·(m²·Hv + O)`` (each merger maps ``m²`` patches of width ``Hv`` through a
  ``m²·Hv``-wide layer to ``O``; Qwen3-VL adds one merger per deepstack layer);
* ``pairs = full·p² + windowed·p·min(p, w)`` — bidirectional attention within the image over
  ``full`` layers, and over ``windowed`` layers inside windows of ``w = (window_size / s)²``
  patches (Qwen2.5-VL: every layer not in ``fullatt_block_indexes``).

With full attention in every layer that is ``4·Hv·depth·p·(p + alpha)``, with :attr:`alpha`:
the ``p·(p + alpha)`` shape. The training cost multiplies forward FLOPs by ``training_multiplier``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from evenflow.engine._model import SampleMetadata
from evenflow.engine._planning.cost import ComponentCost
from evenflow.engine._planning.flops import FlopsCost, _config_dict, _Fields
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError

__all__ = ["VisionLanguageCost"]

# The vision towers modelled, by vision_config model_type: (MLP matrices, windowed attention).
_TOWERS: dict[str, tuple[int, bool]] = {
    "qwen2_5_vl_vision": (3, True),
    "qwen3_vl_vision": (2, False),
    "qwen3_vl_moe_vision": (2, False),
    "qwen3_5_vision": (2, False),
    "qwen3_5_moe_vision": (2, False),
}


class VisionLanguageCost:
    """Training FLOPs of a vision-language sample: encoder term per image + language model.

    ``model_config``: the whole model's configuration (a mapping or an object with
    ``to_dict()``) with ``vision_config`` and ``text_config``; Qwen2.5-VL and Qwen3-VL (and
    Qwen3.5) vision towers are modelled (see the module docstring for the formula), the
    language model by :class:`FlopsCost`. A sample lists its images' patch counts in
    ``meta.features[patches_key]`` (default ``"image_patches"``; absent or empty: no image);
    its ``tokens`` include the merged image tokens (``p / m²`` per image).

    The planner balances the sum of both stages, which is right when one rank runs the
    encoder and then the language model on its own samples. When the stages run
    concurrently (a separate encoder pipeline stage), balance the slower one instead with
    :meth:`as_stages` (``reduce="max"``).
    """

    term_names: tuple[str, ...] = ("encoder", "language")

    def __init__(
        self,
        model_config: object,
        *,
        training_multiplier: float = 3.0,
        patches_key: str = "image_patches",
    ) -> None:
        top = _config_dict(model_config, "model_config", TypeError)
        if not isinstance(patches_key, str) or not patches_key:
            raise ConfigError(
                f"patches_key must be a non-empty string, but got {patches_key!r}."
            )
        self.patches_key = patches_key
        self.training_multiplier = check_number(
            "training_multiplier", training_multiplier, minimum=0.0, strict_minimum=True
        )
        if top.get("vision_config") is None or top.get("text_config") is None:
            raise ConfigError(
                "model_config must hold both 'vision_config' and 'text_config' (a "
                "vision-language model's configuration); for a language model alone use "
                "FlopsCost."
            )
        self.language = FlopsCost(top, training_multiplier=self.training_multiplier)
        vision = _Fields(
            _config_dict(top["vision_config"], "model_config['vision_config']", ConfigError),
            "model_config['vision_config']",
        )
        vision.require("model_type", why="to tell which vision tower this is")
        tower = vision.data["model_type"]
        if tower not in _TOWERS:
            raise ConfigError(
                f"{vision.name('model_type')}={tower!r} is not a vision tower this cost knows; "
                f"known towers are {sorted(_TOWERS)!r}."
            )
        matrices, windowed = _TOWERS[tower]
        keys = (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "patch_size",
            "spatial_merge_size",
            "temporal_patch_size",
            "in_channels",
            "out_hidden_size",
        )
        vision.require(*keys, why=f"by the {tower} encoder")
        depth, width, mlp, heads, patch, merge, temporal, channels, out = (
            vision.integer(key, minimum=1) for key in keys
        )
        if width % heads:
            raise ConfigError(
                f"{vision.name('hidden_size')}={width} is not divisible by "
                f"{vision.name('num_heads')}={heads}; fix either field."
            )
        full_layers = depth
        window = 0
        if windowed:
            vision.require("window_size", "fullatt_block_indexes", why=f"by the {tower} encoder")
            size = vision.integer("window_size", minimum=1)
            if size % patch:
                raise ConfigError(
                    f"{vision.name('window_size')}={size} must be a multiple of "
                    f"{vision.name('patch_size')}={patch}."
                )
            window = (size // patch) ** 2
            full = vision.data["fullatt_block_indexes"]
            if not isinstance(full, (list, tuple)) or not all(
                0 <= check_int(f"{vision.name('fullatt_block_indexes')}[{i}]", v) < depth
                for i, v in enumerate(full)
            ):
                raise ConfigError(
                    f"{vision.name('fullatt_block_indexes')} must list layer indices below "
                    f"depth={depth}, but got {full!r:.80}."
                )
            full_layers = len(set(full))
        mergers = 1
        if vision.has("deepstack_visual_indexes"):
            deep = vision.data["deepstack_visual_indexes"]
            if not isinstance(deep, (list, tuple)):
                raise ConfigError(
                    f"{vision.name('deepstack_visual_indexes')} must be a list, got {deep!r:.80}."
                )
            mergers += len(deep)
        self.merge_units = merge * merge
        per_patch = (
            channels * temporal * patch * patch * width
            + depth * (4 * width * width + matrices * width * mlp)
            + mergers * width * (merge * merge * width + out)
        )
        self._patch_flops = float(2 * per_patch)
        self._full_pair = float(4 * width * full_layers)
        self._window_pair = float(4 * width * (depth - full_layers))
        self._window = float(window)
        self._fields = {
            "tower": tower,
            "depth": depth,
            "hidden_size": width,
            "intermediate_size": mlp,
            "mlp_matrices": matrices,
            "full_attention_layers": full_layers,
            "window_patches": window,
            "mergers": mergers,
            "spatial_merge_size": merge,
            "out_hidden_size": out,
            "patch_embedding": channels * temporal * patch * patch,
        }
        blob = json.dumps({"vision": self._fields, "language": self.language.model_id})
        self._model_id = "vlm-v1-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def resolved_fields(self) -> dict[str, Any]:
        """The vision fields the encoder term was computed from (a copy)."""
        return dict(self._fields)

    @property
    def alpha(self) -> float:
        """``alpha`` of the encoder's ``p·(p + alpha)`` shape when every layer attends to the
        whole image: per-patch FLOPs over per-pair FLOPs of all layers."""
        return self._patch_flops / (self._full_pair + self._window_pair)

    def patches(self, meta: SampleMetadata) -> list[int]:
        """The sample's images' patch counts, validated."""
        value = meta.features.get(self.patches_key) if meta.features else None
        if value is None:
            return []
        where = f"metadata.features[{self.patches_key!r}]"
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list of patch counts, but got {value!r:.80}.")
        merged = 0
        for i, count in enumerate(value):
            check_int(f"{where}[{i}]", count, minimum=1)
            if count % self.merge_units:
                raise ConfigError(
                    f"{where}[{i}]={count} is not a multiple of spatial_merge_size² = "
                    f"{self.merge_units}; give patches before the merge (t·h·w of the grid)."
                )
            merged += count // self.merge_units
        if merged > meta.tokens:
            raise ConfigError(
                f"{where} merge to {merged} image tokens, more than the sample's {meta.tokens} "
                "tokens; tokens must include the image tokens."
            )
        return list(value)

    def encoder_flops(self, meta: SampleMetadata) -> float:
        """Training FLOPs of the encoder over the sample's images."""
        total = 0.0
        for p in self.patches(meta):
            pairs_full = float(p) * p
            pairs_window = float(p) * min(float(p), self._window)
            total += (
                self._patch_flops * p
                + self._full_pair * pairs_full
                + self._window_pair * pairs_window
            )
        return self.training_multiplier * total

    def language_flops(self, meta: SampleMetadata) -> float:
        """Training FLOPs of the language model over the sample's full token length."""
        return self.language(meta)

    def cost_terms(self, meta: SampleMetadata) -> tuple[float, float]:
        return self.encoder_flops(meta), self.language_flops(meta)

    def __call__(self, meta: SampleMetadata) -> float:
        encoder, language = self.cost_terms(meta)
        return encoder + language

    def as_stages(self, reduce: str = "max") -> ComponentCost:
        """The two stages as a :class:`ComponentCost` (``reduce="max"``: balance the slower)."""
        return ComponentCost(
            {
                "encoder": _Stage(self, "encoder", self.encoder_flops),
                "language": _Stage(self, "language", self.language_flops),
            },
            reduce=reduce,  # type: ignore[arg-type]
        )

    def __repr__(self) -> str:
        return f"VisionLanguageCost(model_id={self._model_id!r})"


class _Stage:
    """One stage of a :class:`VisionLanguageCost` as a cost model whose identity names the
    whole model's configuration (a bound method's would name only the code)."""

    def __init__(self, owner: VisionLanguageCost, name: str, fn: Any) -> None:
        self.model_id = f"{owner.model_id}:{name}"
        self._fn = fn

    def __call__(self, meta: SampleMetadata) -> float:
        return float(self._fn(meta))
