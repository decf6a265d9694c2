from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from evenflow.transports import Transport
from evenflow.transports._inprocess import InProcessGroup
from evenflow.transports._local import LocalTransport
from evenflow.transports._registry import (
    _unregister_transport,
    create_transport,
    register_transport,
)
from evenflow.transports.errors import (
    ConfigError,
    EncodeError,
    RouteError,
    TransportClosedError,
    TransportError,
)
from evenflow.transports.testing import check_transport

# -- LocalTransport --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_conformance() -> None:
    # The class is a maker: every check gets a new LocalTransport.
    await check_transport(LocalTransport)


@pytest.mark.asyncio
async def test_conformance_with_timeout_check_is_a_no_op_for_one_rank() -> None:
    await check_transport(LocalTransport, large_bytes=0, check_timeout=True)


@pytest.mark.asyncio
async def test_results_are_equal_copies_not_the_callers_objects() -> None:
    t = LocalTransport()
    sent: dict[str, Any] = {
        "tokens": np.arange(6, dtype=np.int32),
        "t": torch.ones(3),
        "pair": (1, 2),
    }
    [gathered] = await t.all_gather(sent)
    assert gathered is not sent
    assert gathered["pair"] == (1, 2) and isinstance(gathered["pair"], tuple)
    np.testing.assert_array_equal(gathered["tokens"], sent["tokens"])
    assert not np.shares_memory(gathered["tokens"], sent["tokens"])
    gathered["tokens"][0] = 99  # the receiver owns its copy
    assert sent["tokens"][0] == 0
    broadcast = await t.broadcast(sent, src=0)
    assert torch.equal(broadcast["t"], sent["t"])
    assert broadcast["t"].data_ptr() != sent["t"].data_ptr()


@pytest.mark.asyncio
async def test_exchange_delivers_self_sends_in_order_through_the_codec() -> None:
    t = LocalTransport()
    payload = np.arange(4)
    received = await t.exchange({0: [((0, 2), "b"), ((0, 1), payload)]})
    assert list(received) == [(0, 2), (0, 1)]
    assert not np.shares_memory(received[0, 1], payload)
    assert await t.exchange({0: []}) == {}
    assert await t.exchange({}) == {}


@pytest.mark.asyncio
async def test_unsupported_payloads_fail_as_on_a_real_group() -> None:
    t = LocalTransport()
    with pytest.raises(EncodeError):
        await t.exchange({0: [((0,), {1, 2})]})
    with pytest.raises(EncodeError):
        await t.all_gather(object())
    with pytest.raises(EncodeError):
        await t.broadcast({"x": {1}}, src=0)


@pytest.mark.asyncio
async def test_route_errors_name_the_bad_targets() -> None:
    t = LocalTransport()
    with pytest.raises(RouteError) as info:
        await t.exchange({0: [((0,), 1)], 1: [((1,), 2)], -1: []})
    assert str(info.value) == (
        "Rank 0: exchange routes payloads to targets outside the group [0, 1): -1, 1. "
        "No data was moved."
    )
    with pytest.raises(RouteError, match=r"broadcast src must be a group rank in \[0, 1\)"):
        await t.broadcast(1, src=1)


