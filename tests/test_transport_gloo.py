"""GlooTransport and DeviceTransport (CPU tensors over Gloo) on two real processes.

Functions named ``_rank_*`` run inside the ranks (the launcher imports this file there); the
tests run them on one module-wide pool of two ranks and assert on what they return.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from evenflow.transports._protocol import FAILED, Protocol
from evenflow.transports.errors import TransportError, WireFormatError
from evenflow.transports.launch import RankFailedError, RankPool

T = TypeVar("T")

GROUP_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=120.0) as ranks:
        yield ranks


def _make(kind: str, **kwargs: Any) -> Any:
    from evenflow.transports._device import DeviceTransport
    from evenflow.transports._gloo import GlooTransport

    if kind == "gloo":
        return GlooTransport(**kwargs)
    return DeviceTransport(device="cpu", **kwargs)


def _record_calls(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """Wrap torch.distributed collectives in this rank to log (name, thread name) per call."""
    import torch.distributed as dist

    calls: list[tuple[str, str]] = []
    for name in names:
        original = getattr(dist, name)

        def wrapper(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
            calls.append((_name, threading.current_thread().name))
            return _orig(*args, **kw)

        setattr(dist, name, wrapper)
    return calls


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "op": getattr(exc, "op", None),
        "peer_rank": getattr(exc, "peer_rank", None),
    }


# -- functions that run inside the ranks --------------------------------------------------------


def _rank_conformance(rank: int, num_ranks: int, kind: str, check_timeout: bool) -> float:
    from evenflow.transports.testing import check_transport

    async def main() -> float:
        timeout = 2.0 if check_timeout else GROUP_TIMEOUT
        start = time.monotonic()
        # A new group per check, made by every rank at the same point of the suite.
        await check_transport(
            lambda: _make(kind, timeout=timeout),
            large_bytes=4 << 20,
            check_timeout=check_timeout,
        )
        return time.monotonic() - start

    return asyncio.run(main())


def _rank_threads(rank: int, num_ranks: int) -> dict[str, Any]:
    import numpy as np

    calls = _record_calls(("all_to_all_single", "broadcast"))

    async def main() -> dict[str, Any]:
        transport = _make("gloo", timeout=GROUP_TIMEOUT)
        gathered = await transport.all_gather({"rank": rank})
        value = await transport.broadcast("hello" if rank == 1 else None, src=1)
        received = await transport.exchange({1 - rank: [((rank,), np.arange(rank + 3))]})
        default_executor_used = asyncio.get_running_loop()._default_executor is not None  # type: ignore[attr-defined]
        alive = [t.name for t in threading.enumerate() if "evenflow-gloo" in t.name]
        max_workers = transport._executor._max_workers
        await transport.aclose()
        after = [t.name for t in threading.enumerate() if "evenflow-gloo" in t.name]
        return {
            "gathered": gathered,
            "value": value,
            "received": [list(k) + v.tolist() for k, v in received.items()],
            "calls": calls,
            "main": threading.main_thread().name,
            "default_executor_used": default_executor_used,
            "alive": alive,
            "after_close": after,
            "max_workers": max_workers,
        }

    return asyncio.run(main())


def _rank_route_error(rank: int, num_ranks: int, kind: str) -> dict[str, Any]:
    from evenflow.transports.errors import RouteError

    calls = _record_calls(("all_to_all_single",))

    async def main() -> dict[str, Any]:
        transport = _make(kind, timeout=GROUP_TIMEOUT)
        try:
            await transport.exchange({rank: [((rank, 0), "mine")], 7: [((rank, 1), "lost")]})
        except RouteError as exc:
            error = _describe(exc)
        calls_after_error = len(calls)
        received = await transport.exchange({1 - rank: [((rank, 2), "ok")]})
        await transport.aclose()
        return {"error": error, "calls": calls_after_error, "received": list(received.items())}

    return asyncio.run(main())


def _rank_frame_limit(rank: int, num_ranks: int, kind: str) -> dict[str, Any]:
    calls = _record_calls(("all_to_all_single",))

    async def main() -> dict[str, Any]:
        transport = _make(kind, timeout=GROUP_TIMEOUT, max_frame_bytes=4096)
        payload = b"x" * (64 << 10) if rank == 0 else b"small"
        try:
            await transport.exchange({1 - rank: [((rank,), payload)]})
            error = None
        except TransportError as exc:
            error = _describe(exc)
        calls_after_error = len(calls)
        after = await transport.all_gather(rank)
        await transport.aclose()
        return {"error": error, "calls": calls_after_error, "after": after}

    return asyncio.run(main())


class _RecordingLauncher:
    """Records every launch (op, final, thread) and runs it inline."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, bool, str]] = []

    async def launch(self, fn: Callable[[], T], *, op: str, final: bool) -> T:
        result = fn()
        self.launches.append((op, final, threading.current_thread().name))
        return result


