"""The transport conformance suite, and helpers to run in-process groups.

Every transport, built-in or your own, should pass :func:`check_transport`. Every member of
one group runs it at the same time (one call per rank: a task, a thread or a process each)::

    # in each of N ranks, with this rank's transport
    await check_transport(transport)

    # or, for a whole in-process group at once
    from evenflow.transports.testing import run_inprocess
    await run_inprocess(4, check_transport)

The suite issues the same collectives in the same order on every rank and derives every
payload from the sending rank, so each rank knows exactly what it must receive. A contract
violation raises ``AssertionError`` naming the check, the rank and what differed. The suite
closes the transport at the end (it checks close semantics), so give it a fresh one.

:func:`run_inprocess` runs a coroutine function for every rank of an
:class:`~evenflow.transports._inprocess.InProcessGroup` on the current event loop;
:func:`run_inprocess_threads` does the same with one thread and event loop per rank.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

import numpy as np
import torch

from evenflow.transports._base import Transport
from evenflow.transports._inprocess import InProcessGroup, InProcessTransport
from evenflow.transports._sized import prepare
from evenflow.transports.errors import (
    EncodeError,
    PeerEncodeError,
    RouteError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
)

__all__ = [
    "check_inprocess_conformance",
    "check_transport",
    "run_inprocess",
    "run_inprocess_threads",
]

T = TypeVar("T")

_MIXED_OPS = 50


# -- comparing received values ---------------------------------------------------------------

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def _fail(check: str, rank: int, message: str) -> AssertionError:
    return AssertionError(f"[{check}] rank {rank}: {message}")


def _assert_same(actual: Any, expected: Any, where: str, check: str, rank: int) -> None:
    """Structural equality that also demands the same container and array types."""
    kind = type(expected)
    if kind in _SCALARS and type(actual) is kind and actual == expected:
        return  # fast path: most leaves
    if isinstance(expected, np.ndarray):
        if not isinstance(actual, np.ndarray):
            raise _fail(check, rank, f"{where}: expected a numpy array, got {type(actual)}.")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise _fail(
                check,
                rank,
                f"{where}: expected array {expected.dtype}{list(expected.shape)}, got "
                f"{actual.dtype}{list(actual.shape)}.",
            )
        if not np.array_equal(actual, expected):
            raise _fail(check, rank, f"{where}: array values differ.")
        return
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise _fail(check, rank, f"{where}: expected a torch tensor, got {type(actual)}.")
        if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
            raise _fail(
                check,
                rank,
                f"{where}: expected tensor {expected.dtype}{list(expected.shape)}, got "
                f"{actual.dtype}{list(actual.shape)}.",
            )
        if actual.device.type != "cpu" or not torch.equal(actual, expected):
            raise _fail(check, rank, f"{where}: tensor values differ (or not on the CPU).")
        return
    if type(actual) is not type(expected):
        raise _fail(
            check,
            rank,
            f"{where}: expected {type(expected).__name__} {expected!r:.80}, got "
            f"{type(actual).__name__} {actual!r:.80}.",
        )
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            raise _fail(
                check,
                rank,
                f"{where}: keys differ: {sorted(map(repr, set(actual) ^ set(expected)))}.",
            )
        for key, value in expected.items():
            _assert_same(actual[key], value, f"{where}[{key!r}]", check, rank)
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise _fail(
                check, rank, f"{where}: expected length {len(expected)}, got {len(actual)}."
            )
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]", check, rank)
    elif actual != expected:
        raise _fail(check, rank, f"{where}: expected {expected!r:.80}, got {actual!r:.80}.")


def _assert_no_alias(received: Any, sent: Any, check: str, rank: int) -> None:
    """A rank's own value, returned by a collective, must not share memory with the original."""
    if received is sent and not isinstance(sent, (int, float, str, bytes, bool, type(None))):
        raise _fail(check, rank, "the result is the very object that was sent.")
    for got, original in zip(_arrays(received), _arrays(sent), strict=False):
        if np.may_share_memory(got, original):
            raise _fail(check, rank, "a received array shares memory with the sent one.")


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


