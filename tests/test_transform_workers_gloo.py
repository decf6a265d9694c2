"""Per-sample transforms in worker processes, on two real Gloo ranks with two workers each:
every sample once, bitwise the same batches for 0, 1 and 3 workers and in payload and shared
modes (a randomized transform included, moved samples or not), bitwise resume in fresh
processes with another worker count, and failures (a raising transform, a SIGKILLed worker,
a hung one) that fail every rank at one step and leave no worker behind."""

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

N = 160
SEQ_LEN = 64
SEED = 5


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=10.0, deadline=240.0) as ranks:
        yield ranks


def _dataset() -> Any:
    lengths = np.random.default_rng(3).integers(1, 40, size=N)
    return datasets.Dataset.from_dict(
        {"id": list(range(N)), "input_ids": [[i % 251] * int(k) for i, k in enumerate(lengths)]}
    )


_loader = functools.partial(gloo_loader, seq_len=SEQ_LEN)


def _source(rank: int, num_ranks: int, mode: str, workers: int, transform: Any = noisy) -> Any:
    from evenflow.engine import DatasetSource

    return DatasetSource(
        _dataset(),
        seq_len=SEQ_LEN,
        bins_per_rank=2,
        rank=rank,
        num_ranks=num_ranks,
        seed=SEED,
        shared=mode == "shared",
        transform=transform,
        transform_workers=workers,
    )


ARMS = (("payload", 0), ("payload", 1), ("payload", 3), ("shared", 0), ("shared", 2))


def _arms(rank: int, num_ranks: int) -> dict[str, Any]:
    """One epoch per arm; the recording arm (payload, 2 workers) also saves every state."""
    out: dict[str, Any] = {}
    for mode, workers in (("payload", 2), *ARMS):
        source = _source(rank, num_ranks, mode, workers)
        loader = _loader(source)
        batches, states, pids, work = [], [], set(), []
        with loader:
            loader.set_epoch(1)
            for batch in loader:
                batches.append(batch)
                states.append(loader.state_dict())
                pids.update(source.worker_pids)
                step = loader.last_stats.transform
                work.append((step.workers, step.samples, step.busy_s, step.wait_s))
        out[f"{mode}/{workers}"] = {
            "batches": batches,
            "states": states,
            "pids": sorted(pids),
            "gone": gone(sorted(pids)),
            "work": work,
            "read": [
                int(i)
                for step in range(len(batches))
                for b in source.step_indices(step)
                for i in b.tolist()
            ],
            "read_sizes": [
                sum(len(b) for b in source.step_indices(step)) for step in range(len(batches))
            ],
        }
    return out


def _resume(rank: int, num_ranks: int, arms: list[tuple[str, int, dict[str, Any]]]) -> list[Any]:
    tails = []
    for mode, workers, state in arms:
        loader = _loader(_source(rank, num_ranks, mode, workers), depth=3)
        loader.load_state_dict(state)
        with loader:
            tails.append(list(loader))
    return tails


