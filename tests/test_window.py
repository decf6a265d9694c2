"""Balance windows (``LoaderConfig.balance_window``) in the pipeline: conservation within the
window, the same answers as per-step planning at ``W = 1``, fail-together and ends in the
middle of a window, ``max_steps``/``set_epoch``, and bitwise resume at every position of a
window in fresh Gloo processes."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.loaders import IdSource, id_pack, make_loaders, run_in_threads
from testkit.windows import (
    STEPS,
    StatefulWindowSource,
    WindowSource,
    ids_pack,
    record_rank,
    resume_rank,
    rotating_plan_window,
    step_bins,
)

from evenflow.engine import BalancedLoader, LoaderConfig
from evenflow.engine._pipeline import plan_stage
from evenflow.engine._pipeline.step import peer_columns
from evenflow.engine.errors import ConfigError, RemoteStageError
from evenflow.transports import InProcessGroup

WINDOW = 3


@pytest.fixture
def rotating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_stage, "plan_window", rotating_plan_window)


def _loaders(n: int, window: int, *, steps: int = STEPS, **cfg: Any) -> list[BalancedLoader]:
    return make_loaders(
        n,
        [StatefulWindowSource(r, steps) for r in range(n)],
        pack_fn=ids_pack,
        balance_window=window,
        **cfg,
    )


async def _run(loaders: list[BalancedLoader]) -> list[dict[str, Any]]:
    """Every rank's pass: batches, statistics, states and the pass summary."""

    async def one(loader: BalancedLoader) -> dict[str, Any]:
        out: dict[str, Any] = {"batches": [], "stats": [], "states": []}
        async with loader:
            async for batch in loader:
                out["batches"].append(batch)
                out["stats"].append(loader.last_stats)
                out["states"].append(loader.state_dict())
            out["pass"] = loader.last_pass
        return out

    async with asyncio.timeout(60):
        return list(await asyncio.gather(*(one(ld) for ld in loaders)))


def _trained(runs: list[dict[str, Any]]) -> dict[tuple[int, int, int], int]:
    """Every delivered sample id -> the step it trained in; fails on a sample seen twice."""
    seen: dict[tuple[int, int, int], int] = {}
    for run in runs:
        for step, batch in enumerate(run["batches"]):
            for b in batch:
                for sample in b:
                    key = (sample[0], sample[1], sample[2])
                    assert key not in seen, f"sample {key} delivered twice"
                    seen[key] = step
    return seen


def _read(n: int, steps: int) -> set[tuple[int, int, int]]:
    return {
        (r, s, i)
        for r in range(n)
        for s in range(steps)
        for i in range(sum(map(len, step_bins(r, s))))
    }


# -- configuration ------------------------------------------------------------------------------


def test_balance_window_is_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"LoaderConfig\.balance_window"):
        LoaderConfig(seq_len=8, bins_per_rank=1, balance_window=0)
    assert LoaderConfig(seq_len=8, bins_per_rank=1).balance_window == 1


