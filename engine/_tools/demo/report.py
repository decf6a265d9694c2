"""The report of ``evenflow demo``: numbers from the ranks' results, text, JSON, trace and plot.

:func:`build_report` turns what every rank returned into one plain-data document (the
``--json`` output and ``report.json``); :func:`write_outputs` merges the per-rank Chrome traces
into one Perfetto-loadable file per run and draws ``demo.png`` when matplotlib is installed
(it is the optional ``bench`` extra: without it the plot is skipped, never an error);
:func:`format_report` renders the text a person reads, one line of meaning per figure.

Averages leave out step 0 of each run: it pays for filling the pipeline and for the first
touches of the optimizer state, in both runs alike.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evenflow.engine._tracing import merge_chrome_traces

__all__ = ["build_report", "format_report", "write_outputs"]

_RUNS = ("unbalanced", "balanced")
_RUN_LABELS = {"unbalanced": "balancing off", "balanced": "balanced"}
# Stages shown in the timeline, top to bottom; others (if any) follow in name order.
_STAGE_ORDER = (
    "read",
    "source",
    "metadata",
    "gather",
    "plan",
    "exchange",
    "pack",
    "collate",
    "h2d",
    "wait",
    "train/forward+backward",
    "train/all-reduce",
    "train/optimizer",
)
# The loader's own "compute" span covers the same interval as the train/* spans.
_HIDDEN_STAGES = frozenset({"compute"})
_MAX_TIMELINE_RANKS = 4


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _timed(steps: Sequence[Any]) -> Sequence[Any]:
    return steps[1:] if len(steps) > 1 else steps


def _run_summary(run: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [r["runs"][run] for r in results]
    num_steps = min(len(p["steps"]) for p in per_rank)
    if num_steps == 0:
        raise ValueError(f"The {run} run delivered no step; nothing to report.")
    steps = [[p["steps"][s] for p in per_rank] for s in range(num_steps)]
    timed = _timed(steps)
    compute = [[row[r]["compute_s"] for row in timed] for r in range(len(per_rank))]
    imbalance = [
        max(x["compute_s"] for x in row) / _mean([x["compute_s"] for x in row])
        for row in timed
        if _mean([x["compute_s"] for x in row]) > 0
    ]
    step_time = [max(x["step_s"] for x in row) for row in timed]
    tokens = [sum(x["tokens"] for x in row) for row in timed]
    stats = per_rank[0]["stats"]
    predicted = [
        max(s["cost_after"]) / _mean(s["cost_after"]) for s in stats if _mean(s["cost_after"]) > 0
    ]
    return {
        "num_steps": num_steps,
        "num_timed_steps": len(timed),
        "compute_per_rank_s": [_mean(c) for c in compute],
        "compute_per_rank_per_step_s": [
            [row[r]["compute_s"] for row in steps] for r in range(len(per_rank))
        ],
        "sync_per_rank_s": [
            _mean([row[r]["sync_s"] for row in timed]) for r in range(len(per_rank))
        ],
        "imbalance": _mean(imbalance),
        "predicted_imbalance": _mean(predicted),
        "step_time_s": _mean(step_time),
        "step_times_s": [max(x["step_s"] for x in row) for row in steps],
        "tokens_per_s": sum(tokens) / sum(step_time) if sum(step_time) > 0 else 0.0,
        "data_stall_fraction": _mean([p["data_stall_fraction"] for p in per_rank]),
        "data_stall_fraction_max": max(p["data_stall_fraction"] for p in per_rank),
        "samples": sum(sum(x["samples"] for x in row) for row in steps),
        "samples_moved": sum(s["num_moved"] for s in stats),
        "plans_accepted": sum(1 for s in stats if s["accepted"]),
        "sum_max_cost_before": sum(s["max_cost_before"] for s in _timed(stats)),
        "sum_max_cost_after": sum(s["max_cost_after"] for s in _timed(stats)),
        "loss_first": _mean([x["loss"] for x in steps[0]]),
        "loss_last": _mean([x["loss"] for x in steps[-1]]),
        "chrome": [p["chrome"] for p in per_rank],
    }


def build_report(
    spec: dict[str, Any], num_ranks: int, results: Sequence[dict[str, Any]], *, wall_s: float
) -> dict[str, Any]:
    """One plain-data document from every rank's result (``results[rank]``)."""
    runs = {run: _run_summary(run, results) for run in _RUNS}
    off, on = runs["unbalanced"], runs["balanced"]
    predicted = (
        on["sum_max_cost_before"] / on["sum_max_cost_after"] if on["sum_max_cost_after"] else 1.0
    )
    summary = {
        "compute_per_rank_before_s": off["compute_per_rank_s"],
        "compute_per_rank_after_s": on["compute_per_rank_s"],
        "imbalance_before": off["imbalance"],
        "imbalance_after": on["imbalance"],
        "predicted_imbalance_before": off["predicted_imbalance"],
        "predicted_imbalance_after": on["predicted_imbalance"],
        "samples_moved": on["samples_moved"],
        "samples": on["samples"],
        "plans_accepted": on["plans_accepted"],
        "data_stall_fraction_before": off["data_stall_fraction"],
        "data_stall_fraction_after": on["data_stall_fraction"],
        "step_time_before_s": off["step_time_s"],
        "step_time_after_s": on["step_time_s"],
        "speedup": off["step_time_s"] / on["step_time_s"] if on["step_time_s"] > 0 else 0.0,
        "predicted_speedup": predicted,
        "loss_first": on["loss_first"],
        "loss_last": on["loss_last"],
    }
    return {
        "command": "demo",
        "config": {
            "ranks": num_ranks,
            "steps": spec["steps"],
            "data": spec["data"],
            "distribution": spec["distribution"] if spec["data"] == "synthetic" else None,
            "seq_len": spec["seq_len"],
            "bins_per_rank": spec["bins_per_rank"],
            "algorithm": spec["algorithm"],
            "cost_model": results[0]["cost_model"],
            "model": {
                "hidden_size": spec["hidden_size"],
                "layers": spec["layers"],
                "heads": spec["heads"],
                "parameters": results[0]["parameters"],
            },
            "threads_per_rank": spec["threads_per_rank"],
            "seed": spec["seed"],
        },
        "summary": summary,
        "runs": runs,
        "files": {},
        "wall_s": wall_s,
    }


