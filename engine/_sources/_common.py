"""What both step sources share: their ``metadata_fn``, the oversized policies, the end report."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from evenflow.engine._model import SampleMetadata
from evenflow.engine._validate import check_choice

__all__ = ["OVERSIZED", "IndexedSample", "LengthMemo", "Oversized", "SourceReport"]

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
