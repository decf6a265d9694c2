"""A tiny causal transformer that trains on packed sequences, for ``evenflow demo``.

The point of the model is to make the cost of a packed step behave like a real language model's:
linear layers cost per token, attention costs per query-key pair *inside each sample*. A dense
``T x T`` mask over the whole packed sequence would cost ``T^2`` whatever the samples are and
hide exactly the imbalance the demo shows, so attention runs per sample: the packed
``[T, heads, head_dim]`` projections are split at ``cu_seq_lens_q`` and each piece goes through
``scaled_dot_product_attention(is_causal=True)``. Positions come from ``position_ids`` (they
restart at 0 for every sample), so no sample ever sees another one.

The architecture is a pre-norm decoder with learned position embeddings, SwiGLU MLPs and a tied
LM head; :meth:`TinyConfig.hf_config` describes it in Hugging Face field names so that the
engine's ``FlopsCost`` predicts its per-sample work. Limits: per-sample attention is a Python
loop (a few tens of microseconds per sample and layer), which is noise for this model's sample
sizes but would not be for thousands of tiny samples; the LM head and norms are not in
``FlopsCost``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evenflow.engine._pipeline.pack import IGNORE_INDEX
from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError

__all__ = ["TinyCausalLM", "TinyConfig", "packed_loss"]


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    """Shape of :class:`TinyCausalLM`. ``max_positions`` bounds every sample's length."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 192
    max_positions: int = 2048

    def __post_init__(self) -> None:
        check_int("TinyConfig.vocab_size", self.vocab_size, minimum=2)
        check_int("TinyConfig.hidden_size", self.hidden_size, minimum=1)
        check_int("TinyConfig.num_layers", self.num_layers, minimum=1)
        check_int("TinyConfig.num_heads", self.num_heads, minimum=1)
        check_int("TinyConfig.intermediate_size", self.intermediate_size, minimum=1)
        check_int("TinyConfig.max_positions", self.max_positions, minimum=1)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"TinyConfig.hidden_size={self.hidden_size!r} must be a multiple of "
                f"num_heads={self.num_heads!r}; change either."
            )

    def hf_config(self) -> dict[str, Any]:
        """This architecture in Hugging Face config fields (what ``FlopsCost`` reads)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }

    def num_parameters(self) -> int:
        """Trainable parameters (the LM head is tied to the token embedding)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return self.vocab_size * h + self.max_positions * h + self.num_layers * per_layer + h


class _Block(nn.Module):
    """Pre-norm attention (per sample, causal) followed by a pre-norm SwiGLU MLP."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = h // config.num_heads
        self.norm1 = nn.LayerNorm(h, bias=False)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.norm2 = nn.LayerNorm(h, bias=False)
        self.gate_up = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(t, 3, self.num_heads, self.head_dim)
        # [3, 1, heads, T, head_dim]: one split along T gives every sample's q, k and v, each
        # 4-D [batch, heads, L, head_dim], the layout SDPA's fused CPU kernel takes. 3-D
        # inputs fall back to the math path, which materialises every L x L score matrix:
        # 2-5x slower, and its large allocations make a long sample's time vary by ~15% from
        # one call to the next.
        qkv = qkv.permute(1, 2, 0, 3).unsqueeze(1)
        outputs = [
            F.scaled_dot_product_attention(part[0], part[1], part[2], is_causal=True)
            for part in torch.split(qkv, lengths, dim=3)
        ]
        attended = torch.cat(outputs, dim=2)[0].transpose(0, 1).reshape(t, -1)
        x = x + self.proj(attended)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(F.silu(gate) * up)
        return out


class TinyCausalLM(nn.Module):
    """A small decoder-only LM over one packed sequence at a time.

    ``forward(input_ids, position_ids, cu_seq_lens_q)`` takes the tensors of
    :func:`~evenflow.engine.default_pack_fn` (``[1, T]``, ``[1, T]`` and ``[k + 1]``) and
    returns logits ``[T, vocab_size]``; attention never crosses a ``cu_seq_lens_q`` boundary.
    """

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor
    ) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"input_ids must be one packed row [1, T], but got shape "
                f"{tuple(input_ids.shape)!r}; pass the tensors of default_pack_fn."
            )
        input_ids, position_ids = input_ids[0], position_ids.reshape(-1)
        lengths = torch.diff(cu_seq_lens_q).tolist()
        if int(position_ids.max()) >= self.config.max_positions:
            raise ValueError(
                f"position_ids reach {int(position_ids.max())}, but the model has "
                f"max_positions={self.config.max_positions}; build it with max_positions >= "
                "the longest sample."
            )
        x = self.embed(input_ids.long()) + self.positions(position_ids.long())
        for block in self.blocks:
            x = block(x, lengths)
        return F.linear(self.norm(x), self.embed.weight)


def packed_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[Any, int]:
    """Summed next-token cross-entropy of a packed sequence and the number of tokens it covers.

    ``labels`` (``[1, T]`` or ``[T]``) are shifted by one, as Hugging Face models do inside
    their loss: position ``i`` predicts label ``i + 1``, and labels of -100 are skipped. The
    packed labels hold -100 at every sample's first position, so the last position of a
    sample never predicts the next sample. The sum (not the mean) is what a data-parallel loop
    needs: divided by the loss tokens of the whole world, it gives every token the same weight
    whichever rank and bin the plan put it in.
    """
    targets = labels.reshape(-1)[1:].long()
    keep = targets != IGNORE_INDEX
    count = int(keep.sum())
    if count == 0:  # only one-token samples: nothing to predict, zero loss
        return logits.sum() * 0.0, 0
    return F.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum"), count
