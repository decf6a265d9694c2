"""evenflow.engine.testing — the resume contract every step source must keep, as a check.

A loader checkpoints its source with ``source.state_dict()`` and, in a new process, restores
it into a *fresh* source with ``load_state_dict(state)`` before iterating. The training run
then continues as if nothing had happened only if the restored source yields exactly the
steps the saving source would have yielded next. :func:`check_step_source` checks that
contract for any source, built-in or your own, the way ``evenflow.transports.testing``
checks a transport: run it in your tests with a function that builds the source::

    from evenflow.engine import DatasetSource
    from evenflow.engine.testing import check_step_source

    def make():
        return DatasetSource(rows, seq_len=512, bins_per_rank=2, seed=3)

    check_step_source(make)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from evenflow.transports import decode, encode

__all__ = ["check_step_source"]


def check_step_source(
    make_source: Callable[[], Any],
    *,
    epoch: int = 0,
    positions: Sequence[int] | None = None,
    same: Callable[[Any, Any], bool] | None = None,
) -> int:
    """Check that ``make_source()``'s sources resume exactly; return the epoch's step count.

    ``make_source`` must build an equivalent, unread source on every call (same data, seed
    and settings; a source bound to a loader's ranks only if the loader would bind it the same
    way); ``set_epoch(epoch)`` is called where the source has it. The check reads epoch
    ``epoch`` once uninterrupted, then for each ``k`` in ``positions`` (default: ``0``, ``1``,
    the middle and the last step): builds a source, reads ``k`` steps, takes
    ``state_dict()``, passes the state through the encoding a loader checkpoint uses
    (``evenflow.transports.encode``/``decode``: the state must be plain data), loads it into a
    fresh source and asserts that it yields exactly the uninterrupted run's steps after ``k``.
    A state taken after the last step (before and after the source reported its end) must
    restore to a source that yields nothing.

    Steps are compared with ``same(step_a, step_b)`` (default: deep equality of the bins,
    NumPy arrays and torch tensors compared by dtype, shape and value). A source's transform
    workers (``close_workers()``) are closed when the check is done with it. A difference
    raises ``AssertionError`` naming the restore position and the first differing step.
    """
    equal = same if same is not None else _same
    run = _read(make_source, epoch, None, None)
    total = len(run)
    if total == 0:
        raise ValueError(
            f"make_source() built a source whose epoch {epoch} has no step; give it data for "
            "at least one step so that resuming can be checked."
        )
    wanted = sorted({0, 1, total // 2, total} if positions is None else set(positions))
    outside = [k for k in wanted if not 0 <= k <= total]
    if outside:
        raise ValueError(
            f"positions holds {outside[0]}, but epoch {epoch} has {total} steps; pass "
            f"positions between 0 and {total}."
        )
    for k in wanted:
        states = _states_at(make_source, epoch, k, run, equal)
        for label, state in states:
            rest = _read(make_source, epoch, state, label)
            _compare(rest, run[k:], k, f"Restored from the state saved {label}", equal)
    return total


def _states_at(
    make_source: Callable[[], Any],
    epoch: int,
    k: int,
    run: list[Any],
    equal: Callable[[Any, Any], bool],
) -> list[tuple[str, dict[str, Any]]]:
    """The states a source saves after ``k`` steps (at the end: before and after it ended)."""
    source = make_source()
    try:
        _set_epoch(source, epoch)
        steps = iter(source)
        head = [step for _, step in zip(range(k), steps, strict=False)]
        _compare(head, run[:k], 0, "A second build of the source, read uninterrupted", equal)
        states = [(f"after step {k}", _through_checkpoint(source.state_dict(), k))]
        if k == len(run):
            extra = next(steps, None)
            if extra is not None:
                raise AssertionError(
                    f"A second uninterrupted run of epoch {epoch} yielded more than "
                    f"{len(run)} steps: the source must yield the same steps on every build."
                )
            states.append(("after the end", _through_checkpoint(source.state_dict(), k)))
        return states
    finally:
        _close(source)


def _read(
    make_source: Callable[[], Any], epoch: int, state: dict[str, Any] | None, label: str | None
) -> list[Any]:
    """Every step a fresh source yields: epoch ``epoch`` from its start, or after ``state``."""
    source = make_source()
    try:
        if state is None:
            _set_epoch(source, epoch)
        else:
            try:
                source.load_state_dict(state)
            except Exception as exc:
                raise AssertionError(
                    f"A fresh source refused the state saved {label}: {type(exc).__name__}: {exc}"
                ) from exc
        return list(source)
    finally:
        _close(source)


def _set_epoch(source: Any, epoch: int) -> None:
    set_epoch = getattr(source, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    elif epoch != 0:
        raise ValueError(
            f"epoch={epoch} was given, but the source has no set_epoch(); check epoch 0."
        )


def _through_checkpoint(state: Any, k: int) -> dict[str, Any]:
    """``state`` after the loader's checkpoint encoding, as a restore would receive it."""
    try:
        decoded: dict[str, Any] = decode(bytearray(encode(state)))
    except Exception as exc:
        raise AssertionError(
            f"The state saved after step {k} is not plain data a checkpoint can hold "
            f"({type(exc).__name__}: {exc}); keep plain data in it (numbers, strings, bytes, "
            "lists, dicts, NumPy arrays and tensors), never objects."
        ) from exc
    return decoded


def _compare(
    got: list[Any], want: list[Any], start: int, what: str, equal: Callable[[Any, Any], bool]
) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if not equal(a, b):
            raise AssertionError(
                f"{what}, step {start + i} differs from the uninterrupted run's: "
                f"{_short(a)} instead of {_short(b)}."
            )
    if len(got) != len(want):
        raise AssertionError(
            f"{what}, the source yielded {len(got)} steps from step {start} on, where the "
            f"uninterrupted run yielded {len(want)}."
        )


def _close(source: Any) -> None:
    close = getattr(source, "close_workers", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _short(step: Any) -> str:
    text = repr(step)
    return text if len(text) <= 160 else text[:157] + "..."
