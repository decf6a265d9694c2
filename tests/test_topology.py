"""Topology: mesh layouts, balance groups, the build agreement and model-parallel broadcast."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from evenflow.engine._distributed.build import _describe_error, _raise_on_error, _raise_on_mismatch
from evenflow.engine._distributed.loader import decode_error, encode_error
from evenflow.engine._distributed.topology import (
    Topology,
    groups_by_node,
    groups_by_size,
    mesh_layout,
    node_id,
    plain_layout,
)
from evenflow.engine.errors import (
    ConfigError,
    GroupMismatchError,
    RemoteStageError,
    SourceExhaustedError,
)
from evenflow.transports import _wire
from evenflow.transports._broadcast import join_batch, split_batch
from evenflow.transports.errors import WireFormatError

# -- layouts (no processes) ------------------------------------------------------------------


def test_dp_by_tp_mesh_gives_constructors_and_peer_groups() -> None:
    layout = mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), world_size=4)
    assert layout.constructors == (0, 2)
    assert layout.mp_groups == ((0, 1), (2, 3))
    assert layout.dp_dims == ("dp",)


def test_dp2_mp4_matches_the_reference_layout() -> None:
    grid = np.arange(8).reshape(2, 4)
    layout = mesh_layout(grid, ("dp", "tp"), world_size=8)
    assert layout.constructors == (0, 4)
    assert layout.mp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_dp_as_inner_dimension_and_several_dp_dims() -> None:
    layout = mesh_layout([[0, 1], [2, 3]], ("tp", "dp"), world_size=4)
    assert layout.constructors == (0, 1)
    assert layout.mp_groups == ((0, 2), (1, 3))
    # dp_replicate x tp x dp_shard: DP coordinates flatten row-major over the DP dims.
    grid = np.arange(8).reshape(2, 2, 2)
    layout = mesh_layout(grid, ("dp_replicate", "tp", "dp_shard"), world_size=8)
    assert layout.constructors == (0, 1, 4, 5)
    assert layout.mp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_non_contiguous_ranks_follow_mesh_order() -> None:
    layout = mesh_layout([[3, 0], [2, 1]], ("dp", "cp"), world_size=4)
    assert layout.constructors == (3, 2)
    assert layout.mp_groups == ((3, 0), (2, 1))


def test_mesh_without_dp_dims_has_one_data_coordinate() -> None:
    layout = mesh_layout([[0, 1], [2, 3]], ("pp", "tp"), world_size=4)
    assert layout.constructors == (0,)
    assert layout.mp_groups == ((0, 1, 2, 3),)


def test_explicit_dp_dim_names_and_unknown_names() -> None:
    layout = mesh_layout([[0, 1], [2, 3]], ("a", "b"), dp_dim_names=["b"], world_size=4)
    assert layout.constructors == (0, 1)
    with pytest.raises(ConfigError, match=r"unknown names \['dpx'\].*\['dp', 'tp'\]"):
        mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), dp_dim_names=("dpx",))
    with pytest.raises(ConfigError, match="repeated"):
        mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), dp_dim_names=("dp", "dp"))
    with pytest.raises(ConfigError, match="sequence of mesh dimension names"):
        mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), dp_dim_names="dp")


def test_bad_meshes_are_rejected() -> None:
    with pytest.raises(ConfigError, match="no dimension names"):
        mesh_layout([[0, 1]], None)
    with pytest.raises(ConfigError, match="one unique name per dimension"):
        mesh_layout([[0, 1]], ("dp",))
    with pytest.raises(ConfigError, match="distinct"):
        mesh_layout([[0, 0]], ("dp", "tp"))
    with pytest.raises(ConfigError, match=r"missing \[2, 3\]"):
        mesh_layout([[0, 1]], ("dp", "tp"), world_size=4)


def test_groups_by_size_are_consecutive_blocks() -> None:
    assert groups_by_size((0, 1, 2, 3), 2) == ((0, 1), (2, 3))
    assert groups_by_size((0, 4, 8, 12), 2) == ((0, 4), (8, 12))
    assert groups_by_size((0, 1, 2, 3), 4) == ((0, 1, 2, 3),)


@pytest.mark.parametrize("bad", [0, 3, -2, True, "2", 2.0])
def test_groups_by_size_rejects_values_that_do_not_divide(bad: object) -> None:
    with pytest.raises(ConfigError, match=rf"balance_group_size .* \(4\), but got {bad!r}"):
        groups_by_size((0, 1, 2, 3), bad)


def test_groups_by_node_buckets_in_order_of_appearance() -> None:
    nodes = {0: "node:1", 1: "node:0", 2: "node:1", 3: "node:0"}
    assert groups_by_node((0, 1, 2, 3), nodes) == ((0, 2), (1, 3))
    assert groups_by_node((0, 2), nodes) == ((0, 2),)


def test_node_id_prefers_group_rank_then_local_world_size_then_host() -> None:
    assert node_id(5, {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"}) == "node:1"
    assert node_id(5, {"LOCAL_WORLD_SIZE": "4"}) == "block:1"
    assert node_id(5, {}).startswith("host:")
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE .* 'x'"):
        node_id(0, {"LOCAL_WORLD_SIZE": "x"})


def test_topology_roles() -> None:
    layout = mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), world_size=4)
    follower = Topology(
        rank=3, world_size=4, layout=layout, balance_groups=((0, 2),), grouping="size"
    )
    assert (follower.data_rank, follower.constructor, follower.is_constructor) == (1, 2, False)
    assert follower.balance_group == (0, 2)
    assert follower.mp_group == (2, 3)
    plain = Topology(
        rank=1,
        world_size=2,
        layout=plain_layout(2),
        balance_groups=((0,), (1,)),
        grouping="node",
    )
    assert plain.is_constructor and plain.balance_group == (1,)


# -- agreement messages --------------------------------------------------------------------------


def _record(seq_len: int, algorithm: str = "refine-v4") -> dict[str, Any]:
    return {
        "error": None,
        "agree": {
            "version": "0.1.0",
            "config": {"seq_len": seq_len, "bins_per_rank": 2},
            "planner": {"algorithm": algorithm},
        },
    }


def test_mismatch_names_first_differing_rank_and_field() -> None:
    records = [_record(4096), _record(4096), _record(2048, "lpt-v1"), _record(1024)]
    with pytest.raises(
        GroupMismatchError, match=r"rank 2 differs in config\.seq_len: 2048 vs 4096 on rank 0"
    ):
        _raise_on_mismatch(records)
    _raise_on_mismatch([_record(8), _record(8)])  # identical: no error
    with pytest.raises(GroupMismatchError, match=r"rank 1 differs in planner\.algorithm"):
        _raise_on_mismatch([_record(8), _record(8, "lpt-v1")])


def test_build_errors_are_raised_alike_everywhere() -> None:
    ok = {"error": None}
    bad = {"error": _describe_error(ConfigError("seq_len bad"))}
    with pytest.raises(ConfigError, match="failed on rank 1: ConfigError: seq_len bad"):
        _raise_on_error([ok, bad, ok], None)
    with pytest.raises(ConfigError, match="failed on every rank: ConfigError: seq_len bad"):
        _raise_on_error([bad, bad], None)
    typed = {"error": _describe_error(TypeError("not callable"))}
    with pytest.raises(TypeError, match="rank 0"):
        _raise_on_error([typed, ok], None)
    _raise_on_error([ok, ok], None)


# -- batch structure and errors across the broadcast ----------------------------------------


def test_split_and_join_round_trip_through_the_wire() -> None:
    big = torch.arange(40_000, dtype=torch.int64).reshape(200, 200)
    batch = [
        {"input_ids": big, "cu_seqlens": torch.tensor([0, 3], dtype=torch.int32), "n": 7},
        ({1: "int key", "x": torch.zeros(0)}, [torch.ones(3, dtype=torch.bfloat16)]),
        None,
    ]
    tree, tensors = split_batch(batch, inline_bytes=1024)
    assert len(tensors) == 1 and tensors[0].data_ptr() == big.data_ptr()  # sent in place
    decoded = _wire.decode(_wire.encode({"tree": tree}))
    received = [torch.empty_like(t).copy_(t) for t in tensors]
    out = join_batch(decoded["tree"], received)
    assert torch.equal(out[0]["input_ids"], big)
    assert out[0]["cu_seqlens"].tolist() == [0, 3] and out[0]["n"] == 7
    assert out[1][0][1] == "int key" and out[1][0]["x"].numel() == 0
    assert out[1][1][0].dtype == torch.bfloat16 and out[2] is None


def test_malformed_structure_is_rejected() -> None:
    with pytest.raises(WireFormatError, match="missing tensor 3"):
        join_batch(["t", 3], [])
    with pytest.raises(WireFormatError, match="Malformed"):
        join_batch(["q", 1], [])


def test_errors_cross_the_broadcast_as_the_same_kind() -> None:
    same = decode_error(encode_error(SourceExhaustedError("rank 1 ran dry"), rank=0, step=4))
    assert type(same) is SourceExhaustedError and str(same) == "rank 1 ran dry"
    remote = RemoteStageError(
        failed_rank=5, stage="pack", step=3, error_type="ValueError", message="boom"
    )
    again = decode_error(encode_error(remote, rank=0, step=3))
    assert isinstance(again, RemoteStageError) and again.failed_rank == 5
    local = decode_error(encode_error(KeyError("k"), rank=2, step=9))
    assert isinstance(local, RemoteStageError)
    assert (local.failed_rank, local.step, local.error_type) == (2, 9, "KeyError")


# -- a follower's message handling (a scripted broadcast, no processes) ------------------------


class _ScriptedBroadcast:
    """Stands in for BatchBroadcaster on a follower: hands out scripted messages."""

    is_sender = False

    def __init__(self, messages: list[tuple[dict[str, Any], Any]]) -> None:
        self.messages = list(messages)
        self.closed = False

    def receive(self) -> tuple[dict[str, Any], Any]:
        if not self.messages:
            raise AssertionError("the follower received past the end of the script")
        return self.messages.pop(0)

    def call(self, fn: Any) -> Any:
        return fn()

    async def acall(self, fn: Any) -> Any:
        return fn()

    def close(self) -> None:
        self.closed = True


def _ok(step: int, epoch: int = 0) -> tuple[dict[str, Any], Any]:
    return {"status": "ok", "epoch": epoch, "step": step, "error": None}, {"step": step}


def _follower(messages: list[tuple[dict[str, Any], Any]], **config: Any) -> Any:
    from evenflow.engine import DistributedLoader
    from evenflow.engine._pipeline.h2d import DeviceStager

    layout = mesh_layout([[0, 1], [2, 3]], ("dp", "tp"), world_size=4)
    topology = Topology(
        rank=3, world_size=4, layout=layout, balance_groups=((0, 2),), grouping="node"
    )
    released: list[bool] = []
    loader = DistributedLoader(
        topology=topology,
        config=_config(**config),
        inner=None,
        transport=None,
        broadcaster=_ScriptedBroadcast(messages),  # type: ignore[arg-type]
        stager=DeviceStager(None),
        identity={"config": {"seq_len": SEQ_LEN}},
        release=lambda: released.append(True),
    )
    loader.released = released
    return loader


def test_follower_stops_at_the_announced_end() -> None:
    end = {"status": "end", "epoch": 0, "step": 2, "error": None}
    loader = _follower([_ok(0), _ok(1), (end, None)])
    assert [b["step"] for b in loader] == [0, 1]
    assert next(loader, None) is None  # no further receive after the end
    assert loader.epoch == 0  # (a new iteration would start epoch 1, as on the constructor)
    assert loader.step == 2 and loader.last_host_batch == {"step": 1}
    assert not loader.is_constructor and loader.last_stats is None
    loader.close()
    assert loader.released == [True]


def test_follower_raises_the_constructors_error_at_the_same_step() -> None:
    info = encode_error(KeyError("bad sample"), rank=2, step=1)
    error = {"status": "error", "epoch": 0, "step": 1, "error": info}
    loader = _follower([_ok(0), (error, None), _ok(0, epoch=1)])
    assert next(loader)["step"] == 0
    for _ in range(2):  # raised again until a new pass starts
        with pytest.raises(RemoteStageError, match=r"Rank 2 failed .* step 1: KeyError"):
            next(loader)
    loader.set_epoch(1)
    assert next(loader)["step"] == 0 and loader.epoch == 1
    loader.close()


def test_follower_detects_a_step_mismatch() -> None:
    loader = _follower([_ok(5)])
    with pytest.raises(GroupMismatchError, match=r"expected epoch 0 step 0 .* step 5"):
        next(loader)
    loader.close()


@pytest.mark.asyncio
async def test_follower_async_iteration_and_resume() -> None:
    end = {"status": "end", "epoch": 0, "step": 3, "error": None}
    loader = _follower([_ok(2), (end, None)], max_steps=3)
    from evenflow.engine._pipeline.resume import loader_state

    state = loader.state_dict()
    assert state["format"] == "evenflow.loader" and len(loader) == 3
    assert "ranks" not in state and "position" not in state  # only the shared fields
    at_two = loader_state(
        epoch=0,
        step=2,
        identity={},
        source=None,
        source_state=None,
        process_rank=None,
        group_rank=0,
        group=[],
    )
    loader.load_state_dict(at_two)
    async with loader:
        assert [b["step"] async for b in loader] == [2]
    from evenflow.engine.errors import LoaderStateError, ResumeError

    fresh = _follower([])
    with pytest.raises(ResumeError, match=r"a follower of rank 2\) cannot restore this state"):
        fresh.load_state_dict({"format": "evenflow.loader"})
    with pytest.raises(ResumeError, match="do not belong together"):
        fresh.load_state_dict({**state, "step": 2})  # edited: the digest no longer matches
    with pytest.raises(TypeError, match="max_steps is None"):
        len(fresh)
    fresh.close()
    with pytest.raises(LoaderStateError, match="closed"):
        next(fresh)


def test_build_loader_needs_a_distributed_world() -> None:
    import torch.distributed as dist

    from evenflow.engine import build_loader
    from evenflow.engine._distributed.build import _startup_timeout

    if dist.is_available() and dist.is_initialized():  # pragma: no cover - not in this suite
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ConfigError, match=r"initialised torch\.distributed world"):
        build_loader([], _config())
    assert _startup_timeout(None, _config()) == 20.0
    assert _startup_timeout(None, "not a config") == 300.0
    with pytest.raises(ConfigError, match=r"timeout must be > 0\.0, but got -1"):
        _startup_timeout(-1, _config())


# -- real processes ---------------------------------------------------------------------------

SEQ_LEN = 512


def _source(rank: int, num_steps: int) -> Iterator[Any]:
    from evenflow.engine.workloads import step_source

    return step_source(
        "sft",
        "firstfit",
        rank=rank,
        bins_per_rank=2,
        seq_len=SEQ_LEN,
        seed=3,
        num_steps=num_steps,
    )


def _config(**overrides: Any) -> Any:
    from evenflow.engine import LoaderConfig

    fields: dict[str, Any] = {"seq_len": SEQ_LEN, "bins_per_rank": 2, "timeout": 20.0}
    fields.update(overrides)
    return LoaderConfig(**fields)


def _outcome(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc)}


def _tokens(batch: Any) -> list[int]:
    return sorted(int(t) for b in batch for t in b["input_ids"].reshape(-1).tolist())


def rank_groups(rank: int, num_ranks: int, mode: str) -> dict[str, Any]:
    """Build with node grouping from GROUP_RANK or with balance_group_size=2; run two steps."""
    from evenflow.engine import build_loader

    saved = os.environ.get("GROUP_RANK")
    if mode == "env":
        os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        size = 2 if mode == "size" else None
        loader = build_loader(_source(rank, 2), _config(), balance_group_size=size)
        with loader:
            batches = list(loader)
            group = list(loader.group_ranks)
            peers = list(loader.transport.global_ranks) if loader.transport else None
        return {"group": group, "peers": peers, "steps": len(batches)}
    finally:
        if saved is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = saved


class _Untouchable:
    """A source that fails the test if a follower ever reads it."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("a follower read its source")


