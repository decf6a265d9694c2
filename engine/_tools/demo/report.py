"""The report of ``evenflow demo``: figures from the ranks' results, as JSON, files and text.

:func:`build_report` turns what every rank returned into one plain-data document (the
``--json`` output and ``report.json``); :func:`write_outputs` merges each arm's per-rank Chrome
traces into one Perfetto-loadable file and draws ``demo.png`` (:mod:`.plot`, skipped with a
reason when matplotlib is missing); :func:`format_report` renders the text a person reads,
every figure with what it means.

Averages leave out step 0 of each arm: it pays for filling the pipeline and for the first
touches of the optimizer state, in every arm alike. A *predicted* speedup is the planner's:
the sum over steps of the slowest rank's predicted compute before balancing over the same
sum after (each rank's bins' fixed cost included); a *measured* one divides mean step times.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from evenflow.engine._tools.demo.calibrate import FittedCost
from evenflow.engine._tools.demo.plot import write_plot
from evenflow.engine._tools.demo.rank import ARM_LABELS
from evenflow.engine._tracing import merge_chrome_traces

__all__ = [
    "CALIBRATION_TOLERANCE",
    "CORE_SHARE_WARNING",
    "build_report",
    "format_report",
    "write_outputs",
]

#: Beyond this relative disagreement between the cost model and measured compute, the report
#: says the calibration does not hold.
CALIBRATION_TOLERANCE = 0.2
#: Below this share of CPU time in the ranks' compute (wall clock), the machine is busy with
#: other work and the report says so.
CORE_SHARE_WARNING = 0.9


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _timed(steps: Sequence[Any]) -> Sequence[Any]:
    return steps[1:] if len(steps) > 1 else steps


def _arm_summary(arm: str, results: Sequence[dict[str, Any]], per_bin: float) -> dict[str, Any]:
    per_rank = [r["arms"][arm] for r in results]
    num_ranks = len(per_rank)
    num_steps = min(len(p["steps"]) for p in per_rank)
    if num_steps == 0:
        raise ValueError(f"The {ARM_LABELS[arm]} arm delivered no step; nothing to report.")
    steps = [[p["steps"][s] for p in per_rank] for s in range(num_steps)]
    timed = _timed(steps)
    imbalance = [
        max(x["compute_cpu_s"] for x in row) / _mean([x["compute_cpu_s"] for x in row])
        for row in timed
        if _mean([x["compute_cpu_s"] for x in row]) > 0
    ]
    step_time = [max(x["step_s"] for x in row) for row in timed]
    # The slowest rank's CPU time of compute, step by step: the step time dedicated cores
    # would give (no other process delays a rank), besides the sync and optimizer time.
    cpu_bound = sum(max(x["compute_cpu_s"] for x in row) for row in timed)
    wall = sum(sum(x["compute_s"] for x in row) for row in timed)
    cpu = sum(sum(x["compute_cpu_s"] for x in row) for row in timed)
    stats = _timed(per_rank[0]["stats"])
    bins = len(steps[0][0]["bins"])
    fixed = bins * per_bin  # every rank trains the same number of bins
    before = sum(max(s["cost_before"]) + fixed for s in stats)
    after = sum(max(s["cost_after"]) + fixed for s in stats)
    return {
        "label": ARM_LABELS[arm],
        "num_steps": num_steps,
        "num_timed_steps": len(timed),
        "compute_per_rank_s": [
            _mean([row[r]["compute_s"] for row in timed]) for r in range(num_ranks)
        ],
        "compute_cpu_per_rank_s": [
            _mean([row[r]["compute_cpu_s"] for row in timed]) for r in range(num_ranks)
        ],
        "slowest_cpu_compute_s": cpu_bound,
        "core_share": cpu / wall if wall > 0 else 1.0,
        "sync_per_rank_s": [_mean([row[r]["sync_s"] for row in timed]) for r in range(num_ranks)],
        "imbalance": _mean(imbalance),
        "predicted_imbalance": _mean(
            [max(s["cost_after"]) / _mean(s["cost_after"]) for s in stats if _mean(s["cost_after"])]
        ),
        "predicted_imbalance_before": _mean(
            [
                max(s["cost_before"]) / _mean(s["cost_before"])
                for s in stats
                if _mean(s["cost_before"])
            ]
        ),
        "predicted_speedup": before / after if after > 0 else 1.0,
        "step_time_s": _mean(step_time),
        "step_times_s": [max(x["step_s"] for x in row) for row in steps],
        "tokens_per_s": sum(sum(x["tokens"] for x in row) for row in timed) / sum(step_time)
        if sum(step_time) > 0
        else 0.0,
        "data_stall_fraction": sum(sum(x["wait_s"] for x in row) for row in timed)
        / max(sum(sum(x["step_s"] for x in row) for row in timed), 1e-12),
        "samples": sum(sum(x["samples"] for x in row) for row in steps),
        "samples_moved": sum(s["num_moved"] for s in per_rank[0]["stats"]),
        "plans_accepted": sum(1 for s in per_rank[0]["stats"] if s["accepted"]),
        "losses": [row[0]["loss"] for row in steps],
        "timeline": [
            [
                {
                    k: row[r][k]
                    for k in (
                        "start_unix",
                        "wait_s",
                        "compute_s",
                        "sync_s",
                        "optimizer_s",
                    )
                }
                for row in steps
            ]
            for r in range(num_ranks)
        ],
        "chrome": [p["chrome"] for p in per_rank],
    }


def _calibration_check(
    arms: Sequence[str], results: Sequence[dict[str, Any]], cost: dict[str, Any]
) -> dict[str, Any] | None:
    """Measured bin compute against the fitted model's prediction, over every timed bin."""
    coefficients = cost.get("coefficients")
    if not coefficients:
        return None
    model = FittedCost(**coefficients)
    measured, predicted, ratios = 0.0, 0.0, []
    for result in results:
        for arm in arms:
            for step in _timed(result["arms"][arm]["steps"]):
                for lengths, seconds in step["bins"]:
                    guess = model.bin_seconds(lengths)
                    measured += seconds
                    predicted += guess
                    if guess > 0:
                        ratios.append(seconds / guess)
    if predicted <= 0 or not ratios:
        return None
    ratio = measured / predicted
    spread = statistics.median(abs(r / ratio - 1.0) for r in ratios)
    return {
        "measured_over_predicted": ratio,
        "median_bin_error": spread,
        "bins": len(ratios),
        "holds": abs(ratio - 1.0) <= CALIBRATION_TOLERANCE,
    }


