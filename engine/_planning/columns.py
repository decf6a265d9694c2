"""The planner's input as arrays: one row per sample of a step, in source-layout order.

:class:`StepColumns` is what the metadata messages of a gathered step carry, laid side by
side: for every sample the rank that read it, its position in that rank's step, its tokens
and (when configured) its packing costs and features, plus the number of samples in each
source bin. The planner works on these arrays; :class:`SampleKey` and
:class:`SampleMetadata` objects are built only where an API hands out objects (a cost model
called per sample, a custom algorithm reading ``problem.keys``, an error message), through
the lazy views below.

:func:`columns_of_samples` turns the object-based input of ``Planner.plan`` into columns,
checking it with the messages that input has always had.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from evenflow.engine._model import PackingConstraints, SampleKey, SampleMetadata
from evenflow.engine.errors import ConfigError

__all__ = ["StepColumns", "columns_of_samples"]

_KEY_COLUMNS = tuple(map(operator.attrgetter, ("source_rank", "step", "index")))
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, kw_only=True, eq=False)
class StepColumns:
    """One step of one balance group as per-sample arrays (rows in source-layout order).

    ``sizes[b]`` is the number of samples of source bin ``b`` (rank-major: the first
    ``bins_per_rank`` bins belong to rank 0); rows list bin 0's samples in pack order, then
    bin 1's, and so on. Row ``i`` is the sample ``SampleKey(source_rank[i], step, index[i])``
    with ``tokens[i]`` tokens. ``key_step`` gives every key's step when it is not the step
    being planned. ``packing_costs[i, k]`` is the footprint for ``budget_names[k]`` (NaN when
    the sample does not declare it). ``features[i]`` is the sample's feature dict (None:
    empty), passed to cost models as given; ``metadata``, when the caller has the objects,
    replaces the rows' tokens, features and packing costs for cost models.
    """

    sizes: np.ndarray
    source_rank: np.ndarray
    index: np.ndarray
    tokens: np.ndarray
    key_step: np.ndarray | None = None
    packing_costs: np.ndarray | None = None
    budget_names: tuple[str, ...] = ()
    features: Sequence[Mapping[str, Any] | None] | None = None
    metadata: Sequence[SampleMetadata] | None = None

    @property
    def num_samples(self) -> int:
        return len(self.tokens)


# -- views: objects on demand ---------------------------------------------------------------


class KeyView(Sequence[SampleKey]):
    """The keys of an ``(n, 3)`` int64 array of key fields; each built when read."""

    __slots__ = ("_fields",)

    def __init__(self, fields: np.ndarray) -> None:
        self._fields = fields

    def __len__(self) -> int:
        return len(self._fields)

    @overload
    def __getitem__(self, i: int) -> SampleKey: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[SampleKey, ...]: ...
    def __getitem__(self, i: int | slice) -> SampleKey | tuple[SampleKey, ...]:
        if isinstance(i, slice):
            return tuple(itertools.starmap(SampleKey, self._fields[i].tolist()))
        return SampleKey(*self._fields[i].tolist())

    def __iter__(self) -> Iterator[SampleKey]:
        return itertools.starmap(SampleKey, self._fields.tolist())


def _checked_metadata(tokens: int, features: Any, packing_costs: dict[str, float]) -> Any:
    # The planner checked tokens and packing costs as arrays, and every rank validated its
    # features when it built its own SampleMetadata before sending them. Building the object
    # without a second per-sample validation keeps a per-sample cost model (FlopsCost) on a
    # 100,000-sample step at its own cost: validation would add ~4 us per sample.
    meta = object.__new__(SampleMetadata)
    object.__setattr__(meta, "tokens", tokens)
    object.__setattr__(meta, "features", {} if features is None else features)
    object.__setattr__(meta, "packing_costs", packing_costs)
    object.__setattr__(meta, "loss_tokens", None)  # not a planning input
    return meta


class MetadataView(Sequence[SampleMetadata]):
    """The metadata of the rows ``order`` of ``columns``; each object built when read."""

    __slots__ = ("_columns", "_order")

    def __init__(self, columns: StepColumns, order: np.ndarray) -> None:
        self._columns = columns
        self._order = order

    def __len__(self) -> int:
        return len(self._order)

    def _rows(self, rows: list[int]) -> Iterator[SampleMetadata]:
        c = self._columns
        if c.metadata is not None:
            return map(c.metadata.__getitem__, rows)
        tokens: list[int] = c.tokens[rows].tolist()
        features: Iterable[Any] = (
            itertools.repeat(None, len(rows))
            if c.features is None
            else map(c.features.__getitem__, rows)
        )
        if c.packing_costs is None or not c.budget_names:
            costs: Iterable[dict[str, float]] = map(dict, itertools.repeat((), len(rows)))
        else:
            names = c.budget_names
            costs = (
                {n: v for n, v in zip(names, row, strict=True) if not math.isnan(v)}
                for row in c.packing_costs[rows].tolist()
            )
        return map(_checked_metadata, tokens, features, costs)

    @overload
    def __getitem__(self, i: int) -> SampleMetadata: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[SampleMetadata, ...]: ...
    def __getitem__(self, i: int | slice) -> SampleMetadata | tuple[SampleMetadata, ...]:
        if isinstance(i, slice):
            return tuple(self._rows(self._order[i].tolist()))
        return next(self._rows([int(self._order[i])]))

    def __iter__(self) -> Iterator[SampleMetadata]:
        return self._rows(self._order.tolist())


# -- checks shared by both entries ------------------------------------------------------------


def budget_columns(
    columns: StepColumns, constraints: PackingConstraints, order: np.ndarray
) -> np.ndarray:
    """Footprints per configured budget (``constraints.budgets`` order), rows in ``order``."""
    names = list(constraints.budgets)
    out = np.full((len(order), len(names)), np.nan, dtype=np.float64)
    if not names:
        return out
    given = columns.budget_names
    costs = columns.packing_costs
    for k, name in enumerate(names):
        if costs is not None and name in given:
            out[:, k] = costs[order, given.index(name)]
    return out


def check_samples(
    constraints: PackingConstraints,
    tokens: np.ndarray,
    budget_costs: np.ndarray,
    keys: Sequence[SampleKey],
    metas: Sequence[SampleMetadata],
) -> None:
    """Raise the canonical message for the first sample no empty bin could hold."""
    missing = np.isnan(budget_costs)
    for k in range(budget_costs.shape[1]):  # a missing name first, budget by budget
        if missing[:, k].any():
            i = int(np.flatnonzero(missing[:, k])[0])
            constraints.validate_sample(keys[i], metas[i])  # raises: missing name
    bad = np.zeros(len(tokens), dtype=bool)
    if constraints.oversized_policy == "error":
        bad |= tokens > constraints.seq_len
    if budget_costs.shape[1]:
        bad |= np.any(budget_costs > np.array(list(constraints.budgets.values())), axis=1)
    hits = np.flatnonzero(bad)
    if hits.size:
        i = int(hits[0])
        constraints.validate_sample(keys[i], metas[i])  # raises the precise message
        raise AssertionError("unreachable: validate_sample must reject this sample")


def check_columns(columns: StepColumns, num_bins: int) -> None:
    """Shapes, types and ranges of ``columns``; each failure names the column and the fix."""
    if not isinstance(columns, StepColumns):
        raise TypeError(f"columns must be a StepColumns, but got {columns!r:.80}.")
    sizes = _int_vector("sizes", columns.sizes, None)
    if len(sizes) != num_bins:
        raise ConfigError(
            f"columns.sizes must hold num_ranks * bins_per_rank = {num_bins} bin sizes, but "
            f"got {len(sizes)}; list every source bin, rank-major."
        )
    if sizes.min() < 1:
        b = int(np.flatnonzero(sizes < 1)[0])
        raise ConfigError(
            f"columns.sizes[{b}] is {int(sizes[b])}; every source bin holds at least one sample."
        )
    n = len(columns.tokens)
    if int(sizes.sum()) != n:
        raise ConfigError(
            f"columns.sizes sums to {int(sizes.sum())} samples but columns.tokens has {n} rows; "
            "the sizes must count exactly the rows."
        )
    for name in ("source_rank", "index", "tokens", "key_step"):
        value = getattr(columns, name)
        if value is None:
            continue
        column = _int_vector(name, value, n)
        low = 1 if name == "tokens" else 0
        if column.size and column.min() < low:
            i = int(np.flatnonzero(column < low)[0])
            raise ConfigError(f"columns.{name}[{i}] is {int(column[i])}, but must be >= {low}.")
    costs = columns.packing_costs
    if costs is not None:
        array = np.asarray(costs)
        expected = (n, len(columns.budget_names))
        if array.shape != expected or array.dtype.kind != "f":
            raise ConfigError(
                f"columns.packing_costs must be a float array of shape {expected} (one column "
                f"per budget name), but got shape {array.shape} and dtype {array.dtype}."
            )
        invalid = ~np.isnan(array) & ~((array >= 0) & np.isfinite(array))
        if invalid.any():
            i, k = (int(v) for v in np.argwhere(invalid)[0])
            raise ConfigError(
                f"columns.packing_costs[{i}, {k}] ({columns.budget_names[k]!r}) is "
                f"{float(array[i, k])!r}; a packing cost is a finite number >= 0 (NaN: absent)."
            )
    for name in ("features", "metadata"):
        value = getattr(columns, name)
        if value is not None and len(value) != n:
            raise ConfigError(
                f"columns.{name} must hold one entry per row ({n}), but has {len(value)}."
            )


def _int_vector(name: str, value: object, n: int | None) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1 or array.dtype.kind not in "iu" or (n is not None and len(array) != n):
        shape = "one entry per row" if n is None else f"{n} entries, one per row"
        raise ConfigError(
            f"columns.{name} must be a 1-D integer array ({shape}), but got shape "
            f"{array.shape} and dtype {array.dtype}."
        )
    return array


# -- the object-based input ------------------------------------------------------------------


def columns_of_samples(
    samples: Iterable[tuple[SampleKey, SampleMetadata]],
    reference_bins: Sequence[Sequence[SampleKey]],
    *,
    num_ranks: int,
    bins_per_rank: int,
    constraints: PackingConstraints,
) -> tuple[StepColumns, tuple[SampleKey, ...]]:
    """``Planner.plan``'s input as columns, and its keys in canonical (ascending) order."""
    keys, metas, fields = _canonical_samples(samples, num_ranks * bins_per_rank)
    identity = np.arange(len(keys), dtype=np.int64)
    names = tuple(constraints.budgets)
    if names:
        costs = np.array(
            [[m.packing_costs.get(name, np.nan) for name in names] for m in metas],
            dtype=np.float64,
        ).reshape(len(metas), len(names))
    else:  # no budgets: no per-sample pass (a list per sample cost ~0.3 ms per 1,000)
        costs = np.empty((len(metas), 0), dtype=np.float64)
    tokens = np.fromiter(
        map(operator.attrgetter("tokens"), metas), dtype=np.int64, count=len(metas)
    )
    check_samples(constraints, tokens, costs, keys, metas)
    flat, sizes = _source_bins(reference_bins, keys, fields, num_ranks, bins_per_rank)
    same = bool(np.array_equal(flat, identity))
    rows = fields if same else fields[flat]
    columns = StepColumns(
        sizes=sizes,
        source_rank=rows[:, 0],
        key_step=rows[:, 1],
        index=rows[:, 2],
        tokens=tokens if same else tokens[flat],
        packing_costs=costs if same else costs[flat],
        budget_names=names,
        metadata=metas if same else list(map(metas.__getitem__, flat.tolist())),
    )
    return columns, keys


