"""Accelerator readiness: the parts that only a CUDA device can check.

Run on a machine with a CUDA GPU and NCCL (one GPU is enough)::

    python -m pytest tests/test_train_cuda.py -v

Everywhere else the whole module is skipped with that reason. What it checks:

* the device transport (NCCL byte tensors on a data stream, launched on the caller's thread)
  passes the transport conformance suite, on 2 processes when there are 2 GPUs, else on 1
  (NCCL refuses two ranks on one GPU: "Duplicate GPU detected");
* the H2D stager: pinned host copies, a dedicated copy stream, a ready event the training
  stream waits on, ``record_stream`` on every device tensor, and no host synchronisation —
  checked against a CUDA event timeline: a long kernel on the training stream is still
  running after ``stage()`` and ``deliver()`` return, and the copy completes before it;
* ``device_prefetch_depth``: the device memory the loader's batches take stays within the
  documented bound;
* a whole loader over NCCL (``build_loader(transport="device")``) that conserves every sample,
  on 2 processes on one GPU if NCCL allows it, and on 1 process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (torch.cuda.is_available() is False); run "
        "'python -m pytest tests/test_train_cuda.py' on a GPU machine",
        allow_module_level=True,
    )

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine._pipeline.h2d import DeviceStager, StagedBatch
from evenflow.transports.launch import RankFailedError, RankPool, run_ranks

NUM_GPUS = torch.cuda.device_count()
SLEEP_CYCLES = 2_000_000_000  # ~1 s of torch.cuda._sleep on a current GPU


@pytest.fixture(scope="module")
def nccl_pool() -> Iterator[RankPool]:
    with RankPool(min(2, NUM_GPUS), backend="nccl", timeout=30.0, deadline=180.0) as pool:
        yield pool


# -- the device transport over NCCL ----------------------------------------------------------


def _rank_conformance(rank: int, num_ranks: int) -> float:
    from evenflow.transports._device import DeviceTransport
    from evenflow.transports.testing import check_transport

    torch.cuda.set_device(rank % NUM_GPUS)

    async def main() -> float:
        start = time.monotonic()
        await check_transport(
            lambda: DeviceTransport(device=f"cuda:{rank % NUM_GPUS}", timeout=20.0),
            large_bytes=16 << 20,
        )
        return time.monotonic() - start

    return asyncio.run(main())


def test_device_transport_passes_the_conformance_suite_over_nccl(nccl_pool: RankPool) -> None:
    durations = nccl_pool.run(_rank_conformance, deadline=150.0)
    assert len(durations) == min(2, NUM_GPUS)


# -- the H2D stager -------------------------------------------------------------------------


def _host_batch(num_tokens: int) -> dict[str, Any]:
    return {
        "input_ids": torch.arange(num_tokens, dtype=torch.int64).view(1, -1),
        "labels": torch.full((1, num_tokens), 7, dtype=torch.int64),
        "meta": "kept",
    }


def test_stager_copies_on_its_own_stream_without_a_host_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    recorded: list[torch.cuda.Stream] = []
    original_record = torch.Tensor.record_stream

    def record(self: torch.Tensor, stream: Any) -> None:
        recorded.append(stream)
        original_record(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)
    stager = DeviceStager(device, cpu_fields=("meta",))
    host = _host_batch(1 << 22)  # 32 MiB per tensor: a copy that takes measurable time
    # Warm the pinned-memory cache: a first cudaHostAlloc may synchronise the device, which
    # is the allocator's cost, not the stager's.
    warm = stager.pin(host)
    del warm
    training = torch.cuda.current_stream(device)
    busy_start = torch.cuda.Event(enable_timing=True)
    busy_end = torch.cuda.Event(enable_timing=True)
    busy_start.record(training)
    torch.cuda._sleep(SLEEP_CYCLES)  # the "training step" still running on the device
    busy_end.record(training)
    staged = stager.stage(host)
    assert isinstance(staged, StagedBatch)
    # No host synchronisation: the training stream's kernel is still running.
    assert not busy_end.query(), "stage() waited for the device"
    assert all(t.is_pinned() for _, staging in stager._retained for t in staging.values())
    # The copy ran on the stager's own stream and finished while the training stream was busy.
    staged.event.synchronize()
    assert not busy_end.query(), "the copy waited for the training stream"
    batch = stager.deliver(staged)
    assert not busy_end.query(), "deliver() waited for the device"
    assert recorded and all(s == training for s in recorded)  # record_stream(training stream)
    assert len(recorded) == 2  # both device tensors, not the host-only field
    assert batch["input_ids"].device == device and batch["meta"] == "kept"
    # The training stream waits for the ready event: work queued after deliver() sees the data.
    total = batch["input_ids"].sum()
    done = torch.cuda.Event()
    done.record(training)
    done.synchronize()
    assert int(total) == (1 << 22) * ((1 << 22) - 1) // 2
    assert busy_start.elapsed_time(busy_end) > 0
    # What waits on the host for a device slot waits pinned (checked last: a fresh pinned
    # allocation may synchronise the device).
    pinned = stager.pin(host)
    assert pinned["input_ids"].is_pinned() and pinned["meta"] == "kept"
    stager.close()
    assert stager.num_retained == 0


# -- device_prefetch_depth: the memory bound -------------------------------------------------

SEQ_LEN = 1 << 18  # tokens per bin
BINS = 2
STEPS = 8
PREFETCH = 4


def _big_steps() -> list[list[list[Any]]]:
    # One sample fills each bin: a step's device batch is 3 int64 rows of SEQ_LEN per bin.
    sample = np.arange(SEQ_LEN, dtype=np.int64)
    return [[[sample] for _ in range(BINS)] for _ in range(STEPS)]


def _peak_batches(device_depth: int | None) -> float:
    """Peak device memory taken by the loader's batches, in step batches."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    step_bytes = BINS * 3 * 8 * SEQ_LEN
    config = LoaderConfig(
        seq_len=SEQ_LEN,
        bins_per_rank=BINS,
        prefetch_depth=PREFETCH,
        device_prefetch_depth=device_depth,
        log_stats=False,
    )
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with BalancedLoader(_big_steps(), config=config, device=device) as loader:
        for batch in loader:
            # A step of compute: long enough for the pipeline to fill every slot it may.
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            torch.cuda.current_stream(device).synchronize()
            del batch
    peak = torch.cuda.max_memory_allocated(device) - base
    return peak / step_bytes


