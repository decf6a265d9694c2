"""``evenflow bench planner --window W ...``: what planning W steps together buys.

For each mix (``sft``, ``longctx`` and ``stress``: 99% short samples, 1% long), shape (8 and
64 ranks x 1, 2 and 4 bins), cost model (``a·L + L²`` and the FLOPs of a Llama-3-8B-shaped
model) and objective (``makespan``; ``lockstep`` with ``--objectives``), the same run of steps
is planned with every window size ``W`` (windows of ``W`` consecutive steps, as the loader
would) and reported side by side:

* ``cost/lb``: the sum over steps of the planned step cost divided by the sum of per-step lower
  bounds (each read step's bound for its own samples: what ``W = 1`` can reach at best; a
  window can go below 1.0 by moving long samples together);
* ``excess p50/p90``: per delivered step, ``cost / lower bound - 1``;
* ``outlier``: the fraction of delivered steps whose costliest sample costs more than the mean
  rank (no per-step plan can balance them);
* ``delay mean/max``: ``|delivered - read|`` of the samples, in steps (always ``< W``);
* ``ms/step``: planning time per step (process CPU time, so other processes on the machine
  count less), and its ratio to ``W = 1``.

Targets: on ``longctx`` at 8 ranks x 2 bins (``a·L + L²``, makespan) ``W = 4`` removes at least
50% of ``W = 1``'s total excess over the per-step lower bounds with a mean delay of at most 1.5
steps; planning time per step at ``W = 4`` is at most 4x ``W = 1``'s, judged on ``longctx``
at 2 bins per rank, at 8 and at 64 ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evenflow.engine._planning.columns import StepColumns, columns_of_samples
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.flops import FlopsCost
from evenflow.engine._planning.planner import Planner
from evenflow.engine._planning.window import plan_window
from evenflow.engine.workloads import LONGCTX, SFT, LengthMixture, LogNormal, LogUniform, make_step

__all__ = ["STRESS", "WINDOW_MIXES", "run_window"]

STRESS = LengthMixture(
    name="stress",
    components=(LogNormal(0.99, median=1000, sigma=0.9), LogUniform(0.01, low=24576, high=65536)),
    default_seq_len=65536,
)
"""Stress long-context mix: 99% short (median 1,000 tokens), 1% long (24k-64k), seq_len 64k."""

WINDOW_MIXES: dict[str, LengthMixture] = {"sft": SFT, "longctx": LONGCTX, "stress": STRESS}
_WINDOWS = (1, 2, 4, 8)
_RANKS = (8, 64)
_BINS = (1, 2, 4)
_LINEAR = 4096.0
# Llama-3-8B's shape: what the FLOPs cost model reads.
_LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
}
_COSTS = ("quadratic", "flops")
_TARGET = {"mix": "longctx", "num_ranks": 8, "bins_per_rank": 2, "cost": "quadratic"}
_TARGET_EXCESS_REMOVED = 0.5
_TARGET_MEAN_DELAY = 1.5
_TARGET_TIME_RATIO = 4.0


def _steps_for(num_ranks: int) -> int:
    return 32 if num_ranks <= 8 else 16


def _cost_model(name: str) -> Any:
    return QuadraticCost(linear=_LINEAR) if name == "quadratic" else FlopsCost(_LLAMA3_8B)


@dataclass(slots=True)
class _Row:
    """One (case, W): the figures of the window benchmark."""

    cost: float = 0.0
    bound: float = 0.0
    excess: list[float] = field(default_factory=list)
    outliers: int = 0
    steps: int = 0
    delay_sum: int = 0
    delay_count: int = 0
    delay_max: int = 0
    cpu_s: float = 0.0
    accepted: int = 0
    windows: int = 0


def _columns(mix: LengthMixture, planner: Planner, num_steps: int, seed: int) -> list[StepColumns]:
    out = []
    for step in range(num_steps):
        samples, reference = make_step(
            mix,
            "firstfit",
            num_ranks=planner.num_ranks,
            bins_per_rank=planner.bins_per_rank,
            seq_len=mix.default_seq_len,
            seed=seed,
            step=step,
        )
        columns, _ = columns_of_samples(
            samples,
            reference,
            num_ranks=planner.num_ranks,
            bins_per_rank=planner.bins_per_rank,
            constraints=planner.constraints,
        )
        out.append(columns)
    return out


def _run_case(planner: Planner, columns: list[StepColumns], window: int) -> _Row:
    row = _Row()
    for first in range(0, len(columns) - window + 1, window):
        start = time.process_time()
        result = plan_window(planner, columns[first : first + window], first)
        row.cpu_s += time.process_time() - start
        row.windows += 1
        row.accepted += result.decision.accepted
        for s in range(result.num_steps):
            bound = result.step_lower_bounds[s]
            row.cost += result.step_costs[s]
            row.bound += bound
            row.excess.append(result.step_costs[s] / bound - 1.0 if bound > 0 else 0.0)
            row.outliers += result.outlier_bound[s]
            row.steps += 1
            delays = np.abs(result.delays[s])
            row.delay_sum += int(delays.sum())
            row.delay_count += int(delays.size)
            row.delay_max = max(row.delay_max, int(delays.max(initial=0)))
    return row


def _row_json(row: _Row) -> dict[str, Any]:
    excess = np.asarray(row.excess)
    return {
        "cost_over_bound": row.cost / row.bound if row.bound else None,
        "total_excess": row.cost - row.bound,
        "excess_p50": float(np.percentile(excess, 50)),
        "excess_p90": float(np.percentile(excess, 90)),
        "outlier_fraction": row.outliers / row.steps,
        "mean_delay": row.delay_sum / row.delay_count if row.delay_count else 0.0,
        "max_delay": row.delay_max,
        "ms_per_step": 1e3 * row.cpu_s / row.steps,
        "windows": row.windows,
        "windows_accepted": row.accepted,
        "steps": row.steps,
    }


def run_window(
    *,
    windows: Sequence[int] | None,
    ranks: Sequence[int] | None,
    bins: Sequence[int] | None,
    mixes: Sequence[str] | None,
    costs: Sequence[str] | None,
    objectives: Sequence[str],
    steps: int | None,
    seed: int,
    quick: bool,
) -> dict[str, Any]:
    """Run the sweep; the JSON document (cases, targets) :func:`print_window` prints."""
    windows = tuple(windows or ((1, 4) if quick else _WINDOWS))
    ranks = tuple(ranks or ((8,) if quick else _RANKS))
    bins = tuple(bins or ((2,) if quick else _BINS))
    mixes = tuple(mixes or (("longctx",) if quick else tuple(WINDOW_MIXES)))
    costs = tuple(costs or (("quadratic",) if quick else _COSTS))
    cases: list[dict[str, Any]] = []
    started = time.perf_counter()
    for mix_name in mixes:
        mix = WINDOW_MIXES[mix_name]
        for num_ranks in ranks:
            for per in bins:
                num_steps = steps or (8 if quick else _steps_for(num_ranks))
                for cost in costs:
                    for objective in objectives:
                        planner = Planner(
                            num_ranks=num_ranks,
                            bins_per_rank=per,
                            seq_len=mix.default_seq_len,
                            cost_model=_cost_model(cost),
                            objective=objective,
                        )
                        columns = _columns(mix, planner, num_steps, seed)
                        plan_window(planner, columns[:1], 0)  # untimed warm-up
                        rows = {w: _row_json(_run_case(planner, columns, w)) for w in windows}
                        cases.append(
                            {
                                "mix": mix_name,
                                "num_ranks": num_ranks,
                                "bins_per_rank": per,
                                "seq_len": mix.default_seq_len,
                                "cost": cost,
                                "objective": objective,
                                "num_steps": num_steps,
                                "windows": rows,
                            }
                        )
    return {
        "benchmark": "planner --window",
        "config": {
            "windows": list(windows),
            "ranks": list(ranks),
            "bins": list(bins),
            "mixes": list(mixes),
            "costs": list(costs),
            "objectives": list(objectives),
            "seed": seed,
            "linear": _LINEAR,
            "flops_model": _LLAMA3_8B,
        },
        "cases": cases,
        "targets": _targets(cases),
        "wall_s": time.perf_counter() - started,
    }


def _find(cases: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    for case in cases:
        if all(case.get(k) == v for k, v in want.items()):
            return case
    return None


def _targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    case = _find(cases, objective="makespan", **_TARGET)
    name = "W=4 removes >= 50% of W=1's excess, mean delay <= 1.5 (longctx, 8 x 2)"
    if case is None or not {1, 4} <= set(case["windows"]):
        out.append({"name": name, "status": "NOT RUN"})
    else:
        one, four = case["windows"][1], case["windows"][4]
        removed = (
            (one["total_excess"] - four["total_excess"]) / one["total_excess"]
            if one["total_excess"] > 0
            else None
        )
        ok = (
            removed is not None
            and removed >= _TARGET_EXCESS_REMOVED
            and four["mean_delay"] <= _TARGET_MEAN_DELAY
        )
        out.append(
            {
                "name": name,
                "excess_removed": removed,
                "mean_delay": four["mean_delay"],
                "status": "PASS" if ok else "MISS",
            }
        )
    for num_ranks in _RANKS:
        name = f"W=4 planning time per step <= 4x W=1's (longctx, {num_ranks} x 2)"
        case = _find(
            cases,
            mix="longctx",
            num_ranks=num_ranks,
            bins_per_rank=2,
            cost="quadratic",
            objective="makespan",
        )
        if case is None or not {1, 4} <= set(case["windows"]):
            out.append({"name": name, "status": "NOT RUN"})
            continue
        ratio = case["windows"][4]["ms_per_step"] / case["windows"][1]["ms_per_step"]
        out.append(
            {
                "name": name,
                "ratio": ratio,
                "status": "PASS" if ratio <= _TARGET_TIME_RATIO else "MISS",
            }
        )
    return out


def print_window(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(
        f"evenflow planner window benchmark: W in {cfg['windows']}, ranks {cfg['ranks']}, "
        f"bins {cfg['bins']}, costs {cfg['costs']} (a*L+L^2 with a={cfg['linear']:g}; FLOPs of "
        f"a Llama-3-8B shape), objectives {cfg['objectives']}, seed {cfg['seed']}"
    )
    print("cost/lb: sum of step costs / sum of per-step lower bounds; excess per step p50/p90;")
    print("outlier: share of outlier-bound steps; delay |delivered - read| in steps; CPU ms/step")
    header = (
        f"{'mix':<9}{'obj':<9}{'cost':<10}{'ranks':>5}{'bins':>5}{'W':>3}  {'cost/lb':>8}"
        f"  {'excess p50/p90':<16}{'outlier':>8}  {'delay':<10}{'ms/step':>8}{'x W=1':>7}"
        f"{'joint':>7}"
    )
    print(header)
    print("-" * len(header))
    for case in doc["cases"]:
        base = case["windows"].get(1)
        for w, row in case["windows"].items():
            ratio = row["ms_per_step"] / base["ms_per_step"] if base else float("nan")
            print(
                f"{case['mix']:<9}{case['objective']:<9}{case['cost']:<10}"
                f"{case['num_ranks']:>5}{case['bins_per_rank']:>5}{w:>3}  "
                f"{row['cost_over_bound']:>8.4f}  "
                f"{row['excess_p50']:>+7.3f}/{row['excess_p90']:<+8.3f}"
                f"{row['outlier_fraction']:>8.0%}  "
                f"{row['mean_delay']:.2f}/{row['max_delay']:<5d}"
                f"{row['ms_per_step']:>8.2f}{ratio:>7.2f}"
                f"{row['windows_accepted']:>4}/{row['windows']:<3}"
            )
    for target in doc["targets"]:
        detail = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in target.items()
            if k not in ("name", "status")
        )
        print(f"target {target['name']}: {detail} {target['status']}")