async def _expect_error(
    kind: type[BaseException], call: Awaitable[Any], check: str, rank: int
) -> BaseException:
    try:
        result = await call
    except kind as exc:
        return exc
    except Exception as exc:
        raise _fail(
            check, rank, f"expected {kind.__name__}, but {type(exc).__name__} was raised: {exc}"
        ) from exc
    raise _fail(check, rank, f"expected {kind.__name__}, but the call returned {result!r:.80}.")


# -- deterministic per-rank data -------------------------------------------------------------


def _rich_value(rank: int) -> dict[str, Any]:
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


class _Expected:
    """Expected rich values, built once per variant (the suite compares N of them per rank)."""

    def __init__(self) -> None:
        self._bodies: dict[int, dict[str, Any]] = {}

    def rich(self, rank: int) -> dict[str, Any]:
        body = self._bodies.get(rank % 7)
        if body is None:
            body = self._bodies[rank % 7] = _rich_body(rank % 7)
        return {"rank": rank, "text": f"rank {rank} \u00e9\u4e2d", "body": body}


def _small_payload(sender: int, target: int, i: int) -> dict[str, Any]:
    size = (sender + 2 * target + i) % 17  # sometimes 0: empty arrays must travel too
    return {
        "tokens": np.arange(size, dtype=np.int32) + sender,
        "label": (sender, target, i),
        "meta": {"size": size, "weights": np.full(size % 5, i, dtype=np.float32)},
    }


def _uneven_items(sender: int, target: int, n: int) -> list[tuple[Hashable, Any]] | None:
    """What ``sender`` sends ``target`` in the uneven exchange; ``None``: target left out."""
    if n > 1 and sender == n - 1:
        return None  # one rank sends nothing at all
    if (sender + target) % 5 == 4:
        return None
    count = (sender * 7 + target * 3) % 4  # 0 keeps an empty list in the mapping
    return [((sender, target, i), _small_payload(sender, target, i)) for i in range(count)]


