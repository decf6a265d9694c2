"""What a packed bin holds, checked against what the metadata round declared for its samples.

The plan is made from declared metadata (``SampleMetadata.tokens`` and ``loss_tokens``, from
the source or the user's ``metadata_fn``); the batch is made from the samples themselves. When
the two disagree, training goes on silently wrong: an under-declared length alone in a bin is
delivered longer than ``seq_len`` (the planner thought it fit), a ``metadata_fn`` that
declares 0 loss tokens makes ``last_loss_tokens.world`` 0 while the bins hold labels (and the
loss recipe divides by it). So every packed bin is checked, with a few vectorised operations
per bin and no per-sample Python (:class:`Declared` gathers a step's declared columns once):

* the default pack: each sample's packed length (``cu_seq_lens_q``) must equal its declared
  ``tokens``, and its loss targets (labels other than ``-100``) its declared ``loss_tokens``
  when one was declared;
* any pack whose output is a mapping with ``cu_seq_lens_q`` (a varlen layout): its token
  total must not exceed ``seq_len``, unless the bin is one sample and
  ``oversized_policy="single"`` allows it. (A pack that pads, and says nothing of its real
  tokens, is not second-guessed.)

A mismatch raises ``ConfigError`` naming the sample by its dataset index where the source
knows it (``DatasetSource``), else by the rank and step that read it. Errors a ``pack_fn``
raises itself get a note naming the bin's samples the same way (:func:`name_samples`); when
the default pack refuses a bin, :func:`explain_pack_error` says first whether a sample's
length differs from what was declared (the usual reason a planned bin does not fit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.engine.errors import ConfigError
from evenflow.transports.internal import NOTE_PREFIX

__all__ = ["Declared", "check_packed", "explain_pack_error", "name_samples", "sample_name"]

Key = tuple[int, int, int]  # (source rank, step that read it, position in that step)
Messages = Mapping[int, Sequence[dict[str, Any]]]

_IGNORE = -100
_SHOWN = 8


class Declared:
    """The declared ``tokens`` and ``loss_tokens`` of every sample a step's plan may name,
    as flat arrays per reading step, looked up by key arrays."""

    def __init__(self, messages: Messages) -> None:
        self.messages = messages
        self._tokens: dict[int, npt.NDArray[np.int64]] = {}
        self._loss: dict[int, npt.NDArray[np.int64] | None] = {}
        self._offsets: dict[int, npt.NDArray[np.int64]] = {}
        for step, rows in messages.items():
            columns = [np.asarray(m.get("tokens", ()), dtype=np.int64) for m in rows]
            counts = np.fromiter((len(c) for c in columns), dtype=np.int64, count=len(columns))
            self._offsets[step] = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
            self._tokens[step] = np.concatenate(columns) if columns else np.zeros(0, np.int64)
            losses = [m.get("loss") for m in rows]
            self._loss[step] = (
                None
                if any(v is None for v in losses)
                else np.concatenate([np.asarray(v, dtype=np.int64) for v in losses])
            )

    def columns(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
        """Declared tokens and loss tokens (``None`` when any is unknown) of ``keys`` (k by 3)."""
        tokens = np.empty(len(keys), dtype=np.int64)
        loss: npt.NDArray[np.int64] | None = np.empty(len(keys), dtype=np.int64)
        for step in np.unique(keys[:, 1]).tolist():
            rows = keys[:, 1] == step
            flat = self._offsets[step][keys[rows, 0]] + keys[rows, 2]
            tokens[rows] = self._tokens[step][flat]
            column = self._loss[step]
            if column is None or loss is None:
                loss = None
            else:
                loss[rows] = column[flat]
        return tokens, loss


def sample_name(messages: Messages, key: Sequence[int]) -> str:
    """``dataset index 17`` when the reading rank sent its samples' indices, else ``the
    sample read by rank 1 at step 4 (position 2)``."""
    src, step, pos = (int(v) for v in key)
    try:
        indices = messages[step][src].get("indices")
    except (KeyError, IndexError):
        indices = None
    if indices is not None and pos < len(indices):
        return f"dataset index {int(indices[pos])}"
    return f"the sample read by rank {src} at step {step} (position {pos})"


def name_samples(exc: BaseException, messages: Messages, keys: Sequence[Key], where: str) -> None:
    """Note on ``exc`` which samples the failing bin held (its type and message unchanged)."""
    names = [sample_name(messages, k) for k in keys[:_SHOWN]]
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    exc.add_note(
        f"{NOTE_PREFIX}{where} holds samples[0..{len(keys) - 1}] = {', '.join(names)}{more}."
    )


def explain_pack_error(
    samples: Sequence[Any], keys: Sequence[Key], declared: Declared, *, where: str
) -> ConfigError | None:
    """After the default pack refused a bin: a ``ConfigError`` naming the first sample whose
    length (``len(sample["input_ids"])`` or ``len(sample)``) differs from its declared tokens,
    or ``None`` when every length is as declared."""
    tokens, _ = declared.columns(np.asarray(keys, dtype=np.int64).reshape(-1, 3))
    for k, sample in enumerate(samples):
        try:
            actual = len(sample["input_ids"] if isinstance(sample, Mapping) else sample)
        except Exception:
            return None
        if actual != int(tokens[k]):
            return _length_error(
                declared.messages, keys[k], k, where, actual=actual, declared=int(tokens[k])
            )
    return None


def check_packed(
    packed: Any,
    keys: Sequence[Key],
    declared: Declared,
    columns: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None],
    *,
    seq_len: int,
    oversized_single: bool,
    default_pack: bool,
    where: str,
) -> None:
    """Raise ``ConfigError`` when ``packed`` (one bin) disagrees with the declared metadata;
    ``columns`` are the bin's declared tokens and loss tokens (:meth:`Declared.columns`, taken
    once for all of a rank's bins)."""
    if not isinstance(packed, Mapping):
        return
    bounds = packed.get("cu_seq_lens_q")
    if bounds is None:
        return
    ends = np.asarray(bounds, dtype=np.int64).reshape(-1)
    if not len(ends):
        return
    total = int(ends[-1])
    if total > seq_len and not (len(keys) == 1 and oversized_single):
        raise ConfigError(
            f"{where} packs into {total} tokens, more than seq_len={seq_len}, although the "
            f"metadata of its {len(keys)} sample(s) fit: a sample is longer than its declared "
            "tokens (check metadata_fn / lengths=)."
        )
    if not default_pack:
        return
    lengths = np.diff(ends)
    labels = packed.get("labels")
    if labels is None or len(lengths) != len(keys):
        return  # not the default layout after all
    tokens, loss = columns
    bad = np.flatnonzero(lengths != tokens)
    if bad.size:
        k = int(bad[0])
        raise _length_error(
            declared.messages, keys[k], k, where, actual=int(lengths[k]), declared=int(tokens[k])
        )
    if loss is None:
        return
    targets = (np.asarray(labels).reshape(-1) != _IGNORE).astype(np.int64)
    counted = np.add.reduceat(targets, ends[:-1]) if len(lengths) else targets
    bad = np.flatnonzero(counted != loss)
    if bad.size:
        k = int(bad[0])
        raise ConfigError(
            f"{sample_name(declared.messages, keys[k])} (samples[{k}] of {where.lower()}) holds "
            f"{int(counted[k])} loss targets (labels other than -100), but its metadata "
            f"declared loss_tokens={int(loss[k])}; last_loss_tokens and the loss scale would "
            "be wrong. Declare the count the pack trains on (count_loss_tokens(sample) for the "
            "default pack), or leave loss_tokens unset (None) to have it counted."
        )


def _length_error(
    messages: Messages, key: Sequence[int], k: int, where: str, *, actual: int, declared: int
) -> ConfigError:
    return ConfigError(
        f"{sample_name(messages, key)} (samples[{k}] of {where.lower()}) packs into {actual} "
        f"tokens, but its metadata declared {declared}; the plan was made for the declared "
        "length. Fix metadata_fn (or the lengths / length_column the source reads)."
    )
