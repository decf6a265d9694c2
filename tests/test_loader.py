"""The engine over in-process ranks: conservation, iteration modes, lifecycle, failures."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from testkit.loaders import IdSource, evenflow_threads, id_pack, run_in_threads_or_raise
from testkit.loaders import make_loaders as _make_loaders

from evenflow.engine import BalancedLoader, LoaderConfig, SampleMetadata
from evenflow.engine.errors import (
    LoaderStateError,
    RemoteStageError,
    SourceExhaustedError,
)
from evenflow.transports import InProcessGroup

SEQ_LEN = 64


def _lengths(rank: int, step: int, bins: int, epoch: int = 0) -> list[list[int]]:
    """Deterministic, deliberately skewed bins: rank 0 gets long samples on even steps."""
    rng = random.Random(hash((rank, step, epoch)) & 0xFFFF)
    out = []
    for _ in range(bins):
        if rank == 0 and step % 2 == 0:
            sizes = [rng.randint(24, 32), rng.randint(24, 31)]
        else:
            sizes = [rng.randint(1, 8) for _ in range(rng.randint(2, 6))]
        out.append(sizes)
    return out


def _source(rank: int, **kwargs: Any) -> IdSource:
    return IdSource(rank, lambda r, step, epoch: _lengths(r, step, 2, epoch), **kwargs)


def make_loaders(
    n: int, *, sources: list[Any] | None = None, **overrides: Any
) -> list[BalancedLoader]:
    return _make_loaders(n, sources or [_source(r) for r in range(n)], **overrides)


async def run_async(
    loaders: list[BalancedLoader], each: Callable[[int, BalancedLoader, Any], Any] | None = None
) -> list[list[Any]]:
    async def one(rank: int, loader: BalancedLoader) -> list[Any]:
        out = []
        async with loader:
            async for batch in loader:
                out.append(batch)
                if each is not None:
                    each(rank, loader, batch)
        return out

    return list(await asyncio.gather(*(one(r, ld) for r, ld in enumerate(loaders))))


def assert_conserved(per_rank: list[list[list[list[Any]]]], n: int, steps: int) -> None:
    """Every source sample of every step is delivered exactly once, on some rank."""
    for step in range(steps):
        delivered = [sid for r in range(n) for b in per_rank[r][step] for sid in b]
        expected = {
            (r, step, i) for r in range(n) for i in range(sum(len(s) for s in _lengths(r, step, 2)))
        }
        assert len(delivered) == len(set(delivered)), f"duplicate at step {step}"
        assert set(delivered) == expected, f"lost or foreign samples at step {step}"
        for r in range(n):
            assert len(per_rank[r][step]) == 2 and all(per_rank[r][step])


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2, 4, 16])
async def test_async_iteration_conserves_every_sample(n: int) -> None:
    loaders = make_loaders(n)
    batches = await run_async(loaders)
    assert [len(b) for b in batches] == [6] * n
    assert_conserved(batches, n, 6)


@pytest.mark.asyncio
async def test_balancing_moves_samples_and_lowers_the_makespan() -> None:
    stats: list[Any] = []
    loaders = make_loaders(2, stats_callback=stats.append)
    await run_async(loaders)
    rank0 = [s for s in stats if s.step % 2 == 0][::2]
    assert any(s.num_moved > 0 for s in rank0)
    for s in stats:
        assert s.max_cost_after <= s.max_cost_before
        assert sum(s.sent) == sum(s.received) == (s.num_moved if s.decision.accepted else 0)
    assert any(s.max_cost_after < s.max_cost_before for s in stats)


def test_sync_iteration_conserves_every_sample_with_threads_per_rank() -> None:
    before = set(threading.enumerate())  # threads of earlier tests are not ours
    loaders = make_loaders(4)

    def body(rank: int, loader: BalancedLoader) -> list[Any]:
        with loader:
            return list(loader)

    batches = run_in_threads_or_raise(loaders, body)
    assert_conserved(batches, 4, 6)
    assert evenflow_threads(before) == []


@pytest.mark.asyncio
async def test_balance_off_keeps_the_source_layout() -> None:
    loaders = make_loaders(2, balance=False)
    batches = await run_async(loaders)
    for r in range(2):
        for step, bins in enumerate(batches[r]):
            assert all(sid[0] == r and sid[1] == step for b in bins for sid in b)


@pytest.mark.asyncio
async def test_leader_planning_matches_replicated_planning() -> None:
    replicated = await run_async(make_loaders(3))
    leader = await run_async(make_loaders(3, planning="leader"))
    assert leader == replicated


@pytest.mark.asyncio
async def test_canonical_order_survives_adversarial_timings() -> None:
    rng = random.Random(7)
    delays = {(r, i): rng.choice([0.0, 0.0, 0.002, 0.01]) for r in range(4) for i in range(200)}
    group = InProcessGroup(4, timeout=20.0, delay_fn=lambda r, i, op: delays.get((r, i), 0.0))
    loaders = make_loaders(4, group=group, prefetch_depth=3)
    batches = await run_async(loaders)
    assert_conserved(batches, 4, 6)


@pytest.mark.asyncio
async def test_max_steps_stops_every_rank_without_reading_further() -> None:
    sources = [_source(r) for r in range(2)]
    loaders = make_loaders(2, sources=sources, max_steps=2, prefetch_depth=1)
    assert len(loaders[0]) == 2
    batches = await run_async(loaders)
    assert [len(b) for b in batches] == [2, 2]
    assert all(s.reads == 2 for s in sources)


@pytest.mark.asyncio
async def test_source_error_on_one_rank_fails_every_rank_at_the_same_step() -> None:
    sources = [_source(0), _source(1, fail_at=3)]
    loaders = make_loaders(2, sources=sources)
    seen: list[list[int]] = [[], []]

    async def one(rank: int) -> BaseException:
        try:
            async with loaders[rank]:
                async for _ in loaders[rank]:
                    seen[rank].append(loaders[rank].step)
        except Exception as exc:
            return exc
        raise AssertionError("no error surfaced")

    errors = await asyncio.gather(one(0), one(1))
    assert seen == [[1, 2, 3], [1, 2, 3]]
    assert isinstance(errors[1], ValueError) and "source broke" in str(errors[1])
    assert isinstance(errors[0], RemoteStageError)
    assert errors[0].failed_rank == 1 and errors[0].stage == "source" and errors[0].step == 3
    assert "source broke on rank 1" in str(errors[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("stage", ["metadata", "pack", "collate"])
async def test_stage_errors_surface_on_every_rank_naming_the_failing_one(stage: str) -> None:
    boom = RuntimeError(f"{stage} exploded")

    def metadata_fn(sample: dict[str, Any]) -> SampleMetadata:
        if stage == "metadata" and sample["id"] == (1, 2, 0):
            raise boom
        return SampleMetadata(tokens=len(sample["input_ids"]))

    def pack(samples: list[Any], seq_len: int) -> Any:
        if (
            stage == "pack"
            and threading.current_thread().name
            and any(s["id"][1] == 2 for s in samples)
            and samples[0]["id"][0] == 1
        ):
            raise boom
        return id_pack(samples, seq_len)

    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False, balance=False)
    loaders = []
    for r in range(2):

        def collate(bins: list[Any], r: int = r) -> list[Any]:
            if stage == "collate" and r == 1 and bins[0][0][1] == 2:
                raise boom
            return bins

        loaders.append(
            BalancedLoader(
                _source(r),
                config=config,
                transport=group.transport(r),
                metadata_fn=metadata_fn,
                pack_fn=pack,
                collate_fn=collate,
            )
        )

    async def one(rank: int) -> tuple[int, BaseException]:
        steps = 0
        try:
            async with loaders[rank]:
                async for _ in loaders[rank]:
                    steps += 1
        except BaseException as exc:
            return steps, exc
        raise AssertionError("no error surfaced")

    (s0, e0), (s1, e1) = await asyncio.gather(one(0), one(1))
    assert s0 == s1 == 2
    assert e1 is boom
    assert isinstance(e0, RemoteStageError) and e0.failed_rank == 1 and e0.step == 2
    assert e0.stage == stage and f"{stage} exploded" in str(e0)


@pytest.mark.asyncio
@pytest.mark.parametrize(("policy", "error"), [("stop", None), ("raise", SourceExhaustedError)])
async def test_early_exhaustion_on_one_rank_stops_all(policy: str, error: Any) -> None:
    sources = [_source(0, num_steps=6), _source(1, num_steps=4)]
    loaders = make_loaders(2, sources=sources, on_uneven_end=policy)
    if error is None:
        batches = await run_async(loaders)
        assert [len(b) for b in batches] == [4, 4]
    else:
        with pytest.raises(error, match=r"ranks \[1\] ended at step 4"):
            await run_async(loaders)


def test_set_epoch_and_reiteration_restart_cleanly() -> None:
    loaders = make_loaders(2, max_steps=3)

    def body(rank: int, loader: BalancedLoader) -> tuple[list[Any], ...]:
        with loader:
            first = list(loader)
            assert next(loader, None) is None  # no new iteration: the pass stays over
            # A new iteration without set_epoch starts the next epoch, like a DataLoader.
            again = list(loader)
            assert loader.epoch == 1
            loader.set_epoch(1)
            assert loader.step == 0 and loader.last_host_batch is None
            second = list(loader)
            loader.set_epoch(1)
            third = list(loader)
            return first, again, second, third

    results = run_in_threads_or_raise(loaders, body)
    for first, again, second, third in results:
        assert len(first) == len(second) == 3
        assert again == second == third  # epoch 1 each time: same epoch, same data


def test_close_in_every_phase_leaks_no_thread() -> None:
    before = set(threading.enumerate())  # threads of earlier tests are not ours
    for stop_after in (0, 1, 3):
        loaders = make_loaders(2)

        def body(rank: int, loader: BalancedLoader, stop_after: int = stop_after) -> int:
            it = iter(loader)
            for _ in range(stop_after):
                next(it)
            loader.close()
            loader.close()  # idempotent
            with pytest.raises(LoaderStateError, match="closed"):
                next(it)
            return stop_after

        run_in_threads_or_raise(loaders, body)
    assert evenflow_threads(before) == []


@pytest.mark.asyncio
async def test_async_close_mid_pass_cancels_the_pipeline() -> None:
    loaders = make_loaders(2)

    async def one(loader: BalancedLoader) -> None:
        async for _ in loader:
            break
        await loader.aclose()

    await asyncio.gather(*(one(ld) for ld in loaders))
    pending = [t for t in asyncio.all_tasks() if t.get_name() == "evenflow-pipeline"]
    assert pending == []


@pytest.mark.asyncio
async def test_mixing_sync_and_async_iteration_is_refused() -> None:
    (loader,) = make_loaders(1)
    async for _ in loader:
        break
    with pytest.raises(LoaderStateError, match="async mode"):
        next(iter(loader))
    await loader.aclose()


@pytest.mark.asyncio
async def test_last_stats_describe_the_consumed_step() -> None:
    loaders = make_loaders(2, prefetch_depth=3)

    def each(rank: int, loader: BalancedLoader, batch: Any) -> None:
        stats = loader.last_stats
        assert stats is not None and stats.step == loader.step - 1
        assert loader.last_host_batch == batch

    await run_async(loaders, each)


def test_trace_summary_reports_the_callers_stall() -> None:
    loaders = make_loaders(2)

    def body(rank: int, loader: BalancedLoader) -> dict[str, Any]:
        with loader:
            for _ in loader:
                pass
            return loader.trace_summary()

    for summary in run_in_threads_or_raise(loaders, body):
        caller = summary["caller"]
        assert caller["wait"]["count"] == 7  # six steps and the final StopIteration
        assert 0.0 <= caller["data_stall_fraction"] <= 1.0


@pytest.mark.asyncio
async def test_tracing_records_every_stage_as_valid_chrome_json(tmp_path: Any) -> None:
    import json

    from evenflow.engine import Tracer

    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(seq_len=SEQ_LEN, bins_per_rank=2, log_stats=False)
    loaders = [
        BalancedLoader(
            _source(r),
            config=config,
            transport=group.transport(r),
            pack_fn=id_pack,
            cost_model="quadratic",
            tracer=Tracer(chrome=tmp_path / "trace-{rank}.json"),
        )
        for r in range(2)
    ]
    await run_async(loaders)
    for r in range(2):
        summary = loaders[r].trace_summary()
        for stage in ("read", "gather", "plan", "exchange", "pack", "wait", "compute"):
            assert summary["stages"][stage]["count"] >= 5, stage
        events = json.loads((tmp_path / f"trace-{r}.json").read_text())["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X"]
        assert {e["pid"] for e in spans} == {r}
        assert {"read", "gather", "plan", "exchange", "pack"} <= {e["name"] for e in spans}
        assert all(e["dur"] >= 0 for e in spans)


def test_the_loader_lowers_the_gil_switch_interval_while_open_and_restores_it() -> None:
    import gc
    import sys

    from evenflow.engine.errors import ConfigError

    gc.collect()  # loaders earlier tests dropped without close() release it when collected
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        (loader,) = make_loaders(1, max_steps=1)
        (other,) = make_loaders(1, max_steps=1)
        with loader:
            assert len(list(loader)) == 1
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            with other:  # two loaders open: the first close keeps it lowered
                list(other)
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # restored by the last close
        sys.setswitchinterval(0.0001)
        (loader,) = make_loaders(1, max_steps=1)
        with loader:
            list(loader)
            assert sys.getswitchinterval() == pytest.approx(0.0001)  # never raised
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        (loader,) = make_loaders(1, max_steps=1)
        with loader:
            list(loader)
            sys.setswitchinterval(0.002)  # the application's own choice wins over a restore
        assert sys.getswitchinterval() == pytest.approx(0.002)
        sys.setswitchinterval(0.005)
        (loader,) = make_loaders(1, max_steps=1, switch_interval=None)
        with loader:
            list(loader)
            assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ConfigError, match=r"LoaderConfig\.switch_interval"):
        LoaderConfig(seq_len=8, bins_per_rank=1, switch_interval=0.0)


def _loader_thread_priorities(**options: Any) -> dict[str, int]:
    """Niceness of every thread a loader started, read while it delivers its steps."""
    import os
    import threading

    seen: dict[str, int] = {}
    (loader,) = make_loaders(1, max_steps=3, **options)
    with loader:
        for _ in loader:
            for thread in threading.enumerate():
                if thread.name.startswith("evenflow-") and thread.native_id is not None:
                    try:
                        seen[thread.name] = os.getpriority(os.PRIO_PROCESS, thread.native_id)
                    except OSError:  # the thread ended between the listing and the read
                        continue
    return seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_thread_nice_lowers_the_loaders_threads_and_leaves_the_callers_alone() -> None:
    import os
    import threading

    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lowered = _loader_thread_priorities(thread_nice=7)
    plain = _loader_thread_priorities()
    for seen in (lowered, plain):
        # The loop thread (sync iteration), the CPU pool and the source pool all ran.
        assert "evenflow-loop" in seen, seen
        assert any(name.startswith("evenflow-cpu") for name in seen), seen
        assert any(name.startswith("evenflow-source") for name in seen), seen
    assert set(lowered.values()) == {min(19, caller + 7)}, lowered
    assert set(plain.values()) == {caller}, plain
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller


def test_thread_nice_is_validated_with_the_parameter_and_the_fix() -> None:
    from evenflow.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"LoaderConfig\.thread_nice must be at most 19.*got 20"):
        LoaderConfig(seq_len=8, bins_per_rank=1, thread_nice=20)
    with pytest.raises(ConfigError, match=r"LoaderConfig\.thread_nice must be an integer >= 0"):
        LoaderConfig(seq_len=8, bins_per_rank=1, thread_nice=-1)
    assert LoaderConfig(seq_len=8, bins_per_rank=1, thread_nice=19).thread_nice == 19