def _canonical_samples(
    samples: Iterable[tuple[SampleKey, SampleMetadata]], num_bins: int
) -> tuple[tuple[SampleKey, ...], list[SampleMetadata], np.ndarray]:
    """Keys, metadata and key fields (an ``(n, 3)`` int64 array), in ascending key order."""
    given: object = samples
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(
            f"samples must be an iterable of (SampleKey, SampleMetadata) pairs, but got "
            f"{samples!r:.80}."
        )
    items = samples if type(samples) is list else list(samples)
    if not items:
        raise ConfigError(
            f"samples is empty, but a step needs at least num_ranks * bins_per_rank = "
            f"{num_bins} samples (one per bin)."
        )
    # Type checks as C-level passes (a set of types, not a Python frame per sample).
    shapes_ok = set(map(type, items)) == {tuple} and set(map(len, items)) == {2}
    if shapes_ok:
        given_keys = list(map(_FIRST, items))
        given_metas = list(map(_SECOND, items))
        shapes_ok = _all_instances(given_keys, SampleKey) and _all_instances(
            given_metas, SampleMetadata
        )
    if not shapes_ok:
        bad = next(item for item in items if not _is_pair(item))
        raise TypeError(
            f"samples must contain (SampleKey, SampleMetadata) pairs, but got "
            f"{bad!r:.120}; pass one tuple per sample."
        )
    fields = _key_fields(given_keys, "samples")
    if strictly_increasing(fields):
        return tuple(given_keys), given_metas, fields
    order = np.lexsort((fields[:, 2], fields[:, 1], fields[:, 0]))
    fields = fields[order]
    positions: list[int] = order.tolist()
    keys = tuple(map(given_keys.__getitem__, positions))
    if not strictly_increasing(fields):
        raise_duplicate(keys)
    return keys, list(map(given_metas.__getitem__, positions)), fields


