"""The sized exchange: one collective when every rank knows every byte count in advance.

In-process ranks for the checks that a real collective cannot survive (a sender whose bytes do
not add up), two Gloo processes for the single ``all_to_all_single`` (counted) and for a frame
that disagrees with its announced size, and the engine on Gloo: one collective per exchange.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.transports import InProcessGroup, Prepared, Transport, prepare
from evenflow.transports.errors import PeerEncodeError, TransportError, WireFormatError
from evenflow.transports.launch import RankPool
from evenflow.transports.testing import WrappedTransport, run_inprocess


def _payload(sender: int, i: int) -> dict[str, Any]:
    return {"tokens": np.arange(10 * (i + 1), dtype=np.int32) + sender, "i": i}


def _items(sender: int, target: int) -> list[tuple[Hashable, Any]]:
    return [((sender, target, i), _payload(sender, i)) for i in range(sender + target + 1)]


def _plan(rank: int, n: int) -> tuple[dict[int, Any], dict[int, Any], dict[Hashable, Any]]:
    """What ``rank`` sends and expects in an all-to-all of :func:`_items` (self included)."""
    outgoing = {t: [(k, prepare(v)) for k, v in _items(rank, t)] for t in range(n)}
    incoming = {s: [(k, prepare(v).nbytes) for k, v in _items(s, rank)] for s in range(n)}
    expected = {k: v for s in range(n) for k, v in _items(s, rank)}
    return outgoing, incoming, expected


def _same(got: dict[Hashable, Any], want: dict[Hashable, Any]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert np.array_equal(got[key]["tokens"], value["tokens"]) and got[key]["i"] == value["i"]


def test_prepare_measures_the_frame_and_refuses_what_the_wire_cannot_carry() -> None:
    from evenflow.transports import encode
    from evenflow.transports.errors import EncodeError

    value = _payload(1, 3)
    assert prepare(value).nbytes == encode(value).size
    assert prepare(value).value is value
    with pytest.raises(EncodeError, match=r"payload\['bad'\]: unsupported type set"):
        prepare({"bad": {1}})


@pytest.mark.asyncio
async def test_inprocess_sized_exchange_delivers_everything_in_one_operation() -> None:
    async def body(t: Any) -> int:
        outgoing, incoming, expected = _plan(t.rank, t.num_ranks)
        _same(await t.exchange_sized(outgoing, incoming), expected)
        return int(t._next_index)  # the position in the group's order: operations so far

    group = InProcessGroup(3, timeout=10.0)
    counts = await asyncio.gather(*(body(group.transport(r)) for r in range(3)))
    assert counts == [1, 1, 1]  # one collective for the whole exchange


@pytest.mark.asyncio
async def test_a_sender_whose_bytes_differ_from_the_announcement_is_named() -> None:
    async def body(t: Transport) -> Any:
        outgoing, incoming, _ = _plan(t.rank, t.num_ranks)
        if t.rank == 1:  # rank 1 expects one frame too few from rank 0
            incoming[0] = incoming[0][:-1]
        try:
            await t.exchange_sized(outgoing, incoming)
        except WireFormatError as exc:
            return exc
        return None

    results = await run_inprocess(2, body)
    assert results[0] is None
    assert "(sender, bytes, announced)" in str(results[1]) and "[(0, " in str(results[1])


@pytest.mark.asyncio
async def test_zeros_in_place_of_a_payload_are_reported_as_the_senders_failure() -> None:
    async def body(t: Transport) -> Any:
        outgoing, incoming, _ = _plan(t.rank, t.num_ranks)
        if t.rank == 0:
            key, real = outgoing[1][0]
            outgoing[1][0] = (key, Prepared.zeros(real.nbytes))
        error = None
        try:
            await t.exchange_sized(outgoing, incoming)
        except PeerEncodeError as exc:
            error = exc
        follow = await t.all_gather(t.rank)  # the group is still in step
        assert follow == [0, 1]
        return error

    results = await run_inprocess(2, body)
    assert results[0] is None
    assert isinstance(results[1], PeerEncodeError) and results[1].failed_ranks == (0,)
    assert "rank 0 could not write the payload of key (0, 1, 0)" in str(results[1])


def test_the_default_exchange_sized_goes_through_exchange_and_checks_the_keys() -> None:
    class OnlyExchange(WrappedTransport):
        """A transport that implements the required methods only."""

        async def exchange_sized(self, outgoing: Any, incoming: Any) -> dict[Hashable, Any]:
            return await Transport.exchange_sized(self, outgoing, incoming)

    async def body(t: Transport) -> Any:
        wrapped = OnlyExchange(t)
        outgoing, incoming, expected = _plan(t.rank, t.num_ranks)
        _same(await wrapped.exchange_sized(outgoing, incoming), expected)
        incoming[0] = [*incoming[0], ((9, 9, 9), 64)]  # a key nobody sends
        with pytest.raises(
            TransportError, match=r"expected keys that did not arrive \(\(9, 9, 9\)"
        ):
            await wrapped.exchange_sized(outgoing, incoming)
        return 0

    asyncio.run(run_inprocess(2, body))


# -- two Gloo processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=120.0) as ranks:
        yield ranks


def _counting() -> list[int]:
    """Count ``all_to_all_single`` calls in this rank process from now on."""
    import torch.distributed as dist

    calls = [0]
    real = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counted  # type: ignore[assignment]
    return calls


def _gloo_sized(rank: int, num_ranks: int) -> dict[str, Any]:
    from evenflow.transports import GlooTransport

    calls = _counting()

    async def main() -> dict[str, Any]:
        async with GlooTransport(timeout=10.0) as t:
            outgoing, incoming, expected = _plan(rank, num_ranks)
            before = calls[0]
            _same(await t.exchange_sized(outgoing, incoming), expected)
            sized = calls[0] - before
            plain = {dest: [(k, p.value) for k, p in items] for dest, items in outgoing.items()}
            before = calls[0]
            _same(await t.exchange(plain), expected)
            two_step = calls[0] - before
            # Rank 1 expects rank 0's frames in the wrong order: the totals agree (so the
            # collective completes) but the frames do not fit their announced sizes.
            if rank == 1:
                incoming[0] = list(reversed(incoming[0]))
            error = ""
            try:
                await t.exchange_sized(outgoing, incoming)
            except WireFormatError as exc:
                error = str(exc)
            after = await t.all_gather(rank)
            return {"sized": sized, "two_step": two_step, "error": error, "after": after}

    return asyncio.run(main())


@pytest.mark.multiprocess
def test_gloo_sized_exchange_is_one_collective_and_checks_every_frame(pool: RankPool) -> None:
    results = pool.run(_gloo_sized)
    for result in results:
        assert result["sized"] == 1 and result["two_step"] == 2
        assert result["after"] == [0, 1]
    assert results[0]["error"] == ""
    assert "from rank 0 does not fill the" in results[1]["error"]
    assert "announced for it in the metadata round" in results[1]["error"]


def _engine_collectives(rank: int, num_ranks: int) -> dict[str, Any]:
    """A payload-mode loader on Gloo: collectives issued inside each exchange, counted."""
    from evenflow.engine import BalancedLoader, LoaderConfig
    from evenflow.transports import GlooTransport

    calls = _counting()

    class Counted(WrappedTransport):
        def __init__(self, inner: Transport) -> None:
            super().__init__(inner)
            self.per_exchange: list[int] = []

        async def exchange_sized(self, outgoing: Any, incoming: Any) -> dict[Hashable, Any]:
            before = calls[0]
            received = await super().exchange_sized(outgoing, incoming)
            self.per_exchange.append(calls[0] - before)
            return received

    def steps() -> Iterator[list[list[dict[str, Any]]]]:
        rng = np.random.default_rng(rank)
        for step in range(6):
            long = step % 2 == rank
            sizes = rng.integers(40, 60, 2) if long else rng.integers(2, 12, 4)
            bins = [[], []]
            for i, n in enumerate(sizes):
                ids = np.full(int(n), rank * 100 + step, dtype=np.int64)
                bins[i % 2].append({"input_ids": ids})
            yield bins

    transport = Counted(GlooTransport(timeout=10.0))
    config = LoaderConfig(seq_len=128, bins_per_rank=2, log_stats=False)

    class Source:
        def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
            return steps()

    loader = BalancedLoader(Source(), config=config, transport=transport, cost_model="quadratic")
    with loader:
        batches = list(loader)
    tokens = sorted(int(t) for batch in batches for b in batch for t in b["input_ids"].view(-1))
    return {"per_exchange": transport.per_exchange, "tokens": tokens}


@pytest.mark.multiprocess
def test_the_engine_moves_payloads_in_one_collective_per_exchange(pool: RankPool) -> None:
    results = pool.run(_engine_collectives)
    for result in results:
        assert result["per_exchange"], "no step moved a sample"
        assert set(result["per_exchange"]) == {1}
    delivered = sorted(results[0]["tokens"] + results[1]["tokens"])
    assert len(delivered) > 0 and len({t // 100 for t in delivered}) == 2