def _rank_launches(rank: int, num_ranks: int) -> dict[str, Any]:
    calls = _record_calls(("all_to_all_single", "broadcast"))

    async def main() -> dict[str, Any]:
        transport = _make("device", timeout=GROUP_TIMEOUT)
        launcher = _RecordingLauncher()
        transport.launcher = launcher
        await transport.all_gather(rank)
        await transport.broadcast(rank, src=0)
        await transport.exchange({0: [((rank,), rank)]})
        try:
            await transport.all_gather({1, 2} if rank == 0 else rank)
        except Exception as exc:
            failed = type(exc).__name__
        await transport.aclose()
        return {"launches": launcher.launches, "calls": calls, "failed": failed}

    return asyncio.run(main())


def _rank_peer_dies(rank: int, num_ranks: int) -> dict[str, Any]:
    import numpy as np
    import torch.distributed as dist

    if rank == 1:
        original = dist.all_to_all_single
        seen = []

        def die_on_data_step(*args: Any, **kwargs: Any) -> Any:
            seen.append(1)
            if len(seen) == 2:  # after the sizes step, before the bytes move
                os._exit(3)
            return original(*args, **kwargs)

        dist.all_to_all_single = die_on_data_step  # type: ignore[assignment]

    async def main() -> dict[str, Any]:
        transport = _make("gloo", timeout=GROUP_TIMEOUT)
        start = time.monotonic()
        try:
            await transport.exchange({1 - rank: [((rank,), np.zeros(1 << 20, np.uint8))]})
        except TransportError as exc:
            first = _describe(exc) | {"seconds": time.monotonic() - start}
        start = time.monotonic()
        try:
            await transport.all_gather(rank)
        except TransportError as exc:
            second = _describe(exc) | {"seconds": time.monotonic() - start}
        await transport.aclose()
        return {"first": first, "second": second}

    return asyncio.run(main())


def _rank_buffer_reuse(rank: int, num_ranks: int) -> dict[str, Any]:
    """Exchanges of > 1 MiB per rank (pooled), holding the first result while others run."""
    import numpy as np
    import torch

    from evenflow.transports._gloo import GlooTransport

    def payload(round_: int) -> dict[int, list[tuple[Any, Any]]]:
        # Different bytes every round, to every rank including this one.
        return {
            target: [
                (
                    (rank, round_, i),
                    {
                        "a": np.full(150_000, rank * 100 + round_ * 10 + i, dtype=np.int32),
                        "t": torch.full((70_000,), float(round_), dtype=torch.float64),
                    },
                )
                for i in range(2)
            ]
            for target in range(num_ranks)
        }

    def digest(received: dict[Any, Any]) -> dict[str, Any]:
        return {
            str(key): [int(v["a"][0]), int(v["a"][-1]), float(v["t"].sum())]
            for key, v in sorted(received.items())
        }

    async def main() -> dict[str, Any]:
        transport = GlooTransport(timeout=GROUP_TIMEOUT)
        held = await transport.exchange(payload(0))
        held_digest = digest(held)
        views = all(
            not v["a"].flags.owndata and not v["t"].numpy().flags.owndata for v in held.values()
        )
        send_buffer = transport._send_buffer
        digests = []
        for round_ in range(1, 7):
            digests.append(digest(await transport.exchange(payload(round_))))  # dropped at once
        result = {
            "held_before": held_digest,
            "held_after": digest(held),
            "views": views,
            "later": digests,
            "send_buffer_kept": transport._send_buffer is send_buffer,
            "pooled": len(transport._receive_pool._backing),
        }
        await transport.aclose()
        return result

    return asyncio.run(main())


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gloo", "device"])
def test_conformance_with_timeout(pool: RankPool, kind: str) -> None:
    # check_timeout makes rank 0 idle for twice the 2 s group timeout; deadline leaves 3x.
    seconds = pool.run(_rank_conformance, kind, True, deadline=60.0)
    assert len(seconds) == 2
    assert all(s > 2.0 for s in seconds)  # rank 1 waited out a real timeout


