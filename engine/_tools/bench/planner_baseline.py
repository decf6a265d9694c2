"""The planner benchmark side by side with another build (``--baseline PYTHON``).

The other build plans the same steps in its own interpreter (a subprocess that reads the
sweep's cases as JSON and writes per step its makespan, movement and CPU time), so both
builds' CPU times are measured in one run, on the same machine state.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from evenflow.engine._planning import schedule
from evenflow.engine._tools.bench.planner_cases import _TOLERANCE, _Case, _quantiles
from evenflow.engine.errors import ConfigError

__all__ = ["_compare", "_run_baseline"]

# Runs under the other build's interpreter: plans the sweep's steps with its "default"
# algorithm and prints, per case, [makespan, samples moved, tokens moved, CPU ms] per step.
# It uses only what every build of the planner has (Planner, QuadraticCost, make_step).
_BASELINE_SCRIPT = """
import json, sys, time
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.planner import Planner
from evenflow.engine.workloads import make_step
spec = json.load(sys.stdin)
out = []
for dist, packer, ranks, bins, seq_len, linear, steps in spec["cases"]:
    planner = Planner(num_ranks=ranks, bins_per_rank=bins, seq_len=seq_len,
                      cost_model=QuadraticCost(linear=linear, quadratic=1.0))
    rows = []
    for step in range(steps):
        samples, reference = make_step(dist, packer, num_ranks=ranks, bins_per_rank=bins,
                                       seq_len=seq_len, seed=spec["seed"], step=step)
        tokens = {(k.source_rank, k.index): m.tokens for k, m in samples}
        cpu_ms = float("inf")
        for _ in range(spec.get("repeat", 1)):
            start = time.process_time()
            plan = planner.plan(samples, reference, step)
            cpu_ms = min(cpu_ms, (time.process_time() - start) * 1e3)
        moved = moved_tokens = 0
        for rank, rank_bins in enumerate(plan.local_batches):
            for b in rank_bins:
                for key in b.sample_keys:
                    if key.source_rank != rank:
                        moved += 1
                        moved_tokens += tokens[(key.source_rank, key.index)]
        rows.append([max(plan.rank_costs), moved, moved_tokens, cpu_ms])
    out.append(rows)
json.dump(out, sys.stdout)
"""


def _run_baseline(
    python: str, cases: list[_Case], seed: int, *, repeat: int = 1
) -> list[list[list[float]]]:
    """Per case and step, what the build behind ``python`` plans (see ``_BASELINE_SCRIPT``),
    each step planned ``repeat`` times for its least CPU time."""
    spec = {
        "seed": seed,
        "repeat": repeat,
        "cases": [
            [
                c.distribution,
                c.packer,
                c.num_ranks,
                c.bins_per_rank,
                c.seq_len,
                c.linear,
                c.num_steps,
            ]
            for c in cases
        ],
    }
    try:
        done = subprocess.run(
            [python, "-c", _BASELINE_SCRIPT],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise ConfigError(f"--baseline {python!r} could not be run: {exc}") from exc
    if done.returncode != 0:
        raise ConfigError(
            f"--baseline {python!r} failed (exit {done.returncode}); it must be a Python "
            f"with another build of evenflow installed: {done.stderr.strip()[-400:]}"
        )
    rows: list[list[list[float]]] = json.loads(done.stdout)
    return rows


def _compare(cases: list[_Case], baseline: list[list[list[float]]]) -> dict[str, Any]:
    """Per shape and packer: the baseline's and this build's movement and makespans, and the
    steps on which this build's ``default`` has a larger makespan than the baseline's."""
    groups: dict[tuple[str, str, int, int], dict[str, list[float]]] = {}
    worse = better = beyond_tie = 0
    most_worse = 0.0
    for case, rows in zip(cases, baseline, strict=True):
        group = groups.setdefault(
            (case.distribution, case.packer, case.num_ranks, case.bins_per_rank),
            {k: [] for k in ("base_moved", "moved", "base_ratio", "ratio", "base_ms", "ms")},
        )
        record = case.algos["default"]
        for k, (makespan, moved, _, cpu_ms) in enumerate(rows):
            n = case.num_samples[k]
            lower_bound = record.objectives[k] / record.ratios[k]
            group["base_moved"].append(moved / n)
            group["moved"].append(record.moved[k])
            group["base_ratio"].append(makespan / lower_bound)
            group["ratio"].append(record.ratios[k])
            group["base_ms"].append(cpu_ms)
            group["ms"].append(record.plan_cpu_ms[k])
            worse += record.objectives[k] > makespan * (1 + _TOLERANCE)
            better += record.objectives[k] < makespan * (1 - _TOLERANCE)
            # Within schedule.TIE the default prefers the layout that moves fewer samples.
            beyond_tie += record.objectives[k] > makespan * (1 + schedule.TIE)
            if makespan > 0:
                most_worse = max(most_worse, record.objectives[k] / makespan - 1.0)
    shapes = []
    for (dist, packer, ranks, bins), values in sorted(groups.items()):
        shapes.append(
            {
                "distribution": dist,
                "packer": packer,
                "num_ranks": ranks,
                "bins_per_rank": bins,
                "steps": len(values["moved"]),
                **{
                    name: _quantiles(series, "p50", "p90", "p99") for name, series in values.items()
                },
            }
        )
    return {
        "steps_worse_than_baseline": worse,
        "steps_worse_beyond_tie": beyond_tie,
        "steps_better_than_baseline": better,
        "most_worse": most_worse,
        "shapes": shapes,
    }