def test_device_prefetch_depth_bounds_device_memory() -> None:
    bounded = _peak_batches(1)
    unbounded = _peak_batches(None)
    # Documented: at most (d + 2) step batches at the peak (d undelivered, the caller's,
    # and the previous one while the loop variable still holds it); allocator rounding is
    # small at this size.
    assert bounded <= 1 + 2 + 0.25, bounded
    assert unbounded <= PREFETCH + 1 + 2 + 0.25, unbounded
    assert unbounded > bounded + 1.5, (bounded, unbounded)


# -- a whole loader over NCCL -----------------------------------------------------------------

LOADER_STEPS = 4


def _lengths(rank: int) -> list[list[int]]:
    # Rank 0 reads long samples, the others short ones: the plan moves samples.
    return [[40, 36], [30, 34]] if rank == 0 else [[5, 6, 7], [8, 4, 3, 6]]


def _rank_loader(rank: int, num_ranks: int, gpu: int, use_build: bool) -> dict[str, Any]:
    """Iterate a loader whose data plane is NCCL; return the first token of every sample."""
    from evenflow.engine import build_loader
    from evenflow.transports._device import DeviceTransport

    torch.cuda.set_device(gpu)
    steps = []
    for step in range(LOADER_STEPS):
        bins, j = [], 0
        for sizes in _lengths(rank):
            samples = []
            for n in sizes:
                j += 1  # samples are numbered 1.. across the step
                samples.append({"input_ids": [rank * 1000 + step * 10 + j] * n})
            bins.append(samples)
        steps.append(bins)
    config = LoaderConfig(seq_len=96, bins_per_rank=2, timeout=30.0, log_stats=False)
    device = f"cuda:{gpu}"
    if use_build:  # one node: one balance group over every rank, NCCL data plane
        loader: Any = build_loader(
            steps, config, transport="device", device=device, cost_model="quadratic"
        )
    else:  # the device transport directly, over the whole world
        transport = DeviceTransport(device=device, timeout=30.0)
        loader = BalancedLoader(
            steps, config=config, transport=transport, device=device, cost_model="quadratic"
        )
    seen: list[int] = []
    devices: set[str] = set()
    moved = 0
    with loader:
        for batch in loader:
            for i, packed in enumerate(batch):
                devices.add(str(packed["input_ids"].device))
                starts = packed["cu_seq_lens_q"][:-1].long()
                seen.extend(packed["input_ids"][0][starts].tolist())
                if i == 0:
                    loader.prefetch_plan()
            loader.prefetch()
            stats = loader.last_stats
            moved += 0 if stats is None else stats.num_moved
    if not use_build:
        asyncio.run(transport.aclose())
    return {"seen": seen, "devices": sorted(devices), "moved": moved}


def _check_loader_run(results: list[dict[str, Any]]) -> None:
    expected = sorted(
        r * 1000 + s * 10 + j
        for r in range(len(results))
        for s in range(LOADER_STEPS)
        for j in range(1, sum(map(len, _lengths(r))) + 1)
    )
    assert sorted(x for r in results for x in r["seen"]) == expected  # each sample once
    assert all(d.startswith("cuda") for r in results for d in r["devices"])


def test_nccl_loader_on_one_process() -> None:
    results = run_ranks(
        _rank_loader, 1, args=(0, False), backend="nccl", deadline=120.0, timeout=30.0
    )
    _check_loader_run(results)


@pytest.mark.parametrize("use_build", [False, True])
def test_nccl_loader_on_two_processes(use_build: bool) -> None:
    if NUM_GPUS >= 2:
        results = run_ranks(
            _rank_loader_by_rank,
            2,
            args=(use_build,),
            backend="nccl",
            deadline=150.0,
            timeout=30.0,
        )
    else:
        try:
            results = run_ranks(
                _rank_loader,
                2,
                args=(0, use_build),
                backend="nccl",
                deadline=150.0,
                timeout=30.0,
            )
        except RankFailedError as exc:
            text = str(exc).lower()
            if "duplicate gpu" in text or "invalid usage" in text:
                pytest.skip(f"NCCL refuses two ranks on one GPU here: {exc}")
            raise
    _check_loader_run(results)
    assert sum(r["moved"] for r in results) > 0


def _rank_loader_by_rank(rank: int, num_ranks: int, use_build: bool) -> dict[str, Any]:
    return _rank_loader(rank, num_ranks, rank, use_build)
