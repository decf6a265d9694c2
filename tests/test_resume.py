"""Exact resume with prefetch in flight, over in-process ranks."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from testkit.loaders import record_pass

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine.errors import LoaderStateError, ResumeError
from evenflow.transports import InProcessGroup, _wire

STEPS = 12
SEQ_LEN = 96


def _step(rank: int, epoch: int, step: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng([rank, epoch, step])
    bins = []
    for _ in range(2):
        if rank == 0 and step % 3 == 0:
            sizes = rng.integers(30, 45, size=2)
        else:
            sizes = rng.integers(1, 12, size=int(rng.integers(2, 6)))
        bins.append([rng.integers(0, 50_000, size=int(n), dtype=np.int32) for n in sizes])
    return bins


class StatefulSource:
    """Deterministic per (rank, epoch, step); exposes state_dict/load_state_dict."""

    def __init__(self, rank: int) -> None:
        self.rank, self.epoch, self.position, self.reads = rank, 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self) -> Iterator[list[list[np.ndarray]]]:
        while self.position < STEPS:
            step = self.position
            self.position += 1
            self.reads += 1
            yield _step(self.rank, self.epoch, step)


class PlainSource:
    """Deterministic, no state: restored by fast-forwarding."""

    def __init__(self, rank: int) -> None:
        self.rank, self.epoch = rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[list[np.ndarray]]]:
        for step in range(STEPS):
            yield _step(self.rank, self.epoch, step)


def _loaders(n: int, kind: type, depth: int, **cfg: Any) -> list[BalancedLoader]:
    group = InProcessGroup(n, timeout=20.0)
    config = LoaderConfig(
        seq_len=cfg.pop("seq_len", SEQ_LEN),
        bins_per_rank=2,
        prefetch_depth=depth,
        log_stats=False,
        **cfg,
    )
    return [
        BalancedLoader(kind(r), config=config, transport=group.transport(r), cost_model="quadratic")
        for r in range(n)
    ]


def _source_state(state: dict[str, Any], rank: int) -> Any:
    """The source's own state inside a loader state (stored encoded with the wire format)."""
    return _wire.decode(state["ranks"][str(rank)]["source"])


def _flat(batch: list[dict[str, Any]]) -> list[bytes]:
    return [b["input_ids"].numpy().tobytes() + b["cu_seq_lens_q"].numpy().tobytes() for b in batch]


async def _record(
    n: int, kind: type, depth: int = 2
) -> tuple[list[list[list[bytes]]], list[list[dict[str, Any]]]]:
    """Every batch delivered and the state saved after every step, per rank."""
    loaders = _loaders(n, kind, depth)
    out = await asyncio.gather(*(record_pass(ld, _flat) for ld in loaders))
    return [o[0] for o in out], [o[1] for o in out]


async def _resume(
    n: int, kind: type, depth: int, states: list[dict[str, Any]]
) -> list[list[list[bytes]]]:
    loaders = _loaders(n, kind, depth)
    for loader, state in zip(loaders, states, strict=True):
        loader.load_state_dict(state)

    async def one(loader: BalancedLoader) -> list[list[bytes]]:
        async with loader:
            return [_flat(b) async for b in loader]

    return list(await asyncio.gather(*(one(ld) for ld in loaders)))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", [StatefulSource, PlainSource])
@pytest.mark.parametrize("n", [2, 4])
async def test_resume_after_step_k_replays_the_tail_bitwise(kind: type, n: int) -> None:
    recorded, states = await _record(n, kind)
    assert all(len(r) == STEPS for r in recorded)
    for k in (0, 1, 5, 11):
        for depth in (1, 2, 4):
            tail = await _resume(n, kind, depth, [states[r][k] for r in range(n)])
            for r in range(n):
                assert tail[r] == recorded[r][k + 1 :], f"rank {r}, k={k}, depth={depth}"


@pytest.mark.asyncio
async def test_prefetched_steps_are_never_counted_as_consumed() -> None:
    loaders = _loaders(2, StatefulSource, depth=4)
    sources = [ld._source for ld in loaders]

    async def one(loader: BalancedLoader) -> dict[str, Any]:
        async for _ in loader:
            break
        state = loader.state_dict()
        await loader.aclose()
        return state

    states = await asyncio.gather(*(one(ld) for ld in loaders))
    for rank, (state, source) in enumerate(zip(states, sources, strict=True)):
        assert state["step"] == 1
        assert _source_state(state, rank) == {"epoch": 0, "position": 1}
        assert source.reads > 1  # the pipeline had read ahead


@pytest.mark.asyncio
async def test_resume_across_an_epoch_boundary() -> None:
    loaders = _loaders(2, StatefulSource, depth=2)

    async def one(loader: BalancedLoader) -> tuple[list[list[bytes]], dict[str, Any]]:
        async with loader:
            async for _ in loader:
                pass
            await loader.aset_epoch(1)
            out, state = [], None
            async for batch in loader:
                out.append(_flat(batch))
                if loader.step == 4:
                    state = loader.state_dict()
            assert state is not None
            return out, state

    first = await asyncio.gather(*(one(ld) for ld in loaders))
    assert all(s["epoch"] == 1 and s["step"] == 4 for _, s in first)
    tail = await _resume(2, StatefulSource, 2, [s for _, s in first])
    for r in range(2):
        assert tail[r] == first[r][0][4:]


@pytest.mark.asyncio
async def test_state_is_plain_data() -> None:
    _, states = await _record(2, StatefulSource)
    state = states[0][3]
    assert msgpack.unpackb(msgpack.packb(state), strict_map_key=False) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


@pytest.mark.asyncio
async def test_mismatched_configuration_is_rejected_naming_the_field() -> None:
    _, states = await _record(2, StatefulSource)
    other = _loaders(2, StatefulSource, depth=2, seq_len=SEQ_LEN + 1)
    with pytest.raises(ResumeError, match=r"config\.seq_len was 96 and is now 97"):
        other[0].load_state_dict(states[0][3])
    with pytest.raises(ResumeError, match=r"ranks \['1'\] but none for this rank \(0\)"):
        _loaders(2, StatefulSource, depth=2)[0].load_state_dict(states[1][3])
    for ld in other:
        await ld.aclose()


@pytest.mark.asyncio
async def test_ranks_restored_at_different_steps_fail_on_every_rank() -> None:
    _, states = await _record(2, StatefulSource)
    loaders = _loaders(2, StatefulSource, depth=2)
    loaders[0].load_state_dict(states[0][5])
    loaders[1].load_state_dict(states[1][3])

    async def one(loader: BalancedLoader) -> BaseException:
        try:
            async with loader:
                async for _ in loader:
                    pass
        except ResumeError as exc:
            return exc
        raise AssertionError("restoring different steps was not rejected")

    errors = await asyncio.gather(*(one(ld) for ld in loaders))
    for exc in errors:
        assert "different steps" in str(exc) and "step 6" in str(exc)


@pytest.mark.asyncio
async def test_load_state_dict_after_iteration_started_is_refused() -> None:
    _, states = await _record(1, StatefulSource)
    (loader,) = _loaders(1, StatefulSource, depth=2)
    async for _ in loader:
        break
    with pytest.raises(LoaderStateError, match="before iteration starts"):
        loader.load_state_dict(states[0][2])
    await loader.aclose()
