"""What both step sources share: their ``metadata_fn``, the oversized policies, the end report."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from evenflow.engine._model import SampleMetadata
from evenflow.engine._validate import check_choice
from evenflow.engine.errors import ConfigError

__all__ = [
    "LOADER_FIELDS",
    "OVERSIZED",
    "IndexedSample",
    "LengthMemo",
    "LoaderBinding",
    "Oversized",
    "SourceReport",
]

Oversized = Literal["error", "single", "drop"]
OVERSIZED: tuple[str, ...] = ("error", "single", "drop")


def check_oversized(value: object) -> str:
    return check_choice("oversized", value, OVERSIZED)


class IndexedSample(NamedTuple):
    """A dataset index and its token count: what ``DatasetSource(yield_indices=True)`` yields
    in place of the sample (fetch the samples with ``DatasetSource.read``)."""

    dataset_index: int
    tokens: int


@dataclass(frozen=True)
class SourceReport:
    """What one pass (an epoch) of a step source delivers and leaves unread.

    ``num_dropped_samples`` / ``num_dropped_tokens``: samples of the pass that no step holds
    (the end-of-epoch remainder, plus oversized samples under ``oversized="drop"``, also
    counted alone in ``num_oversized_dropped``). For a ``DatasetSource`` the counts are over
    all ranks together (every rank computes the same numbers); for an ``IterableSource`` they
    are this rank's.
    """

    epoch: int
    num_steps: int
    num_samples: int
    num_dropped_samples: int
    num_dropped_tokens: int
    num_oversized_dropped: int

    def log_line(self, name: str) -> str:
        return (
            f"{name} epoch {self.epoch}: {self.num_steps} steps from {self.num_samples} samples; "
            f"{self.num_dropped_samples} samples ({self.num_dropped_tokens} tokens) are left "
            f"unread, {self.num_oversized_dropped} of them oversized."
        )


class LengthMemo:
    """Token counts of the samples of the last few steps a source yielded, by identity.

    The source already knows every sample's length; ``metadata_fn`` looks the sample up here
    (the loader calls it right after reading the step, on the same thread) instead of
    measuring it again. The memo holds references to its samples, so an ``id`` is never
    reused while remembered. A sample not remembered (a copy, or one many steps old) is
    measured with ``measure``.
    """

    STEPS = 8

    def __init__(
        self,
        measure: Callable[[Any], int],
        features_fn: Callable[[Any], dict[str, Any]] | None,
    ) -> None:
        self._steps: collections.deque[dict[int, tuple[Any, int]]] = collections.deque(
            maxlen=self.STEPS
        )
        self._measure = measure
        self._features_fn = features_fn

    def remember(self, samples: list[Any], lengths: list[int]) -> None:
        self._steps.append({id(s): (s, n) for s, n in zip(samples, lengths, strict=True)})

    def clear(self) -> None:
        self._steps.clear()

    def metadata(self, sample: Any) -> SampleMetadata:
        if isinstance(sample, IndexedSample):
            tokens = sample.tokens
        else:
            key = id(sample)
            for memo in reversed(self._steps):
                entry = memo.get(key)
                if entry is not None and entry[0] is sample:
                    tokens = entry[1]
                    break
            else:
                tokens = self._measure(sample)
        if self._features_fn is None:
            return SampleMetadata(tokens=tokens)
        return SampleMetadata(tokens=tokens, features=self._features_fn(sample))


#: What a loader tells its step source (``bind_loader``): the step shape from its
#: ``LoaderConfig`` and this rank's place among the data-parallel ranks from its group.
LOADER_FIELDS = ("seq_len", "bins_per_rank", "rank", "num_ranks")

_WHERE = {
    "seq_len": "LoaderConfig(seq_len={value})",
    "bins_per_rank": "LoaderConfig(bins_per_rank={value})",
    "rank": "this rank's place in the loader's group (rank={value})",
    "num_ranks": "the loader's group of {value} data-parallel rank(s) (num_ranks={value})",
}


class LoaderBinding:
    """The values a step source shares with its loader, given once.

    A source may be built with ``seq_len``, ``bins_per_rank`` (and, for a ``DatasetSource``,
    ``rank`` / ``num_ranks``) or without them; the loader that reads it calls
    :meth:`bind` with its own. A missing value is taken from the loader; an explicit value
    that differs is refused with an error naming both values and the fix, because either
    silently changes what trains (a wrong ``num_ranks`` trains a fraction of the data, a
    wrong ``rank`` trains one shard twice, a smaller ``seq_len`` gives half-full steps).
    """

    def __init__(self, owner: str, **explicit: int | None) -> None:
        self._owner = owner
        self._explicit = explicit
        self.values: dict[str, int | None] = dict(explicit)
        self.refusal: ConfigError | None = None
        self.bound = False

    def bind(self, **given: int | None) -> ConfigError | None:
        """Take the loader's values (``None``: the loader does not know it); return (and
        remember) the refusal when they disagree."""
        loader = {name: value for name, value in given.items() if value is not None}
        wrong = [
            (name, mine, loader[name])
            for name, mine in self.values.items()
            if name in loader and mine is not None and mine != loader[name]
        ]
        if wrong:
            parts = [
                f"{self._owner}({name}={mine}) disagrees with " + _WHERE[name].format(value=theirs)
                for name, mine, theirs in wrong
            ]
            names = ", ".join(f"{name}=" for name, _, _ in wrong)
            self.refusal = ConfigError(
                "; ".join(parts) + f". Drop {names} from the {self._owner} (the loader sets it) "
                "or make the values agree: a wrong value silently changes what trains."
            )
            return self.refusal
        for name, value in loader.items():
            if name in self.values:
                self.values[name] = value
        self.bound = True
        return None

    def require(self, name: str) -> int:
        """The value of ``name``, or a ConfigError saying how to give it."""
        if self.refusal is not None:
            raise self.refusal
        value = self.values[name]
        if value is None:
            raise ConfigError(
                f"This {self._owner} has no {name}: pass {name}= to it, or give it to a "
                "BalancedLoader or build_loader, which set seq_len, bins_per_rank, rank and "
                "num_ranks from the loader's config and process group."
            )
        return value