def _collate_with_big(packed: list[Any]) -> dict[str, Any]:
    """A batch with a tensor large enough to be broadcast on its own (not inline)."""
    tokens = torch.cat([b["input_ids"].reshape(-1) for b in packed])
    return {"bins": packed, "big": tokens.repeat(40).to(torch.float32), "tag": ("x", 1)}


def rank_mesh(rank: int, num_ranks: int, fail_at: int | None, mode: str) -> dict[str, Any]:
    """2x2 (dp, tp) mesh: tp peers get identical batches; only constructors read sources."""
    import asyncio

    from torch.distributed.device_mesh import init_device_mesh

    from evenflow.engine import build_loader

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    constructor = rank % 2 == 0
    if not constructor:
        source: Any = None if rank == 1 else _Untouchable()
    elif fail_at is None:
        source = _source(rank, 3)
    else:
        source = _failing(_source(rank, 3), fail_at if rank == 2 else None)
    kwargs: dict[str, Any] = {"collate_fn": _collate_with_big} if mode == "async" else {}
    loader = build_loader(source, _config(), mesh=mesh, **kwargs)
    tokens: list[list[int]] = []
    big: list[float] = []

    def record(batch: Any) -> None:
        if mode == "async":
            assert batch["tag"] == ("x", 1)
            big.append(float(batch["big"].sum()))
            batch = batch["bins"]
        tokens.append(_tokens(batch))
        assert isinstance(batch[0]["max_length_q"], int)

    async def consume() -> None:
        async with loader:
            async for batch in loader:
                record(batch)

    outcome: dict[str, str] | None = None
    try:
        if mode == "async":
            asyncio.run(consume())
        else:
            with loader:
                for batch in loader:
                    record(batch)
    except Exception as exc:
        outcome = _outcome(exc)
    return {
        "constructor": loader.is_constructor,
        "group": list(loader.group_ranks),
        "tokens": tokens,
        "big": big,
        "outcome": outcome,
    }