# -- conservation ---------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("window", "steps", "planning", "planner"),
    [
        (WINDOW, STEPS, "replicated", "rotating"),
        (4, 8, "leader", "rotating"),
        (2, 5, "replicated", "rotating"),
        (4, 10, "replicated", "window"),
    ],
)
async def test_every_sample_trains_once_within_its_window(
    window: int, steps: int, planning: str, planner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if planner == "rotating":
        monkeypatch.setattr(plan_stage, "plan_window", rotating_plan_window)
    runs = await _run(_loaders(2, window, steps=steps, planning=planning))
    assert [len(r["batches"]) for r in runs] == [steps, steps]
    trained = _trained(runs)
    assert set(trained) == _read(2, steps)
    delays = [t - s for (_, s, _), t in trained.items()]
    for (_, read, _), step in trained.items():
        assert read // window == step // window, "a sample left its window"
    assert max(abs(d) for d in delays) < window
    if planner == "rotating":
        assert any(d != 0 for d in delays), "the rotating planner moves samples across steps"
    assert all(r["pass"].end_reason == "exhausted" for r in runs)


@pytest.mark.asyncio
async def test_the_window_planner_is_never_worse_than_the_per_step_sources() -> None:
    runs = await _run(_loaders(2, 4, steps=8))
    assert set(_trained(runs)) == _read(2, 8)
    stats = runs[0]["stats"]
    before = sum(max(s.cost_before) for s in stats)
    after = sum(max(s.cost_after) for s in stats)
    assert after <= before
    assert [s.digest for s in stats] == [s.digest for s in runs[1]["stats"]]


# -- W = 1 is per-step planning ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_window_of_one_plans_each_step_as_the_planner_does() -> None:
    """The delivered plans are the planner's own plans of each gathered step (digests), and
    a window of one delivers bitwise what the default configuration delivers."""
    default = await _run(_loaders(2, 1))
    explicit = await _run(
        make_loaders(2, [StatefulWindowSource(r) for r in range(2)], pack_fn=ids_pack)
    )
    assert [r["batches"] for r in default] == [r["batches"] for r in explicit]
    assert [s.digest for s in default[0]["stats"]] == [s.digest for s in explicit[0]["stats"]]
    loader = _loaders(2, 1)[0]
    planner = loader._planner
    for step, stats in enumerate(default[0]["stats"]):
        messages = [
            {
                "sizes": np.array([len(b) for b in step_bins(r, step)]),
                "tokens": np.array([len(s["input_ids"]) for b in step_bins(r, step) for s in b]),
            }
            for r in range(2)
        ]
        assert planner.plan_arrays(peer_columns(messages, ()), step).digest == stats.digest


# -- ends and failures in the middle of a window ------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.usefixtures("rotating")
async def test_max_steps_inside_a_window_ends_the_window_there() -> None:
    runs = await _run(_loaders(2, 4, max_steps=6))
    assert [len(r["batches"]) for r in runs] == [6, 6]
    assert set(_trained(runs)) == _read(2, 6)  # nothing read beyond the limit is lost
    assert all(r["pass"].end_reason == "limit" for r in runs)


def _sizes(rank: int, step: int, epoch: int) -> list[list[int]]:
    return [[3 + rank, 2 + step % 3], [5, 1 + rank]]


@pytest.mark.usefixtures("rotating")
def test_a_source_error_in_the_middle_of_a_window_stops_every_rank_at_that_step() -> None:
    sources = [IdSource(r, _sizes, num_steps=8, fail_at=4 if r == 1 else None) for r in (0, 1)]
    loaders = make_loaders(2, sources, pack_fn=id_pack, balance_window=WINDOW)

    def body(rank: int, loader: BalancedLoader) -> list[Any]:
        return [batch for batch in loader]

    delivered: list[list[int]] = [[], []]

    def counted(rank: int, loader: BalancedLoader) -> None:
        for _ in loader:
            delivered[rank].append(loader.step)

    _, errors, hung = run_in_threads(loaders, counted)
    assert not any(hung)
    assert delivered == [[1, 2, 3, 4], [1, 2, 3, 4]]  # steps 0-3; step 4 raises everywhere
    assert isinstance(errors[1], ValueError)
    assert isinstance(errors[0], RemoteStageError)
    assert errors[0].failed_rank == 1 and errors[0].step == 4


@pytest.mark.asyncio
@pytest.mark.usefixtures("rotating")
async def test_an_uneven_end_in_the_middle_of_a_window_stops_every_rank_there() -> None:
    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(seq_len=64, bins_per_rank=2, balance_window=4, log_stats=False)
    loaders = [
        BalancedLoader(
            StatefulWindowSource(r, steps=6 if r == 0 else 8),
            config=config,
            transport=group.transport(r),
            pack_fn=ids_pack,
            cost_model="quadratic",
        )
        for r in range(2)
    ]
    runs = await _run(loaders)
    assert [len(r["batches"]) for r in runs] == [6, 6]
    assert set(_trained(runs)) == _read(2, 6)
    for run in runs:
        summary = run["pass"]
        assert summary.end_reason == "uneven" and summary.uneven.step == 6
        assert summary.num_dropped_samples == sum(map(len, step_bins(1, 6)))


@pytest.mark.usefixtures("rotating")
def test_a_pack_error_in_a_window_raises_on_every_rank_at_that_step() -> None:
    def pack(rank: int) -> dict[str, Any]:
        def fn(samples: list[Any], seq_len: int) -> Any:
            if rank == 0 and any(s["id"][1] == 5 for s in samples):
                raise RuntimeError("pack broke")
            return ids_pack(samples, seq_len)

        return {"pack_fn": fn}

    loaders = make_loaders(
        2, [StatefulWindowSource(r) for r in range(2)], per_rank=pack, balance_window=WINDOW
    )
    delivered: list[list[int]] = [[], []]

    def counted(rank: int, loader: BalancedLoader) -> None:
        for _ in loader:
            delivered[rank].append(loader.step)

    _, errors, hung = run_in_threads(loaders, counted)
    assert not any(hung)
    # Sample (r, 5, i) trains in step 3 + (5 - 3 + 1) % 3 = 3 under the rotating planner.
    assert delivered[0] == delivered[1] == [1, 2, 3]
    assert isinstance(errors[0], RuntimeError)
    assert isinstance(errors[1], RemoteStageError) and errors[1].step == 3


@pytest.mark.asyncio
@pytest.mark.usefixtures("rotating")
async def test_set_epoch_in_the_middle_of_a_window_restarts_cleanly() -> None:
    loaders = _loaders(2, 4)

    async def one(loader: BalancedLoader) -> tuple[list[Any], list[Any], Any]:
        async with loader:
            first = []
            async for batch in loader:
                first.append(batch)
                if loader.step == 2:
                    break
            await loader.aset_epoch(1)
            summary = loader.last_pass
            second = [batch async for batch in loader]
        return first, second, summary

    async with asyncio.timeout(60):
        out = await asyncio.gather(*(one(ld) for ld in loaders))
    for first, second, summary in out:
        assert len(first) == 2 and len(second) == STEPS
        assert summary.end_reason == "restart" and summary.steps == 2
        assert summary.num_discarded_samples > 0
    ids = [tuple(s) for _, second, _ in out for batch in second for b in batch for s in b]
    assert len(ids) == len(set(ids)) == len(_read(2, STEPS))


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_resume_at_every_position_of_a_window_is_bitwise_in_fresh_processes() -> None:
    from evenflow.transports.launch import run_ranks

    recorded = run_ranks(record_rank, 2, args=(WINDOW,), timeout=10.0, deadline=120.0)
    for kind in ("stateful", "stateless"):
        runs = [r[kind] for r in recorded]
        assert all(len(r["batches"]) == STEPS for r in runs)
    # Every position: after 1 .. STEPS - 1 delivered steps, inside and at the end of windows.
    states = {
        kind: [r[kind]["states"][: STEPS - 1] for r in recorded]
        for kind in ("stateful", "stateless")
    }
    assert {s["step"] % WINDOW for s in states["stateful"][0]} == {0, 1, 2}  # every position
    tails = run_ranks(resume_rank, 2, args=(WINDOW, states), timeout=10.0, deadline=120.0)
    for kind in ("stateful", "stateless"):
        for rank in range(2):
            want = recorded[rank][kind]["batches"]
            for cut, tail in enumerate(tails[rank][kind], start=1):
                assert tail == want[cut:], (kind, rank, cut)


@pytest.mark.asyncio
@pytest.mark.usefixtures("rotating")
@pytest.mark.parametrize("stateful", [True, False])
async def test_a_run_extended_past_a_window_it_ended_early_delivers_every_sample_once(
    stateful: bool,
) -> None:
    """``max_steps=4`` ends the window of steps 3..5 after step 3. A state saved there closes
    that window, so a run extended to the source's end plans steps 4.. on their own: planning
    step 3 again with step 4 (whose samples the rotating planner swaps) would deliver step 3's
    samples twice and step 4's never."""
    source = StatefulWindowSource if stateful else WindowSource

    def loaders(**cfg: Any) -> list[BalancedLoader]:
        sources = [source(r) for r in range(2)]
        return make_loaders(2, sources, pack_fn=ids_pack, balance_window=WINDOW, **cfg)

    async def resumed(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
        restored = loaders()
        for loader, state in zip(restored, states, strict=True):
            loader.load_state_dict(state)
        return await _run(restored)

    short = await _run(loaders(max_steps=4))
    longer = await resumed([r["states"][-1] for r in short])
    assert [len(r["batches"]) for r in longer] == [STEPS - 4] * 2
    delivered = collections.Counter(
        tuple(sample)
        for run in (*short, *longer)
        for batch in run["batches"]
        for b in batch
        for sample in b
    )
    assert set(delivered) == _read(2, STEPS) and max(delivered.values()) == 1
    # The extended run's first window is steps 4..5 (it starts where the closed one ended): a
    # state saved inside it restores bitwise.
    again = await resumed([r["states"][0] for r in longer])
    assert [r["batches"] for r in again] == [r["batches"][1:] for r in longer]


# -- memory bound -------------------------------------------------------------------------------


class _Watched(StatefulWindowSource):
    """Records, at every read, how many steps are read and not yet delivered."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, steps=12)
        self.delivered = 0
        self.ahead: list[int] = []

    def __iter__(self) -> Iterator[list[list[dict[str, Any]]]]:
        for bins in super().__iter__():
            self.ahead.append(self.position - self.delivered)
            yield bins


@pytest.mark.asyncio
@pytest.mark.parametrize(("window", "depth"), [(4, 1), (3, 2)])
async def test_at_most_window_plus_prefetch_depth_steps_are_read_ahead(
    window: int, depth: int
) -> None:
    sources = [_Watched(r) for r in range(2)]
    loaders = make_loaders(
        2, sources, pack_fn=ids_pack, balance_window=window, prefetch_depth=depth
    )

    async def one(loader: BalancedLoader, source: _Watched) -> int:
        n = 0
        async with loader:
            async for _ in loader:
                source.delivered = loader.step
                n += 1
                await asyncio.sleep(0.005)  # a slow caller: the pipeline runs ahead
        return n

    async with asyncio.timeout(60):
        counts = await asyncio.gather(*(one(ld, s) for ld, s in zip(loaders, sources, strict=True)))
    assert counts == [12, 12]
    for source in sources:
        # Step 0 needs the next window's first round: W + 1 steps read before it is delivered.
        assert window + 1 <= max(source.ahead) <= window + depth


# -- shared-dataset mode --------------------------------------------------------------------------


def _shared_loaders(shared: bool, depth: int = 2) -> list[BalancedLoader]:
    datasets = pytest.importorskip("datasets")
    from evenflow.engine import DatasetSource

    lengths = np.random.default_rng(3).integers(1, 48, size=90)
    data = datasets.Dataset.from_dict(
        {"id": list(range(90)), "input_ids": [[i % 251] * int(k) for i, k in enumerate(lengths)]}
    )
    group = InProcessGroup(2, timeout=20.0)
    config = LoaderConfig(
        seq_len=64, bins_per_rank=2, balance_window=WINDOW, prefetch_depth=depth, log_stats=False
    )
    loaders = []
    for r in range(2):
        source = DatasetSource(
            data, seq_len=64, bins_per_rank=2, rank=r, num_ranks=2, seed=4, shared=shared
        )
        loaders.append(
            BalancedLoader(
                source,
                config=config,
                transport=group.transport(r),
                metadata_fn=source.metadata_fn,
                pack_fn=lambda samples, _: [int(s["id"]) for s in samples],
                cost_model="quadratic",
            )
        )
    return loaders


@pytest.mark.asyncio
@pytest.mark.usefixtures("rotating")
async def test_shared_dataset_mode_delivers_the_payload_modes_windows_and_resumes() -> None:
    payload = await _run(_shared_loaders(shared=False))
    shared = await _run(_shared_loaders(shared=True))
    steps = len(payload[0]["batches"])
    assert steps > WINDOW + 1 and steps % WINDOW != 0  # the pass ends inside a window
    assert [r["batches"] for r in shared] == [r["batches"] for r in payload]
    ids = [i for r in shared for batch in r["batches"] for b in batch for i in b]
    assert len(ids) == len(set(ids))
    # Resume inside the second window, bitwise.
    cut = WINDOW + 1
    restored = _shared_loaders(shared=True, depth=1)
    for loader, run in zip(restored, shared, strict=True):
        loader.load_state_dict(run["states"][cut - 1])
    tails = await _run(restored)
    assert [t["batches"] for t in tails] == [r["batches"][cut:] for r in shared]


# -- device staging -------------------------------------------------------------------------------


def test_a_window_longer_than_the_device_bound_still_flows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``device_prefetch_depth=1`` the copy of a window's second step waits for its first
    to be delivered, which waits for the window's last step to be packed: the stages between
    them must be able to hold the window's steps, or the pipeline stalls for good."""
    import torch
    from testkit.devices import FakeDevice

    from evenflow.engine._pipeline import h2d

    monkeypatch.setattr(h2d, "_load_device_module", lambda _: FakeDevice())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    window, steps = 8, 20
    config = LoaderConfig(
        seq_len=16,
        bins_per_rank=2,
        balance_window=window,
        device_prefetch_depth=1,
        log_stats=False,
    )
    source = [[[[s] * 5, [s] * 3], [[s] * 4]] for s in range(steps)]
    loader = BalancedLoader(source, config=config, device="cuda:0", move_fn=lambda b, d: b)
    results, errors, hung = run_in_threads(
        [loader], lambda rank, ld: [int(b[0]["input_ids"][0, 0]) for b in ld], deadline=30.0
    )
    assert hung == [False] and errors == [None]
    assert sorted(results[0]) == list(range(steps))


# -- outlier-bound steps --------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [1, 4])
async def test_outlier_bound_steps_are_flagged_and_their_cost_reported(
    window: int, caplog: pytest.LogCaptureFixture
) -> None:
    from evenflow.engine import SampleMetadata
    from evenflow.engine.planning import QuadraticCost

    cost = QuadraticCost(linear=0.0)  # attention only: the long samples dominate
    loaders = _loaders(2, window, steps=8, cost_model=cost)
    with caplog.at_level(logging.INFO, logger="evenflow"):
        runs = await _run(loaders)
    lengths = {
        (r, s, i): len(sample["input_ids"])
        for r in range(2)
        for s in range(8)
        for i, sample in enumerate(x for b in step_bins(r, s) for x in b)
    }
    outliers, excess, planned = 0, 0.0, 0.0
    for step, stats in enumerate(runs[0]["stats"]):
        # The step's samples as delivered, from both ranks' batches.
        ids = [tuple(x) for run in runs for b in run["batches"][step] for x in b]
        costs = [cost(SampleMetadata(tokens=lengths[k])) for k in ids]
        mean, largest = sum(costs) / 2, max(costs)
        assert stats.outlier_bound == (largest > mean)
        want = max(0.0, min(largest, stats.max_cost_after) - mean) if largest > mean else 0.0
        assert stats.outlier_excess == pytest.approx(want)
        assert 0.0 <= stats.outlier_share <= 1.0
        outliers += stats.outlier_bound
        excess += want
        planned += stats.max_cost_after
    # One rank in four reads a long sample: steps planned alone are outlier-bound. A window
    # of four may put a window's two long samples side by side in one step, where none is.
    assert outliers > 0 or window > 1
    balance = loaders[0].trace_summary()["balance"]
    assert balance["outlier_fraction"] == pytest.approx(outliers / 8)
    assert balance["outlier_cost_fraction"] == pytest.approx(excess / planned)
    summary = runs[0]["pass"]
    assert summary.num_outlier_bound_steps == outliers
    assert summary.outlier_cost_fraction == pytest.approx(excess / planned)
    assert (f"{outliers} steps outlier-bound" in summary.log_line()) == (outliers > 0)
    for flagged in (s for s in runs[0]["stats"] if s.outlier_bound):
        assert "outlier-bound" in flagged.log_line()
        assert f"explaining {flagged.outlier_share:.0%} of the cost above balance" in (
            flagged.log_line()
        )