def raise_duplicate(keys: Sequence[SampleKey]) -> None:
    """Name the first key listed twice (``keys`` sorted, so duplicates are neighbours)."""
    for a, b in itertools.pairwise(keys):
        if a == b:
            raise ConfigError(
                f"samples lists key {a} more than once; every sample of a step needs a "
                "distinct SampleKey."
            )
    raise AssertionError("unreachable: a duplicate key must be adjacent in sorted order")


def _source_bins(
    reference_bins: Sequence[Sequence[SampleKey]],
    keys: Sequence[SampleKey],
    fields: np.ndarray,
    num_ranks: int,
    bins_per_rank: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The source layout as ``(flat, sizes)``: the canonical index of every listed key."""
    nb = num_ranks * bins_per_rank
    given: object = reference_bins
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(
            f"reference_bins must be a sequence of {nb} bins (sequences of SampleKey), "
            f"but got {reference_bins!r:.80}."
        )
    if len(reference_bins) != nb:
        raise ConfigError(
            f"reference_bins must hold num_ranks * bins_per_rank = {nb} bins "
            f"({num_ranks} ranks x {bins_per_rank}), but got "
            f"{len(reference_bins)}; pass the source layout rank-major."
        )
    if not set(map(type, reference_bins)) <= {list, tuple} or 0 in map(len, reference_bins):
        for b, items in enumerate(reference_bins):
            bin_value: object = items
            if (
                isinstance(bin_value, (str, bytes))
                or not isinstance(bin_value, Sequence)
                or not bin_value
            ):
                raise ConfigError(
                    f"reference_bins[{b}] (rank {b // bins_per_rank}, bin "
                    f"{b % bins_per_rank}) must be a non-empty sequence of SampleKey, "
                    f"but got {items!r:.80}; every source bin holds at least one sample."
                )
    sizes = np.fromiter(map(len, reference_bins), dtype=np.int64, count=nb)
    given_keys = list(itertools.chain.from_iterable(reference_bins))
    ends = np.cumsum(sizes)
    if not _all_instances(given_keys, SampleKey):
        p = next(p for p, k in enumerate(given_keys) if not isinstance(k, SampleKey))
        b = int(np.searchsorted(ends, p, side="right"))
        raise TypeError(
            f"reference_bins[{b}] must contain SampleKey values, but got {given_keys[p]!r:.80}."
        )
    if len(given_keys) == len(keys) and all(map(operator.is_, given_keys, keys)):
        # The bins list the samples' own key objects, in canonical order (what a caller
        # that builds both from one list passes): every key once, so the source layout is
        # the identity, without re-reading every key's fields (~0.2 ms per 1,000 keys).
        return np.arange(len(keys), dtype=np.int64), sizes
    flat = _lookup(fields, _key_fields(given_keys, "reference_bins"))
    if flat.size and flat.min() < 0:
        p = int(np.flatnonzero(flat < 0)[0])
        b = int(np.searchsorted(ends, p, side="right"))
        raise ConfigError(
            f"reference_bins[{b}] lists key {given_keys[p]}, which is not among samples; "
            "reference_bins must list exactly the keys of samples."
        )
    seen = np.bincount(flat, minlength=len(keys))
    if not np.all(seen == 1):
        twice = np.flatnonzero(seen > 1)
        if twice.size:
            raise ConfigError(
                f"reference_bins lists key {keys[int(twice[0])]} more than once; every "
                "key must appear in exactly one source bin."
            )
        absent = int(np.flatnonzero(seen == 0)[0])
        raise ConfigError(
            f"reference_bins does not list key {keys[absent]} of samples; every key must "
            "appear in exactly one source bin."
        )
    return flat, sizes


def _all_instances(values: Iterable[object], cls: type) -> bool:
    """Whether every value is a ``cls`` (one C-level pass over the distinct types)."""
    return all(issubclass(t, cls) for t in set(map(type, values)))


def _is_pair(item: object) -> bool:
    return (
        type(item) is tuple
        and len(item) == 2
        and isinstance(item[0], SampleKey)
        and isinstance(item[1], SampleMetadata)
    )


def _key_fields(keys: Sequence[SampleKey], who: str) -> np.ndarray:
    """``(source_rank, step, index)`` of every key, as an ``(n, 3)`` int64 array."""
    n = len(keys)
    out = np.empty((n, 3), dtype=np.int64)
    try:
        # One C-level pass per field (no tuple per key).
        for column, field in enumerate(_KEY_COLUMNS):
            out[:, column] = np.fromiter(map(field, keys), dtype=np.int64, count=n)
    except OverflowError:
        big = next(k for k in keys if max(k.as_tuple()) > _INT64_MAX)
        raise ConfigError(
            f"{who} holds key {big}, whose fields exceed 2**63 - 1; the planner encodes key "
            "fields as int64, so use smaller ranks, steps and indices."
        ) from None
    return out


def strictly_increasing(fields: np.ndarray) -> bool:
    """Whether the rows of an ``(n, 3)`` array ascend strictly in lexicographic order."""
    if len(fields) < 2:
        return True
    d = np.diff(fields, axis=0)
    up = (d[:, 0] > 0) | ((d[:, 0] == 0) & ((d[:, 1] > 0) | ((d[:, 1] == 0) & (d[:, 2] > 0))))
    return bool(up.all())


def _lookup(table: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Row of ``table`` (sorted, distinct rows) equal to each query row, or -1.

    Rows are packed into one int64 each by mixed radix over the table's value ranges, which
    keeps their order, so one ``searchsorted`` finds them all. A query outside those ranges
    cannot be in the table. When the ranges are too wide to pack (arbitrary huge indices)
    a dictionary of rows does the lookup instead.
    """
    low = table.min(axis=0)
    span = table.max(axis=0) - low + 1
    inside = np.all((queries >= low) & (queries < low + span), axis=1)
    if float(span[0]) * float(span[1]) * float(span[2]) < 2.0**62:
        pack = np.array([span[1] * span[2], span[2], 1], dtype=np.int64)
        codes = (table - low) @ pack
        wanted = (np.where(inside[:, None], queries, low) - low) @ pack
        pos = np.minimum(np.searchsorted(codes, wanted), len(codes) - 1)
        return np.where(inside & (codes[pos] == wanted), pos, -1)
    index = {row: i for i, row in enumerate(map(tuple, table.tolist()))}
    return np.fromiter(
        (index.get(row, -1) for row in map(tuple, queries.tolist())),
        dtype=np.int64,
        count=len(queries),
    )
