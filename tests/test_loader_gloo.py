"""The engine on real torch.distributed Gloo process groups (2 and 4 processes)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.transports.launch import RankPool

pytestmark = pytest.mark.multiprocess

STEPS = 8


@pytest.fixture(scope="module")
def pool2() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=120.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    with RankPool(4, timeout=10.0, deadline=120.0) as pool:
        yield pool


def _bins(rank: int, epoch: int, step: int) -> list[list[dict[str, Any]]]:
    rng = np.random.default_rng([rank, epoch, step])
    bins, i = [], 0
    for _ in range(2):
        long = rank == step % 4
        sizes = rng.integers(40, 60, size=2) if long else rng.integers(2, 16, size=4)
        b = []
        for n in sizes:
            b.append(
                {
                    "id": [rank, step, i],
                    "input_ids": np.full(int(n), rank * 100 + i, dtype=np.int32),
                }
            )
            i += 1
        bins.append(b)
    return bins


class Source:
    def __init__(self, rank: int, steps: int = STEPS, fail_at: int | None = None) -> None:
        self.rank, self.steps, self.fail_at, self.epoch, self.position = rank, steps, fail_at, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        while self.position < self.steps:
            step = self.position
            if step == self.fail_at:
                raise KeyError(f"bad record at step {step}")
            self.position += 1
            yield _bins(self.rank, self.epoch, step)


def _ids_pack(samples: list[dict[str, Any]], seq_len: int) -> list[list[int]]:
    for s in samples:
        rank, _, i = s["id"]
        assert np.all(np.asarray(s["input_ids"]) == rank * 100 + i)
    return [list(s["id"]) for s in samples]


def _loader(rank: int, kind: str, source: Any, **cfg: Any) -> Any:
    from evenflow.engine import BalancedLoader, LoaderConfig
    from evenflow.transports import DeviceTransport, GlooTransport

    transport = GlooTransport(timeout=10.0) if kind == "gloo" else DeviceTransport(timeout=10.0)
    config = LoaderConfig(seq_len=128, bins_per_rank=2, log_stats=False, **cfg)
    return BalancedLoader(
        source, config=config, transport=transport, pack_fn=_ids_pack, cost_model="quadratic"
    )


def _rank_run(rank: int, num_ranks: int, kind: str, mode: str) -> dict[str, Any]:
    loader = _loader(rank, kind, Source(rank))
    moved = 0
    if mode == "sync":
        with loader:
            batches = []
            for batch in loader:
                loader.prefetch_plan()
                loader.prefetch()
                batches.append(batch)
                moved += loader.last_stats.num_moved
    else:

        async def run() -> list[Any]:
            out = []
            async with loader:
                async for batch in loader:
                    await loader.aprefetch()
                    out.append(batch)
                    nonlocal moved
                    moved += loader.last_stats.num_moved
            return out

        batches = asyncio.run(run())
    return {"batches": batches, "moved": moved}


def _check_conserved(results: list[dict[str, Any]], n: int) -> None:
    for step in range(STEPS):
        got = [tuple(sid) for r in range(n) for b in results[r]["batches"][step] for sid in b]
        expected = {
            (r, step, i) for r in range(n) for i in range(sum(len(b) for b in _bins(r, 0, step)))
        }
        assert len(got) == len(set(got)) and set(got) == expected, f"step {step}"
    assert results[0]["moved"] > 0, "the skewed workload should move samples"
    assert len({r["moved"] for r in results}) == 1


@pytest.mark.parametrize(
    ("kind", "mode"), [("gloo", "sync"), ("gloo", "async"), ("device", "sync")]
)
def test_two_processes_conserve_every_sample(pool2: RankPool, kind: str, mode: str) -> None:
    _check_conserved(pool2.run(_rank_run, kind, mode, deadline=90.0), 2)


def test_four_processes_conserve_every_sample(pool4: RankPool) -> None:
    _check_conserved(pool4.run(_rank_run, "gloo", "sync", deadline=90.0), 4)


def _rank_fail(rank: int, num_ranks: int) -> dict[str, Any]:
    from evenflow.engine.errors import RemoteStageError

    loader = _loader(rank, "gloo", Source(rank, fail_at=3 if rank == 1 else None))
    steps = 0
    try:
        with loader:
            for _ in loader:
                steps += 1
    except RemoteStageError as exc:
        return {
            "steps": steps,
            "kind": "remote",
            "rank": exc.failed_rank,
            "stage": exc.stage,
            "step": exc.step,
            "text": str(exc),
            "traceback": exc.remote_traceback,
            "notes": list(getattr(exc, "__notes__", [])),
        }
    except KeyError as exc:
        return {"steps": steps, "kind": "own", "text": str(exc)}
    return {"steps": steps, "kind": "none"}


def test_a_source_error_stops_every_process_at_the_same_step(pool4: RankPool) -> None:
    results = pool4.run(_rank_fail, deadline=90.0)
    assert [r["steps"] for r in results] == [3, 3, 3, 3]
    assert results[1]["kind"] == "own" and "bad record at step 3" in results[1]["text"]
    for r in (0, 2, 3):
        assert results[r]["kind"] == "remote"
        assert (results[r]["rank"], results[r]["stage"], results[r]["step"]) == (1, "source", 3)
        assert "bad record at step 3" in results[r]["text"]


def test_a_peers_error_on_gloo_carries_the_failing_ranks_traceback(pool2: RankPool) -> None:
    survivor, failed = pool2.run(_rank_fail, deadline=90.0)
    assert failed["kind"] == "own" and survivor["kind"] == "remote"
    assert "\n" not in survivor["text"]
    assert "in __iter__" in survivor["traceback"]
    assert 'raise KeyError(f"bad record at step {step}")' in survivor["traceback"]
    assert survivor["notes"] == [f"Remote traceback (rank 1):\n{survivor['traceback'].rstrip()}"]


def _rank_record(rank: int, num_ranks: int) -> dict[str, Any]:
    loader = _loader(rank, "gloo", Source(rank))
    batches, states = [], []
    with loader:
        for batch in loader:
            batches.append(batch)
            states.append(loader.state_dict())
    return {"batches": batches, "states": states}


def _rank_resume(rank: int, num_ranks: int, state: dict[str, Any], depth: int) -> list[Any]:
    loader = _loader(rank, "gloo", Source(rank), prefetch_depth=depth)
    loader.load_state_dict(state)
    with loader:
        return list(loader)


@pytest.mark.parametrize("which", ["pool2", "pool4"])
def test_resume_in_fresh_processes_replays_the_tail(
    which: str, request: pytest.FixtureRequest
) -> None:
    pool: RankPool = request.getfixturevalue(which)
    n = pool.num_ranks
    recorded = pool.run(_rank_record, deadline=90.0)
    for k in (0, 1, 5, STEPS - 1):
        for depth in (1, 4):
            # Each rank gets its own state: run one call per rank layout via a per-rank table.
            tails = pool.run(
                _rank_resume_from_table,
                [recorded[r]["states"][k] for r in range(n)],
                depth,
                deadline=90.0,
            )
            for r in range(n):
                assert tails[r] == recorded[r]["batches"][k + 1 :], f"rank {r} k={k} depth={depth}"


def _rank_resume_from_table(
    rank: int, num_ranks: int, states: list[dict[str, Any]], depth: int
) -> list[Any]:
    return _rank_resume(rank, num_ranks, states[rank], depth)


def test_resume_in_a_fresh_set_of_processes(pool2: RankPool) -> None:
    from evenflow.transports.launch import run_ranks

    recorded = pool2.run(_rank_record, deadline=90.0)
    states = [recorded[r]["states"][4] for r in range(2)]
    tails = run_ranks(_rank_resume_from_table, 2, args=(states, 2), deadline=120.0, timeout=10.0)
    for r in range(2):
        assert tails[r] == recorded[r]["batches"][5:]
