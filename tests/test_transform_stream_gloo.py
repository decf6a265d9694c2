"""Per-sample transforms of an ``IterableSource`` in worker processes, on two real Gloo ranks:
each rank streams its own shard (a Hugging Face ``IterableDataset``), the training process
packs the steps and the workers transform the raw samples with the random state of
``(seed, epoch, step, slot)``. Every sample once, bitwise the same batches for 0, 1 and 3
workers (a randomized transform, moved samples or not), bitwise resume in fresh processes
with transforms in flight onto another worker count, and failures (a raising transform, a
SIGKILLed worker) that fail every rank at one step and leave no worker behind."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.transforms import (
    failed_together,
    failing_epoch,
    gloo_loader,
    gone,
    noisy,
    pack_noisy,
    stuck,
)

from evenflow.transports.launch import RankPool, run_ranks

pytestmark = pytest.mark.multiprocess

datasets = pytest.importorskip("datasets")

N = 96  # samples per rank's stream
SEQ_LEN = 64
SEED = 7
EPOCH = 1


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=180.0) as ranks:
        yield ranks


def _stream(rank: int) -> Any:
    """Rank ``rank``'s shard: ids ``rank * 1000 + i``; the two shards' lengths differ but
    pack into the same number of steps (so no sample is lost to an uneven end)."""
    lengths = np.random.default_rng((11, 14)[rank]).integers(1, 40, size=N)
    rows = {
        "id": [rank * 1000 + i for i in range(N)],
        "input_ids": [[i % 251] * int(k) for i, k in enumerate(lengths)],
    }
    return datasets.Dataset.from_dict(rows).to_iterable_dataset()


_loader = functools.partial(gloo_loader, seq_len=SEQ_LEN)


def _source(rank: int, workers: int, transform: Any = noisy) -> Any:
    from evenflow.engine import IterableSource

    return IterableSource(
        _stream(rank),
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        seed=SEED,
        transform=transform,
        transform_workers=workers,
    )


def _positions(rank: int) -> dict[int, tuple[int, int]]:
    """Sample id -> (step, slot) in rank ``rank``'s stream as the source yields it (raw)."""
    from evenflow.engine import IterableSource

    source = IterableSource(_stream(rank), seq_len=SEQ_LEN, bins_per_rank=2)
    source.bind_loader(seq_len=SEQ_LEN, bins_per_rank=2, rank=rank, num_ranks=2)
    source.set_epoch(EPOCH)
    out = {}
    for step, bins in enumerate(source):
        for slot, sample in enumerate(s for b in bins for s in b):
            out[sample["id"]] = (step, slot)
    return out


def _arms(rank: int, num_ranks: int) -> dict[str, Any]:
    """One epoch per worker count; the recording arm (2 workers) also saves every state."""
    del num_ranks
    out: dict[str, Any] = {}
    for workers in (2, 0, 1, 3):
        source = _source(rank, workers)
        loader = _loader(source)
        batches, states, pids, work = [], [], set(), []
        with loader:
            loader.set_epoch(EPOCH)
            for batch in loader:
                batches.append(batch)
                states.append(loader.state_dict())
                pids.update(source.worker_pids)
                step = loader.last_stats.transform
                work.append([step.workers, step.samples])
        report = source.report
        out[workers] = {
            "batches": batches,
            "states": states,
            "pids": sorted(pids),
            "gone": gone(sorted(pids)),
            "dropped": None if report is None else report.num_dropped_samples,
            "transform": loader.last_pass.transform.to_dict(),
            "work": work,
        }
    return out


def _resume_rank(rank: int, num_ranks: int, arms: list[Any]) -> list[Any]:
    del num_ranks
    tails = []
    for workers, state in arms[rank]:
        loader = _loader(_source(rank, workers), depth=3)
        loader.load_state_dict(state)
        with loader:
            tails.append(list(loader))
    return tails


