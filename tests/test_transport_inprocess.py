from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from evenflow.transports._inprocess import InProcessGroup, InProcessTransport
from evenflow.transports.errors import (
    CollectiveMismatchError,
    EncodeError,
    PeerFailureError,
    RouteError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
)
from evenflow.transports.testing import (
    WrappedTransport,
    check_inprocess_conformance,
    check_transport,
    run_inprocess,
    run_inprocess_threads,
)


async def wait_until(predicate: Callable[[], bool], deadline: float = 10.0) -> None:
    """Yield to the loop until ``predicate()`` holds; fail after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.001)


# -- conformance -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [1, 2, 8])
@pytest.mark.parametrize("threads", [False, True], ids=["one-loop", "threads"])
def test_conformance(num_ranks: int, threads: bool) -> None:
    check_inprocess_conformance(num_ranks, threads=threads, large_bytes=1 << 20, debug=True)


def test_conformance_64_ranks_one_loop() -> None:
    check_inprocess_conformance(64, large_bytes=1 << 14)


@pytest.mark.parametrize("threads", [False, True], ids=["one-loop", "threads"])
def test_conformance_with_timeout_check(threads: bool) -> None:
    # Every operation of the suite runs under this timeout, so it leaves room for a loaded
    # machine; the missing rank then idles 2 * 0.5 + 0.5 s.
    check_inprocess_conformance(
        3, threads=threads, large_bytes=1 << 10, check_timeout=True, timeout=0.5
    )


def _members(num_ranks: int, **group_kwargs: Any) -> list[InProcessTransport]:
    """Every member of a new in-process group: a maker for check_transport."""
    group = InProcessGroup(num_ranks, **group_kwargs)
    return [group.transport(rank) for rank in range(num_ranks)]


@pytest.mark.asyncio
async def test_conformance_with_default_large_payload() -> None:
    await check_transport(lambda: _members(2))


@pytest.mark.asyncio
async def test_conformance_with_an_async_maker_of_one_member() -> None:
    async def make() -> InProcessTransport:
        return InProcessGroup(1).transport(0)

    await check_transport(make, large_bytes=0)


@pytest.mark.asyncio
async def test_a_wrapped_transport_passes_the_conformance_suite_and_closes_its_inner() -> None:
    inner: list[InProcessTransport] = []

    def make() -> list[WrappedTransport]:
        members = _members(2)
        inner.extend(members)
        wrappers = [WrappedTransport(t) for t in members]
        assert [(w.rank, w.num_ranks, w.timeout) for w in wrappers] == [
            (t.rank, 2, t.timeout) for t in members
        ]
        return wrappers

    await check_transport(make, large_bytes=1 << 10)
    # One fresh group per check, two for the check of independent groups; all closed.
    assert len(inner) == 2 * 11 and all(t.closed for t in inner)


def test_a_wrapped_transport_needs_a_transport() -> None:
    with pytest.raises(TypeError, match="inner must be an evenflow Transport, but got dict"):
        WrappedTransport({})  # type: ignore[arg-type]


def _failed_checks(group: BaseExceptionGroup[Any]) -> set[str]:
    return {str(e).split("]")[0].removeprefix("[").split(":")[0] for e in group.exceptions}


@pytest.mark.asyncio
async def test_conformance_suite_detects_a_broken_transport_in_every_check_it_breaks() -> None:
    class Reversing(InProcessTransport):
        async def all_gather(self, obj: Any) -> list[Any]:
            return list(reversed(await super().all_gather(obj)))

    def make() -> list[InProcessTransport]:
        group = InProcessGroup(2, timeout=5.0)
        return [Reversing(group, rank, None) for rank in range(2)]

    with pytest.raises(ExceptionGroup) as caught:
        await check_transport(make, large_bytes=0)
    failures = caught.value.exceptions
    assert all(isinstance(e, AssertionError) for e in failures), failures
    assert str(failures[0]).startswith("[sanity]")
    # Every check that gathers fails on its own fresh group; those that never gather pass.
    failed = _failed_checks(caught.value)
    assert {"sanity", "all_gather", "mixed operation 0", "async with"} <= failed, failed
    assert not failed & {"broadcast", "exchange: uneven", "close"}, failed
    assert "transport conformance checks failed (sanity, all_gather" in str(caught.value)


@pytest.mark.asyncio
async def test_conformance_suite_checks_a_second_close() -> None:
    class ClosesOnce(InProcessTransport):
        async def aclose(self) -> None:
            if self.closed:
                raise RuntimeError("closed twice")
            await super().aclose()

    def make() -> list[InProcessTransport]:
        group = InProcessGroup(2, timeout=5.0)
        return [ClosesOnce(group, rank, None) for rank in range(2)]

    with pytest.raises(ExceptionGroup) as caught:
        await check_transport(make, large_bytes=0)
    # Only the checks that close a transport themselves see a second close (the suite's own,
    # after the check); every other check passes.
    errors = caught.value.exceptions
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    checks = {re.findall(r"check '([^']+)'", " ".join(e.__notes__))[0] for e in errors}
    assert checks == {"close", "async with", "fresh instances"}
    assert "3 of 10 transport conformance checks failed (close, async with, fresh" in str(
        caught.value
    )


@pytest.mark.asyncio
async def test_conformance_suite_needs_a_maker_of_fresh_transports() -> None:
    transport = InProcessGroup(1).transport(0)
    with pytest.raises(
        TypeError,
        match=r"make_group must be a maker of fresh transports, but "
        r"got the transport <InProcessTransport rank=0/1 .*check_transport\(lambda",
    ):
        await check_transport(transport)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"make_group must be a callable .* but got 3"):
        await check_transport(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a Transport or a non-empty sequence"):
        await check_transport(lambda: [])
    with pytest.raises(TypeError, match="an earlier check already used"):
        await check_transport(lambda: transport)
    group = InProcessGroup(2)
    with pytest.raises(TypeError, match="members of one group"):
        await check_transport(lambda: [group.transport(0), group.transport(0)])


@pytest.mark.asyncio
async def test_a_failing_maker_ends_the_suite_with_what_failed_so_far() -> None:
    calls = 0

    def make() -> list[InProcessTransport]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("no more groups")
        return _members(2)

    with pytest.raises(ExceptionGroup) as caught:
        await check_transport(make, large_bytes=0)
    [error] = caught.value.exceptions
    assert isinstance(error, RuntimeError) and calls == 3
    assert "make_group failed before the conformance check 'broadcast'." in error.__notes__


# -- collective semantics --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_results_do_not_alias_across_ranks_and_are_writable() -> None:
    async def fn(t: InProcessTransport) -> list[Any]:
        return await t.all_gather(np.arange(8, dtype=np.int64) * (t.rank + 1))

    results = await run_inprocess(3, fn)
    for i, a in enumerate(results):
        for j, b in enumerate(results):
            if i != j:
                assert not np.shares_memory(a[0], b[0])
        assert a[1].flags.writeable
        np.testing.assert_array_equal(a[2], np.arange(8) * 3)


@pytest.mark.asyncio
async def test_exchange_orders_by_sender_then_sender_order() -> None:
    async def fn(t: InProcessTransport) -> list[Any]:
        received = await t.exchange({0: [((t.rank, 1), "b"), ((t.rank, 0), "a")]})
        return list(received)

    results = await run_inprocess(3, fn, delay_fn=lambda rank, i, op: 0.002 * (3 - rank))
    assert results[0] == [(0, 1), (0, 0), (1, 1), (1, 0), (2, 1), (2, 0)]
    assert results[1] == results[2] == []


@pytest.mark.asyncio
async def test_duplicate_key_on_a_receiver_is_reported() -> None:
    async def fn(t: InProcessTransport) -> dict[Any, Any]:
        return await t.exchange({0: [((7,), t.rank)]})

    results = await run_inprocess(2, fn, return_exceptions=True)
    assert isinstance(results[0], TransportError)
    assert "key (7,) more than once (again from rank 1)" in str(results[0])
    assert results[1] == {}


@pytest.mark.asyncio
async def test_route_error_message_names_rank_targets_and_that_nothing_moved() -> None:
    group = InProcessGroup(2)
    t = group.transport(1)
    with pytest.raises(RouteError) as info:
        await t.exchange({0: [], 5: [((1,), 1)], -2: []})
    message = str(info.value)
    assert message.startswith("Rank 1: exchange routes payloads to targets outside the group")
    assert "[0, 2): -2, 5." in message
    assert "No data was moved." in message
    assert info.value.rank == 1 and info.value.op == "exchange"
    assert group.statistics().num_open_operations == 0


@pytest.mark.asyncio
async def test_bad_outgoing_shapes_raise_type_error_before_any_collective() -> None:
    group = InProcessGroup(2)
    t = group.transport(0)
    with pytest.raises(TypeError, match="must map target ranks"):
        await t.exchange([(0, [])])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"outgoing\[1\] must be a list of \(key, payload\) pairs"):
        await t.exchange({1: "ab"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"must be a \(key, payload\) tuple, but got \[1, 2\]"):
        await t.exchange({1: [[1, 2]]})  # type: ignore[list-item]
    with pytest.raises(EncodeError):
        await t.all_gather({"x": {1}})
    assert group.statistics().num_open_operations == 0


@pytest.mark.asyncio
async def test_mismatched_operations_raise_on_every_rank() -> None:
    async def fn(t: InProcessTransport) -> Any:
        if t.rank == 1:
            return await t.exchange({})
        return await t.all_gather(t.rank)

    results = await run_inprocess(3, fn, return_exceptions=True)
    for rank, result in enumerate(results):
        assert isinstance(result, CollectiveMismatchError), (rank, result)
        assert str(result).startswith(f"Rank {rank}: ranks issued different collectives")
        assert "operation #0" in str(result)
        assert "issued all_gather" in str(result) and "issued exchange" in str(result)


@pytest.mark.asyncio
async def test_broadcast_with_different_sources_is_a_mismatch_and_kills_the_group() -> None:
    later: list[BaseException] = []

    async def fn(t: InProcessTransport) -> Any:
        await t.all_gather(0)
        try:
            return await t.broadcast(t.rank, src=t.rank)
        except CollectiveMismatchError:
            with pytest.raises(PeerFailureError, match="unusable") as info:
                await t.all_gather(1)
            later.append(info.value)
            raise

    results = await run_inprocess(2, fn, return_exceptions=True)
    assert all(isinstance(r, CollectiveMismatchError) for r in results)
    assert "operation #1" in str(results[0])
    assert "broadcast(src=0)" in str(results[0]) and "broadcast(src=1)" in str(results[0])
    assert len(later) == 2


@pytest.mark.asyncio
async def test_missing_rank_times_out_naming_rank_op_and_missing_ranks() -> None:
    timed_out = asyncio.Event()
    waited = 0

    async def fn(t: InProcessTransport) -> Any:
        nonlocal waited
        if t.rank == 2:
            await timed_out.wait()  # this rank never joins the first collective in time
            with pytest.raises(PeerFailureError, match=r"rank [01] timed out at operation #0"):
                await t.all_gather(2)
            return "late"
        try:
            await t.all_gather(t.rank)
        finally:
            waited += 1
            if waited == 2:
                timed_out.set()

    start = time.monotonic()
    results = await run_inprocess(3, fn, timeout=0.2, return_exceptions=True)
    assert time.monotonic() - start < 10
    for rank in (0, 1):
        error = results[rank]
        assert isinstance(error, TransportTimeoutError), error
        assert str(error).startswith(f"Rank {rank}: all_gather (operation #0) timed out")
        assert "ranks [2]" in str(error)
    assert results[2] == "late"


@pytest.mark.asyncio
async def test_close_while_peers_wait_fails_them_promptly() -> None:
    async def fn(t: InProcessTransport) -> Any:
        if t.rank == 2:
            await wait_until(lambda: t.group.statistics().num_waiting == 2)
            await t.aclose()
            return "closed"
        return await t.all_gather(t.rank)

    start = time.monotonic()
    results = await run_inprocess(3, fn, timeout=30.0, return_exceptions=True)
    assert time.monotonic() - start < 10  # far below the 30 s timeout
    for rank in (0, 1):
        assert isinstance(results[rank], PeerFailureError), results[rank]
        assert "rank 2 closed its transport" in str(results[rank])
    assert results[2] == "closed"


def test_close_while_peers_wait_in_other_threads() -> None:
    async def fn(t: InProcessTransport) -> Any:
        if t.rank == 0:
            await wait_until(lambda: t.group.statistics().num_waiting == 3)
            await t.aclose()
            return "closed"
        return await t.broadcast(None, src=0)

    start = time.monotonic()
    results = run_inprocess_threads(4, fn, timeout=30.0, return_exceptions=True)
    assert time.monotonic() - start < 10
    assert results[0] == "closed"
    assert all(isinstance(r, PeerFailureError) for r in results[1:]), results


@pytest.mark.asyncio
async def test_cancelled_waiter_fails_its_peers_promptly() -> None:
    group = InProcessGroup(3, timeout=30.0)
    t0, t1 = group.transport(0), group.transport(1)
    task0 = asyncio.create_task(t0.all_gather(0))
    task1 = asyncio.create_task(t1.all_gather(1))
    await wait_until(lambda: group.statistics().num_waiting == 2)
    task1.cancel()
    with pytest.raises(PeerFailureError, match=r"rank 1 abandoned operation #0"):
        await asyncio.wait_for(task0, 10)
    with pytest.raises(asyncio.CancelledError):
        await task1
    with pytest.raises(PeerFailureError):
        await group.transport(2).all_gather(2)


@pytest.mark.asyncio
async def test_operations_after_close_raise_closed_and_close_is_idempotent() -> None:
    group = InProcessGroup(2)
    t = group.transport(0)
    await t.aclose()
    await t.aclose()
    assert t.closed
    with pytest.raises(TransportClosedError, match="Rank 0: cannot run exchange on a closed"):
        await t.exchange({})
    with pytest.raises(PeerFailureError, match="rank 0 closed its transport"):
        await group.transport(1).all_gather(1)


@pytest.mark.asyncio
async def test_two_concurrent_operations_on_one_transport_are_refused() -> None:
    group = InProcessGroup(2, timeout=30.0)
    t = group.transport(0)
    first = asyncio.create_task(t.all_gather(0))
    await wait_until(lambda: group.statistics().num_waiting == 1)
    with pytest.raises(TransportError, match="await one operation at a time"):
        await t.all_gather(1)
    assert (await group.transport(1).all_gather(1)) == [0, 1]
    assert (await first) == [0, 1]


# -- timing independence ---------------------------------------------------------------------


async def _scripted_ops(t: InProcessTransport) -> list[Any]:
    """A fixed mix of operations whose results depend only on the ranks' data."""
    n, out = t.num_ranks, []
    for i in range(12):
        out.append(await t.all_gather((t.rank, i)))
        out.append(await t.broadcast([i, t.rank] if t.rank == i % n else None, src=i % n))
        got = await t.exchange({(t.rank * i + j) % n: [((t.rank, i, j), j)] for j in range(3)})
        out.append(sorted(got.items()))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_delays_do_not_change_results(seed: int) -> None:
    calls: list[tuple[int, int, str]] = []
    rng = random.Random(seed)

    def delay(rank: int, index: int, op: str) -> float:
        calls.append((rank, index, op))
        return rng.random() * 0.002

    reference = await run_inprocess(5, _scripted_ops)
    shuffled = await run_inprocess(5, _scripted_ops, delay_fn=delay)
    assert shuffled == reference
    for rank in range(5):
        mine = [(i, op) for r, i, op in calls if r == rank]
        assert [i for i, _ in mine] == list(range(36))
        assert [op for _, op in mine[:3]] == ["all_gather", "broadcast", "exchange"]