def _refit(arms: Sequence[str], results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Re-calibrate on the sequences training measured, and predict every arm again with it.

    The model fitted at start-up decided the plans; this one is fitted afterwards to every
    timed packed sequence of every arm, so it saw the machine exactly as training did. Each
    arm's prediction then takes, step by step, the slowest rank's sum of re-fitted bin costs
    over the bins that rank really trained (the source's layout with balancing off, the
    plan's otherwise).
    """
    lengths, seconds = [], []
    for result in results:
        for arm in arms:
            for step in _timed(result["arms"][arm]["steps"]):
                for bin_lengths, bin_seconds in step["bins"]:
                    lengths.append(bin_lengths)
                    seconds.append(bin_seconds)
    if len(lengths) < 8 or min(seconds, default=0.0) <= 0:
        return None
    fitted = FittedCost.fit(lengths, seconds)
    slowest = {}
    for arm in arms:
        per_rank = [_timed(r["arms"][arm]["steps"]) for r in results]
        slowest[arm] = sum(
            max(
                sum(fitted.bin_seconds(b) for b, _ in rank_steps[s]["bins"])
                for rank_steps in per_rank
            )
            for s in range(min(len(p) for p in per_rank))
        )
    return {
        "formula": fitted.describe(),
        "coefficients": fitted.as_dict(),
        "predicted_speedup": {
            arm: slowest["off"] / slowest[arm] if slowest[arm] > 0 else 1.0 for arm in arms
        },
    }


def build_report(
    spec: dict[str, Any], num_ranks: int, results: Sequence[dict[str, Any]], *, wall_s: float
) -> dict[str, Any]:
    """One plain-data document from every rank's result (``results[rank]``)."""
    cost = results[0]["cost_model"]
    per_bin = float(cost.get("coefficients", {}).get("per_bin", 0.0))
    names = list(spec["arms"])
    arms = {name: _arm_summary(name, results, per_bin) for name in names}
    off = arms["off"]
    for name, arm in arms.items():
        arm["speedup"] = off["step_time_s"] / arm["step_time_s"] if arm["step_time_s"] else 0.0
        cpu = arm["slowest_cpu_compute_s"]
        arm["cpu_speedup"] = off["slowest_cpu_compute_s"] / cpu if cpu > 0 else 0.0
        if name == "off":
            arm["predicted_speedup"] = 1.0
    check = _calibration_check(names, results, cost)
    refit = _refit(names, results) if check is not None else None
    if refit is not None:
        for name, arm in arms.items():
            arm["refit_predicted_speedup"] = refit["predicted_speedup"][name]
    warnings = []
    share = _mean([arm["core_share"] for arm in arms.values()])
    if share < CORE_SHARE_WARNING:
        warnings.append(
            f"the ranks ran only {share:.0%} of the time they spent computing: other processes "
            "share these cores, so step times (wall clock) are noisy and the measured speedup "
            "understates balancing; the CPU-time speedup is what dedicated cores would see."
        )
    if check is not None and not check["holds"]:
        warnings.append(
            f"measured compute was {check['measured_over_predicted']:.2f}x what the cost model "
            f"predicted (more than {CALIBRATION_TOLERANCE:.0%} off): the machine ran at another "
            "speed while training than while calibrating (other jobs?), so the predicted "
            "figures are less reliable than usual."
        )
    return {
        "command": "demo",
        "config": {
            "ranks": num_ranks,
            "cores": spec["cores"],
            "threads_per_rank": spec["threads_per_rank"],
            "thread_nice": spec.get("thread_nice", 0),
            "steps": spec["steps"],
            "seq_len": spec["seq_len"],
            "bins_per_rank": spec["bins_per_rank"],
            "window": spec["window"] if "window" in names else None,
            "arms": names,
            "algorithm": spec["algorithm"],
            "data": {
                "name": "the Python standard library's sources, one function or class a "
                "document, bytes as tokens",
                "documents": results[0]["documents"],
            },
            "cost_model": cost,
            "model": {
                "hidden_size": spec["hidden_size"],
                "layers": spec["layers"],
                "heads": spec["heads"],
                "parameters": results[0]["parameters"],
            },
            "lr": spec["lr"],
            "seed": spec["seed"],
        },
        "arms": arms,
        "calibration_check": check,
        "refit": refit,
        "warnings": warnings,
        "files": {},
        "wall_s": wall_s,
    }


def write_outputs(report: dict[str, Any], out: Path) -> None:
    """Merge traces, draw the plot and write ``report.json``; records the paths in ``report``."""
    files: dict[str, Any] = report["files"]
    for name, arm in report["arms"].items():
        paths = [p for p in arm["chrome"] if p]
        if paths:
            files[f"trace_{name}"] = str(merge_chrome_traces(paths, out / f"trace-{name}.json"))
    files["plot"], files["plot_skipped"] = write_plot(report, out / "demo.png")
    files["report"] = str(out / "report.json")
    Path(files["report"]).write_text(json.dumps(report, indent=1), encoding="utf-8")


# -- text ---------------------------------------------------------------------------------------


#: Rows of the per-arm table: label, how an arm's record shows, what it means.
_ARM_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str], str], ...] = (
    (
        "share of cores",
        lambda a: f"{a['core_share'] * 100:.0f}%",
        "CPU time / wall time of compute (100% = the ranks had their cores)",
    ),
    (
        "imbalance, measured",
        lambda a: f"{a['imbalance']:.2f}",
        "slowest rank's compute / average rank's, step by step (1.00 = even)",
    ),
    (
        "imbalance, predicted",
        lambda a: f"{a['predicted_imbalance']:.2f}",
        "the same ratio from the cost model",
    ),
    (
        "data stall",
        lambda a: f"{a['data_stall_fraction'] * 100:.1f}%",
        "share of step time spent waiting for the next batch",
    ),
    (
        "samples moved",
        lambda a: f"{a['samples_moved']} of {a['samples']}",
        "samples the plans sent to another rank",
    ),
    (
        "loss, first -> last step",
        lambda a: f"{a['losses'][0]:.2f} -> {a['losses'][-1]:.2f}",
        "mean next-token loss over the world's tokens",
    ),
)