def test_stream_workers_give_every_sample_once_bitwise_for_any_worker_count_and_resume(
    pool: RankPool,
) -> None:
    from evenflow.engine._sources.workers import stream_rng

    results = pool.run(_arms)
    recorded = [r[2] for r in results]
    steps = len(recorded[0]["batches"])
    assert steps > 4 and len(recorded[1]["batches"]) == steps
    for rank, result in enumerate(results):
        for workers in (0, 1, 3):
            arm = result[workers]
            assert arm["batches"] == recorded[rank]["batches"], (rank, workers)
            assert len(arm["pids"]) == workers
            assert arm["gone"], "a worker outlived its loader"
            # The pass summary reports this rank's transform time, in workers or in process.
            assert arm["transform"]["workers"] == workers and arm["transform"]["busy_s"] > 0
            # StepStats.transform: the raw samples this rank's step held, for any worker count.
            counts = [n for _, n in recorded[rank]["work"]]
            assert arm["work"] == [[workers, n] for n in counts], (rank, workers)
        assert recorded[rank]["gone"] and len(recorded[rank]["pids"]) == 2
    # Each sample is transformed once, by the rank whose stream yielded it.
    transformed = sum(n for r in recorded for _, n in r["work"])
    delivered = sum(len(b) for r in recorded for batch in r["batches"] for b in batch)
    assert transformed == delivered
    delivered = [s for r in recorded for batch in r["batches"] for b in batch for s in b]
    ids = [s[0] for s in delivered]
    assert len(ids) == len(set(ids)), "a sample delivered twice"
    streamed = {rank * 1000 + i for rank in range(2) for i in range(N)}
    assert set(ids) <= streamed
    # Nothing silently lost: what was not delivered is what the sources report left over.
    assert all(r["dropped"] is not None for r in recorded)
    assert len(streamed) - len(ids) == sum(r["dropped"] for r in recorded)
    # The random state is (seed, epoch, step, slot) of the sample in its own rank's stream:
    # a sample that moved to the other rank carries the same noise as one that stayed.
    positions = {**_positions(0), **_positions(1)}
    moved = 0
    for rank, r in enumerate(recorded):
        for sample_id, noise, fill in (s for batch in r["batches"] for b in batch for s in b):
            rng = stream_rng(SEED, EPOCH, *positions[sample_id])
            assert (noise, fill) == (float(rng.random()), int(rng.integers(1 << 40)))
            moved += sample_id // 1000 != rank
    assert moved > 0, "no sample moved: the test does not cover moved samples"
    # Resume in fresh processes mid-epoch, with transforms in flight at the save (2 workers
    # keep 4 steps ahead), onto another worker count: the rest of the epoch, bitwise.
    cuts = ((2, 1), (steps - 3, 3), (3, 0))
    arms = [[(w, r["states"][cut - 1]) for cut, w in cuts] for r in recorded]
    tails = run_ranks(_resume_rank, 2, args=(arms,), timeout=10.0, deadline=120.0)
    for rank in range(2):
        for (cut, _), tail in zip(cuts, tails[rank], strict=True):
            assert tail == recorded[rank]["batches"][cut:], (rank, cut)


#: The failing sample: rank 0's step 3, slot 1 (the workers have delivered steps by then,
#: with transforms of later steps in flight).
BAD_STEP, BAD_SLOT = 3, 1


def _failing(rank: int, num_ranks: int, how: str) -> dict[str, Any]:
    """An epoch whose transform fails as ``how`` says; what each rank raised, and where."""
    del num_ranks
    bad = next(i for i, at in _positions(0).items() if at == (BAD_STEP, BAD_SLOT))
    transform = functools.partial(noisy, bad=bad) if how == "raise" else noisy
    source = _source(rank, 2, transform)
    return failing_epoch(_loader(source), source, rank=rank, kill=how == "kill", epoch=EPOCH)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_stream_worker_fails_every_rank_at_one_step_and_leaves_no_process(
    pool: RankPool, how: str
) -> None:
    results = pool.run(_failing, how)
    step, own = failed_together(results)
    for r in results:
        if how == "raise":
            # A stream has no dataset index: the error names the stream position.
            where = f"epoch {EPOCH}, step {BAD_STEP}, slot {BAD_SLOT}"
            assert where in r["text"], r["text"]
            assert "this sample cannot be transformed" in r["text"]
        else:
            assert "TransformWorkerError" in r["type"] + r["text"], r
            assert "killed by signal 9" in r["text"], r["text"]
    assert f"source step {step})" in own[0]["text"], own[0]["text"]
    if how == "raise":
        assert own[0]["type"] == "ValueError"
        assert "Traceback in transform worker process" in own[0]["text"]
    else:
        assert own[0]["type"] == "TransformWorkerError"