def test_workers_give_every_sample_once_bitwise_for_any_worker_count_mode_and_resume(
    pool: RankPool,
) -> None:
    from evenflow.engine._sources.workers import sample_rng

    results = pool.run(_arms)
    recorded = [r["payload/2"] for r in results]
    steps = len(recorded[0]["batches"])
    assert steps > 4 and len(recorded[1]["batches"]) == steps
    for rank, result in enumerate(results):
        for mode, workers in ARMS:
            arm = result[f"{mode}/{workers}"]
            assert arm["batches"] == recorded[rank]["batches"], (rank, mode, workers)
            assert len(arm["pids"]) == workers
            assert arm["gone"], "a worker outlived its loader"
            # StepStats.transform: this rank's own work for each step, by its workers: the
            # samples it read (payload mode) or was assigned (shared mode).
            if mode == "shared":
                counts = [sum(map(len, batch)) for batch in arm["batches"]]
            else:
                counts = arm["read_sizes"]
            got = [list(w[:2]) for w in arm["work"]]
            assert got == [[workers, c] for c in counts], (mode, workers)
            assert all(busy > 0 and wait >= 0 for _, _, busy, wait in arm["work"])
        assert recorded[rank]["gone"] and len(recorded[rank]["pids"]) == 2
    delivered = [s for r in recorded for batch in r["batches"] for b in batch for s in b]
    ids = [s[0] for s in delivered]
    assert len(ids) == len(set(ids)) and set(ids) <= set(range(N)), "a sample twice or unknown"
    source = _source(0, 2, "payload", 0)
    source.set_epoch(1)
    assert N - len(ids) == source.report.num_dropped_samples
    # The random state is (seed, epoch, index) alone: a sample that moved to another rank
    # than the one that read (and transformed) it carries the same noise as one that stayed.
    moved = 0
    for r in recorded:
        read_here = set(r["read"])
        for index, noise, fill in (s for batch in r["batches"] for b in batch for s in b):
            rng = sample_rng(SEED, 1, index)
            assert (noise, fill) == (float(rng.random()), int(rng.integers(1 << 40)))
            moved += index not in read_here
    assert moved > 0, "no sample moved: the test does not cover moved samples"
    # Resume in fresh processes mid-epoch, with transforms in flight at the save, on another
    # worker count (and in the other mode): the rest of the epoch, bitwise.
    cuts = ((2, "payload", 1), (steps - 3, "shared", 3))
    arms = [[(mode, w, r["states"][cut - 1]) for cut, mode, w in cuts] for r in recorded]
    tails = run_ranks(_resume_rank, 2, args=(arms,), timeout=10.0, deadline=180.0)
    for rank in range(2):
        for (cut, _, _), tail in zip(cuts, tails[rank], strict=True):
            assert tail == recorded[rank]["batches"][cut:], (rank, cut)


def _resume_rank(rank: int, num_ranks: int, arms: list[Any]) -> list[Any]:
    return _resume(rank, num_ranks, arms[rank])


def _failing(rank: int, num_ranks: int, how: str, mode: str) -> dict[str, Any]:
    """An epoch whose transform fails as ``how`` says; what each rank raised, and where."""
    # The failing sample is read at step 3 (by rank 0): the workers have delivered steps by
    # then, with transforms of later steps in flight.
    bad = int(_source(rank, num_ranks, mode, 0).step_indices(3, rank=0)[0][0])
    if how == "raise":
        source = _source(rank, num_ranks, mode, 2, functools.partial(noisy, bad=bad))
    elif how == "hang":
        source = _source(rank, num_ranks, mode, 2, functools.partial(stuck, bad=bad))
    else:
        source = _source(rank, num_ranks, mode, 2)
    # The hang is told by LoaderConfig.timeout, which also bounds the first reply of freshly
    # started workers (they unpickle the dataset): 8 s leaves a loaded host room for steps 0-2.
    loader = _loader(source, timeout=8.0 if how == "hang" else 30.0)
    return {**failing_epoch(loader, source, rank=rank, kill=how == "kill"), "bad": bad}


@pytest.mark.parametrize(
    ("how", "mode"),
    [("raise", "payload"), ("raise", "shared"), ("kill", "payload"), ("hang", "shared")],
)
def test_a_failing_worker_fails_every_rank_at_one_step_and_leaves_no_process(
    pool: RankPool, how: str, mode: str
) -> None:
    results = pool.run(_failing, how, mode)
    step, own = failed_together(results)
    for r in results:
        if how == "raise":
            assert f"dataset index {r['bad']}" in r["text"], r["text"]
            assert "this sample cannot be transformed" in r["text"]
        else:
            assert "TransformWorkerError" in r["type"] + r["text"], r
            what = "killed by signal 9" if how == "kill" else "hung"
            assert what in r["text"], r["text"]
    if mode == "payload":  # the failing rank's own error names the step too
        assert f"source step {step})" in own[0]["text"], own[0]["text"]
    if how == "raise" and mode == "payload":
        assert own[0]["type"] == "ValueError"
        assert "Traceback in transform worker process" in own[0]["text"]
    elif how != "raise":
        assert own[0]["type"] == "TransformWorkerError"


