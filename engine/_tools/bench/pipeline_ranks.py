"""The rank side of ``evenflow bench pipeline``: every configuration and mode on one world.

:func:`bench_rank` runs inside each Gloo rank (through ``run_ranks``) and returns plain data:
per case, every step's wait and step time, the loader's trace figures and, on rank 0, the
planned costs. The configurations, the simulated training step and what the figures mean are
described in :mod:`evenflow.engine._tools.bench.pipeline`, which runs the worlds and sums up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._pipeline.pack import default_pack_fn
from evenflow.engine._planning.planner import Planner
from evenflow.engine._tools.bench.pipeline_window import _seconds_per_cost, _train, run_window_cases
from evenflow.engine._tracing import Tracer
from evenflow.engine.workloads import step_source
from evenflow.transports import GlooTransport

__all__ = ["BINS", "CONFIGS", "MODES", "SEQ_LEN", "bench_rank"]

CONFIGS = ("balanced", "balanced+trace", "off", "sync-ref")
MODES = ("sync", "async")
SEQ_LEN = 32768
BINS = 2
# Stages that are the caller's, not the pipeline's work.
_CALLER_STAGES = frozenset({"wait", "compute"})


def _source(rank: int, steps: int, seed: int) -> Iterator[Any]:

    return step_source(
        "sft",
        "firstfit",
        rank=rank,
        bins_per_rank=BINS,
        seq_len=SEQ_LEN,
        seed=seed,
        num_steps=steps,
    )


class _Reference:
    """Balances without prefetch: every stage of step ``s`` runs inside the fetch of ``s``."""

    def __init__(self, transport: Any, rank: int, spec: dict[str, Any]) -> None:
        self.transport, self.rank = transport, rank
        self.planner = Planner(
            num_ranks=transport.num_ranks,
            bins_per_rank=BINS,
            seq_len=SEQ_LEN,
            cost_model="quadratic",
            algorithm=spec["algorithm"],
        )
        self.source = _source(rank, spec["steps"], spec["seed"])
        self.step = 0

    async def fetch(self) -> tuple[list[Any], float] | None:

        bins = next(self.source, None)
        # Every source here has the same number of steps, so all ranks end together.
        if bins is None:
            return None
        step, self.step = self.step, self.step + 1
        mine = [s["input_ids"] for b in bins for s in b]
        message = {
            "tokens": np.array([len(x) for x in mine], dtype=np.int64),
            "bins": np.array([len(b) for b in bins], dtype=np.int64),
        }
        gathered = await self.transport.all_gather(message)
        samples: list[tuple[Any, Any]] = []
        reference: list[list[Any]] = []
        for r, msg in enumerate(gathered):
            tokens = np.asarray(msg["tokens"]).tolist()
            keys = [SampleKey(r, step, i) for i in range(len(tokens))]
            samples.extend((k, SampleMetadata(tokens=t)) for k, t in zip(keys, tokens, strict=True))
            edges = np.cumsum([0, *np.asarray(msg["bins"]).tolist()]).tolist()
            reference.extend(keys[edges[i] : edges[i + 1]] for i in range(len(edges) - 1))
        plan = self.planner.plan(samples, reference, step)
        outgoing: dict[int, list[tuple[Any, Any]]] = {}
        for dest, dest_bins in enumerate(plan.local_batches):
            for b in dest_bins:
                for key in b.sample_keys:
                    if key.source_rank == self.rank:
                        outgoing.setdefault(dest, []).append((key.as_tuple(), mine[key.index]))
        received = {tuple(k): v for k, v in (await self.transport.exchange(outgoing)).items()}
        packed = [
            default_pack_fn([received[k.as_tuple()] for k in b.sample_keys], SEQ_LEN)
            for b in plan.local_batches[self.rank]
        ]
        return packed, plan.rank_costs[self.rank]


def _make_loader(config_name: str, transport: Any, spec: dict[str, Any], rank: int) -> Any:

    tracer = None
    if config_name == "balanced+trace":
        tracer = Tracer(chrome=Path(spec["trace_dir"]) / f"{spec['case']}")
    config = LoaderConfig(
        seq_len=SEQ_LEN,
        bins_per_rank=BINS,
        balance=config_name != "off",
        timeout=spec["timeout"],
        log_stats=False,
    )
    return BalancedLoader(
        _source(rank, spec["steps"], spec["seed"]),
        config=config,
        transport=transport,
        cost_model="quadratic",
        algorithm=spec["algorithm"],
        tracer=tracer,
    )


def _record(
    rank: int, steps: list[dict[str, float]], stats: list[Any], loader: Any
) -> dict[str, Any]:
    record: dict[str, Any] = {"steps": steps}
    if loader is not None:
        summary = loader.trace_summary()
        record["caller_stall"] = summary["caller"]["data_stall_fraction"]
        stages = summary.get("stages", {})
        work = sum(v["total"] for k, v in stages.items() if k not in _CALLER_STAGES)
        record["pipeline_work_s"] = work / max(1, len(steps)) if stages else None
        record["num_spans"] = summary.get("num_spans", 0)
    if rank == 0:
        record["max_cost"] = [(s.max_cost_before, s.max_cost_after) for s in stats]
    return record


def _run_sync(config_name: str, transport: Any, spec: dict[str, Any], rank: int) -> dict[str, Any]:

    k = spec["seconds_per_cost"]
    steps: list[dict[str, float]] = []
    stats: list[Any] = []
    if config_name == "sync-ref":
        ref = _Reference(transport, rank, spec)
        loop = asyncio.new_event_loop()
        try:
            while True:
                t0 = time.perf_counter()
                got = loop.run_until_complete(ref.fetch())
                if got is None:
                    break
                t1 = time.perf_counter()
                _train(k * got[1])
                steps.append({"wait_s": t1 - t0, "step_s": time.perf_counter() - t0})
        finally:
            loop.close()
        return _record(rank, steps, stats, None)
    loader = _make_loader(config_name, transport, spec, rank)
    with loader:
        iterator = iter(loader)
        while True:
            t0 = time.perf_counter()
            batch = next(iterator, None)
            if batch is None:
                break
            t1 = time.perf_counter()
            st = loader.last_stats
            stats.append(st)
            _train(k * st.cost_after[rank])
            steps.append({"wait_s": t1 - t0, "step_s": time.perf_counter() - t0})
        record = _record(rank, steps, stats, loader)
    return record


async def _run_async(
    config_name: str, transport: Any, spec: dict[str, Any], rank: int
) -> dict[str, Any]:

    k = spec["seconds_per_cost"]
    loop = asyncio.get_running_loop()
    steps: list[dict[str, float]] = []
    stats: list[Any] = []
    # The training group's collectives get one thread of their own, as in an async trainer
    # that keeps its event loop free while the device computes.
    with ThreadPoolExecutor(1, thread_name_prefix="bench-train") as train:
        if config_name == "sync-ref":
            ref = _Reference(transport, rank, spec)
            while True:
                t0 = time.perf_counter()
                got = await ref.fetch()
                if got is None:
                    break
                t1 = time.perf_counter()
                await loop.run_in_executor(train, _train, k * got[1])
                steps.append({"wait_s": t1 - t0, "step_s": time.perf_counter() - t0})
            return _record(rank, steps, stats, None)
        loader = _make_loader(config_name, transport, spec, rank)
        async with loader:
            iterator = aiter(loader)
            while True:
                t0 = time.perf_counter()
                try:
                    await anext(iterator)
                except StopAsyncIteration:
                    break
                t1 = time.perf_counter()
                st = loader.last_stats
                stats.append(st)
                await loop.run_in_executor(train, _train, k * st.cost_after[rank])
                steps.append({"wait_s": t1 - t0, "step_s": time.perf_counter() - t0})
            return _record(rank, steps, stats, loader)


def bench_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Every configuration and mode on this world, one after another (plain-data result)."""
    import torch

    torch.set_num_threads(1)
    spec = dict(
        spec,
        seconds_per_cost=_seconds_per_cost(
            num_ranks,
            spec["seed"],
            spec["target_s"],
            distribution="sft",
            bins=BINS,
            seq_len=SEQ_LEN,
        ),
    )
    results: dict[str, Any] = {}
    for mode in MODES:
        for config_name in CONFIGS:
            case = f"{mode}-{config_name}-{num_ranks}"
            transport = GlooTransport(timeout=spec["timeout"])
            try:
                case_spec = dict(spec, case=case)
                if mode == "sync":
                    results[case] = _run_sync(config_name, transport, case_spec, rank)
                else:
                    results[case] = asyncio.run(_run_async(config_name, transport, case_spec, rank))
            finally:
                asyncio.run(transport.aclose())
    window = run_window_cases(rank, num_ranks, spec) if spec["window"] > 1 else None
    return {"cases": results, "seconds_per_cost": spec["seconds_per_cost"], "window": window}
