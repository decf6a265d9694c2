"""Sample lengths of a map-style dataset, read once and checked, naming the bad index.

Where the lengths come from, in order of preference:

* ``lengths=``: an array (or sequence) of one integer per dataset index;
* ``length_column=``: a column of a Hugging Face ``datasets.Dataset``, read once through Arrow
  without decoding any other column — an integer column is used as is, a list column (such as
  ``input_ids``) by the length of each list (Arrow's list offsets: no token is decoded). On any
  other dataset the column is read item by item (``dataset[i][length_column]``);
* ``length_fn=``: called once on every ``dataset[i]`` (reads every sample once);
* none of them: a Hugging Face dataset with an ``input_ids`` column uses that column; any other
  dataset is measured item by item like the loader's default ``metadata_fn``
  (``len(sample["input_ids"])`` for mappings, else ``len(sample)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from evenflow.engine._model import MAX_TOKENS
from evenflow.engine.errors import ConfigError
from evenflow.transports.internal import NOTE_PREFIX

__all__ = ["default_length", "fingerprint", "is_hf_dataset", "read_lengths"]


def is_hf_dataset(dataset: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (duck-typed: ``datasets`` is not imported)."""
    return all(hasattr(dataset, name) for name in ("column_names", "select_columns", "with_format"))


def default_length(sample: Any) -> int:
    """Token count of a sample: ``len(sample["input_ids"])`` for mappings, else ``len(sample)``.
    A mapping without ``input_ids`` is refused (``len`` would count its keys)."""
    if isinstance(sample, Mapping):
        if "input_ids" in sample:
            return len(sample["input_ids"])
        raise ConfigError(
            f"Cannot measure a sample with keys {sorted(map(str, sample))[:8]}: the default "
            "length is len(sample['input_ids']). Pass length_column= (the column holding "
            "token ids or counts), length_fn= or lengths=, or tokenize into 'input_ids' first."
        )
    try:
        return len(sample)
    except TypeError:
        raise TypeError(
            f"Cannot measure a sample of type {type(sample).__name__}; pass length_fn= "
            "(sample -> token count), length_column= or lengths=."
        ) from None


def read_lengths(
    dataset: Any,
    *,
    lengths: Any = None,
    length_column: str | None = None,
    length_fn: Callable[[Any], int] | None = None,
) -> npt.NDArray[np.int64]:
    """One int64 length per dataset index, every one >= 1, or an error naming the index."""
    given = [
        name
        for name, v in (
            ("lengths", lengths),
            ("length_column", length_column),
            ("length_fn", length_fn),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ConfigError(
            f"Pass at most one of lengths, length_column and length_fn, but got {given}."
        )
    size = len(dataset)
    if lengths is not None:
        array = _as_lengths(np.asarray(lengths), "lengths")
    elif length_fn is not None:
        if not callable(length_fn):
            raise TypeError(f"length_fn must be callable, but got {length_fn!r:.80}.")
        array = _measure(dataset, size, length_fn, "length_fn")
    elif length_column is not None:
        if not isinstance(length_column, str):
            raise TypeError(f"length_column must be a column name, but got {length_column!r}.")
        if is_hf_dataset(dataset):
            array = _hf_column(dataset, length_column)
        else:
            column = length_column
            array = _measure(dataset, size, lambda s: _column_length(s[column]), "length_column")
    elif is_hf_dataset(dataset) and "input_ids" in dataset.column_names:
        array = _hf_column(dataset, "input_ids")
    elif is_hf_dataset(dataset):
        raise ConfigError(
            f"The dataset has no 'input_ids' column (its columns are {dataset.column_names}), "
            "so its samples' token counts are unknown. Pass length_column= naming the column "
            "of token ids or counts (e.g. length_column='tokens'), length_fn= or lengths=, "
            "or tokenize into 'input_ids' first (dataset.map)."
        )
    else:
        array = _measure(dataset, size, default_length, "the default length (len of input_ids)")
    if array.shape != (size,):
        raise ConfigError(
            f"lengths must hold one length per dataset index ({size}), but has shape {array.shape}."
        )
    huge = np.flatnonzero(array > MAX_TOKENS)
    if huge.size:
        i = int(huge[0])
        raise ConfigError(
            f"Dataset index {i} has length {int(array[i])} ({huge.size} such samples), more than "
            f"the {MAX_TOKENS} tokens any sample may hold; check the length column or "
            f"length_fn, starting with index {i}."
        )
    bad = np.flatnonzero(array < 1)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"Dataset index {i} has length {int(array[i])} ({bad.size} such samples); every "
            "sample needs at least 1 token. Filter empty samples out of the dataset first "
            f"(e.g. datasets' .filter), starting with index {i}."
        )
    return array


def _as_lengths(array: npt.NDArray[Any], what: str) -> npt.NDArray[np.int64]:
    if array.ndim != 1:
        raise ConfigError(f"{what} must be one-dimensional, but has shape {array.shape}.")
    if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
        raise ConfigError(
            f"{what} must hold integers, but has dtype {array.dtype}; pass token counts."
        )
    return array.astype(np.int64)  # a copy: the source keeps it read-only


def _hf_column(dataset: Any, column: str) -> npt.NDArray[np.int64]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if column not in dataset.column_names:
        raise ConfigError(
            f"length_column={column!r} is not a column of the dataset; its columns are "
            f"{dataset.column_names}."
        )
    # select_columns + the arrow format respect an indices mapping (select/shuffle/filter)
    # and never touch the other columns.
    values = dataset.select_columns([column]).with_format("arrow")[:].column(column)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = pc.list_value_length(values)
    if values.null_count:
        first = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(
            f"Dataset index {first} has no value in length_column={column!r}; every row needs "
            "a length."
        )
    return _as_lengths(values.to_numpy(), f"length_column={column!r}")


def _measure(dataset: Any, size: int, fn: Callable[[Any], Any], what: str) -> npt.NDArray[np.int64]:
    out = np.empty(size, dtype=np.int64)
    for i in range(size):
        try:
            value = fn(dataset[i])
        except Exception as exc:
            exc.add_note(f"{NOTE_PREFIX}raised measuring dataset index {i} ({what}).")
            raise
        if isinstance(value, np.integer):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{what} returned {value!r:.80} ({type(value).__name__}) for dataset index {i}; "
                "it must return the sample's token count as an int."
            )
        out[i] = value
    return out


def _column_length(value: Any) -> Any:
    """A length column's value: an integer as is, a token sequence by its length."""
    return len(value) if hasattr(value, "__len__") and not isinstance(value, str) else value


def fingerprint(lengths: npt.NDArray[np.int64]) -> str:
    """Digest of the length array (16 hex characters): equal on ranks that see one dataset."""
    return hashlib.sha256(lengths.astype("<i8", copy=False).tobytes()).hexdigest()[:16]