# -- files --------------------------------------------------------------------------------------


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """Merge traces, draw the plot and write ``report.json``; records paths in ``report``."""

    files: dict[str, Any] = report["files"]
    for run, name in (("balanced", "trace.json"), ("unbalanced", "trace-unbalanced.json")):
        paths = [p for p in report["runs"][run]["chrome"] if p]
        if paths:
            files[f"trace_{run}"] = str(merge_chrome_traces(paths, out / name))
    files["trace"] = files.get("trace_balanced")
    files["plot"], files["plot_skipped"] = _write_plot(report, out / "demo.png")
    files["report"] = str(out / "report.json")
    Path(files["report"]).write_text(json.dumps(report, indent=1), encoding="utf-8")


def _timeline(trace: str) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """``(rank, stage) -> [(start_s, duration_s)]`` from a merged Chrome trace."""
    document = json.loads(Path(trace).read_text(encoding="utf-8"))
    names: dict[tuple[int, int], str] = {}
    spans: list[tuple[int, int, float, float]] = []
    for event in document["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[(event["pid"], event["tid"])] = event["args"]["name"]
        elif event.get("ph") == "X":
            spans.append((event["pid"], event["tid"], event["ts"] * 1e-6, event["dur"] * 1e-6))
    origin = min((s[2] for s in spans), default=0.0)
    lanes: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for pid, tid, start, duration in spans:
        stage = names.get((pid, tid), str(tid))
        if stage not in _HIDDEN_STAGES:
            lanes.setdefault((pid, stage), []).append((start - origin, duration))
    return lanes


def _write_plot(report: dict[str, Any], path: Path) -> tuple[str | None, str | None]:
    """Draw ``path``; returns ``(path, None)`` or ``(None, why it was skipped)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'evenflow[bench]')"
    runs = report["runs"]
    num_ranks = report["config"]["ranks"]
    fig, (bars, timeline) = plt.subplots(
        2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    width = 0.38
    colors = {"unbalanced": "#d62728", "balanced": "#2ca02c"}
    for i, run in enumerate(_RUNS):
        values = runs[run]["compute_per_rank_s"]
        xs = [r + (i - 0.5) * width for r in range(num_ranks)]
        bars.bar(
            xs,
            values,
            width,
            color=colors[run],
            alpha=0.8,
            label=f"compute per rank, {_RUN_LABELS[run]}",
        )
        bars.axhline(
            runs[run]["step_time_s"],
            color=colors[run],
            linestyle="--",
            linewidth=1.2,
            label=f"step time, {_RUN_LABELS[run]} ({runs[run]['step_time_s']:.3f} s)",
        )
    bars.set_xticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    bars.set_ylabel("seconds per step (mean)")
    bars.set_title("Forward+backward time per rank; every rank waits for the slowest (dashed)")
    bars.legend(fontsize=8, loc="lower center", ncol=2, framealpha=0.9)
    trace = report["files"].get("trace_balanced")
    if trace:
        lanes = _timeline(trace)
        ranks = sorted({rank for rank, _ in lanes})[:_MAX_TIMELINE_RANKS]
        known = [s for s in _STAGE_ORDER if any((r, s) in lanes for r in ranks)]
        extra = sorted({s for _, s in lanes} - set(known) - _HIDDEN_STAGES)
        stages = known + extra
        cmap = plt.get_cmap("tab20")
        labels: list[str] = []
        y = 0
        for rank in ranks:
            for k, stage in enumerate(stages):
                intervals = lanes.get((rank, stage))
                if intervals:
                    timeline.broken_barh(intervals, (y - 0.4, 0.8), color=cmap(k % 20))
                    labels.append(f"r{rank} {stage}")
                    y += 1
        timeline.set_yticks(range(len(labels)), labels, fontsize=7)
        timeline.invert_yaxis()
        timeline.set_xlabel("seconds since the balanced run's first span")
        shown = "" if len(ranks) == num_ranks else f" (ranks 0-{len(ranks) - 1} of {num_ranks})"
        timeline.set_title(f"Per-stage timeline of the balanced run{shown}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path), None


# -- text ---------------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report: every figure with one line saying what it means."""
    c, s, runs, files = report["config"], report["summary"], report["runs"], report["files"]
    data = (
        f"{c['distribution']} lengths scaled to seq_len {c['seq_len']}"
        if c["data"] == "synthetic"
        else f"Python standard library source as bytes, seq_len {c['seq_len']}"
    )
    model = c["model"]
    lines = [
        f"evenflow demo: {c['ranks']} ranks x {runs['balanced']['num_steps']} steps x "
        f"{c['bins_per_rank']} packed sequences per rank; {data}",
        f"model: causal transformer, {model['layers']} layers x {model['hidden_size']} wide, "
        f"{model['parameters'] / 1e6:.2f}M parameters; algorithm {c['algorithm']}; cost model "
        f"{c['cost_model']['name']} ({c['cost_model']['formula']})",
        f"averages over steps 1-{runs['balanced']['num_steps'] - 1} (step 0 fills the pipeline)",
        "",
        f"{'':34}{'balancing off':>14}{'balanced':>11}",
    ]

    def row(label: str, before: str, after: str, meaning: str) -> None:
        lines.append(f"{label:<34}{before:>14}{after:>11}   {meaning}")

    for rank, (b, a) in enumerate(
        zip(s["compute_per_rank_before_s"], s["compute_per_rank_after_s"], strict=True)
    ):
        row(
            f"compute, rank {rank} (s/step)",
            f"{b:.3f}",
            f"{a:.3f}",
            "forward+backward time of this rank's packed sequences" if rank == 0 else "",
        )
    row(
        "max/mean imbalance (measured)",
        f"{s['imbalance_before']:.2f}",
        f"{s['imbalance_after']:.2f}",
        "slowest rank's compute / average rank's (1.00 = even)",
    )
    row(
        "max/mean imbalance (predicted)",
        f"{s['predicted_imbalance_before']:.2f}",
        f"{s['predicted_imbalance_after']:.2f}",
        "the same ratio from the cost model's costs",
    )
    row(
        "step time (s)",
        f"{s['step_time_before_s']:.3f}",
        f"{s['step_time_after_s']:.3f}",
        "wall time of one training step; all ranks wait for the slowest",
    )
    row(
        "data stall",
        _pct(s["data_stall_fraction_before"]),
        _pct(s["data_stall_fraction_after"]),
        "share of the loop's time spent waiting for the next batch",
    )
    row(
        "throughput (tokens/s, all ranks)",
        f"{runs['unbalanced']['tokens_per_s']:.0f}",
        f"{runs['balanced']['tokens_per_s']:.0f}",
        "tokens trained per second of step time",
    )
    lines.append("")
    lines.append(
        f"speedup: {s['speedup']:.2f}x   balanced step time vs balancing off, measured side by "
        f"side on the same data (the cost model predicted {s['predicted_speedup']:.2f}x)"
    )
    lines.append(
        f"samples moved: {s['samples_moved']} of {s['samples']}   samples the plans sent to "
        f"another rank ({s['plans_accepted']} of {runs['balanced']['num_steps']} plans accepted)"
    )
    lines.append(
        f"loss: {s['loss_first']:.3f} -> {s['loss_last']:.3f}   mean next-token loss, first vs "
        "last balanced step (real training, not a simulation)"
    )
    if files.get("trace"):
        lines.append(
            f"trace: {files['trace']}   open in https://ui.perfetto.dev: one process per rank, "
            "one track per stage (balancing off: "
            f"{Path(files.get('trace_unbalanced') or '').name or 'n/a'})"
        )
    if files.get("plot"):
        lines.append(
            f"plot: {files['plot']}   top: compute per rank before/after and step times; "
            "bottom: per-stage timeline of the balanced run"
        )
    else:
        lines.append(f"plot: skipped, {files.get('plot_skipped')}")
    lines.append(f"report: {files.get('report')}   everything above as JSON")
    lines.append(f"wall time: {report['wall_s']:.1f} s")
    return "\n".join(lines)
