"""The default pack and collate functions: one bin of token samples → one packed sequence.

Packing concatenates the bin's samples without padding and describes the boundaries the way
variable-length attention kernels expect them: ``cu_seqlens`` (cumulative lengths starting at
0, int32) with ``max_seqlen`` is the layout of flash-attention's ``*_varlen_*`` functions and of
Hugging Face's flattening collator, and ``position_ids`` restarting at 0 per sample lets models
that infer boundaries from positions keep samples apart.

A sample is a 1-D integer sequence (list, tuple, numpy array, torch tensor) of token ids, or a
mapping with ``"input_ids"`` and optionally ``"labels"`` of the same length. Other keys of a
mapping (attention masks, metadata) are ignored: a packed sequence needs only the boundaries,
and a custom ``pack_fn`` can carry more. All conversion goes through numpy so read-only inputs
(zero-copy views of received buffers) work without copies or warnings until the one
concatenation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from evenflow.engine._validate import check_int
from evenflow.engine.errors import ConfigError

__all__ = ["default_collate_fn", "default_pack_fn"]

_IntArray = npt.NDArray[np.int64]


def _as_tokens(value: object, what: str) -> _IntArray:
    """``value`` as a 1-D int64 array, or a ConfigError/TypeError naming ``what``."""
    if isinstance(value, torch.Tensor):
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


def _split_sample(sample: object, index: int) -> tuple[_IntArray, _IntArray | None]:
    if isinstance(sample, Mapping):
        if "input_ids" not in sample:
            raise ConfigError(
                f"samples[{index}] is a mapping without 'input_ids' (keys: "
                f"{sorted(map(str, sample))!r}); add the token ids under 'input_ids'."
            )
        tokens = _as_tokens(sample["input_ids"], f"samples[{index}]['input_ids']")
        raw_labels = sample.get("labels")
        if raw_labels is None:
            return tokens, None
        labels = _as_tokens(raw_labels, f"samples[{index}]['labels']")
        if len(labels) != len(tokens):
            raise ConfigError(
                f"samples[{index}] has {len(tokens)} input_ids but {len(labels)} labels; "
                "labels must align one-to-one with input_ids."
            )
        return tokens, labels
    return _as_tokens(sample, f"samples[{index}]"), None


def default_pack_fn(samples: Sequence[Any], seq_len: int) -> dict[str, Any]:
    """Concatenate one bin of samples into one packed sequence of ``T`` tokens (no padding).

    Returns a dict with:

    * ``input_ids``: int64 tensor ``[T]``;
    * ``labels``: int64 tensor ``[T]``, only if every sample is a mapping with labels;
    * ``position_ids``: int64 tensor ``[T]``, restarting at 0 for each sample;
    * ``cu_seqlens``: int32 tensor ``[k + 1]``: ``[0, l1, l1 + l2, ..., T]``;
    * ``seq_lens``: int32 tensor ``[k]`` of the sample lengths;
    * ``max_seqlen``: python ``int``, the longest sample.

    ``T`` must not exceed ``seq_len`` unless the bin holds a single (oversized) sample. Empty
    bins, empty samples and non-integer tokens raise ``ConfigError`` (a ``ValueError``).
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
    parts = [_split_sample(sample, i) for i, sample in enumerate(samples)]
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
    cu_seqlens = np.zeros(len(parts) + 1, dtype=np.int32)
    cu_seqlens[1:] = ends
    packed: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "seq_lens": torch.from_numpy(lengths.astype(np.int32)),
        "max_seqlen": int(lengths.max()),
    }
    label_parts = [labels for _, labels in parts]
    if all(labels is not None for labels in label_parts):
        packed["labels"] = torch.from_numpy(
            np.concatenate([labels for labels in label_parts if labels is not None])
        )
    return packed


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
