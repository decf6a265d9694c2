"""The data model: sample identity, sample metadata and packing constraints.

A *sample* is one raw training example read by one rank for one step. Its ``SampleKey`` is the
identity used for routing and tie-breaking; its ``SampleMetadata`` is the small, CPU-only
description the planner sees (it is gathered from every rank, so it must stay cheap and
serialisable). ``PackingConstraints`` is the feasibility contract shared by the planner and
every balancing algorithm: a bin is feasible when its tokens fit ``seq_len`` (or it holds one
oversized sample alone under ``oversized_policy="single"``) and every named budget holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from evenflow.engine._validate import check_amounts, check_choice, check_int
from evenflow.engine.errors import ConfigError

__all__ = ["MAX_TOKENS", "OversizedPolicy", "PackingConstraints", "SampleKey", "SampleMetadata"]

#: The most tokens a packed sequence (``seq_len``) or one sample may hold: packed layouts
#: address positions with int32 (``position_ids``, ``cu_seq_lens``), and with it the token
#: sums of any step (fewer than 2**32 samples) fit the planner's int64 arithmetic exactly.
MAX_TOKENS = 2**31 - 1
_TOKENS_WHY = "positions are int32 in packed layouts, and token sums must stay exact"

OversizedPolicy = Literal["error", "single"]
_OVERSIZED_POLICIES: tuple[str, ...] = ("error", "single")


@dataclass(frozen=True, order=True, slots=True)
class SampleKey:
    """Identity of one sample occurrence: who read it, for which step, at which position.

    Orderable (by ``source_rank``, then ``step``, then ``index``): the total order ends every
    tie-break in planning, which is what makes plans deterministic.
    """

    source_rank: int
    step: int
    index: int

    def __post_init__(self) -> None:
        for name in ("source_rank", "step", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"SampleKey.{name} must be a non-negative integer, but got {value!r}."
                )

    def as_tuple(self) -> tuple[int, int, int]:
        """The key as a plain int tuple (what transports route)."""
        return (self.source_rank, self.step, self.index)

    @classmethod
    def from_tuple(cls, value: Iterable[int]) -> SampleKey:
        """Inverse of :meth:`as_tuple`; validates like the constructor."""
        items = tuple(value)
        if len(items) != 3:
            raise ConfigError(
                f"A SampleKey tuple must have 3 items (source_rank, step, index), got {items!r}."
            )
        return cls(items[0], items[1], items[2])


def _check_feature(value: object, path: str, active: set[int]) -> None:
    if value is None or type(value) in (bool, int, str):
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise ConfigError(f"SampleMetadata.features{path} must be finite, but got {value!r}.")
        return
    if type(value) in (dict, list, tuple):
        if id(value) in active:
            raise ConfigError(
                f"SampleMetadata.features{path} must not contain reference cycles; "
                "pass a tree of plain values."
            )
        active.add(id(value))
        if isinstance(value, dict):
            for key, child in value.items():
                if not isinstance(key, str):
                    raise ConfigError(
                        f"SampleMetadata.features{path} keys must be strings, but got {key!r}."
                    )
                _check_feature(child, f"{path}[{key!r}]", active)
        else:
            for i, child in enumerate(value):  # type: ignore[arg-type]
                _check_feature(child, f"{path}[{i}]", active)
        active.discard(id(value))
        return
    raise ConfigError(
        f"SampleMetadata.features{path} must contain only CPU basic types (None, bool, int, "
        f"float, str, dict, list, tuple), but got {type(value).__name__}: {value!r:.80}. "
        "Convert tensors and arrays to Python numbers or lists first."
    )


@dataclass(frozen=True, slots=True)
class SampleMetadata:
    """What the planner knows about one sample.

    ``tokens``: positions the sample occupies in a packed sequence (the same accounting as
    ``pack_fn``). ``features``: plain CPU values for cost models and logs (e.g. ``P``/``D``
    for a multimodal prefix/generated split). ``packing_costs``: named additive footprints
    (e.g. vision patches) checked against ``packing_budgets``; they never enter the cost.
    ``loss_tokens``: how many of the sample's positions are loss targets once packed
    (``count_loss_tokens(sample)`` for the default pack), between 0 and ``tokens``; ``None``
    means unknown. The loader sums it into every step's ``LossTokens``; with the default
    ``pack_fn`` it fills in a missing value itself.
    """

    tokens: int
    features: Mapping[str, Any] = field(default_factory=dict, hash=False)
    packing_costs: Mapping[str, float] = field(default_factory=dict, hash=False)
    loss_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int(
            "SampleMetadata.tokens", self.tokens, minimum=1, maximum=MAX_TOKENS, why=_TOKENS_WHY
        )
        if self.loss_tokens is not None:
            check_int("SampleMetadata.loss_tokens", self.loss_tokens, minimum=0)
            if self.loss_tokens > self.tokens:
                raise ConfigError(
                    f"SampleMetadata.loss_tokens must be at most tokens={self.tokens} (a sample "
                    f"cannot train on more positions than it occupies), but got "
                    f"{self.loss_tokens!r}."
                )
        if not isinstance(self.features, dict):
            raise ConfigError(f"SampleMetadata.features must be a dict, but got {self.features!r}.")
        _check_feature(self.features, "", set())
        if not isinstance(self.packing_costs, dict):
            raise ConfigError(
                f"SampleMetadata.packing_costs must be a dict, but got {self.packing_costs!r}."
            )
        check_amounts("SampleMetadata.packing_costs", self.packing_costs)

    def to_wire(self) -> tuple[Any, ...]:
        """Plain-data form: ``(tokens, features, packing_costs)``, plus ``loss_tokens`` when
        it is known (the three-item form stays what it was)."""
        base = (self.tokens, dict(self.features), dict(self.packing_costs))
        return base if self.loss_tokens is None else (*base, self.loss_tokens)

    @classmethod
    def from_wire(cls, value: Any) -> SampleMetadata:
        """Rebuild (and re-validate) metadata received from a peer."""
        if not isinstance(value, (tuple, list)) or len(value) not in (3, 4):
            raise ConfigError(f"Malformed SampleMetadata wire value: {value!r:.120}.")
        loss = value[3] if len(value) == 4 else None
        return cls(tokens=value[0], features=value[1], packing_costs=value[2], loss_tokens=loss)


@dataclass(frozen=True, slots=True)
class PackingConstraints:
    """Feasibility contract for one packed sequence (bin).

    ``seq_len``: token capacity. ``oversized_policy``: ``"error"`` rejects a sample longer than
    ``seq_len``; ``"single"`` lets it occupy a bin alone. ``packing_budgets``: named hard
    limits every bin must respect (never overflowable, not even alone).
    """

    seq_len: int
    oversized_policy: OversizedPolicy = "error"
    packing_budgets: Mapping[str, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        check_int("seq_len", self.seq_len, minimum=1, maximum=MAX_TOKENS, why=_TOKENS_WHY)
        check_choice("oversized_policy", self.oversized_policy, _OVERSIZED_POLICIES)
        budgets = (
            {}
            if self.packing_budgets is None
            else check_amounts("packing_budgets", self.packing_budgets)
        )
        object.__setattr__(self, "packing_budgets", budgets)

    @property
    def budgets(self) -> dict[str, float]:
        """The configured budgets (empty when packing is token-only)."""
        assert isinstance(self.packing_budgets, dict)
        return self.packing_budgets

    def validate_sample(self, key: SampleKey, meta: SampleMetadata) -> None:
        """Reject a sample that could not fit even an empty bin."""
        for name, budget in self.budgets.items():
            if name not in meta.packing_costs:
                raise ConfigError(
                    f"Sample {key} is missing packing_costs[{name!r}] required by "
                    f"packing_budgets; add it to every sample's metadata (0 is allowed)."
                )
            if meta.packing_costs[name] > budget:
                raise ConfigError(
                    f"Sample {key} requires packing_costs[{name!r}]={meta.packing_costs[name]!r},"
                    f" exceeding packing_budgets[{name!r}]={budget!r}. Budgets never allow "
                    "overflow, not even for a sample alone; raise the budget or drop the sample "
                    "in the source."
                )
        if meta.tokens > self.seq_len and self.oversized_policy == "error":
            raise ConfigError(
                f"Sample {key} requires {meta.tokens} tokens, exceeding seq_len="
                f"{self.seq_len}. Set oversized_policy='single' only when pack_fn supports "
                "a sample longer than seq_len alone in its bin."
            )

    def fits(self, bin_tokens: int, bin_costs: Mapping[str, float], meta: SampleMetadata) -> bool:
        """Whether ``meta`` can join a bin holding ``bin_tokens`` and ``bin_costs``."""
        if meta.tokens > self.seq_len:
            if not (bin_tokens == 0 and self.oversized_policy == "single"):
                return False
        elif bin_tokens + meta.tokens > self.seq_len:
            return False
        for name, budget in self.budgets.items():
            if bin_costs.get(name, 0.0) + meta.packing_costs.get(name, 0.0) > budget:
                return False
        return True

    def add_costs(self, bin_costs: Mapping[str, float], meta: SampleMetadata) -> dict[str, float]:
        """Budget sums of a bin after adding ``meta`` (configured names only)."""
        return {
            name: bin_costs.get(name, 0.0) + meta.packing_costs.get(name, 0.0)
            for name in self.budgets
        }

    def validate_bin(self, items: Iterable[tuple[SampleKey, SampleMetadata]]) -> int:
        """Check one bin from empty; return its token count or raise naming the sample."""
        tokens = 0
        costs: dict[str, float] = {}
        for key, meta in items:
            self.validate_sample(key, meta)
            if not self.fits(tokens, costs, meta):
                raise ConfigError(
                    f"Packing bin cannot admit sample {key} ({meta.tokens} tokens) within "
                    f"seq_len={self.seq_len} and packing_budgets={self.budgets!r}."
                )
            tokens += meta.tokens
            costs = self.add_costs(costs, meta)
        return tokens
