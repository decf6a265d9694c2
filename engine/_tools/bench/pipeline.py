"""``evenflow bench pipeline``: step time and data stall of the pipeline on real Gloo ranks.

On 2 and 4 local ranks (Gloo over loopback), synthetic SFT-like steps (the ``sft`` workload,
first-fit source packing) feed a *simulated* training step: each rank sleeps for a time
proportional to the cost the plan gives it (``time.sleep`` releases the GIL, as device compute
would), then joins a small all-reduce on the training group, so every step waits for the
slowest rank as DDP does. The sleep scale is fixed per run of the benchmark (from the
workload's mean rank cost), identical for every configuration, so step times compare directly.

Side by side, each in sync (``for batch in loader``) and async (``async for``) iteration:

* ``balanced``: evenflow, balanced and pipelined (``prefetch_depth=2``), tracing off;
* ``balanced+trace``: the same with ``Tracer(chrome=...)`` (for the tracing overhead and the
  per-stage work of the pipeline);
* ``off``: evenflow with ``balance=False`` (same pipeline, source layout);
* ``sync-ref``: a minimal synchronous reference loop written here: read → metadata
  ``all_gather`` → plan (same :class:`Planner`) → payload ``exchange`` (same
  :class:`GlooTransport`) → pack, all on the critical path of every step, no prefetch.

Figures: median step time (steps after the first ``_WARMUP``), data stall (time waiting for
the batch over step time, same steps; the loader's whole-run ``trace_summary()["caller"]``
figure is printed beside it), throughput ratios against ``off``, and the per-step work of the
pipeline (sum of its stage spans per step). Targets, each printed PASS/MISS:

* data stall <= 5% of step time for ``balanced`` when the simulated compute per step exceeds
  the pipeline's per-step work (2 and 4 ranks, sync and async);
* ``off`` / ``balanced`` step time >= 0.95 x the ideal ratio the planner predicts
  (``sum(max_cost_before) / sum(max_cost_after)`` over the timed steps);
* (the pipeline's per-step work is the sum of its stage spans per step, waits on peers
  included: an upper bound on what must hide behind compute)
* tracing: disabled < 1% (the ``NullTracer`` calls of one step, timed in a loop, over the step
  time: a run without the hooks does not exist to compare with), enabled < 3% (median step
  time with ``Tracer(chrome=...)`` against ``tracer=None``).

Then the balance-window view (:mod:`.pipeline_window`, skipped with ``--window 1``): measured
throughput at ``balance_window=W`` (default 4) against ``W = 1`` on a long-context workload,
with the simulated compute of each rank taken from the planned costs, beside the ratio the
plans predict.

What each rank runs is in :mod:`.pipeline_ranks`; this module starts the worlds, sums up
their figures and checks the targets.

Limits: step times on a shared 2-core machine vary by several percent between runs; the
tracing comparison in particular is at the edge of that noise (rerun before concluding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine._tools.bench.pipeline_ranks import BINS, CONFIGS, MODES, SEQ_LEN, bench_rank
from evenflow.engine._tools.bench.pipeline_window import (
    print_window,
    summarize_window,
    window_targets,
)
from evenflow.engine._tracing import NullTracer
from evenflow.engine._validate import check_int, check_number
from evenflow.engine.errors import ConfigError
from evenflow.transports.launch import LaunchError, run_ranks

__all__ = ["main"]

_WARMUP = 2  # steps left out of step times and stall: they fill the pipeline
_STALL_TARGET = 0.05
_RATIO_TARGET = 0.95
_TRACE_DISABLED_TARGET = 0.01
_TRACE_ENABLED_TARGET = 0.03


def _null_tracer_cost(spans_per_step: int) -> float:
    """Seconds the tracing hooks cost per step when tracing is off (NullTracer calls)."""

    tracer = NullTracer()
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        with tracer.span("stage", i):
            pass
    per_span = (time.perf_counter() - start) / n
    return per_span * spans_per_step


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _summarize(
    num_ranks: int, result: dict[str, Any], ranks: list[dict[str, Any]]
) -> dict[str, Any]:
    out: dict[str, Any] = {"num_ranks": num_ranks, "cases": {}}
    for case in ranks[0]["cases"]:
        per_rank = [r["cases"][case] for r in ranks]
        n = min(len(p["steps"]) for p in per_rank)
        timed = range(min(_WARMUP, n - 1), n)
        step_s = [max(p["steps"][s]["step_s"] for p in per_rank) for s in timed]
        stall = statistics.fmean(
            sum(p["steps"][s]["wait_s"] for s in timed)
            / sum(p["steps"][s]["step_s"] for s in timed)
            for p in per_rank
        )
        entry: dict[str, Any] = {
            "steps": n,
            "step_time_s": _median(step_s),
            "mean_step_time_s": statistics.fmean(step_s),
            "data_stall_fraction": stall,
        }
        first = per_rank[0]
        if "caller_stall" in first:
            entry["caller_stall_all_steps"] = statistics.fmean(p["caller_stall"] for p in per_rank)
        if first.get("pipeline_work_s") is not None:
            entry["pipeline_work_s"] = max(p["pipeline_work_s"] for p in per_rank)
            entry["spans_per_step"] = first["num_spans"] / max(1, n)
        if first.get("max_cost"):
            costs = [first["max_cost"][s] for s in timed]
            after = sum(a for _, a in costs)
            entry["ideal_ratio"] = sum(b for b, _ in costs) / after if after else 1.0
            entry["mean_max_cost_after"] = after / len(costs)
        out["cases"][case] = entry
    out["seconds_per_cost"] = result["seconds_per_cost"]
    if result.get("window") is not None:
        out["window"] = summarize_window(result["window_size"], [r["window"] for r in ranks])
    return out


def _targets(worlds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []
    for world in worlds:
        n, cases = world["num_ranks"], world["cases"]
        k = world["seconds_per_cost"]
        for mode in MODES:
            on = cases[f"{mode}-balanced-{n}"]
            traced = cases[f"{mode}-balanced+trace-{n}"]
            off = cases[f"{mode}-off-{n}"]
            compute = k * on.get("mean_max_cost_after", 0.0)
            work = traced.get("pipeline_work_s", 0.0)
            applies = compute > work
            targets.append(
                {
                    "name": f"data stall <= 5% ({n} ranks, {mode})",
                    "value": on["data_stall_fraction"],
                    "limit": _STALL_TARGET,
                    "status": ("PASS" if on["data_stall_fraction"] <= _STALL_TARGET else "MISS")
                    if applies
                    else "N/A",
                    "note": f"compute {compute * 1e3:.1f} ms/step vs pipeline work "
                    f"{work * 1e3:.1f} ms/step",
                }
            )
            ideal = on.get("ideal_ratio", 1.0)
            ratio = off["step_time_s"] / on["step_time_s"] if on["step_time_s"] else 0.0
            targets.append(
                {
                    "name": f"balanced/off throughput >= 0.95 x ideal ({n} ranks, {mode})",
                    "value": ratio / ideal if ideal else 0.0,
                    "limit": _RATIO_TARGET,
                    "status": "PASS" if ratio >= _RATIO_TARGET * ideal else "MISS",
                    "note": f"measured {ratio:.3f}x, ideal {ideal:.3f}x",
                }
            )
            overhead = traced["step_time_s"] / on["step_time_s"] - 1.0 if on["step_time_s"] else 0.0
            targets.append(
                {
                    "name": f"tracing enabled overhead < 3% ({n} ranks, {mode})",
                    "value": overhead,
                    "limit": _TRACE_ENABLED_TARGET,
                    "status": "PASS" if overhead < _TRACE_ENABLED_TARGET else "MISS",
                    "note": f"median step {traced['step_time_s'] * 1e3:.2f} ms traced vs "
                    f"{on['step_time_s'] * 1e3:.2f} ms untraced",
                }
            )
            disabled = _null_tracer_cost(round(traced.get("spans_per_step", 0))) / on["step_time_s"]
            targets.append(
                {
                    "name": f"tracing disabled overhead < 1% ({n} ranks, {mode})",
                    "value": disabled,
                    "limit": _TRACE_DISABLED_TARGET,
                    "status": "PASS" if disabled < _TRACE_DISABLED_TARGET else "MISS",
                    "note": f"{round(traced.get('spans_per_step', 0))} NullTracer spans per step",
                }
            )
        if "window" in world:
            targets.extend(window_targets(n, world["window"]))
    return targets


def _print_text(doc: dict[str, Any]) -> None:
    print(
        f"evenflow bench pipeline: sft steps, seq_len {SEQ_LEN}, {BINS} bins per rank, "
        f"{doc['config']['steps']} steps per case, simulated compute ~"
        f"{doc['config']['target_ms']:g} ms per mean rank; medians over steps {_WARMUP}+"
    )
    print(
        "step time: median wall time per step (max over ranks); stall: share of step time "
        "waiting for the batch; vs off: throughput relative to balancing off"
    )
    for world in doc["worlds"]:
        n = world["num_ranks"]
        print(f"\n{n} ranks")
        print(
            f"  {'mode':<6}{'config':<16}{'step ms':>9}{'stall':>8}{'stall*':>8}{'vs off':>8}"
            f"{'pipe ms':>9}"
        )
        for mode in MODES:
            off = world["cases"][f"{mode}-off-{n}"]["step_time_s"]
            for config_name in CONFIGS:
                c = world["cases"][f"{mode}-{config_name}-{n}"]
                caller = c.get("caller_stall_all_steps")
                pipe = c.get("pipeline_work_s")
                print(
                    f"  {mode:<6}{config_name:<16}{c['step_time_s'] * 1e3:>9.2f}"
                    f"{c['data_stall_fraction'] * 100:>7.2f}%"
                    f"{'' if caller is None else f'{caller * 100:.2f}%':>8}"
                    f"{off / c['step_time_s']:>7.3f}x"
                    f"{'' if pipe is None else f'{pipe * 1e3:.2f}':>9}"
                )
    print(
        "  stall*: trace_summary()['caller'] over the whole run (includes filling the "
        "pipeline); pipe ms: pipeline stage time per step (traced run)"
    )
    if doc["config"]["window"] > 1:
        print_window(doc["worlds"], doc["config"])
    print("\ntargets")
    for t in doc["targets"]:
        print(
            f"  {t['status']:<5} {t['name']}: {t['value'] * 100:.2f}%"
            if "overhead" in t["name"] or "stall" in t["name"]
            else f"  {t['status']:<5} {t['name']}: {t['value']:.3f}",
            end="",
        )
        print(f"  ({t['note']})")
    print(f"\nwall time {doc['wall_s']:.1f} s")


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Step time, data stall and throughput of the evenflow pipeline on 2 and 4 "
        "Gloo ranks with simulated compute, against balancing off and a synchronous reference.",
    )
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per case (default 40, 10 with --quick)"
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="simulated compute of the mean rank per step (default 60, 20 quick)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=None,
        help="world sizes to run (default 2 4; 2 with --quick)",
    )
    parser.add_argument(
        "--algorithm",
        choices=("default", "refine", "lpt"),
        default="default",
        help="balancing algorithm of every balanced configuration",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=4,
        help="balance window compared with 1 on long-context steps (default 4; 1 skips it)",
    )
    parser.add_argument(
        "--window-steps",
        type=int,
        default=None,
        help="steps per balance-window case (default 32, 12 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds per world before its ranks are killed (default 300)",
    )
    add_report_only(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench pipeline") -> int:
    """Run the pipeline benchmark; 0 when every target passed, 1 on a MISS (unless
    ``--report-only``) or a failure, 2 on bad input."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    steps = args.steps if args.steps is not None else (6 if args.quick else 40)
    world_sizes = args.ranks if args.ranks is not None else ([2] if args.quick else [2, 4])
    target_ms = args.compute_ms if args.compute_ms is not None else (20.0 if args.quick else 60.0)
    window_steps = (
        args.window_steps if args.window_steps is not None else (12 if args.quick else 32)
    )
    try:
        check_int("--steps", steps, minimum=_WARMUP + 2)
        check_int("--window", args.window, minimum=1)
        check_int("--window-steps", window_steps, minimum=2 * args.window)
        check_number("--compute-ms", target_ms, minimum=0.0, strict_minimum=True)
        check_int("--seed", args.seed, minimum=0)
        check_number("--deadline", args.deadline, minimum=0.0, strict_minimum=True)
        for n in world_sizes:
            check_int("--ranks", n, minimum=2)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    worlds = []
    with tempfile.TemporaryDirectory(prefix="evenflow-bench-pipeline-") as trace_dir:
        spec = {
            "steps": steps,
            "target_s": target_ms / 1e3,
            "seed": args.seed,
            "timeout": 30.0,
            "trace_dir": trace_dir,
            "algorithm": args.algorithm,
            "window": args.window,
            "window_steps": window_steps,
        }
        for n in world_sizes:
            print(f"{prog}: {n} ranks ...", file=sys.stderr)
            try:
                ranks = run_ranks(bench_rank, n, args=[spec], deadline=args.deadline, timeout=30.0)
            except LaunchError as exc:
                print(f"{prog}: error: {exc}", file=sys.stderr)
                return 1
            worlds.append(_summarize(n, {**ranks[0], "window_size": args.window}, ranks))
    doc: dict[str, Any] = {
        "benchmark": "pipeline",
        "config": {
            "steps": steps,
            "target_ms": target_ms,
            "seq_len": SEQ_LEN,
            "bins_per_rank": BINS,
            "distribution": "sft",
            "ranks": list(world_sizes),
            "algorithm": args.algorithm,
            "warmup_steps": _WARMUP,
            "window": args.window,
            "window_steps": window_steps,
            "quick": args.quick,
            "reference": "sync-ref: read, gather, plan, exchange and pack on the critical path "
            "of every step (no prefetch), same Planner and GlooTransport",
        },
        "worlds": worlds,
    }
    doc["targets"] = _targets(worlds)
    doc["wall_s"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_text(doc)
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)