def _failing(source: Iterator[Any], at: int | None) -> Iterator[Any]:
    for step, item in enumerate(source):
        if step == at:
            raise RuntimeError(f"source broke at step {step}")
        yield item


def rank_build_error(rank: int, num_ranks: int, case: str) -> dict[str, str] | None:
    """Every rank must raise the same error for a bad build on one or all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from evenflow.engine import build_loader

    kwargs: dict[str, Any] = {}
    config = _config()
    if case == "seq_len" and rank == 2:
        config = _config(seq_len=SEQ_LEN // 2)
    elif case == "size" or (case == "size_on_one" and rank == 1):
        kwargs["balance_group_size"] = 3
    elif case == "dims":
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tp"))
        kwargs["dp_dim_names"] = ("dp",)
    try:
        loader = build_loader(_source(rank, 1), config, **kwargs)
    except Exception as exc:
        return _outcome(exc)
    loader.close()
    return None


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    from evenflow.transports.launch import RankPool

    with RankPool(4, timeout=20.0, deadline=60.0) as ranks:
        yield ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["env", "size"])
def test_groups_from_group_rank_or_size(pool: Any, mode: str) -> None:
    results = pool.run(rank_groups, mode)
    assert [r["group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["peers"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["steps"] == 2 for r in results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tp_peers_receive_identical_batches(pool: Any, mode: str) -> None:
    results = pool.run(rank_mesh, None, mode)
    assert [r["constructor"] for r in results] == [True, False, True, False]
    assert all(r["group"] == [0, 2] for r in results)
    assert all(r["outcome"] is None for r in results), results
    assert len(results[0]["tokens"]) == 3
    assert results[0]["tokens"] == results[1]["tokens"]
    assert results[2]["tokens"] == results[3]["tokens"]
    assert results[0]["tokens"] != results[2]["tokens"]
    if mode == "async":  # the large tensor went through its own broadcast
        assert len(results[1]["big"]) == 3 and results[0]["big"] == results[1]["big"]


@pytest.mark.multiprocess
def test_constructor_error_reaches_its_peers_at_the_same_step(pool: Any) -> None:
    results = pool.run(rank_mesh, 1, "sync")
    steps = [len(r["tokens"]) for r in results]
    assert steps == [1, 1, 1, 1], results
    outcomes = [r["outcome"] for r in results]
    assert all(o is not None for o in outcomes)
    assert all("source broke at step 1" in o["message"] for o in outcomes), outcomes
    assert outcomes[1]["error"] == outcomes[3]["error"] == "RemoteStageError"


@pytest.mark.multiprocess
def test_mismatched_config_raises_the_same_error_everywhere(pool: Any) -> None:
    results = pool.run(rank_build_error, "seq_len")
    assert all(r["error"] == "GroupMismatchError" for r in results), results
    assert len({r["message"] for r in results}) == 1
    assert "rank 2 differs in config.seq_len: 256 vs 512 on rank 0" in results[0]["message"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("size", r"failed on every rank: ConfigError: balance_group_size .* but got 3"),
        ("size_on_one", r"failed on rank 1: ConfigError: balance_group_size .* but got 3"),
        ("dims", r"unknown names \['dp'\].*\['data', 'tp'\]"),
    ],
)
def test_invalid_arguments_raise_clear_errors_on_every_rank(
    pool: Any, case: str, expected: str
) -> None:
    import re

    results = pool.run(rank_build_error, case)
    assert all(r is not None and r["error"] == "ConfigError" for r in results), results
    assert len({r["message"] for r in results}) == 1
    assert re.search(expected, results[0]["message"]), results[0]["message"]


def test_a_follower_keeps_a_restored_position_and_refuses_an_earlier_epoch() -> None:
    from evenflow.engine._pipeline.resume import loader_state
    from evenflow.engine.errors import LoaderStateError

    def at(epoch: int, step: int) -> dict[str, Any]:
        return loader_state(
            epoch=epoch,
            step=step,
            identity={},
            source=None,
            source_state=None,
            process_rank=None,
            group_rank=0,
            group=[],
        )

    # The constructor's rule, so that a model-parallel group cannot diverge.
    loader = _follower([_ok(3, epoch=2)])
    loader.load_state_dict(at(2, 3))
    with pytest.raises(LoaderStateError, match=r"set_epoch\(1\) .* epoch 2 .*set_epoch\(2\)"):
        loader.set_epoch(1)
    loader.set_epoch(2)  # the restored epoch: the position stays
    assert next(loader)["step"] == 3 and loader.step == 4
    loader.close()
