"""Caller-synchronized launches: collectives of launch_on_caller transports start only on the
caller's thread, inside next() and the prefetch hooks, in canonical order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.transports import InProcessGroup, Transport
from evenflow.transports.testing import WrappedTransport


class CallerLaunched(WrappedTransport):
    """An in-process transport that declares caller launches and records where they ran."""

    name: ClassVar[str] = "caller-launched"
    launch_on_caller: ClassVar[bool] = True

    def __init__(self, inner: Transport, log: list[tuple[int, str, int]]) -> None:
        super().__init__(inner)
        self._log = log

    def _launch_record(self, op: str) -> None:
        self._log.append((self.rank, op, threading.get_ident()))

    async def all_gather(self, obj: Any) -> list[Any]:
        await self.launcher.launch(
            lambda: self._launch_record("all_gather"), op="all_gather", final=True
        )
        return await super().all_gather(obj)

    async def broadcast(self, obj: Any, *, src: int) -> Any:
        await self.launcher.launch(
            lambda: self._launch_record("broadcast"), op="broadcast", final=True
        )
        return await super().broadcast(obj, src=src)

    async def exchange(
        self, outgoing: Mapping[int, Sequence[tuple[Hashable, Any]]]
    ) -> dict[Hashable, Any]:
        await self.launcher.launch(lambda: self._launch_record("sizes"), op="exchange", final=False)
        await self.launcher.launch(
            lambda: self._launch_record("exchange"), op="exchange", final=True
        )
        return await super().exchange(outgoing)


def _source(rank: int, steps: int = 5) -> list[list[list[dict[str, Any]]]]:
    out = []
    for step in range(steps):
        long = rank == 0
        sizes = [[30, 28], [25, 20]] if long else [[3, 2, 4], [5, 1]]
        bins = []
        i = 0
        for b in sizes:
            bins.append(
                [
                    {"id": (rank, step, i + j), "input_ids": np.zeros(n, np.int32)}
                    for j, n in enumerate(b)
                ]
            )
            i += len(b)
        out.append(bins)
    return out


def _pack(samples: list[dict[str, Any]], seq_len: int) -> list[Any]:
    return [s["id"] for s in samples]


def _loaders(n: int, log: list[Any], **cfg: Any) -> list[BalancedLoader]:
    group = InProcessGroup(n, timeout=20.0)
    config = LoaderConfig(seq_len=64, bins_per_rank=2, log_stats=False, **cfg)
    return [
        BalancedLoader(
            _source(r),
            config=config,
            transport=CallerLaunched(group.transport(r), log),
            pack_fn=_pack,
        )
        for r in range(n)
    ]


@pytest.mark.parametrize("window", [1, 3])
def test_sync_launches_run_on_the_caller_thread_only(window: int) -> None:
    log: list[tuple[int, str, int]] = []
    loaders = _loaders(2, log, balance_window=window)
    callers: dict[int, int] = {}
    results: list[Any] = [None, None]

    def main(rank: int) -> None:
        callers[rank] = threading.get_ident()
        out = []
        with loaders[rank] as loader:
            for batch in loader:
                loader.prefetch_plan()
                loader.prefetch_plan()  # repeated hooks are harmless
                loader.prefetch()
                loader.prefetch()
                out.append(batch)
        results[rank] = out

    threads = [threading.Thread(target=main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert [len(r) for r in results] == [5, 5]
    assert log, "no collective was launched"
    for rank, op, ident in log:
        assert ident == callers[rank], f"{op} of rank {rank} launched off the caller thread"
    ops = [[op for r, op, _ in log if r == rank] for rank in range(2)]
    assert ops[0] == ops[1], "ranks launched different collective sequences"
    assert "exchange" in ops[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [1, 3])
async def test_async_launches_run_inside_anext_and_hooks(window: int) -> None:
    inside = {0: False, 1: False}
    outside_launches: list[Any] = []

    class Log(list[tuple[int, str, int]]):
        def append(self, entry: tuple[int, str, int]) -> None:
            if not inside[entry[0]]:
                outside_launches.append(entry)
            super().append(entry)

    log = Log()
    loaders = _loaders(2, log, planning="leader", balance_window=window)

    async def one(rank: int) -> int:
        n = 0
        async with loaders[rank] as loader:
            it = loader.__aiter__()
            while True:
                inside[rank] = True
                try:
                    await it.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    inside[rank] = False
                n += 1
                inside[rank] = True
                await loader.aprefetch()
                inside[rank] = False
                for _ in range(3):  # the pipeline runs; no launch may happen meanwhile
                    await asyncio.sleep(0)
        return n

    counts = await asyncio.gather(one(0), one(1))
    assert counts == [5, 5]
    assert outside_launches == []
    assert any(op == "broadcast" for _, op, _ in log)