@pytest.mark.asyncio
async def test_duplicate_keys_and_bad_items_are_refused() -> None:
    t = LocalTransport()
    with pytest.raises(TransportError, match=r"key \(1,\) more than once"):
        await t.exchange({0: [((1,), "a"), ((1,), "b")]})
    with pytest.raises(TypeError, match="must be a list of"):
        await t.exchange({0: "ab"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"must be a \(key, payload\) tuple, but got 1"):
        await t.exchange({0: [1]})  # type: ignore[list-item]


@pytest.mark.asyncio
async def test_close_semantics() -> None:
    t = LocalTransport(global_rank=5)
    assert t.global_ranks == (5,) and (t.rank, t.num_ranks) == (0, 1)
    async with t:
        assert await t.all_gather(3) == [3]
    assert t.closed
    with pytest.raises(TransportClosedError, match="Rank 0: cannot run broadcast on a closed"):
        await t.broadcast(1, src=0)
    await t.aclose()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_local_rejects_bad_global_rank(bad: Any) -> None:
    with pytest.raises(ValueError, match="global_rank must be a non-negative integer"):
        LocalTransport(global_rank=bad)


# -- registry --------------------------------------------------------------------------------


@pytest.fixture
def registered() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        _unregister_transport(name)


def test_create_local_passes_keyword_arguments() -> None:
    t = create_transport("local", global_rank=3)
    assert isinstance(t, LocalTransport)
    assert t.global_ranks == (3,)


def test_create_inprocess_returns_the_groups_member() -> None:
    group = InProcessGroup(2)
    t = create_transport("inprocess", group=group, rank=1)
    assert t is group.transport(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "missing group"),
        ({"group": None}, "missing rank"),
        ({"group": None, "rank": 0, "timeout": 1.0}, "unexpected timeout"),
    ],
)
def test_create_inprocess_requires_group_and_rank(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        create_transport("inprocess", **kwargs)


def test_create_inprocess_rejects_a_non_group() -> None:
    with pytest.raises(TypeError, match="needs an InProcessGroup, but got 'g'"):
        create_transport("inprocess", group="g", rank=0)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="Unknown transport 'nccl'") as info:
        create_transport("nccl")
    assert "'device', 'gloo', 'inprocess', 'local'" in str(info.value)
    assert "For 'nccl', use 'device'." in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match="register_transport") as other:
        create_transport("carrier-pigeon")
    assert "use '" not in str(other.value)
    with pytest.raises(TypeError, match="Transport name must be a string"):
        create_transport(3)  # type: ignore[arg-type]


def test_register_and_create_a_custom_transport(registered: list[str]) -> None:
    made: list[dict[str, Any]] = []

    def factory(**kwargs: Any) -> Transport:
        made.append(kwargs)
        return LocalTransport()

    register_transport("mine", factory)
    registered.append("mine")
    assert isinstance(create_transport("mine", x=1), LocalTransport)
    assert made == [{"x": 1}]
    with pytest.raises(ValueError, match="'mine'"):
        create_transport("unknown-name")


def test_register_refuses_taken_names_unless_replacing(registered: list[str]) -> None:
    with pytest.raises(ValueError, match="'gloo' is already registered; pass replace=True"):
        register_transport("gloo", LocalTransport)
    register_transport("again", LocalTransport)
    registered.append("again")
    with pytest.raises(ValueError, match="already registered"):
        register_transport("again", LocalTransport)
    register_transport("again", lambda **kw: LocalTransport(global_rank=7), replace=True)
    assert create_transport("again").global_ranks == (7,)


def test_register_validates_name_and_factory(registered: list[str]) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        register_transport("", LocalTransport)
    with pytest.raises(ValueError, match="non-empty string"):
        register_transport(" x", LocalTransport)
    with pytest.raises(TypeError, match="must be callable"):
        register_transport("x", "LocalTransport")  # type: ignore[arg-type]
    register_transport("not-a-transport", lambda **kw: object())  # type: ignore[arg-type]
    registered.append("not-a-transport")
    with pytest.raises(TypeError, match="is not an evenflow Transport"):
        create_transport("not-a-transport")


def test_builtin_transports_are_imported_only_when_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    imported: list[str] = []
    real_import = importlib.import_module

    def recording_import(name: str, package: str | None = None) -> Any:
        imported.append(name)
        if name in ("evenflow.transports._gloo", "evenflow.transports._device"):
            raise ImportError(f"{name} stands in for a backend that is not installed")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", recording_import)  # what _registry calls
    create_transport("local")
    create_transport("inprocess", group=InProcessGroup(1), rank=0)
    assert imported == ["evenflow.transports._local"]
    for name in ("gloo", "device"):
        with pytest.raises(ImportError, match=f"_{name} stands in"):
            create_transport(name)
    assert imported[1:] == ["evenflow.transports._gloo", "evenflow.transports._device"]
