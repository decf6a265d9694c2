"""``evenflow bench scale``: planning time and traffic from 8 to 1,024 ranks per group.

Two parts:

1. **One group of N ranks** (N = 8, 64, 256, 1,024): per step, the planner's wall time on the
   whole step (``Planner.plan`` on key and metadata objects), the pipeline's plan stage (the
   engine's real ``plan_step``: every rank's decoded metadata message to the plan, its step
   statistics and one rank's exchange and pack routes), the metadata message each rank sends
   (the engine's real ``build_message`` encoded with the real wire codec), and the payload
   bytes each rank sends to others under the accepted plan. For N up to ``--gather-up-to``
   the metadata round also runs for real over the ``inprocess`` transport, every rank an
   asyncio task of this one process.
2. **Two levels** (default 128 nodes x 8 ranks): the same step balanced node-local (one group
   per node, planned independently) versus globally (one group of every rank): the balance
   each reaches, the planning time, and the payload bytes that would cross nodes. Node-local
   grouping must move no byte across nodes; the benchmark checks it and fails otherwise.

Payload bytes count 4 bytes per token (int32 token ids, as the workloads' samples carry) and
leave out framing, so they compare layouts rather than predict wire bytes exactly. All ranks
share this machine's cores, so the in-process gather time is a simulation: its wall time is the
decoding work of all N ranks; ``per rank`` divides it by N, the share one real rank would do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine._model import SampleKey, SampleMetadata
from evenflow.engine._pipeline.step import StepState, build_message, plan_step
from evenflow.engine._plan import Plan
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.planner import Planner
from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine.workloads import make_step
from evenflow.transports import decode, encode
from evenflow.transports.testing import run_inprocess

__all__ = ["main"]

TARGET_PLAN_P50_MS = 500.0
TARGET_META_BYTES_PER_SAMPLE = 64.0
BYTES_PER_TOKEN = 4

Samples = list[tuple[SampleKey, SampleMetadata]]
Bins = list[list[SampleKey]]


@dataclass(frozen=True)
class _Settings:
    sizes: tuple[int, ...]
    steps: int
    large_steps: int
    bins_per_rank: int
    seq_len: int
    distribution: str
    packer: str
    algorithm: str
    seed: int
    gather_up_to: int
    nodes: int
    ranks_per_node: int
    two_level_steps: int


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def _planner(num_ranks: int, settings: _Settings) -> Any:

    return Planner(
        num_ranks=num_ranks,
        bins_per_rank=settings.bins_per_rank,
        seq_len=settings.seq_len,
        cost_model=QuadraticCost(),
        algorithm=settings.algorithm,
    )


def _step(num_ranks: int, step: int, settings: _Settings) -> tuple[Samples, Bins]:

    return make_step(
        settings.distribution,
        settings.packer,
        num_ranks=num_ranks,
        bins_per_rank=settings.bins_per_rank,
        seq_len=settings.seq_len,
        seed=settings.seed,
        step=step,
    )


def _messages(
    samples: Samples, bins: Bins, step: int, bins_per_rank: int, prev: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Each rank's real metadata message for ``step``."""
    meta = dict(samples)
    out = []
    for rank in range(len(bins) // bins_per_rank):
        rank_bins = bins[rank * bins_per_rank : (rank + 1) * bins_per_rank]
        metas = [meta[key] for b in rank_bins for key in b]
        state = StepState(step=step, sizes=list(map(len, rank_bins)), metas=metas)
        out.append(build_message(state, rank, 0, (), prev))
    return out


def _moves(
    plan: Plan, samples: Samples, offset: int = 0
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(source rank, destination rank, payload bytes)`` of every sample, as global ranks.

    The source is the rank that read the sample (``key.source_rank``, a global rank in these
    workloads); the destination is the plan's group rank shifted by the group's first global
    rank ``offset`` (groups here are consecutive blocks of ranks).
    """
    dest = plan.rank_of()
    n = len(samples)
    return (
        np.fromiter((key.source_rank for key, _ in samples), dtype=np.int64, count=n),
        np.fromiter((offset + dest[key] for key, _ in samples), dtype=np.int64, count=n),
        np.fromiter((m.tokens * BYTES_PER_TOKEN for _, m in samples), dtype=np.int64, count=n),
    )


async def _gather_seconds(messages: list[dict[str, Any]]) -> float:
    """Wall time of one real metadata all-gather among ``len(messages)`` in-process ranks."""

    async def member(transport: Any) -> int:
        received = await transport.all_gather(messages[transport.rank])
        return len(received)

    started = time.perf_counter()
    counts = await run_inprocess(len(messages), member, timeout=600.0)
    elapsed = time.perf_counter() - started
    assert all(c == len(messages) for c in counts)
    return elapsed


def _one_group(num_ranks: int, settings: _Settings) -> dict[str, Any]:
    planner = _planner(num_ranks, settings)
    steps = settings.steps if num_ranks < 1024 else settings.large_steps
    plan_ms: list[float] = []
    stage_ms: list[float] = []
    meta_bytes: list[float] = []
    meta_per_sample: list[float] = []
    sent_mean: list[float] = []
    sent_max: list[float] = []
    gather_s: list[float] = []
    samples_per_rank: list[float] = []
    prev: dict[str, Any] | None = None
    for step in range(steps):
        samples, bins = _step(num_ranks, step, settings)
        started = time.perf_counter()
        plan = planner.plan(samples, bins, step)
        plan_ms.append((time.perf_counter() - started) * 1e3)
        messages = _messages(samples, bins, step, settings.bins_per_rank, prev)
        encoded = [encode(m) for m in messages]
        sizes = [len(e) for e in encoded]
        received = [decode(e) for e in encoded]
        started = time.perf_counter()
        staged, _, _ = plan_step(
            planner,
            received,
            step,
            budget_names=(),
            rank=num_ranks // 2,
            group_ranks=tuple(range(num_ranks)),
        )
        stage_ms.append((time.perf_counter() - started) * 1e3)
        if staged.digest != plan.digest:
            raise AssertionError(
                f"step {step}: the plan stage's digest {staged.digest!r} differs from "
                f"Planner.plan's {plan.digest!r}; both must plan the same step identically."
            )
        meta_bytes.append(statistics.fmean(sizes))
        meta_per_sample.append(sum(sizes) / len(samples))
        samples_per_rank.append(len(samples) / num_ranks)
        src, dst, nbytes = _moves(plan, samples)
        moved = src != dst
        per_rank = np.bincount(src[moved], weights=nbytes[moved], minlength=num_ranks)
        sent_mean.append(float(per_rank.mean()))
        sent_max.append(float(per_rank.max()))
        if num_ranks <= settings.gather_up_to:
            gather_s.append(asyncio.run(_gather_seconds(messages)))
        prev = {"step": step, "error": None, "digest": plan.digest}
    return {
        "num_ranks": num_ranks,
        "steps": steps,
        "samples_per_rank": statistics.fmean(samples_per_rank),
        "plan_ms_p50": _percentile(plan_ms, 50),
        "plan_ms_p99": _percentile(plan_ms, 99),
        "stage_ms_p50": _percentile(stage_ms, 50),
        "stage_ms_p99": _percentile(stage_ms, 99),
        "meta_bytes_per_rank": statistics.fmean(meta_bytes),
        "meta_bytes_per_sample": statistics.fmean(meta_per_sample),
        "sent_bytes_per_rank_mean": statistics.fmean(sent_mean),
        "sent_bytes_per_rank_max": max(sent_max),
        "gather_wall_ms": statistics.fmean(gather_s) * 1e3 if gather_s else None,
        "gather_per_rank_ms": (statistics.fmean(gather_s) * 1e3 / num_ranks if gather_s else None),
    }


def _balance(rank_costs: np.ndarray[Any, Any], largest: float) -> dict[str, float]:
    mean = float(rank_costs.mean())
    bound = max(mean, largest)
    top = float(rank_costs.max())
    return {
        "max_over_mean": top / mean if mean else 1.0,
        "max_over_bound": top / bound if bound else 1.0,
    }


def _two_level(settings: _Settings) -> dict[str, Any]:

    nodes, per_node = settings.nodes, settings.ranks_per_node
    num_ranks = nodes * per_node
    cost = QuadraticCost()
    global_planner = _planner(num_ranks, settings)
    local_planner = _planner(per_node, settings)
    rows: dict[str, list[dict[str, float]]] = {"source": [], "node": [], "global": []}
    plan_ms: dict[str, list[float]] = {"node": [], "global": []}
    cross: dict[str, int] = {"node": 0, "global": 0}
    moved: dict[str, int] = {"node": 0, "global": 0}
    for step in range(settings.two_level_steps):
        samples, bins = _step(num_ranks, step, settings)
        costs = {key: cost(meta) for key, meta in samples}
        largest = max(costs.values())
        source = np.zeros(num_ranks)
        for i, b in enumerate(bins):
            source[i // settings.bins_per_rank] += sum(costs[k] for k in b)
        rows["source"].append(_balance(source, largest))

        started = time.perf_counter()
        plan = global_planner.plan(samples, bins, step)
        plan_ms["global"].append((time.perf_counter() - started) * 1e3)
        rows["global"].append(_balance(np.asarray(plan.rank_costs), largest))
        src, dst, nbytes = _moves(plan, samples)
        cross["global"] += int(nbytes[(src // per_node) != (dst // per_node)].sum())
        moved["global"] += int(nbytes[src != dst].sum())

        node_costs: list[float] = []
        slowest = 0.0
        width = per_node * settings.bins_per_rank
        for node in range(nodes):
            node_bins = bins[node * width : (node + 1) * width]
            keys = {k for b in node_bins for k in b}
            node_samples = [(k, m) for k, m in samples if k in keys]
            started = time.perf_counter()
            node_plan = local_planner.plan(node_samples, node_bins, step)
            # Nodes plan in parallel, so a step waits for the slowest node's planner.
            slowest = max(slowest, (time.perf_counter() - started) * 1e3)
            node_costs.extend(node_plan.rank_costs)
            src, dst, nbytes = _moves(node_plan, node_samples, offset=node * per_node)
            cross["node"] += int(nbytes[(src // per_node) != (dst // per_node)].sum())
            moved["node"] += int(nbytes[src != dst].sum())
        plan_ms["node"].append(slowest)
        rows["node"].append(_balance(np.asarray(node_costs), largest))

    def summary(name: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            key: statistics.fmean(r[key] for r in rows[name]) for key in rows[name][0]
        }
        if name != "source":
            out["plan_ms_p50"] = _percentile(plan_ms[name], 50)
            out["moved_bytes_per_step"] = moved[name] / settings.two_level_steps
            out["cross_node_bytes_per_step"] = cross[name] / settings.two_level_steps
        return out

    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "steps": settings.two_level_steps,
        "source": summary("source"),
        "node_local": summary("node"),
        "global": summary("global"),
    }


def _targets(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    big = next((g for g in groups if g["num_ranks"] == 1024), None)
    out = []
    for name, key, limit, unit in (
        ("planning p50 at 1,024 ranks", "plan_ms_p50", TARGET_PLAN_P50_MS, "ms"),
        ("metadata per sample", "meta_bytes_per_sample", TARGET_META_BYTES_PER_SAMPLE, "B"),
    ):
        value = None if big is None else float(big[key])
        status = "SKIP" if value is None else ("PASS" if value <= limit else "MISS")
        out.append({"name": name, "value": value, "limit": limit, "unit": unit, "status": status})
    return out


def run(settings: _Settings) -> dict[str, Any]:
    """Run the whole benchmark and return its report (plain data)."""
    groups = [_one_group(n, settings) for n in settings.sizes]
    two_level = _two_level(settings)
    return {
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        "groups": groups,
        "two_level": two_level,
        "targets": _targets(groups),
        "node_local_cross_node_bytes_ok": two_level["node_local"]["cross_node_bytes_per_step"] == 0,
    }


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        width = spec.split(".", maxsplit=1)[0]
        return "-".rjust(int(width)) if width.isdigit() else "-"
    return format(value, spec)


def _print(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"One balance group: {s['distribution']}/{s['packer']} steps, {s['bins_per_rank']} bins "
        f"per rank, seq_len {s['seq_len']}, algorithm {s['algorithm']!r}, cost 24576*L + L^2"
    )
    print(
        "plan: Planner.plan on key and metadata objects; stage: the pipeline's plan stage "
        "(decoded messages -> plan, statistics and one rank's routes); both in ms"
    )
    header = (
        f"{'ranks':>6} {'samples/rk':>10} {'plan p50':>9} {'plan p99':>9} {'stage p50':>9} "
        f"{'stage p99':>9} {'meta B/rk':>9} "
        f"{'meta B/smp':>10} {'sent MB/rk':>10} {'max MB/rk':>9} {'gather ms':>9} {'per rk':>7}"
    )
    print(header)
    for g in report["groups"]:
        print(
            f"{g['num_ranks']:>6} {g['samples_per_rank']:>10.1f} {g['plan_ms_p50']:>9.1f} "
            f"{g['plan_ms_p99']:>9.1f} {g['stage_ms_p50']:>9.1f} {g['stage_ms_p99']:>9.1f} "
            f"{g['meta_bytes_per_rank']:>9.0f} "
            f"{g['meta_bytes_per_sample']:>10.2f} {g['sent_bytes_per_rank_mean'] / 1e6:>10.3f} "
            f"{g['sent_bytes_per_rank_max'] / 1e6:>9.3f} {_fmt(g['gather_wall_ms'], '9.1f')} "
            f"{_fmt(g['gather_per_rank_ms'], '7.2f')}"
        )
    t = report["two_level"]
    print(
        f"\nTwo levels: {t['nodes']} nodes x {t['ranks_per_node']} ranks, {t['steps']} step(s); "
        "balance = max rank cost / mean (and / lower bound)"
    )
    print(
        f"{'grouping':>10} {'max/mean':>9} {'max/bound':>9} {'plan p50 ms':>11} "
        f"{'moved MB/step':>13} {'cross-node MB/step':>18}"
    )
    for name in ("source", "node_local", "global"):
        row = t[name]
        moved = row.get("moved_bytes_per_step")
        crossing = row.get("cross_node_bytes_per_step")
        print(
            f"{name:>10} {row['max_over_mean']:>9.3f} {row['max_over_bound']:>9.3f} "
            f"{_fmt(row.get('plan_ms_p50'), '11.1f')} "
            f"{_fmt(None if moved is None else moved / 1e6, '13.2f')} "
            f"{_fmt(None if crossing is None else crossing / 1e6, '18.2f')}"
        )
    verdict = "PASS" if report["node_local_cross_node_bytes_ok"] else "FAIL"
    print(f"node-local grouping moves 0 bytes across nodes: {verdict}")
    print("\nTargets:")
    for target in report["targets"]:
        print(
            f"  {target['name']}: {_fmt(target['value'], '.2f')} {target['unit']} "
            f"(target <= {target['limit']:g} {target['unit']}) {target['status']}"
        )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None, *, prog: str = "evenflow bench scale") -> int:
    """Entry point of ``evenflow bench scale``; returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    parser.add_argument("--ranks", type=_positive, nargs="+", help="group sizes to run")
    parser.add_argument("--steps", type=_positive, default=5, help="steps per group size")
    parser.add_argument(
        "--bins-per-rank", type=_positive, default=4, help="bins per rank per step (default 4)"
    )
    parser.add_argument(
        "--seq-len", type=_positive, default=8192, help="tokens per bin (default 8192)"
    )
    parser.add_argument(
        "--distribution",
        default="sft",
        help="sample length distribution of evenflow.engine.workloads (default sft)",
    )
    parser.add_argument(
        "--packer",
        default="firstfit",
        choices=("firstfit", "bfd"),
        help="how the synthetic sources pack their bins (default firstfit)",
    )
    parser.add_argument(
        "--algorithm",
        default="default",
        choices=("default", "lpt"),
        help="balancing algorithm (default default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--gather-up-to",
        type=int,
        default=256,
        help="largest group whose metadata gather also runs over the inprocess transport",
    )
    parser.add_argument(
        "--nodes",
        type=_positive,
        default=128,
        help="nodes of the node-local grouping case (default 128)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=_positive,
        default=8,
        help="ranks per node of the node-local grouping case (default 8)",
    )
    add_report_only(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    quick = args.quick
    settings = _Settings(
        sizes=tuple(args.ranks or ((8, 64) if quick else (8, 64, 256, 1024))),
        steps=1 if quick else args.steps,
        large_steps=1 if quick else min(args.steps, 3),
        bins_per_rank=args.bins_per_rank,
        seq_len=args.seq_len,
        distribution=args.distribution,
        packer=args.packer,
        algorithm=args.algorithm,
        seed=args.seed,
        gather_up_to=args.gather_up_to,
        nodes=4 if quick else args.nodes,
        ranks_per_node=args.ranks_per_node,
        two_level_steps=1 if quick else 2,
    )
    report = run(settings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    if not report["node_local_cross_node_bytes_ok"]:
        print(f"{prog}: node-local groups moved bytes across nodes.", file=sys.stderr)
        return 1
    return targets_status(report["targets"], report_only=args.report_only, prog=prog)


if __name__ == "__main__":
    raise SystemExit(main())
