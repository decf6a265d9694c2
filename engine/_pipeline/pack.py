"""The default pack and collate functions: one bin of token samples → one packed sequence.

Packing concatenates the bin's samples without padding into one row, laid out the way Hugging
Face causal language models take packed input (the layout of ``DataCollatorWithFlattening``),
so that ``model(**packed, use_cache=False)`` trains on the bin as if each sample ran alone:

* ``position_ids`` restart at 0 for every sample; with no ``attention_mask`` and no cache the
  model derives one causal mask per sample from them (sdpa, eager), and flash attention reads
  the boundaries from ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``;
* ``labels`` hold -100 (the ignore index of the loss) at each sample's first position: the
  model shifts labels by one inside its loss, so without it the last token of a sample would
  be trained to predict the first token of the next one.

A sample is a 1-D integer sequence (list, tuple, numpy array, torch tensor) of token ids, or a
mapping with ``"input_ids"`` and optionally ``"labels"`` of the same length (-100 where the
sample is not trained on, e.g. its prompt). Other keys of a mapping (attention masks, metadata)
are ignored: an ``attention_mask`` in the packed batch would switch off the per-sample masks,
and a custom ``pack_fn`` can carry more. All conversion goes through numpy so read-only inputs
(zero-copy views of received buffers) work without copies or warnings until the one
concatenation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from evenflow.engine._model import SampleMetadata
from evenflow.engine._sources._common import IndexedSample
from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError

__all__ = [
    "IGNORE_INDEX",
    "count_loss_tokens",
    "default_collate_fn",
    "default_pack_fn",
    "with_loss_tokens",
]

IGNORE_INDEX = -100
"""The label that takes no part in the loss (Hugging Face's and ``cross_entropy``'s default)."""

_IntArray = npt.NDArray[np.int64]


def _as_tokens(value: object, what: str, *, row_ok: bool = False) -> _IntArray:
    """``value`` as a 1-D int64 array, or a ConfigError/TypeError naming ``what``.

    ``row_ok`` also accepts one row ``[1, T]`` (a packed bin's layout), flattened.
    """
    if isinstance(value, torch.Tensor):
        if row_ok and value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ConfigError(
                f"{what} must be a 1-D integer tensor, but got a tensor of shape "
                f"{tuple(value.shape)!r} and dtype {value.dtype}."
            )
        if value.dtype == torch.bool:
            raise ConfigError(f"{what} must hold integer token ids, but got a bool tensor.")
        array = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{what} must be a 1-D sequence of token ids (list, numpy array, torch tensor) or a "
            f"mapping with 'input_ids', but got {type(value).__name__}: {value!r:.80}."
        )
    else:
        array = np.asarray(value)
        if array.size == 0:
            array = array.astype(np.int64)
    if row_ok and array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ConfigError(
            f"{what} must be 1-D, but got an array of shape {array.shape!r}; pass one "
            "sequence of token ids per sample."
        )
    if array.dtype.kind not in "iu":
        raise ConfigError(
            f"{what} must hold integer token ids, but got dtype {array.dtype} "
            f"(first values {array[:4].tolist()!r})."
        )
    return array.astype(np.int64, copy=False)


def _split_sample(
    sample: object, what: str, *, row_ok: bool = False
) -> tuple[_IntArray, _IntArray | None]:
    if isinstance(sample, Mapping):
        if "input_ids" not in sample:
            raise ConfigError(
                f"{what} is a mapping without 'input_ids' (keys: "
                f"{sorted(map(str, sample))!r}); add the token ids under 'input_ids'."
            )
        tokens = _as_tokens(sample["input_ids"], f"{what}['input_ids']", row_ok=row_ok)
        raw_labels = sample.get("labels")
        if raw_labels is None:
            return tokens, None
        labels = _as_tokens(raw_labels, f"{what}['labels']", row_ok=row_ok)
        if len(labels) != len(tokens):
            raise ConfigError(
                f"{what} has {len(tokens)} input_ids but {len(labels)} labels; "
                "labels must align one-to-one with input_ids."
            )
        return tokens, labels
    return _as_tokens(sample, what, row_ok=row_ok), None


def count_loss_tokens(sample: object) -> int:
    """How many tokens ``sample`` contributes to a causal-LM loss once packed.

    The first token of a sample is never a target (nothing in the sample precedes it), so a
    sample without labels counts ``len(input_ids) - 1``, and one with labels counts its
    labels after the first that are not ``-100``. This is the number of -100-free labels
    :func:`default_pack_fn` emits for the sample, and a packed bin from it (a mapping whose
    ``labels`` are ``[1, T]``) is accepted too: its count is the sum over its samples. Use it
    in a ``metadata_fn`` to carry per-sample loss tokens, or to normalise a summed loss.
    """
    tokens, labels = _split_sample(sample, "sample", row_ok=True)
    if labels is None:
        return max(len(tokens) - 1, 0)
    return int(np.count_nonzero(labels[1:] != IGNORE_INDEX))


def with_loss_tokens(metadata_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``metadata_fn`` completed with each sample's loss tokens as :func:`default_pack_fn`
    counts them, where it leaves ``loss_tokens`` unknown (the loader wraps the metadata
    function this way whenever the default pack is used).

    A sample without ``labels`` trains on all its positions but the first, so its count is
    ``tokens - 1`` with no look at the tokens; only a sample carrying ``labels`` is counted
    (:func:`count_loss_tokens`). A value the metadata function gives is kept. An
    ``IndexedSample`` (a dataset index standing for a sample not read yet) stays unknown: its
    labels cannot be seen. What is neither a ``SampleMetadata`` nor an ``int`` passes through
    for the loader to reject by name.
    """

    def describe(sample: Any) -> Any:
        meta = metadata_fn(sample)
        if isinstance(meta, int) and not isinstance(meta, bool):
            meta = SampleMetadata(tokens=meta)
        if not isinstance(meta, SampleMetadata) or meta.loss_tokens is not None:
            return meta
        if isinstance(sample, IndexedSample):
            return meta
        if isinstance(sample, Mapping) and sample.get("labels") is not None:
            loss = count_loss_tokens(sample)
        else:
            loss = meta.tokens - 1
        return dataclasses.replace(meta, loss_tokens=loss)

    return describe


def default_pack_fn(samples: Sequence[Any], seq_len: int) -> dict[str, Any]:
    """Concatenate one bin of ``k`` samples into one packed row of ``T`` tokens (no padding).

    Returns a dict that a Hugging Face causal LM takes as keyword arguments
    (``model(**packed, use_cache=False)``):

    * ``input_ids``: int64 tensor ``[1, T]``;
    * ``labels``: int64 tensor ``[1, T]``: each sample's ``labels`` (its ``input_ids`` when it
      has none), with ``-100`` at each sample's first position;
    * ``position_ids``: int64 tensor ``[1, T]``, restarting at 0 for each sample;
    * ``cu_seq_lens_q``, ``cu_seq_lens_k``: the same int32 tensor ``[k + 1]``,
      ``[0, l1, l1 + l2, ..., T]``;
    * ``max_length_q``, ``max_length_k``: python ``int``, the longest sample.

    ``count_loss_tokens(packed)`` is the number of tokens the bin trains on. ``T`` must not
    exceed ``seq_len`` unless the bin holds a single (oversized) sample. Empty bins, empty
    samples and non-integer tokens raise ``ConfigError`` (a ``ValueError``).
    """
    check_int("seq_len", seq_len, minimum=1)
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise TypeError(
            f"samples must be a sequence of samples (one bin), but got "
            f"{type(samples).__name__}; pass a list."
        )
    if not samples:
        raise ConfigError(
            "samples is empty, but a bin must hold at least one sample; the planner never "
            "produces empty bins, so check the pack input."
        )
    parts = [_split_sample(sample, f"samples[{i}]") for i, sample in enumerate(samples)]
    lengths = np.fromiter((len(tokens) for tokens, _ in parts), dtype=np.int64, count=len(parts))
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ConfigError(
            f"samples[{int(empty[0])}] has no tokens; every sample needs at least one token."
        )
    total = int(lengths.sum())
    if total > seq_len and len(parts) > 1:
        raise ConfigError(
            f"The bin holds {total} tokens in {len(parts)} samples, more than seq_len={seq_len}; "
            "only a single sample may exceed seq_len (an oversized bin of its own)."
        )
    input_ids = np.concatenate([tokens for tokens, _ in parts])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    # concatenate copies, so writing the boundaries never touches a sample's own labels.
    labels = np.concatenate([tokens if own is None else own for tokens, own in parts])
    labels[starts] = IGNORE_INDEX
    cu_seq_lens = np.zeros(len(parts) + 1, dtype=np.int32)
    cu_seq_lens[1:] = ends
    boundaries = torch.from_numpy(cu_seq_lens)
    longest = int(lengths.max())
    return {
        "input_ids": torch.from_numpy(input_ids).view(1, total),
        "labels": torch.from_numpy(labels).view(1, total),
        "position_ids": torch.from_numpy(position_ids).view(1, total),
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def default_collate_fn(packed_bins: Sequence[Any]) -> list[Any]:
    """Return the step's packed bins (one per microbatch) as a list, unchanged.

    Each bin stays its own packed sequence because microbatches run one after another; a
    custom ``collate_fn`` may stack or pad them instead.
    """
    if isinstance(packed_bins, list):
        return packed_bins
    if isinstance(packed_bins, (str, bytes, Mapping)) or not isinstance(packed_bins, Sequence):
        raise TypeError(
            f"packed_bins must be a sequence of packed bins, but got "
            f"{type(packed_bins).__name__}; pass a list."
        )
    return list(packed_bins)