def _large_array(rank: int, num_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    pattern = (np.arange(251, dtype=np.uint8) + np.uint8(rank % 251)) % np.uint8(251)
    return np.resize(pattern, num_bytes)


# -- the checks ------------------------------------------------------------------------------


async def _check_sanity(t: Transport) -> None:
    check, rank, n = "sanity", t.rank, t.num_ranks
    if not isinstance(n, int) or n < 1:
        raise _fail(check, rank, f"num_ranks must be an int >= 1, got {n!r}.")
    if not isinstance(rank, int) or not 0 <= rank < n:
        raise _fail(check, rank, f"rank must be in [0, {n}), got {rank!r}.")
    ranks = t.global_ranks
    if len(ranks) != n or len(set(ranks)) != n or not all(isinstance(r, int) for r in ranks):
        raise _fail(check, rank, f"global_ranks must be {n} distinct ints, got {ranks!r}.")
    if t.closed:
        raise _fail(check, rank, "a fresh transport reports closed=True.")
    if not isinstance(t.name, str) or not isinstance(t.launch_on_caller, bool):
        raise _fail(check, rank, "name must be a str and launch_on_caller a bool.")
    if not t.timeout > 0:
        raise _fail(check, rank, f"timeout must be positive, got {t.timeout!r}.")
    gathered = await t.all_gather((rank, n, list(ranks), t.name))
    expected = [(r, n, list(ranks), t.name) for r in range(n)]
    _assert_same(gathered, expected, "all_gather(identity)", check, rank)


def _is_rich_sender(rank: int, n: int) -> bool:
    # A bounded set of ranks sends the rich value, so large groups stay fast to check;
    # every rank still sends something rank-specific, so ordering is checked for all.
    return rank < 4 or rank == n - 1


async def _check_all_gather(t: Transport, expected: _Expected) -> None:
    check, rank, n = "all_gather", t.rank, t.num_ranks
    sent = _rich_value(rank) if _is_rich_sender(rank, n) else (rank, f"rank {rank}")
    gathered = await t.all_gather(sent)
    want = [expected.rich(r) if _is_rich_sender(r, n) else (r, f"rank {r}") for r in range(n)]
    _assert_same(gathered, want, "result", check, rank)
    _assert_no_alias(gathered[rank], sent, check, rank)
    empty = await t.all_gather(None)
    _assert_same(empty, [None] * n, "all_gather(None)", check, rank)


async def _check_broadcast(t: Transport, expected: _Expected) -> None:
    check, rank, n = "broadcast", t.rank, t.num_ranks
    for src in range(n):
        rich = _is_rich_sender(src, n)
        value = expected.rich(src) if rich else (src, f"from {src}", np.arange(src % 5))
        sent = (_rich_value(src) if rich else value) if rank == src else None
        result = await t.broadcast(sent, src=src)
        _assert_same(result, value, f"broadcast(src={src})", check, rank)
        if rank == src:
            _assert_no_alias(result, sent, check, rank)


async def _check_exchange(t: Transport, large_bytes: int) -> None:
    rank, n = t.rank, t.num_ranks

    check = "exchange: empty"
    _assert_same(await t.exchange({}), {}, "exchange({})", check, rank)
    all_empty: dict[int, list[tuple[Hashable, Any]]] = {target: [] for target in range(n)}
    _assert_same(await t.exchange(all_empty), {}, "exchange(all lists empty)", check, rank)

    check = "exchange: self-sends"
    own = {(rank, i): {"i": i, "data": np.full(i, rank, dtype=np.int16)} for i in range(5)}
    received = await t.exchange({rank: list(own.items())})
    _assert_same(received, own, "result", check, rank)
    _assert_no_alias(received, own, check, rank)

    check = "exchange: uneven"
    outgoing = {}
    for target in range(n):
        items = _uneven_items(rank, target, n)
        if items is not None:
            outgoing[target] = items
    expected: dict[Hashable, Any] = {}
    for sender in range(n):
        expected.update(_uneven_items(sender, rank, n) or [])
    received = await t.exchange(outgoing)
    _assert_same(received, expected, "result", check, rank)
    for key in received:
        if type(key) is not tuple or not all(type(k) is int for k in key):
            raise _fail(check, rank, f"key {key!r} did not come back as a tuple of ints.")

    if large_bytes > 0:
        check = "exchange: large payload"
        target, source = (rank + 1) % n, (rank - 1) % n
        received = await t.exchange(
            {target: [((rank, 0), _large_array(rank, large_bytes)), ((rank, 1), "small")]}
        )
        expected = {(source, 0): _large_array(source, large_bytes), (source, 1): "small"}
        _assert_same(received, expected, "result", check, rank)

    check = "exchange: many small payloads"
    per_target = max(1, 128 // n)
    outgoing = {
        target: [((rank, target, i), (i, np.array([rank, target, i]))) for i in range(per_target)]
        for target in range(n)
    }
    expected = {
        (sender, rank, i): (i, np.array([sender, rank, i]))
        for sender in range(n)
        for i in range(per_target)
    }
    _assert_same(await t.exchange(outgoing), expected, "result", check, rank)


def _sized_items(sender: int, target: int, n: int) -> list[tuple[Hashable, Any]]:
    return _uneven_items(sender, target, n) or []


async def _check_exchange_sized(t: Transport, large_bytes: int) -> None:
    """``exchange_sized``: every rank computes what it receives and its sizes in advance."""
    rank, n = t.rank, t.num_ranks

    check = "exchange_sized: empty"
    _assert_same(await t.exchange_sized({}, {}), {}, "exchange_sized({}, {})", check, rank)

    check = "exchange_sized: uneven"
    outgoing = {
        target: [(key, prepare(value)) for key, value in _sized_items(rank, target, n)]
        for target in range(n)
    }
    incoming = {
        sender: [(key, prepare(value).nbytes) for key, value in _sized_items(sender, rank, n)]
        for sender in range(n)
    }
    expected: dict[Hashable, Any] = {}
    for sender in range(n):
        expected.update(_sized_items(sender, rank, n))
    received = await t.exchange_sized(outgoing, incoming)
    _assert_same(received, expected, "result", check, rank)
    own = dict(_sized_items(rank, rank, n))
    _assert_no_alias({key: received[key] for key in own}, own, check, rank)

    if large_bytes > 0:
        check = "exchange_sized: large payload"
        target, source = (rank + 1) % n, (rank - 1) % n
        mine = [((rank, 0), _large_array(rank, large_bytes)), ((rank, 1), "small")]
        theirs = [((source, 0), _large_array(source, large_bytes)), ((source, 1), "small")]
        received = await t.exchange_sized(
            {target: [(k, prepare(v)) for k, v in mine]},
            {source: [(k, prepare(v).nbytes) for k, v in theirs]},
        )
        _assert_same(received, dict(theirs), "result", check, rank)

    check = "exchange_sized: bad arguments"
    await _expect_error(ValueError, t.exchange_sized({n: []}, {}), check, rank)
    unprepared: Any = {rank: [((rank,), "not prepared")]}
    await _expect_error(TypeError, t.exchange_sized(unprepared, {}), check, rank)
    await _expect_error(ValueError, t.exchange_sized({}, {rank: [((rank,), 7)]}), check, rank)
    gathered = await t.all_gather(rank)
    _assert_same(gathered, list(range(n)), "all_gather after bad arguments", check, rank)


async def _check_local_errors(t: Transport) -> None:
    """Errors every rank raises locally, before any collective: the group stays in step."""
    rank, n = t.rank, t.num_ranks
    check = "RouteError"
    for bad in ({n: [((rank,), 1)]}, {-1: [((rank,), 1)]}, {rank: [((rank,), 1)], n + 3: []}):
        await _expect_error(RouteError, t.exchange(bad), check, rank)
    await _expect_error(RouteError, t.broadcast(rank, src=n), check, rank)
    # Nothing of the refused calls may arrive with the next exchange.
    received = await t.exchange({rank: [((rank, 99), "after")]})
    _assert_same(received, {(rank, 99): "after"}, "exchange after RouteError", check, rank)

    check = "EncodeError"
    await _expect_error(EncodeError, t.all_gather({"bad": {1, 2}}), check, rank)
    await _expect_error(EncodeError, t.exchange({rank: [((rank,), object())]}), check, rank)
    remote = (rank + 1) % n
    await _expect_error(EncodeError, t.exchange({remote: [((rank,), {"x": {3}})]}), check, rank)
    gathered = await t.all_gather(rank)
    _assert_same(gathered, list(range(n)), "all_gather after EncodeError", check, rank)

    if n > 1:
        # Only rank 0 cannot encode: it raises EncodeError, every other rank PeerEncodeError
        # naming it, no data moves, and the group stays in step.
        check = "PeerEncodeError"
        payload: Any = object() if rank == 0 else "fine"
        call = t.exchange({(rank + 1) % n: [((rank,), payload)]})
        if rank == 0:
            await _expect_error(EncodeError, call, check, rank)
        else:
            try:
                await call
            except PeerEncodeError as exc:
                if 0 not in exc.failed_ranks:
                    raise _fail(
                        check, rank, f"failed_ranks {exc.failed_ranks} omit rank 0."
                    ) from exc
            else:
                raise _fail(check, rank, "a peer's encode failure was not reported.")
        gathered = await t.all_gather(rank)
        _assert_same(gathered, list(range(n)), "all_gather after PeerEncodeError", check, rank)


async def _check_mixed(t: Transport) -> None:
    rank, n = t.rank, t.num_ranks
    for i in range(_MIXED_OPS):
        check = f"mixed operation {i}"
        kind = (i * 7) % 3
        result: Any
        if kind == 0:
            result = await t.all_gather((i, rank, f"s{i}"))
            _assert_same(result, [(i, r, f"s{i}") for r in range(n)], "all_gather", check, rank)
        elif kind == 1:
            src = (i * 5) % n
            result = await t.broadcast({"i": i, "src": src} if rank == src else None, src=src)
            _assert_same(result, {"i": i, "src": src}, "broadcast", check, rank)
        else:
            sender = (rank - i) % n
            result = await t.exchange({(rank + i) % n: [((rank, i), np.array([i, rank]))]})
            expected = {(sender, i): np.array([i, sender])}
            _assert_same(result, expected, "exchange", check, rank)


async def _check_timeout(t: Transport) -> None:
    """Rank 0 never joins one all_gather; every other rank must time out, then fail fast."""
    rank, check = t.rank, "timeout"
    if t.num_ranks < 2:
        return
    if rank == 0:
        # A live peer that never calls: stay away (without closing, which would look like a
        # crash) until the others have surely given up, then touch the dead group no more.
        await asyncio.sleep(2 * t.timeout + 0.5)
        return
    await _expect_error(TransportTimeoutError, t.all_gather(rank), check, rank)
    start = time.monotonic()
    await _expect_error(TransportError, t.all_gather(rank), check, rank)
    if time.monotonic() - start > 0.5 * t.timeout:
        raise _fail(check, rank, "an operation on a timed-out group did not fail promptly.")


async def _check_close(t: Transport) -> None:
    rank, check = t.rank, "close"
    await t.aclose()
    if not t.closed:
        raise _fail(check, rank, "closed is False after aclose().")
    await _expect_error(TransportClosedError, t.all_gather(1), check, rank)
    await _expect_error(TransportClosedError, t.broadcast(1, src=0), check, rank)
    await _expect_error(TransportClosedError, t.exchange({}), check, rank)
    await t.aclose()  # idempotent


async def check_transport(
    transport: Transport, *, large_bytes: int = 8 << 20, check_timeout: bool = False
) -> None:
    """Run the whole transport contract on ``transport``; every member must call it at once.

    Checks, in this order: identity and ordering by group rank; ``all_gather`` and
    ``broadcast`` (from every source) of every supported value type; ``exchange`` with empty
    input, self-sends, uneven and missing routes, a ``large_bytes`` payload (0 skips it) and
    many small payloads; ``exchange_sized`` with empty, uneven and large input and bad
    arguments refused before any data moves; ``RouteError`` and ``EncodeError`` raised
    locally with the group still usable afterwards; 50 mixed operations; with
    ``check_timeout=True`` (only for a transport with a short timeout: rank 0 idles for
    twice the timeout) a missing peer
    causing ``TransportTimeoutError`` and prompt failures afterwards; last, close semantics.
    The transport is closed on return. Raises ``AssertionError`` on a contract violation.
    """
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be an evenflow Transport, but got {transport!r}.")
    if isinstance(large_bytes, bool) or not isinstance(large_bytes, int) or large_bytes < 0:
        raise ValueError(f"large_bytes must be an integer >= 0, but got {large_bytes!r}.")
    await _check_sanity(transport)
    expected = _Expected()
    await _check_all_gather(transport, expected)
    await _check_broadcast(transport, expected)
    await _check_exchange(transport, large_bytes)
    await _check_exchange_sized(transport, large_bytes)
    await _check_local_errors(transport)
    await _check_mixed(transport)
    if check_timeout:
        await _check_timeout(transport)
    await _check_close(transport)


# -- running in-process groups ---------------------------------------------------------------


def _pick_result(outcomes: list[Any], failures: list[tuple[int, BaseException]]) -> list[Any]:
    """Raise the failure that happened first (usually the cause of the others)."""
    if failures:
        raise min(failures, key=lambda pair: pair[0])[1]
    return outcomes


async def run_inprocess(
    num_ranks: int,
    fn: Callable[[InProcessTransport], Awaitable[T]],
    *,
    return_exceptions: bool = False,
    **group_kwargs: Any,
) -> list[Any]:
    """Run ``fn(transport)`` for every rank of a new in-process group on the current loop.

    ``group_kwargs`` go to :class:`InProcessGroup` (``timeout``, ``delay_fn``, ...). Each
    rank's transport is closed when its ``fn`` ends, so peers of a failed rank fail fast
    instead of waiting for the timeout. Returns the results by rank; on failure raises the
    exception that occurred first, or with ``return_exceptions=True`` returns exceptions in
    place of results.
    """
    group = InProcessGroup(num_ranks, **group_kwargs)
    order = itertools.count()
    failures: list[tuple[int, BaseException]] = []

    async def member(rank: int) -> Any:
        transport = group.transport(rank)
        try:
            return await fn(transport)
        except Exception as exc:
            failures.append((next(order), exc))
            return exc
        finally:
            await transport.aclose()

    outcomes = list(await asyncio.gather(*(member(r) for r in range(num_ranks))))
    return outcomes if return_exceptions else _pick_result(outcomes, failures)


def run_inprocess_threads(
    num_ranks: int,
    fn: Callable[[InProcessTransport], Awaitable[T]],
    *,
    deadline: float = 120.0,
    return_exceptions: bool = False,
    debug: bool = False,
    **group_kwargs: Any,
) -> list[Any]:
    """Like :func:`run_inprocess`, but each rank runs in its own thread and event loop.

    Blocks the calling thread. ``debug`` runs every rank's loop in asyncio debug mode, which
    also rejects loop calls made from the wrong thread. Raises ``TimeoutError`` if the ranks
    are not all done after ``deadline`` seconds (their threads are daemons, left behind).
    """
    group = InProcessGroup(num_ranks, **group_kwargs)
    outcomes: list[Any] = [None] * num_ranks
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    order = itertools.count()

    async def member(transport: InProcessTransport) -> Any:
        try:
            return await fn(transport)
        finally:
            await transport.aclose()

    def body(rank: int) -> None:
        try:
            outcomes[rank] = asyncio.run(member(group.transport(rank)), debug=debug)
        except Exception as exc:
            with lock:
                failures.append((next(order), exc))
            outcomes[rank] = exc

    threads = [
        threading.Thread(target=body, args=(r,), name=f"evenflow-inprocess-rank{r}", daemon=True)
        for r in range(num_ranks)
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        raise TimeoutError(
            f"In-process ranks {stuck} were still running after the deadline of {deadline:g} s."
        )
    return outcomes if return_exceptions else _pick_result(outcomes, failures)


def check_inprocess_conformance(
    num_ranks: int,
    *,
    threads: bool = False,
    large_bytes: int = 1 << 20,
    check_timeout: bool = False,
    timeout: float = 30.0,
    debug: bool = False,
) -> None:
    """Run :func:`check_transport` on a fresh in-process group of ``num_ranks`` ranks.

    With ``threads=True`` every rank gets its own thread and event loop; otherwise all ranks
    share one new event loop. ``debug`` runs the loops in asyncio debug mode (slow for many
    ranks). Blocks until done; raises the first failure.
    """

    async def check(transport: InProcessTransport) -> None:
        await check_transport(transport, large_bytes=large_bytes, check_timeout=check_timeout)

    if threads:
        run_inprocess_threads(num_ranks, check, timeout=timeout, debug=debug)
    else:
        asyncio.run(run_inprocess(num_ranks, check, timeout=timeout), debug=debug)
