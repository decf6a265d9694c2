"""What a packed bin holds, checked against what the metadata round declared for its samples.

The plan is made from declared metadata (``SampleMetadata.tokens`` and ``loss_tokens``, from
the source or the user's ``metadata_fn``); the batch is made from the samples themselves. When
the two disagree, training goes on silently wrong: an under-declared length alone in a bin is
delivered longer than ``seq_len`` (the planner thought it fit), a ``metadata_fn`` that
declares 0 loss tokens makes ``last_loss_tokens.world`` 0 while the bins hold labels (and the
loss recipe divides by it). So every packed bin is checked, cheaply (a few vectorised
operations per bin, no per-token Python):

* any pack: a mapping with an ``input_ids`` tensor must not hold more than ``seq_len`` tokens,
  unless the bin is one sample and ``oversized_policy="single"`` allows it;
* the default pack: each sample's packed length (``cu_seq_lens_q``) must equal its declared
  ``tokens``, and its loss targets (labels other than ``-100``) its declared ``loss_tokens``
  when one was declared.

A mismatch raises ``ConfigError`` naming the sample by its dataset index where the source
knows it (``DatasetSource``), else by the rank and step that read it. Errors a ``pack_fn``
raises itself get a note naming the bin's samples the same way (:func:`name_samples`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from evenflow.engine.errors import ConfigError
from evenflow.transports._remote import NOTE_PREFIX

__all__ = ["check_declared_lengths", "check_packed", "name_samples", "sample_name"]

Key = tuple[int, int, int]  # (source rank, step that read it, position in that step)
Messages = Mapping[int, Sequence[dict[str, Any]]]

_IGNORE = -100
_SHOWN = 8


def sample_name(messages: Messages, key: Key) -> str:
    """``dataset index 17`` when the reading rank sent its samples' indices, else ``the
    sample read by rank 1 at step 4 (position 2)``."""
    src, step, pos = key
    try:
        indices = messages[step][src].get("indices")
    except (KeyError, IndexError):
        indices = None
    if indices is not None and pos < len(indices):
        return f"dataset index {int(indices[pos])}"
    return f"the sample read by rank {src} at step {step} (position {pos})"


def name_samples(exc: BaseException, messages: Messages, keys: Sequence[Key], where: str) -> None:
    """Note on ``exc`` which samples the failing bin held (its type and message unchanged)."""
    names = [sample_name(messages, tuple(k)) for k in keys[:_SHOWN]]  # type: ignore[arg-type]
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    exc.add_note(
        f"{NOTE_PREFIX}{where} holds samples[0..{len(keys) - 1}] = {', '.join(names)}{more}."
    )


def check_packed(
    packed: Any,
    keys: Sequence[Key],
    messages: Messages,
    *,
    seq_len: int,
    oversized_single: bool,
    default_pack: bool,
    where: str,
) -> None:
    """Raise ``ConfigError`` when ``packed`` (one bin) disagrees with the declared metadata."""
    if not isinstance(packed, Mapping):
        return
    ids = packed.get("input_ids")
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) >= 1:
        total = int(shape[-1])
        if total > seq_len and not (len(keys) == 1 and oversized_single):
            raise ConfigError(
                f"{where} packs into {total} tokens, more than seq_len={seq_len}, although "
                f"the metadata of its {len(keys)} sample(s) fit: a sample is longer than its "
                "declared tokens (check metadata_fn / lengths=). "
                + _first_mismatch_hint(packed, keys, messages, default_pack)
            )
    if not default_pack:
        return
    bounds = packed.get("cu_seq_lens_q")
    labels = packed.get("labels")
    if bounds is None or labels is None:
        return
    ends = np.asarray(bounds, dtype=np.int64)
    lengths = np.diff(ends)
    if len(lengths) != len(keys):
        return  # not the default layout after all
    declared, loss = _declared(messages, keys)
    bad = np.flatnonzero(lengths != declared)
    if bad.size:
        k = int(bad[0])
        raise ConfigError(
            f"{sample_name(messages, keys[k])} (samples[{k}] of {where.lower()}) packs into "
            f"{int(lengths[k])} tokens, but its metadata declared {int(declared[k])}; the plan "
            "was made for the declared length. Fix metadata_fn (or the lengths / "
            f"length_column the source reads): {len(bad)} sample(s) of this bin disagree."
        )
    if loss is None:
        return
    targets = np.asarray(labels, dtype=np.int64).reshape(-1) != _IGNORE
    counted = np.add.reduceat(targets.astype(np.int64), ends[:-1]) if len(lengths) else targets
    bad = np.flatnonzero(counted != loss)
    if bad.size:
        k = int(bad[0])
        raise ConfigError(
            f"{sample_name(messages, keys[k])} (samples[{k}] of {where.lower()}) holds "
            f"{int(counted[k])} loss targets (labels other than -100), but its metadata "
            f"declared loss_tokens={int(loss[k])}; last_loss_tokens and the loss scale would "
            "be wrong. Declare the count the pack trains on (count_loss_tokens(sample) for the "
            "default pack), or leave loss_tokens unset (None) to have it counted."
        )


def check_declared_lengths(
    samples: Sequence[Any], keys: Sequence[Key], messages: Messages, *, where: str
) -> None:
    """Before the default pack: each sample's token count (``len(sample["input_ids"])``, or
    ``len(sample)``) must be the one its metadata declared, or the pack would make a bin of
    another size than the plan (longer than ``seq_len``, for an under-declared length)."""
    declared, _ = _declared(messages, keys)
    for k, sample in enumerate(samples):
        try:
            ids = sample["input_ids"] if isinstance(sample, Mapping) else sample
            actual = len(ids)
        except Exception:
            return  # the pack itself says what is wrong with such a sample
        if actual != int(declared[k]):
            raise ConfigError(
                f"{sample_name(messages, keys[k])} (samples[{k}] of {where.lower()}) packs "
                f"into {actual} tokens, but its metadata declared {int(declared[k])}; the plan "
                "was made for the declared length. Fix metadata_fn (or the lengths / "
                "length_column the source reads)."
            )


def _declared(messages: Messages, keys: Sequence[Key]) -> tuple[np.ndarray, np.ndarray | None]:
    tokens = np.empty(len(keys), dtype=np.int64)
    loss: np.ndarray | None = np.empty(len(keys), dtype=np.int64)
    for i, (src, step, pos) in enumerate(keys):
        message = messages[step][src]
        tokens[i] = int(message["tokens"][pos])
        column = message.get("loss")
        if column is None or loss is None:
            loss = None
        else:
            loss[i] = int(column[pos])
    return tokens, loss


def _first_mismatch_hint(
    packed: Mapping[str, Any], keys: Sequence[Key], messages: Messages, default_pack: bool
) -> str:
    bounds = packed.get("cu_seq_lens_q") if default_pack else None
    if bounds is not None:
        lengths = np.diff(np.asarray(bounds, dtype=np.int64))
        if len(lengths) == len(keys):
            declared, _ = _declared(messages, keys)
            bad = np.flatnonzero(lengths != declared)
            if bad.size:
                k = int(bad[0])
                return (
                    f"{sample_name(messages, keys[k])} packs into {int(lengths[k])} tokens but "
                    f"declared {int(declared[k])}."
                )
    names = ", ".join(sample_name(messages, k) for k in keys[:_SHOWN])
    return f"The bin holds {names}."
