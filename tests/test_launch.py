"""The multi-process launcher: results, environment, deadlines, failures, no orphans.

Functions named ``_rank_*`` run inside the spawned ranks (the launcher imports this file
there by path).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evenflow.transports.launch import (
    LaunchError,
    RankDeadlineError,
    RankFailedError,
    RankPool,
    run_ranks,
)

ENV = [{"EF_TAG": "first"}, {"EF_TAG": "second"}]


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    # One world for the module: a spawn costs seconds. Tests that fail a call restart it.
    with RankPool(2, timeout=10.0, deadline=120.0, env=ENV) as ranks:
        yield ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- functions that run inside the ranks --------------------------------------------------------


def _rank_identity(rank: int, num_ranks: int, offset: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "EF_TAG")
    return {
        "sum": int(total.item()),
        "env": {key: os.environ.get(key) for key in keys},
        "pid": os.getpid(),
        "backend": str(dist.get_backend()),
    }


def _rank_pid_then_hang(rank: int, num_ranks: int, folder: str) -> int:
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        threading.Event().wait()  # never set: a rank stuck for good
    return rank


def _rank_raise(rank: int, num_ranks: int) -> int:
    if rank == 1:
        raise KeyError(f"missing shard {rank * 10}")
    return rank


def _rank_exit(rank: int, num_ranks: int) -> int:
    if rank == 0:
        os._exit(7)
    return rank


def _rank_bad_result(rank: int, num_ranks: int) -> Any:
    return {1, 2} if rank == 0 else rank


def _rank_block(rank: int, num_ranks: int) -> None:
    threading.Event().wait()


# -- tests ------------------------------------------------------------------------------------


def test_arguments_are_checked_before_anything_starts() -> None:
    pool = RankPool(2)
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda rank, n: rank)
    with pytest.raises(TypeError, match="plain data"):
        pool.run(_rank_raise, object())
    assert not pool.running
    with pytest.raises(ValueError, match="num_ranks must be a positive integer"):
        RankPool(0)
    with pytest.raises(ValueError, match="list of num_ranks=2 mappings"):
        RankPool(2, env=[{}])
    with pytest.raises(ValueError, match="backend must be one of"):
        RankPool(2, backend="tcp")
    with pytest.raises(ValueError, match="deadline must be a positive number"):
        run_ranks(_rank_raise, 2, deadline=0)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(LaunchError, match="closed"):
        pool.run(_rank_raise)


@pytest.mark.multiprocess
def test_pool_reuses_its_ranks_with_env_per_rank(pool: RankPool) -> None:
    first = pool.run(_rank_identity, 1)
    second = pool.run(_rank_identity, 2)
    assert [r["sum"] for r in first] == [3, 3]
    assert [r["sum"] for r in second] == [5, 5]
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == pool.pids
    for rank, result in enumerate(first):
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "EF_TAG": ENV[rank]["EF_TAG"],
        }
        assert result["backend"] == "gloo"


@pytest.mark.multiprocess
def test_deadline_kills_the_hanging_rank_and_names_it(pool: RankPool, tmp_path: Path) -> None:
    pool.run(_rank_identity, 0)  # make sure the world is up, so the deadline is the call's
    starts = pool.num_starts
    with pytest.raises(RankDeadlineError) as info:
        pool.run(_rank_pid_then_hang, str(tmp_path), deadline=3.0)
    assert info.value.ranks == [1]
    assert "rank(s) 1 of 2" in str(info.value)
    hung = int((tmp_path / "rank1.pid").read_text())
    assert not _alive(hung)
    assert not pool.running
    # The next call restarts a fresh world.
    assert [r["sum"] for r in pool.run(_rank_identity, 0)] == [1, 1]
    assert pool.num_starts == starts + 1


@pytest.mark.multiprocess
def test_a_slow_start_up_is_not_blamed_on_a_collective() -> None:
    # No rank can import torch and join a group in 10 ms: the deadline passes in start-up.
    with pytest.raises(RankDeadlineError) as info:
        run_ranks(_rank_identity, 2, args=[0], deadline=0.01)
    text = str(info.value)
    assert text.startswith("start-up did not finish") or "used up by start-up" in text
    assert "collective" not in text and "raise the deadline" in text


@pytest.mark.multiprocess
def test_run_ranks_reraises_a_rank_exception_with_its_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_rank_raise, 2, deadline=120.0)
    error = info.value
    assert error.rank == 1
    assert error.exc_type == "builtins.KeyError"
    assert error.remote_message == "'missing shard 10'"
    assert error.remote_traceback is not None
    assert "in _rank_raise" in error.remote_traceback
    assert 'raise KeyError(f"missing shard {rank * 10}")' in error.remote_traceback
    assert "_rank_raise" in str(error)
    assert error.outcomes[0] == ("result", 0)
    # One line; the traceback travels in the notes that printed tracebacks and logs show.
    assert "\n" not in str(error)
    assert error.__notes__ == [f"Remote traceback (rank 1):\n{error.remote_traceback.rstrip()}"]


@pytest.mark.multiprocess
def test_rank_that_dies_is_reported_with_its_exit_code(pool: RankPool) -> None:
    with pytest.raises(RankFailedError) as info:
        pool.run(_rank_exit)
    error = info.value
    assert error.rank == 0
    assert error.exitcode == 7
    assert error.exc_type is None
    assert "Rank 0 of 2 exited with code 7" in str(error)


@pytest.mark.multiprocess
def test_result_that_is_not_plain_data_is_a_failure(pool: RankPool) -> None:
    with pytest.raises(RankFailedError, match="not plain data") as info:
        pool.run(_rank_bad_result)
    assert info.value.rank == 0
    assert info.value.exc_type == "builtins.TypeError"


@pytest.mark.multiprocess
def test_keyboard_interrupt_kills_every_rank(pool: RankPool) -> None:
    pool.start()
    pids = pool.pids
    assert len(pids) == 2
    main = threading.main_thread().ident
    assert main is not None
    # A real SIGINT to the main thread while it waits for the ranks; 30 s would be a hang.
    timer = threading.Timer(0.5, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run(_rank_block, deadline=30.0)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 15.0
    assert not pool.running
    assert not any(_alive(pid) for pid in pids)
