"""The loader's edges on real Gloo processes: what ranks must agree on, what fails together,
and a randomized lifecycle — many build, iterate, break or exhaust, close and rebuild cycles —
with bounded closes, no thread or file-descriptor growth without a garbage collection, and
every sample of a completed epoch delivered exactly once.

One pool of two ranks serves the module (its processes are reused across tests); the
cross-group test kills a rank of its own four-rank pool by PID. Every call has a deadline, so
a hang fails the test instead of the suite.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, build_loader
from evenflow.transports.launch import RankFailedError, RankPool

pytestmark = pytest.mark.multiprocess

N = 120
SEQ_LEN = 64
TIMEOUT = 20.0  # the groups' timeout: a close that waited for it would show


def _rows(n: int = N) -> list[dict[str, Any]]:
    lengths = np.random.default_rng(5).integers(4, 44, size=n)
    return [
        {"id": i, "input_ids": np.full(int(k), i % 97, dtype=np.int64)}
        for i, k in enumerate(lengths)
    ]


def _ids(samples: list[dict[str, Any]], seq_len: int) -> list[int]:
    return [int(s["id"]) for s in samples]


def _config(**kw: Any) -> LoaderConfig:
    base: dict[str, Any] = {
        "seq_len": SEQ_LEN,
        "bins_per_rank": 2,
        "log_stats": False,
        "timeout": TIMEOUT,
    }
    base.update(kw)
    return LoaderConfig(**base)


def _describe(exc: BaseException) -> str:
    notes = "\n".join(getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {exc}\n{notes}"


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=TIMEOUT, deadline=120.0) as ranks:
        yield ranks


# -- 2. a KeyboardInterrupt / SystemExit in user code --------------------------------------------


class _Trap(list):  # type: ignore[type-arg]
    """A dataset whose ``__getitem__`` raises ``exc`` at one index (on one rank only)."""

    def __init__(self, rows: list[Any], trap: int | None, exc: BaseException) -> None:
        super().__init__(rows)
        self.trap, self.exc = trap, exc

    def __getitem__(self, i: Any) -> Any:
        if i == self.trap:
            raise self.exc
        return super().__getitem__(i)


def _interrupted(rank: int, num_ranks: int, kind: str) -> tuple[int, str]:
    rows = _rows()
    lengths = [len(r["input_ids"]) for r in rows]
    # The first sample rank 1 reads at its step 2.
    probe = DatasetSource(
        rows, lengths=lengths, seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2, seed=4
    )
    trap = int(probe.step_indices(2)[0][0])
    exc: BaseException = KeyboardInterrupt() if kind == "keyboard" else SystemExit(7)
    data = _Trap(rows, trap if rank == 1 else None, exc)
    loader = build_loader(DatasetSource(data, lengths=lengths, seed=4), _config(), pack_fn=_ids)
    n = 0
    try:
        with loader:
            for _ in loader:
                n += 1
    except BaseException as caught:
        return n, _describe(caught)
    return n, "ended"


@pytest.mark.parametrize("kind", ["keyboard", "exit"])
def test_a_keyboard_interrupt_in_a_dataset_fails_every_rank_at_the_same_step(
    pool: RankPool, kind: str
) -> None:
    (n0, seen0), (n1, seen1) = pool.run(_interrupted, kind, deadline=60.0)
    name = "KeyboardInterrupt" if kind == "keyboard" else "SystemExit"
    assert n0 == n1 == 2
    assert seen1.startswith(name), seen1
    assert seen0.startswith("RemoteStageError") and name in seen0 and "Rank 1" in seen0


# -- 5 and 15. iterating again; last_pass on build_loader's loader ------------------------------


def _two_iterations(rank: int, num_ranks: int) -> dict[str, Any]:
    loader = build_loader(DatasetSource(_rows(), seed=9), _config(), pack_fn=_ids)
    with loader:
        first = [i for batch in loader for b in batch for i in b]
        summary = loader.last_pass
        second = [i for batch in loader for b in batch for i in b]
        return {
            "first": first,
            "second": second,
            "epoch": loader.epoch,
            "end_reason": None if summary is None else summary.end_reason,
        }


def test_a_second_iteration_trains_the_next_epoch_and_last_pass_is_there(
    pool: RankPool,
) -> None:
    results = pool.run(_two_iterations, deadline=60.0)
    for key in ("first", "second"):
        got = [i for r in results for i in r[key]]
        assert len(got) == len(set(got)) and len(got) > N // 2, key
    assert [r["epoch"] for r in results] == [1, 1]
    assert [r["end_reason"] for r in results] == ["exhausted", "exhausted"]
    assert results[0]["first"] != results[0]["second"]


# -- 6. a source's ranks that disagree with the group --------------------------------------------


def _wrong_ranks(rank: int, num_ranks: int, how: str) -> str:
    from evenflow.transports import GlooTransport

    explicit = {"num_ranks": 4, "rank": rank} if how == "num_ranks" else {"rank": 0, "num_ranks": 2}
    source = DatasetSource(_rows(), seed=1, **explicit)
    try:
        if how == "plain":
            loader: Any = BalancedLoader(
                source, config=_config(), transport=GlooTransport(timeout=TIMEOUT), pack_fn=_ids
            )
        else:
            loader = build_loader(source, _config(), pack_fn=_ids)
        with loader:
            list(loader)  # (len(), which list() asks first, defers to the first round)
    except Exception as exc:
        return _describe(exc)
    return "trained"


@pytest.mark.parametrize("how", ["num_ranks", "rank", "plain"])
def test_a_source_rank_or_size_that_disagrees_with_the_group_is_refused_on_every_rank(
    pool: RankPool, how: str
) -> None:
    results = pool.run(_wrong_ranks, how, deadline=60.0)
    if how == "num_ranks":
        for text in results:
            assert text.startswith("ConfigError") and "num_ranks=4" in text, text
            assert "2 data-parallel rank" in text
    else:
        # rank=0 on both: only rank 1 disagrees, and every rank hears of it.
        for text in results:
            assert "DatasetSource(rank=0) disagrees" in text and "rank=1" in text, text
        assert results[1].startswith("ConfigError")
        expected = "RemoteStageError" if how == "plain" else "ConfigError"
        assert results[0].startswith(expected), results[0]


# -- 6. the data-parallel position with model parallelism alone -----------------------------------


def _tensor_parallel_only(rank: int, num_ranks: int) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    loader = build_loader(DatasetSource(_rows(), seed=2), _config(), pack_fn=_ids, mesh=mesh)
    with loader:
        return [i for batch in loader for b in batch for i in b]


def test_one_data_parallel_rank_under_tensor_parallelism_reads_the_whole_dataset(
    pool: RankPool,
) -> None:
    constructor, follower = pool.run(_tensor_parallel_only, deadline=60.0)
    assert constructor == follower and len(constructor) == len(set(constructor))
    reference = DatasetSource(_rows(), seq_len=SEQ_LEN, bins_per_rank=2, seed=2)
    assert N - len(constructor) == reference.report.num_dropped_samples


# -- 14. errors that name the dataset index on every rank ----------------------------------------


def _bad_record(rank: int, num_ranks: int) -> str:
    rows = _rows()
    lengths = [len(r["input_ids"]) for r in rows]
    probe = DatasetSource(
        rows, lengths=lengths, seq_len=SEQ_LEN, bins_per_rank=2, rank=1, num_ranks=2, seed=4
    )
    bad = int(probe.step_indices(1)[1][0])
    data = _Trap(rows, bad if rank == 1 else None, ValueError("corrupt record"))
    loader = build_loader(DatasetSource(data, lengths=lengths, seed=4), _config(), pack_fn=_ids)
    try:
        with loader:
            list(loader)
    except Exception as exc:
        return f"{bad}|{_describe(exc)}"
    return f"{bad}|trained"


def test_a_read_error_names_the_dataset_index_on_every_rank(pool: RankPool) -> None:
    results = pool.run(_bad_record, deadline=60.0)
    bad = results[1].split("|")[0]
    for text in results:
        assert "corrupt record" in text and f"dataset index {bad}" in text, text
    assert results[1].split("|")[1].startswith("ValueError")


# -- 3, 4 and the lifecycle: many cycles, bounded closes, no growth ------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lifecycle(rank: int, num_ranks: int, cycles: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)  # the same on both ranks: they break at the same points
    rows = _rows()
    gc.collect()
    gc.disable()  # growth must not wait for a garbage collection
    try:
        closes: list[float] = []
        epochs: list[list[int]] = []
        counts: list[tuple[int, int]] = []
        for cycle in range(cycles):
            source = DatasetSource(rows, seed=seed)
            loader = build_loader(
                source, _config(prefetch_depth=rng.choice([1, 2, 3])), pack_fn=_ids
            )
            loader.set_epoch(cycle)
            stop = rng.choice([None, 0, 1, 2, 5])
            ids: list[int] = []
            for i, batch in enumerate(loader):
                if stop is not None and i >= stop:
                    break
                ids.extend(x for b in batch for x in b)
            started = time.monotonic()
            loader.close()
            closes.append(time.monotonic() - started)
            epochs.append(ids if stop is None else [-1])
            del loader, source, batch
            counts.append((threading.active_count(), _fds()))
        return {"closes": closes, "epochs": epochs, "counts": counts}
    finally:
        gc.enable()


def test_randomized_lifecycle_closes_fast_grows_nothing_and_conserves_epochs(
    pool: RankPool,
) -> None:
    cycles = 24
    results = pool.run(_lifecycle, cycles, 11, deadline=150.0)
    for r in results:
        # A close waited for the group timeout (20 s) when the peer's pipeline sat in a
        # collective this rank never joined; now it never nears it.
        assert max(r["closes"]) < TIMEOUT / 4, r["closes"]
        first, last = r["counts"][1], r["counts"][-1]
        assert last[0] - first[0] <= 2, r["counts"]  # threads
        assert last[1] - first[1] <= 8, r["counts"]  # file descriptors (sockets)
    reference = DatasetSource(
        _rows(), seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=2, seed=11
    )
    complete = 0
    for cycle in range(cycles):
        if results[0]["epochs"][cycle] == [-1]:
            continue
        complete += 1
        got = results[0]["epochs"][cycle] + results[1]["epochs"][cycle]
        assert len(got) == len(set(got)), f"cycle {cycle}: a sample delivered twice"
        reference.set_epoch(cycle)
        assert N - len(got) == reference.report.num_dropped_samples, cycle
    assert complete >= 2


# -- 18. a rank killed during the world round across balance groups -----------------------------


def _killed_in_world_round(rank: int, num_ranks: int) -> dict[str, Any]:
    loader = build_loader(
        DatasetSource(_rows(200), seed=3), _config(timeout=10.0), pack_fn=_ids, balance_group_size=2
    )
    n = 0
    try:
        with loader:
            for _ in loader:
                n += 1
                if rank == 3 and n == 3:
                    os.kill(os.getpid(), signal.SIGKILL)  # by PID, mid-pass
    except Exception as exc:
        return {"steps": n, "error": _describe(exc)}
    return {"steps": n, "error": None}


def test_a_rank_killed_across_balance_groups_stops_every_group_at_one_step_naming_it() -> None:
    with (
        RankPool(4, timeout=10.0, deadline=120.0, failure_grace=60.0) as four,
        pytest.raises(RankFailedError) as info,
    ):
        four.run(_killed_in_world_round, deadline=90.0)
    outcomes = info.value.outcomes
    assert outcomes[3][0] == "died"
    survivors = [outcomes[r] for r in range(3)]
    assert all(kind == "result" for kind, _ in survivors), survivors
    steps = {value["steps"] for _, value in survivors}
    assert len(steps) == 1, survivors  # every group stops at the same step
    # The other group's ranks learn of the death through the world round, which names it.
    for r in (0, 1):
        assert "rank(s) 3 did not answer" in survivors[r][1]["error"], survivors[r]
    # The dead rank's own partner fails with it (its group, or the world round), at the same
    # step; under heavy load its pipeline may still sit behind the dead rank's exchange when
    # the stall limit passes, and then it says so instead.
    partner = survivors[2][1]["error"]
    assert partner is not None
    assert "global rank 3" in partner or "rank(s) 3" in partner or "StallTimeoutError" in partner