def _times(key: str) -> Callable[[dict[str, Any]], str | None]:
    """An arm's speedup ``key`` as ``1.23x``; None where the record has none."""
    return lambda a: f"{a[key]:.2f}x" if key in a else None


#: The speedup rows; a row shows only when every arm has its figure.
_SPEEDUP_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str | None], str], ...] = (
    (
        "speedup, measured",
        _times("speedup"),
        "step time of balancing off / this arm's (wall clock)",
    ),
    (
        "speedup, predicted",
        _times("predicted_speedup"),
        "by the cost model the plans used (fitted at start-up)",
    ),
    (
        "speedup, re-predicted",
        _times("refit_predicted_speedup"),
        "by that model re-fitted to the sequences training timed",
    ),
    (
        "speedup, CPU time",
        _times("cpu_speedup"),
        "of the slowest rank's compute: what dedicated cores would see",
    ),
)


def format_report(report: dict[str, Any]) -> str:
    """The text a person reads: what ran, what balancing changed, and where the files are."""
    c, arms, files = report["config"], report["arms"], report["files"]
    names = list(arms)
    off = arms["off"]
    model, cost = c["model"], c["cost_model"]
    lines = [
        f"evenflow demo: {c['ranks']} ranks ({c['cores']} CPU cores, {c['threads_per_rank']} "
        f"thread(s) a rank) x {off['num_steps']} steps x {c['bins_per_rank']} packed sequences "
        f"of up to {c['seq_len']:,} tokens per rank",
        f"data: {c['data']['documents']:,} documents of {c['data']['name']}; DatasetSource "
        "shuffles them and packs each rank's steps first-fit",
        f"model: causal transformer, {model['layers']} layers x {model['hidden_size']} wide, "
        f"{model['parameters'] / 1e6:.2f}M parameters, attention within each sample; loss = "
        "summed token loss / the world's loss tokens",
        f"cost model: {cost['name']}: {cost['formula']}"
        + (f" (timed in {cost['calibration_s']:.1f} s)" if "calibration_s" in cost else ""),
        "arms: "
        + ", ".join(arms[n]["label"] for n in names)
        + (f" ({c['window']} steps planned together)" if c.get("window") else "")
        + "; the same steps from the same weights, one step of each arm in turn"
        + (
            f"; the loaders' threads run at lower priority (thread_nice={c['thread_nice']}), so "
            "the training step gets the cores first"
            if c.get("thread_nice")
            else ""
        ),
        f"averages over steps 1-{off['num_steps'] - 1} (step 0 fills the pipeline)",
        "",
        f"{'':32}" + "".join(f"{arms[n]['label']:>20}" for n in names),
    ]

    def row(label: str, values: Sequence[str], meaning: str = "") -> None:
        lines.append(f"{label:<32}" + "".join(f"{v:>20}" for v in values) + f"   {meaning}")

    def by_arm(label: str, form: Callable[[dict[str, Any]], str], meaning: str) -> None:
        row(label, [form(arms[n]) for n in names], meaning)

    by_arm(
        "step time (s)",
        lambda a: f"{a['step_time_s']:.3f}",
        "one training step; every rank waits for the slowest",
    )
    for r in range(c["ranks"]):
        row(
            f"compute, rank {r} (CPU s/step)",
            [f"{arms[n]['compute_cpu_per_rank_s'][r]:.3f}" for n in names],
            "forward+backward of this rank's packed sequences" if r == 0 else "",
        )
    for label, form, meaning in _ARM_ROWS:
        by_arm(label, form, meaning)
    lines.append("")
    for label, speedup, meaning in _SPEEDUP_ROWS:
        shown = [speedup(arms[n]) for n in names]
        if None not in shown:
            row(label, [str(v) for v in shown], meaning)
    lines.append("")
    for name in names[1:]:
        arm = arms[name]
        lines.append(
            f"{arm['label']}: steps {arm['speedup']:.2f}x as fast as with balancing off, "
            f"measured side by side ({arm['predicted_speedup']:.2f}x predicted)"
        )
    window = (
        "; a window may also move a sample to another step of its window, so that arm's losses "
        "differ step by step"
        if "window" in arms
        else ""
    )
    lines.append(
        f"loss: {off['losses'][0]:.2f} -> {off['losses'][-1]:.2f} in {off['num_steps']} steps "
        f"(random guessing over 256 bytes: 5.55); every arm trains the same samples, so their "
        f"losses agree: balancing changes where a sample trains, not what the model learns{window}"
    )
    check = report.get("calibration_check")
    if check is not None:
        verdict = "holds" if check["holds"] else "does NOT hold"
        lines.append(
            f"calibration {verdict}: measured compute was {check['measured_over_predicted']:.2f}x "
            f"the cost model's prediction over {check['bins']:,} packed sequences (median "
            f"error of one sequence {check['median_bin_error'] * 100:.0f}%)"
        )
    if report.get("refit"):
        lines.append(
            "re-calibrated on the sequences training timed: "
            f"{report['refit']['formula']}; the re-prediction applies it to the bins each rank "
            "really trained"
        )
    for warning in report.get("warnings", []):
        lines.append(f"warning: {warning}")
    lines.append("")
    lines.append("files:")
    for name in names:
        trace = files.get(f"trace_{name}")
        if trace:
            lines.append(f"  {trace}   Perfetto trace of {arms[name]['label']} (ui.perfetto.dev)")
    if files.get("plot"):
        lines.append(
            f"  {files['plot']}   plot: compute per rank and step time per arm; who waits, step "
            "by step"
        )
    else:
        lines.append(f"  plot skipped: {files.get('plot_skipped')}")
    lines.append(f"  {files.get('report')}   everything above as JSON")
    lines.append(f"wall time: {report['wall_s']:.1f} s")
    return "\n".join(lines)