def test_close_mid_epoch_reaps_stuck_workers_within_its_deadline() -> None:
    """Single rank: a worker stuck in a transform when the loader closes is killed, and
    close() returns within a bounded time."""
    from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig

    # The stuck sample is one of step 2: the prefetch reads it while the caller holds step 0.
    probe = DatasetSource(_dataset(), seed=SEED, seq_len=SEQ_LEN, bins_per_rank=2)
    bad = int(probe.step_indices(2)[0][0])
    source = DatasetSource(
        _dataset(), seed=SEED, transform=functools.partial(stuck, bad=bad), transform_workers=2
    )
    config = LoaderConfig(
        seq_len=SEQ_LEN, bins_per_rank=2, prefetch_depth=3, log_stats=False, close_timeout=2.0
    )
    loader = BalancedLoader(
        source, config=config, metadata_fn=source.metadata_fn, pack_fn=pack_noisy
    )
    it = iter(loader)
    next(it)
    pids = source.worker_pids
    assert len(pids) == 2
    started = time.monotonic()
    loader.close()
    took = time.monotonic() - started
    assert gone(pids)
    assert took < 30.0, took  # close_timeout=2 s: generous margin on a shared 2-core host


_ORPHAN_SCRIPT = """
import os, sys
sys.path[:0] = {path!r}
from evenflow.engine import DatasetSource
from {module} import _dataset, noisy
source = DatasetSource(_dataset(), seq_len=64, bins_per_rank=2, transform=noisy,
                       transform_workers=2)
source.read(range(8))
print(" ".join(map(str, source.worker_pids)), flush=True)
os._exit(0)  # dies without closing anything: the workers must notice and exit
"""


def test_workers_exit_when_the_training_process_dies(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = _ORPHAN_SCRIPT.format(path=sys.path, module=__name__)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    # The workers watch the parent's pid every 0.5 s; allow a generous 30 s on a busy host.
    until = time.monotonic() + 30.0
    while not gone(pids) and time.monotonic() < until:
        time.sleep(0.1)
    assert gone(pids), f"transform workers {pids} outlived their training process"


def slow(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    time.sleep(0.03)  # a transform slower than the (empty) training step
    return noisy(sample, rng)


def test_the_pass_summary_reports_transform_time_and_warns_when_transforms_set_the_pace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from evenflow.engine import BalancedLoader, DatasetSource, LoaderConfig, Tracer

    source = DatasetSource(_dataset(), seed=SEED, transform=slow, transform_workers=1)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False, max_steps=16)
    tracer = Tracer()
    began = time.perf_counter()
    loader = BalancedLoader(
        source, config=config, metadata_fn=source.metadata_fn, pack_fn=pack_noisy, tracer=tracer
    )
    work = []
    with caplog.at_level("WARNING", logger="evenflow"), loader:
        for batch in loader:
            work.append((loader.last_stats.transform, sum(map(len, batch))))
    assert len(work) == 16
    # Each step's own figures: the samples it transformed (one rank: those it delivers),
    # at least their sleeps of busy time, and what the pass summary sums.
    for step, samples in work:
        assert step.workers == 1 and step.samples == samples
        assert step.busy_s >= 0.03 * samples
    report = loader.last_pass.transform
    assert report is not None and report.workers == 1
    assert report.busy_s >= 0.03 * 16  # at least the sleeps of the samples delivered
    assert report.wait_s > 0.2 * report.elapsed_s
    assert any("transforms were the bottleneck" in r.getMessage() for r in caplog.records)
    assert "transforms took" in loader.last_pass.log_line()
    # The trace has the worker's track: one span per step it transformed, on the worker's clock.
    spans = [span for span in tracer.spans() if span.stage == "transform.w0"]
    assert {span.step for span in spans} >= set(range(16))
    assert all(span.end - span.start >= 0.03 for span in spans)
    assert all(began < span.start < span.end < time.perf_counter() for span in spans)


def test_a_transform_workers_cannot_receive_is_refused_at_construction() -> None:
    from evenflow.engine import DatasetSource
    from evenflow.engine.errors import ConfigError

    rows = [{"input_ids": [1, 2]}] * 4
    with pytest.raises(ConfigError, match=r"transform=.*transform_workers=2.*module-level"):
        DatasetSource(rows, transform=lambda s, rng: s, transform_workers=2)
    with pytest.raises(ConfigError, match="transform_workers"):
        DatasetSource(rows, transform=noisy, transform_workers=-1)
    with pytest.raises(TypeError, match="transform must be callable"):
        DatasetSource(rows, transform="tokenize")
    DatasetSource(rows, transform=lambda s, rng: s)  # in process: any callable