@pytest.mark.multiprocess
def test_collectives_run_on_one_dedicated_thread(pool: RankPool) -> None:
    for rank, result in enumerate(pool.run(_rank_threads)):
        assert result["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert result["value"] == "hello"
        peer = 1 - rank
        assert result["received"] == [[peer, *range(peer + 3)]]
        threads = {thread for _, thread in result["calls"]}
        assert len(threads) == 1, threads
        (thread,) = threads
        assert "evenflow-gloo" in thread
        assert thread != result["main"]
        # 3 ops: sizes + data each; broadcast uses broadcast for both steps.
        assert [name for name, _ in result["calls"]].count("all_to_all_single") == 4
        assert [name for name, _ in result["calls"]].count("broadcast") == 2
        assert result["default_executor_used"] is False
        assert result["max_workers"] == 1
        assert result["alive"] == [thread]
        assert result["after_close"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gloo", "device"])
def test_route_error_before_any_collective(pool: RankPool, kind: str) -> None:
    for rank, result in enumerate(pool.run(_rank_route_error, kind)):
        assert result["error"]["type"] == "RouteError"
        assert "7" in result["error"]["message"]
        assert result["error"]["op"] == "exchange"
        assert result["calls"] == 0
        assert result["received"] == [[[1 - rank, 2], "ok"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gloo", "device"])
def test_frame_limit_fails_every_rank_before_data_moves(pool: RankPool, kind: str) -> None:
    sender, receiver = pool.run(_rank_frame_limit, kind)
    assert sender["error"]["type"] == "TransportError"
    assert "max_frame_bytes=4096" in sender["error"]["message"]
    assert receiver["error"]["type"] == "PeerEncodeError"
    assert "rank(s) 0 could not build their frames" in receiver["error"]["message"]
    for result in (sender, receiver):
        assert result["calls"] == 1  # the sizes step only: no bytes moved
        assert result["after"] == [0, 1]  # the group is still in step


def test_receiver_refuses_sizes_over_the_limit() -> None:
    proto = Protocol(rank=1, num_ranks=3, global_ranks=(0, 1, 2), name="gloo", limit=1024)
    proto.check_incoming("exchange", [0, 1024, 64])
    with pytest.raises(WireFormatError, match=r"\(2, 1025\)"):
        proto.check_incoming("exchange", [0, 64, 1025])
    with pytest.raises(WireFormatError, match=r"\(0, -5\)"):
        proto.check_incoming("exchange", [-5, 64, 0])
    with pytest.raises(TransportError, match=r"rank\(s\) 2 could not build"):
        proto.check_incoming("all_gather", [64, 64, FAILED])


def test_error_translation() -> None:
    proto = Protocol(rank=0, num_ranks=2, global_ranks=(4, 5), name="gloo", limit=1024)
    timeout = proto.translate("exchange", RuntimeError("Timed out waiting 5000ms for recv"))
    peer = proto.translate("all_gather", RuntimeError("Connection closed by peer [::1]:4"))
    other = proto.translate("broadcast", RuntimeError("something odd"))
    assert type(timeout).__name__ == "TransportTimeoutError"
    assert type(peer).__name__ == "PeerFailureError"
    assert type(other) is TransportError
    for error, op in ((timeout, "exchange"), (peer, "all_gather"), (other, "broadcast")):
        assert error.op == op
        assert error.rank == 0
        assert "[4, 5]" in str(error)
        assert op in str(error)


def test_constructors_reject_bad_arguments() -> None:
    import torch

    from evenflow.transports._device import DeviceTransport
    from evenflow.transports._gloo import GlooTransport

    with pytest.raises(ValueError, match="timeout must be a positive number"):
        GlooTransport(timeout=0)
    with pytest.raises(ValueError, match="max_frame_bytes must be at least 64"):
        GlooTransport(max_frame_bytes=10)
    with pytest.raises(TransportError, match="init_process_group"):
        GlooTransport()  # this test process has no process group
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu'"):
            DeviceTransport(device="cuda")


@pytest.mark.multiprocess
def test_device_launches_go_through_the_launcher(pool: RankPool) -> None:
    for result in pool.run(_rank_launches):
        launches = result["launches"]
        ops = ["all_gather", "broadcast", "exchange", "all_gather"]
        expected = [[op, final, "MainThread"] for op in ops for final in (False, True)]
        assert launches == expected
        # Every collective was issued from inside a launch, on the caller's thread.
        assert {thread for _, thread in result["calls"]} == {"MainThread"}
        assert len(result["calls"]) == 7  # the failed all_gather only ran its sizes step
        assert result["failed"] in ("EncodeError", "TransportError", "PeerEncodeError")


@pytest.mark.multiprocess
def test_exchange_benchmark_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    from evenflow.engine._tools.bench.exchange import main

    assert main(["--quick", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (row,) = document["results"]
    assert row["num_ranks"] == 2
    assert row["mib_per_rank"] == 1
    for method in ("evenflow", "raw", "gather_raw", "pickled"):
        assert row[f"{method}_bytes_per_s"] > 0
    assert row["vs_raw"] == pytest.approx(row["evenflow_bytes_per_s"] / row["raw_bytes_per_s"])
    assert row["vs_gather"] == pytest.approx(
        row["evenflow_bytes_per_s"] / row["gather_raw_bytes_per_s"]
    )
    assert document["targets"] == []  # quick runs measure no target case


def test_receive_pool_reuses_a_buffer_only_once_no_view_remains() -> None:
    import numpy as np
    import torch

    from evenflow.transports._gloo import _POOL_MAX_BUFFERS, _POOL_MIN_BYTES, _ReceivePool
    from evenflow.transports._wire import decode, encode

    pool = _ReceivePool()
    frame = encode({"a": np.arange(_POOL_MIN_BYTES // 8), "t": torch.arange(1000.0)})
    for kind in ("array", "tensor", "slice", "memoryview"):
        lease = pool.lease(frame.size)
        assert lease.flags.writeable and lease.size == frame.size
        lease[:] = frame
        address = lease.ctypes.data
        got = decode(lease)
        keep: Any = {
            "array": got["a"],
            "tensor": got["t"],
            "slice": got["a"][10:20],
            "memoryview": memoryview(got["a"]),
        }[kind]
        before = bytes(np.asarray(keep).view(np.uint8))
        del lease, got
        # Only ``keep`` refers to the lease now: its memory must not be handed out again.
        other = pool.lease(frame.size)
        assert other.ctypes.data != address, kind
        other[:] = 0xFF
        assert bytes(np.asarray(keep).view(np.uint8)) == before, kind
        del other, keep
    # Everything released: later leases reuse the pooled buffers instead of allocating.
    count = len(pool._backing)
    addresses = {b.ctypes.data for b in pool._backing}
    leases = [pool.lease(frame.size) for _ in range(count)]
    assert {lease.ctypes.data for lease in leases} == addresses
    assert len(pool._backing) == count
    # Small receives are not pooled; neither are receives while every buffer is busy.
    assert pool.lease(100).base is None
    leases += [pool.lease(_POOL_MIN_BYTES) for _ in range(_POOL_MAX_BUFFERS - count)]
    extra = pool.lease(_POOL_MIN_BYTES)
    assert len(pool._backing) == _POOL_MAX_BUFFERS
    assert all(not np.shares_memory(extra, b) for b in pool._backing)
    pool.clear()
    assert not pool._backing
    leases[0][:] = 1  # leases outlive clear(): they keep their own memory
    assert int(leases[0].sum()) == leases[0].size


@pytest.mark.multiprocess
def test_exchange_never_overwrites_a_result_the_caller_still_holds(pool: RankPool) -> None:
    for rank, result in enumerate(pool.run(_rank_buffer_reuse)):
        assert result["views"]  # zero-copy: decoded arrays and tensors are views
        assert result["held_after"] == result["held_before"]
        for round_, got in enumerate([result["held_before"], *result["later"]]):
            assert len(got) == 4
            for key, (first, last, total) in got.items():
                src, sent_round, i = (int(x) for x in key.strip("()").split(","))
                assert sent_round == round_
                assert first == last == src * 100 + round_ * 10 + i
                assert total == 70_000 * round_
        assert result["send_buffer_kept"]
        # The held result pins one buffer; the six dropped ones reused the others. Gloo may
        # release its own reference to an output a moment after the collective returns, so
        # consecutive receives can alternate between two buffers; without reuse all four
        # pool slots would fill.
        assert 2 <= result["pooled"] <= 3, rank


@pytest.mark.multiprocess
def test_peer_dying_mid_exchange_fails_survivor_promptly(pool: RankPool) -> None:
    # Last on purpose: the pool is torn down by the death and would restart for a next test.
    with pytest.raises(RankFailedError) as info:
        pool.run(_rank_peer_dies, deadline=4 * GROUP_TIMEOUT)
    error = info.value
    assert error.rank == 1
    assert error.exitcode == 3
    assert "exited with code 3" in str(error)
    kind, survivor = error.outcomes[0]
    assert kind == "result"
    assert survivor["first"]["type"] == "PeerFailureError"
    assert survivor["first"]["op"] == "exchange"
    assert "exchange" in survivor["first"]["message"]
    assert survivor["first"]["seconds"] < GROUP_TIMEOUT
    # Gloo names the dead peer only by address; in a group of two it is the other member.
    assert survivor["first"]["peer_rank"] == 1
    assert "group rank 1 (global rank 1), the only other member" in survivor["first"]["message"]
    # The dead group fails the next operation at once, without touching the wire.
    assert survivor["second"]["op"] == "all_gather"
    assert survivor["second"]["seconds"] < 1.0
    assert not pool.running