def test_random_delays_with_threads_match_one_loop() -> None:
    rng = random.Random(7)
    delays = {(r, i): rng.random() * 0.002 for r in range(4) for i in range(36)}
    reference = asyncio.run(run_inprocess(4, _scripted_ops))
    threaded = run_inprocess_threads(4, _scripted_ops, delay_fn=lambda r, i, op: delays[r, i])
    assert threaded == reference


@pytest.mark.asyncio
async def test_delay_fn_must_return_a_non_negative_number() -> None:
    group = InProcessGroup(1, delay_fn=lambda rank, index, op: -1.0)
    with pytest.raises(ValueError, match=r"delay_fn\(0, 0, 'all_gather'\) must return"):
        await group.transport(0).all_gather(1)


# -- scale -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_256_ranks_gather_and_exchange() -> None:
    async def fn(t: InProcessTransport) -> tuple[int, dict[Any, Any]]:
        n = t.num_ranks
        gathered = await t.all_gather(t.rank)
        received = await t.exchange({(t.rank + 1) % n: [((t.rank,), t.rank)]})
        return sum(gathered), received

    results = await run_inprocess(256, fn)
    for rank, (total, received) in enumerate(results):
        assert total == 256 * 255 // 2
        assert received == {((rank - 1) % 256,): (rank - 1) % 256}


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_group_rejects_bad_num_ranks(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"num_ranks must be an integer >= 1, but got {bad!r}"):
        InProcessGroup(bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_group_rejects_bad_timeout(bad: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        InProcessGroup(2, timeout=bad)


def test_group_rejects_non_callable_delay_fn() -> None:
    with pytest.raises(TypeError, match="delay_fn must be callable"):
        InProcessGroup(2, delay_fn=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 3, True, "0"])
def test_transport_rank_must_be_a_member(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 3\)"):
        InProcessGroup(3).transport(bad)


def test_transport_is_one_object_per_rank_and_carries_group_settings() -> None:
    group = InProcessGroup(3, timeout=4.5, global_ranks=[10, 11, 12])
    t = group.transport(2)
    assert group.transport(2) is t
    assert (t.rank, t.num_ranks, t.global_ranks, t.timeout) == (2, 3, (10, 11, 12), 4.5)
    assert t.name == "inprocess" and not t.launch_on_caller
    assert t.group is group
    assert "InProcessGroup num_ranks=3" in repr(group)
