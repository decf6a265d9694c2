"""What the conformance suite sends, and how it compares what arrives.

Every payload derives from the sending rank (and the target, for exchanges), so each rank
knows exactly what it must receive without asking anyone. The comparison is strict on
purpose: a transport must give back the same container types, array dtypes and shapes, and
copies that share no memory with what was sent. A difference raises ``AssertionError`` naming
the check, the rank and the first place that differs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Hashable
from typing import Any

import numpy as np
import torch

__all__ = [
    "Expected",
    "assert_no_alias",
    "assert_same",
    "expect_error",
    "fail",
    "large_array",
    "rich_value",
    "sized_items",
    "small_payload",
    "uneven_items",
]


# -- comparing received values ---------------------------------------------------------------

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def fail(check: str, rank: int, message: str) -> AssertionError:
    return AssertionError(f"[{check}] rank {rank}: {message}")


def assert_same(actual: Any, expected: Any, where: str, check: str, rank: int) -> None:
    """Structural equality that also demands the same container and array types."""
    kind = type(expected)
    if kind in _SCALARS and type(actual) is kind and actual == expected:
        return  # fast path: most leaves
    if isinstance(expected, np.ndarray):
        if not isinstance(actual, np.ndarray):
            raise fail(check, rank, f"{where}: expected a numpy array, got {type(actual)}.")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise fail(
                check,
                rank,
                f"{where}: expected array {expected.dtype}{list(expected.shape)}, got "
                f"{actual.dtype}{list(actual.shape)}.",
            )
        if not np.array_equal(actual, expected):
            raise fail(check, rank, f"{where}: array values differ.")
        return
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise fail(check, rank, f"{where}: expected a torch tensor, got {type(actual)}.")
        if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
            raise fail(
                check,
                rank,
                f"{where}: expected tensor {expected.dtype}{list(expected.shape)}, got "
                f"{actual.dtype}{list(actual.shape)}.",
            )
        if actual.device.type != "cpu" or not torch.equal(actual, expected):
            raise fail(check, rank, f"{where}: tensor values differ (or not on the CPU).")
        return
    if type(actual) is not type(expected):
        raise fail(
            check,
            rank,
            f"{where}: expected {type(expected).__name__} {expected!r:.80}, got "
            f"{type(actual).__name__} {actual!r:.80}.",
        )
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            raise fail(
                check,
                rank,
                f"{where}: keys differ: {sorted(map(repr, set(actual) ^ set(expected)))}.",
            )
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}[{key!r}]", check, rank)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise fail(check, rank, f"{where}: expected length {len(expected)}, got {len(actual)}.")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]", check, rank)
    elif actual != expected:
        raise fail(check, rank, f"{where}: expected {expected!r:.80}, got {actual!r:.80}.")


def assert_no_alias(received: Any, sent: Any, check: str, rank: int) -> None:
    """A rank's own value, returned by a collective, must not share memory with the original."""
    if received is sent and not isinstance(sent, (int, float, str, bytes, bool, type(None))):
        raise fail(check, rank, "the result is the very object that was sent.")
    for got, original in zip(_arrays(received), _arrays(sent), strict=False):
        if np.may_share_memory(got, original):
            raise fail(check, rank, "a received array shares memory with the sent one.")


def _arrays(value: Any) -> list[np.ndarray[Any, Any]]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, torch.Tensor):
        return [value.detach().view(-1).view(torch.uint8).numpy()] if value.numel() else []
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


async def expect_error(
    kind: type[BaseException], call: Awaitable[Any], check: str, rank: int
) -> BaseException:
    try:
        result = await call
    except kind as exc:
        return exc
    except Exception as exc:
        raise fail(
            check, rank, f"expected {kind.__name__}, but {type(exc).__name__} was raised: {exc}"
        ) from exc
    raise fail(check, rank, f"expected {kind.__name__}, but the call returned {result!r:.80}.")


# -- deterministic per-rank data -------------------------------------------------------------


def rich_value(rank: int) -> dict[str, Any]:
    """One value of every supported kind; neighbouring ranks send different values."""
    return {"rank": rank, "text": f"rank {rank} \u00e9\u4e2d", "body": _rich_body(rank % 7)}


def _rich_body(variant: int) -> dict[str, Any]:
    base = np.arange(variant, variant + 12, dtype=np.int64)
    return {
        "none": None,
        "flag": variant % 2 == 0,
        "ratio": variant + 0.25,
        "big": 2**62 + variant,
        "unsigned": 2**64 - 1 - variant,
        "negative": -(2**40) - variant,
        "bytes": bytes((variant + i) % 256 for i in range(19)),
        "empty_bytes": b"",
        "bytearray": bytearray(b"\x00\xff" * (variant + 1)),
        "tuple": (variant, ("nested", variant * 2), [variant, (variant,)]),
        "list": [variant, [variant + 1, {"deep": (variant, variant + 1)}]],
        "nested": {"a": {"b": {"c": [variant, (1, 2.5, "x")]}}},
        "empty": {"list": [], "tuple": (), "dict": {}},
        "arrays": [
            base.astype(np.int32),
            base,
            (base * 1.5).astype(np.float32),
            base.astype(np.float64).reshape(3, 4) / 7,
            base.astype(np.uint8),
            base % 3 == 0,
            base.astype(np.float16).reshape(2, 6),
            base.astype(np.int16)[::3],  # not contiguous
            np.array(variant * 3, dtype=np.int64),  # 0-d
            np.zeros((0, 4), dtype=np.float32),
        ],
        "tensors": [
            torch.arange(variant, variant + 5, dtype=torch.float32),
            torch.arange(6, dtype=torch.int64).reshape(2, 3) + variant,
            torch.linspace(0, variant + 1, 7).to(torch.bfloat16),
            torch.tensor([True, False, variant % 2 == 1]),
            torch.arange(4, dtype=torch.int8) - variant,
            torch.zeros(0, 3, dtype=torch.float16),
        ],
    }


class Expected:
    """Expected rich values, built once per variant (the suite compares N of them per rank)."""

    def __init__(self) -> None:
        self._bodies: dict[int, dict[str, Any]] = {}

    def rich(self, rank: int) -> dict[str, Any]:
        body = self._bodies.get(rank % 7)
        if body is None:
            body = self._bodies[rank % 7] = _rich_body(rank % 7)
        return {"rank": rank, "text": f"rank {rank} \u00e9\u4e2d", "body": body}


def small_payload(sender: int, target: int, i: int) -> dict[str, Any]:
    size = (sender + 2 * target + i) % 17  # sometimes 0: empty arrays must travel too
    return {
        "tokens": np.arange(size, dtype=np.int32) + sender,
        "label": (sender, target, i),
        "meta": {"size": size, "weights": np.full(size % 5, i, dtype=np.float32)},
    }


def uneven_items(sender: int, target: int, n: int) -> list[tuple[Hashable, Any]] | None:
    """What ``sender`` sends ``target`` in the uneven exchange; ``None``: target left out."""
    if n > 1 and sender == n - 1:
        return None  # one rank sends nothing at all
    if (sender + target) % 5 == 4:
        return None
    count = (sender * 7 + target * 3) % 4  # 0 keeps an empty list in the mapping
    return [((sender, target, i), small_payload(sender, target, i)) for i in range(count)]


def large_array(rank: int, num_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    pattern = (np.arange(251, dtype=np.uint8) + np.uint8(rank % 251)) % np.uint8(251)
    return np.resize(pattern, num_bytes)


def sized_items(sender: int, target: int, n: int) -> list[tuple[Hashable, Any]]:
    return uneven_items(sender, target, n) or []
