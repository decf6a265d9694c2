"""The loaders' shared lifecycle (LoaderFacade) and the follower's identity without a loader."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DistributedLoader, LoaderConfig
from evenflow.engine._distributed.topology import Topology, mesh_layout
from evenflow.engine._pipeline import loader as loader_module
from evenflow.engine._pipeline.facade import drive
from evenflow.engine.errors import LoaderStateError
from evenflow.transports import InProcessGroup, LocalTransport

SEQ_LEN = 64


def _config(**overrides: Any) -> LoaderConfig:
    return LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False, **overrides)


def _steps(rank: int, num_steps: int = 3) -> Iterator[list[list[dict[str, Any]]]]:
    for step in range(num_steps):
        yield [[{"input_ids": np.full(4 + b + rank, step, dtype=np.int32)}] for b in range(2)]


class _Broadcast:
    """Stands in for a follower's BatchBroadcaster; it is never used to receive here."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _topology(balance_groups: tuple[tuple[int, ...], ...]) -> Topology:
    layout = mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), world_size=4)
    return Topology(
        rank=3 if (0, 2) in balance_groups else 1,
        world_size=4,
        layout=layout,
        balance_groups=balance_groups,
        grouping="size",
    )


_KWARGS: dict[str, Any] = {"cost_model": "quadratic", "algorithm": "lpt"}


def _follower(topology: Topology, **kwargs: Any) -> DistributedLoader:
    return DistributedLoader.follower(
        config=_config(),
        topology=topology,
        broadcaster=_Broadcast(),  # type: ignore[arg-type]
        loader_kwargs=kwargs,
        release=lambda: None,
        transport="inprocess",
    )


# -- the follower's identity ----------------------------------------------------------------------


def test_constructor_and_follower_hold_the_same_identity() -> None:
    # A balance group of two constructors (global ranks 0 and 2); rank 3 follows rank 2.
    group = InProcessGroup(2, timeout=10.0, global_ranks=(0, 2))
    constructor = BalancedLoader(
        _steps(1), config=_config(), transport=group.transport(1), **_KWARGS
    )
    follower = _follower(_topology(((0, 2),)), **_KWARGS)
    assert follower.identity() == constructor.identity()
    assert follower.fingerprint() == constructor.fingerprint()
    constructor.close()
    follower.close()
    # A balance group of one rank balances over a local transport.
    alone = BalancedLoader(
        _steps(0), config=_config(), transport=LocalTransport(global_rank=0), **_KWARGS
    )
    follower = _follower(_topology(((0,), (2,))), **_KWARGS)
    assert follower.identity() == alone.identity()
    alone.close()
    follower.close()


def test_the_follower_builds_no_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a follower built a BalancedLoader")

    monkeypatch.setattr(loader_module.BalancedLoader, "__init__", refuse)
    follower = _follower(_topology(((0, 2),)), **_KWARGS)
    assert follower.identity()["planner"]["num_ranks"] == 2
    follower.close()


def test_the_follower_validates_the_arguments_like_the_constructor() -> None:
    topology = _topology(((0, 2),))
    for bad in ({"pack_fn": 3}, {"cost_model": "no-such-model"}, {"pack_fun": len}):
        with pytest.raises((TypeError, ValueError)) as follower_error:
            _follower(topology, **bad)
        with pytest.raises((TypeError, ValueError)) as constructor_error:
            BalancedLoader(_steps(0), config=_config(), **bad)
        assert type(follower_error.value) is type(constructor_error.value)
        if "pack_fun" not in bad:  # Python names the function that refused the keyword
            assert str(follower_error.value) == str(constructor_error.value)


# -- one lifecycle for both loaders -------------------------------------------------------------


def test_a_closed_loader_of_either_kind_refuses_to_iterate() -> None:
    loader = BalancedLoader(_steps(0), config=_config())
    follower = _follower(_topology(((0, 2),)))
    for item, name, hint in (
        (loader, "BalancedLoader", "create"),
        (follower, "DistributedLoader", "build"),
    ):
        item.close()
        item.close()  # idempotent
        with pytest.raises(LoaderStateError, match=f"This {name} is closed; {hint} a new one"):
            next(item)
        with pytest.raises(LoaderStateError, match="is closed"):
            item.set_epoch(1)


@pytest.mark.asyncio
async def test_blocking_forms_are_refused_on_an_async_loader_of_either_kind() -> None:
    loader = BalancedLoader(_steps(0), config=_config())
    follower = _follower(_topology(((0, 2),)))
    assert [len(b) async for b in loader] == [2, 2, 2]
    await follower.aprefetch()  # fixes the async mode; a follower has no launch points
    for item in (loader, follower):
        with pytest.raises(LoaderStateError, match="instead of the sync hooks"):
            item.prefetch()
        with pytest.raises(LoaderStateError, match="aclose"):
            item.close()
        with pytest.raises(LoaderStateError, match="async mode"):
            next(iter(item))
        await item.aclose()


def test_sync_iteration_runs_the_async_body_without_a_loop_on_the_caller_thread() -> None:
    loader = BalancedLoader(_steps(0), config=_config())
    with loader:
        assert [len(b) for b in loader] == [2, 2, 2]
        assert loader._loop_thread is not None  # the pipeline ran on the loader's loop thread
    assert loader._loop_thread is None  # joined by close()


def test_drive_refuses_a_coroutine_that_suspends() -> None:
    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(AssertionError, match="awaited outside its Runner"):
        drive(suspends())


def test_aclose_of_a_sync_loader_closes_the_pass_on_its_own_loop() -> None:
    loader = BalancedLoader(_steps(0, num_steps=5), config=_config(prefetch_depth=2))
    it = iter(loader)
    next(it)  # the pass now runs on the loader's loop thread
    thread = loader._loop_thread
    assert thread is not None
    asyncio.run(loader.aclose())
    assert loader._loop_thread is None and thread.loop.is_closed()
    with pytest.raises(LoaderStateError, match="closed"):
        next(it)
