"""The checks of the transport conformance suite, one coroutine per part of the contract.

Each check gets one rank's member of a fresh group (two members, of two fresh groups, for the
check that groups are independent) and runs the same collectives in the same order as every
other rank. :func:`~evenflow.transports.testing.check_transport` makes the groups, runs the
checks in the order of :func:`checks` and closes every member after its check, so a check may
leave its group in any state (closed, timed out) without spoiling the next one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evenflow.transports._base import Transport
from evenflow.transports._sized import prepare
from evenflow.transports.errors import (
    EncodeError,
    PeerEncodeError,
    RouteError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
)
from evenflow.transports.testing._values import (
    Expected,
    assert_no_alias,
    assert_same,
    expect_error,
    fail,
    large_array,
    rich_value,
    sized_items,
    uneven_items,
)

__all__ = ["Check", "Options", "checks"]

MIXED_OPS = 50


@dataclass(frozen=True)
class Options:
    """What one run of the suite asks for, shared by its checks."""

    #: Bytes of the large exchange payload (0 skips it).
    large_bytes: int
    #: Expected rich values, built once per run (every rank compares N of them).
    expected: Expected = field(default_factory=Expected)


@dataclass(frozen=True)
class Check:
    """One part of the contract: ``run(*members, options)`` on every rank at once."""

    name: str
    run: Callable[..., Awaitable[None]]
    #: Fresh groups the check gets; ``run`` receives this rank's member of each, in order.
    groups: int = 1


async def _check_sanity(t: Transport, options: Options) -> None:
    check, rank, n = "sanity", t.rank, t.num_ranks
    if not isinstance(n, int) or n < 1:
        raise fail(check, rank, f"num_ranks must be an int >= 1, got {n!r}.")
    if not isinstance(rank, int) or not 0 <= rank < n:
        raise fail(check, rank, f"rank must be in [0, {n}), got {rank!r}.")
    ranks = t.global_ranks
    if len(ranks) != n or len(set(ranks)) != n or not all(isinstance(r, int) for r in ranks):
        raise fail(check, rank, f"global_ranks must be {n} distinct ints, got {ranks!r}.")
    if t.closed:
        raise fail(check, rank, "a fresh transport reports closed=True.")
    if not isinstance(t.name, str) or not isinstance(t.launch_on_caller, bool):
        raise fail(check, rank, "name must be a str and launch_on_caller a bool.")
    if not t.timeout > 0:
        raise fail(check, rank, f"timeout must be positive, got {t.timeout!r}.")
    gathered = await t.all_gather((rank, n, list(ranks), t.name))
    expected = [(r, n, list(ranks), t.name) for r in range(n)]
    assert_same(gathered, expected, "all_gather(identity)", check, rank)


def _is_rich_sender(rank: int, n: int) -> bool:
    # A bounded set of ranks sends the rich value, so large groups stay fast to check;
    # every rank still sends something rank-specific, so ordering is checked for all.
    return rank < 4 or rank == n - 1


async def _check_all_gather(t: Transport, options: Options) -> None:
    expected = options.expected
    check, rank, n = "all_gather", t.rank, t.num_ranks
    sent = rich_value(rank) if _is_rich_sender(rank, n) else (rank, f"rank {rank}")
    gathered = await t.all_gather(sent)
    want = [expected.rich(r) if _is_rich_sender(r, n) else (r, f"rank {r}") for r in range(n)]
    assert_same(gathered, want, "result", check, rank)
    assert_no_alias(gathered[rank], sent, check, rank)
    empty = await t.all_gather(None)
    assert_same(empty, [None] * n, "all_gather(None)", check, rank)


async def _check_broadcast(t: Transport, options: Options) -> None:
    expected = options.expected
    check, rank, n = "broadcast", t.rank, t.num_ranks
    for src in range(n):
        rich = _is_rich_sender(src, n)
        value = expected.rich(src) if rich else (src, f"from {src}", np.arange(src % 5))
        sent = (rich_value(src) if rich else value) if rank == src else None
        result = await t.broadcast(sent, src=src)
        assert_same(result, value, f"broadcast(src={src})", check, rank)
        if rank == src:
            assert_no_alias(result, sent, check, rank)


async def _check_exchange(t: Transport, options: Options) -> None:
    rank, n, large_bytes = t.rank, t.num_ranks, options.large_bytes

    check = "exchange: empty"
    assert_same(await t.exchange({}), {}, "exchange({})", check, rank)
    all_empty: dict[int, list[tuple[Hashable, Any]]] = {target: [] for target in range(n)}
    assert_same(await t.exchange(all_empty), {}, "exchange(all lists empty)", check, rank)

    check = "exchange: self-sends"
    own = {(rank, i): {"i": i, "data": np.full(i, rank, dtype=np.int16)} for i in range(5)}
    received = await t.exchange({rank: list(own.items())})
    assert_same(received, own, "result", check, rank)
    assert_no_alias(received, own, check, rank)

    check = "exchange: uneven"
    outgoing = {}
    for target in range(n):
        items = uneven_items(rank, target, n)
        if items is not None:
            outgoing[target] = items
    expected: dict[Hashable, Any] = {}
    for sender in range(n):
        expected.update(uneven_items(sender, rank, n) or [])
    received = await t.exchange(outgoing)
    assert_same(received, expected, "result", check, rank)
    for key in received:
        if type(key) is not tuple or not all(type(k) is int for k in key):
            raise fail(check, rank, f"key {key!r} did not come back as a tuple of ints.")

    if large_bytes > 0:
        check = "exchange: large payload"
        target, source = (rank + 1) % n, (rank - 1) % n
        received = await t.exchange(
            {target: [((rank, 0), large_array(rank, large_bytes)), ((rank, 1), "small")]}
        )
        expected = {(source, 0): large_array(source, large_bytes), (source, 1): "small"}
        assert_same(received, expected, "result", check, rank)

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
    assert_same(await t.exchange(outgoing), expected, "result", check, rank)


async def _check_exchange_sized(t: Transport, options: Options) -> None:
    """``exchange_sized``: every rank computes what it receives and its sizes in advance."""
    rank, n, large_bytes = t.rank, t.num_ranks, options.large_bytes

    check = "exchange_sized: empty"
    assert_same(await t.exchange_sized({}, {}), {}, "exchange_sized({}, {})", check, rank)

    check = "exchange_sized: uneven"
    outgoing = {
        target: [(key, prepare(value)) for key, value in sized_items(rank, target, n)]
        for target in range(n)
    }
    incoming = {
        sender: [(key, prepare(value).nbytes) for key, value in sized_items(sender, rank, n)]
        for sender in range(n)
    }
    expected: dict[Hashable, Any] = {}
    for sender in range(n):
        expected.update(sized_items(sender, rank, n))
    received = await t.exchange_sized(outgoing, incoming)
    assert_same(received, expected, "result", check, rank)
    own = dict(sized_items(rank, rank, n))
    assert_no_alias({key: received[key] for key in own}, own, check, rank)

    if large_bytes > 0:
        check = "exchange_sized: large payload"
        target, source = (rank + 1) % n, (rank - 1) % n
        mine = [((rank, 0), large_array(rank, large_bytes)), ((rank, 1), "small")]
        theirs = [((source, 0), large_array(source, large_bytes)), ((source, 1), "small")]
        received = await t.exchange_sized(
            {target: [(k, prepare(v)) for k, v in mine]},
            {source: [(k, prepare(v).nbytes) for k, v in theirs]},
        )
        assert_same(received, dict(theirs), "result", check, rank)

    check = "exchange_sized: bad arguments"
    await expect_error(ValueError, t.exchange_sized({n: []}, {}), check, rank)
    unprepared: Any = {rank: [((rank,), "not prepared")]}
    await expect_error(TypeError, t.exchange_sized(unprepared, {}), check, rank)
    await expect_error(ValueError, t.exchange_sized({}, {rank: [((rank,), 7)]}), check, rank)
    gathered = await t.all_gather(rank)
    assert_same(gathered, list(range(n)), "all_gather after bad arguments", check, rank)


async def _check_local_errors(t: Transport, options: Options) -> None:
    """Errors every rank raises locally, before any collective: the group stays in step."""
    rank, n = t.rank, t.num_ranks
    check = "RouteError"
    for bad in ({n: [((rank,), 1)]}, {-1: [((rank,), 1)]}, {rank: [((rank,), 1)], n + 3: []}):
        await expect_error(RouteError, t.exchange(bad), check, rank)
    await expect_error(RouteError, t.broadcast(rank, src=n), check, rank)
    # Nothing of the refused calls may arrive with the next exchange.
    received = await t.exchange({rank: [((rank, 99), "after")]})
    assert_same(received, {(rank, 99): "after"}, "exchange after RouteError", check, rank)

    check = "EncodeError"
    await expect_error(EncodeError, t.all_gather({"bad": {1, 2}}), check, rank)
    await expect_error(EncodeError, t.exchange({rank: [((rank,), object())]}), check, rank)
    remote = (rank + 1) % n
    await expect_error(EncodeError, t.exchange({remote: [((rank,), {"x": {3}})]}), check, rank)
    gathered = await t.all_gather(rank)
    assert_same(gathered, list(range(n)), "all_gather after EncodeError", check, rank)

    if n > 1:
        # Only rank 0 cannot encode: it raises EncodeError, every other rank PeerEncodeError
        # naming it, no data moves, and the group stays in step.
        check = "PeerEncodeError"
        payload: Any = object() if rank == 0 else "fine"
        call = t.exchange({(rank + 1) % n: [((rank,), payload)]})
        if rank == 0:
            await expect_error(EncodeError, call, check, rank)
        else:
            try:
                await call
            except PeerEncodeError as exc:
                if 0 not in exc.failed_ranks:
                    raise fail(
                        check, rank, f"failed_ranks {exc.failed_ranks} omit rank 0."
                    ) from exc
            else:
                raise fail(check, rank, "a peer's encode failure was not reported.")
        gathered = await t.all_gather(rank)
        assert_same(gathered, list(range(n)), "all_gather after PeerEncodeError", check, rank)


async def _check_mixed(t: Transport, options: Options) -> None:
    rank, n = t.rank, t.num_ranks
    for i in range(MIXED_OPS):
        check = f"mixed operation {i}"
        kind = (i * 7) % 3
        result: Any
        if kind == 0:
            result = await t.all_gather((i, rank, f"s{i}"))
            assert_same(result, [(i, r, f"s{i}") for r in range(n)], "all_gather", check, rank)
        elif kind == 1:
            src = (i * 5) % n
            result = await t.broadcast({"i": i, "src": src} if rank == src else None, src=src)
            assert_same(result, {"i": i, "src": src}, "broadcast", check, rank)
        else:
            sender = (rank - i) % n
            result = await t.exchange({(rank + i) % n: [((rank, i), np.array([i, rank]))]})
            expected = {(sender, i): np.array([i, sender])}
            assert_same(result, expected, "exchange", check, rank)


async def _check_timeout(t: Transport, options: Options) -> None:
    """Rank 0 never joins one all_gather; every other rank must time out, then fail fast."""
    rank, check = t.rank, "timeout"
    if t.num_ranks < 2:
        return
    if rank == 0:
        # A live peer that never calls: stay away (without closing, which would look like a
        # crash) until the others have surely given up, then touch the dead group no more.
        await asyncio.sleep(2 * t.timeout + 0.5)
        return
    await expect_error(TransportTimeoutError, t.all_gather(rank), check, rank)
    start = time.monotonic()
    await expect_error(TransportError, t.all_gather(rank), check, rank)
    if time.monotonic() - start > 0.5 * t.timeout:
        raise fail(check, rank, "an operation on a timed-out group did not fail promptly.")


async def _check_close(t: Transport, options: Options) -> None:
    rank, check = t.rank, "close"
    await t.aclose()
    if not t.closed:
        raise fail(check, rank, "closed is False after aclose().")
    await expect_error(TransportClosedError, t.all_gather(1), check, rank)
    await expect_error(TransportClosedError, t.broadcast(1, src=0), check, rank)
    await expect_error(TransportClosedError, t.exchange({}), check, rank)
    await expect_error(TransportClosedError, t.exchange_sized({}, {}), check, rank)
    await t.aclose()  # idempotent
    if not t.closed:
        raise fail(check, rank, "closed is False after a second aclose().")


async def _check_async_with(t: Transport, options: Options) -> None:
    rank, check = t.rank, "async with"
    async with t as entered:
        if entered is not t:
            raise fail(check, rank, f"async with gave {entered!r}, not the transport itself.")
        gathered = await t.all_gather(rank)
        assert_same(gathered, list(range(t.num_ranks)), "all_gather inside", check, rank)
    if not t.closed:
        raise fail(check, rank, "the transport is still open after its async with block.")


async def _check_fresh_instances(first: Transport, second: Transport, options: Options) -> None:
    """Two groups alive at once are independent: results never cross, and closing one leaves
    the other working (the engine holds several groups, and closes them one by one)."""
    rank, n, check = first.rank, first.num_ranks, "fresh instances"
    if second.closed:
        raise fail(check, rank, "a second fresh transport reports closed=True.")
    if (second.rank, second.num_ranks) != (rank, n):
        raise fail(
            check,
            rank,
            f"two calls of the maker gave this rank {first!r} and {second!r}; every call "
            "must give each rank its member of a group of the same shape.",
        )
    a = await first.all_gather(("first", rank))
    b = await second.all_gather(("second", rank))
    assert_same(a, [("first", r) for r in range(n)], "first group's all_gather", check, rank)
    assert_same(b, [("second", r) for r in range(n)], "second group's all_gather", check, rank)
    value = await second.broadcast("from the second" if rank == 0 else None, src=0)
    assert_same(value, "from the second", "second group's broadcast", check, rank)
    await first.aclose()
    if second.closed:
        raise fail(check, rank, "closing one transport closed another one made alongside it.")
    received = await second.exchange({(rank + 1) % n: [((rank,), "after")]})
    expected = {((rank - 1) % n,): "after"}
    assert_same(received, expected, "exchange after the first group closed", check, rank)


def checks(*, check_timeout: bool) -> list[Check]:
    """The suite, in the order every rank runs it; the timeout check, when asked for, last
    (a timed-out collective may still hold a worker thread for a while)."""
    suite = [
        Check("sanity", _check_sanity),
        Check("all_gather", _check_all_gather),
        Check("broadcast", _check_broadcast),
        Check("exchange", _check_exchange),
        Check("exchange_sized", _check_exchange_sized),
        Check("local errors", _check_local_errors),
        Check("mixed operations", _check_mixed),
        Check("close", _check_close),
        Check("async with", _check_async_with),
        Check("fresh instances", _check_fresh_instances, groups=2),
    ]
    if check_timeout:
        suite.append(Check("timeout", _check_timeout))
    return suite