def test_close_mid_epoch_reaps_stuck_stream_workers_within_its_deadline() -> None:
    """Single rank: a worker stuck in a transform when the loader closes is killed, and
    close() returns within a bounded time."""
    from evenflow.engine import BalancedLoader, LoaderConfig

    # The stuck sample is one of step 2: sent ahead while the caller holds step 0.
    bad = next(i for i, at in _positions(0).items() if at == (2, 0))
    source = _source(0, 2, functools.partial(stuck, bad=bad))
    config = LoaderConfig(
        seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=3, log_stats=False, close_timeout=2.0
    )
    loader = BalancedLoader(
        source, config=config, metadata_fn=source.metadata_fn, pack_fn=pack_noisy
    )
    loader.set_epoch(EPOCH)
    it = iter(loader)
    next(it)
    pids = source.worker_pids
    assert len(pids) == 2
    started = time.monotonic()
    loader.close()
    took = time.monotonic() - started
    assert gone(pids)
    assert took < 30.0, took  # close_timeout=2 s: generous margin on a shared 2-core host


def test_stream_transform_settings_are_checked_at_construction() -> None:
    from evenflow.engine import IterableSource
    from evenflow.engine.errors import ConfigError

    rows = [{"input_ids": [1, 2]}] * 4
    with pytest.raises(ConfigError, match=r"transform=.*transform_workers=2.*module-level"):
        IterableSource(rows, transform=lambda s, rng: s, transform_workers=2)
    with pytest.raises(ConfigError, match=r"transform_workers=2 was given without a transform"):
        IterableSource(rows, transform_workers=2)
    with pytest.raises(ConfigError, match="transform_workers"):
        IterableSource(rows, transform=noisy, transform_workers=-1)
    with pytest.raises(TypeError, match="transform must be callable"):
        IterableSource(rows, transform="tokenize")
    IterableSource(rows, transform=lambda s, rng: s)  # in process: any callable


def _with_oversized(at: int) -> Any:
    """A 96-sample stream whose sample ``at`` is longer than ``SEQ_LEN``."""
    rows = [{"id": i, "input_ids": [1] * (SEQ_LEN + 1 if i == at else 20)} for i in range(96)]
    return datasets.Dataset.from_list(rows).to_iterable_dataset()


def test_an_error_packing_a_step_ahead_is_raised_at_that_step_not_earlier() -> None:
    """With workers the source packs steps ahead; a stream error met while packing ahead
    (here an oversized sample) must surface when its step is due, as without workers."""
    from evenflow.engine import IterableSource
    from evenflow.engine.errors import ConfigError

    delivered = {}
    for workers in (0, 2):
        source = IterableSource(
            _with_oversized(40),
            seq_len=SEQ_LEN,
            bins_per_rank=2,
            transform=noisy,
            transform_workers=workers,
        )
        source.bind_loader(seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=1)
        steps = iter(source)
        delivered[workers] = 0

        def drain(steps: Iterator[Any] = steps, workers: int = workers) -> None:
            for _ in steps:
                delivered[workers] += 1

        with pytest.raises(ConfigError, match=r"Sample 40 of epoch 0's stream has 65 tokens"):
            drain()
        assert source.close_workers() or workers == 0
    assert delivered[0] == delivered[2] > 2, delivered


def test_a_stream_without_state_resumes_by_replaying_onto_another_worker_count() -> None:
    """A factory saves no position: the restored source re-packs the delivered steps (without
    transforming them) and continues bitwise, whatever the worker counts."""
    from evenflow.engine import IterableSource

    def source(workers: int) -> Any:
        made = IterableSource(
            lambda: iter(_stream(0)),
            seq_len=SEQ_LEN,
            bins_per_rank=2,
            seed=SEED,
            transform=noisy,
            transform_workers=workers,
        )
        made.bind_loader(seq_len=SEQ_LEN, bins_per_rank=2, rank=0, num_ranks=1)
        return made

    def packed(steps: Any) -> list[Any]:
        return [[pack_noisy(b, SEQ_LEN) for b in step] for step in steps]

    full = packed(source(0))
    saving = source(2)
    steps = iter(saving)
    head = packed(next(steps) for _ in range(5))
    state = saving.state_dict()  # 4 later steps were sent to the workers by now
    saving.close_workers()
    assert head == full[:5] and state["ahead"] is None
    restored = source(1)
    restored.load_state_dict(state)
    assert packed(restored) == full[5:]
    restored.close_workers()
