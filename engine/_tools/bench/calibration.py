"""``evenflow bench calibration``: does online calibration win back what a wrong cost model loses?

Two Gloo ranks train a small causal LM (the demo's, one CPU thread per rank) on a long-tailed
mix of sample lengths, measuring each bin's forward + backward CPU seconds, then joining a
gradient all-reduce, as DDP does. Five arms, each with its own loader and Gloo group, take
turns step by step *in the same processes* (a rotating order), over the same steps:

* ``off``: balancing off (the source layout);
* ``well``: balanced with ``QuadraticCost`` fitted to this model at start-up (the ratio of
  the ``L`` and ``L²`` terms timed on a set of packed bins, as the demo does);
* ``mis``: balanced with the linear term 3.5x too small (a model fitted on a loaded machine);
* ``calibrating``: ``CalibratedCost`` on the misspecified model, fed by ``record_compute``.

Per arm: measured max/mean rank compute (the slowest rank over the mean, per step), the
slowest rank's compute against ``off`` on the same steps (in seconds, and as its share
max/mean), step time against ``off``, and the per-bin prediction error over time (relative,
after the best common scale). The whole run is repeated ``--repeats`` times (fresh processes)
for the run-to-run spread.

Targets (PASS/MISS): ``calibrating`` recovers >= 80% of ``well``'s measured reduction of the
slowest rank's compute over the steps after the first 50 (within 50 steps); its median
per-bin error over the last 50 steps <= 10%; no balanced arm's step time is above ``off`` by
more than the run-to-run spread (the largest difference of one arm between repeats, at least
2%). The reduction is measured on the slowest rank's share (max/mean against ``off``'s on the
same step): every arm trains the same samples at a step, so the share is the slowest rank's
compute with the machine's speed, which drifts between the arms' turns on a shared machine,
divided out; the reduction in seconds is printed beside it.

Limits: CPU compute on a shared 2-core machine; a repeat takes each rank's CPU time, so
another job delays a step but lengthens its timing less. The gains are small (a few percent)
on this model; the figures speak about recovery (calibrating vs well), not about GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._planning.calibration import CalibratedCost, fit_coefficients
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine._tools.demo.calibrate import calibration_bins, time_bins
from evenflow.engine._tools.demo.model import TinyCausalLM, TinyConfig, packed_loss
from evenflow.engine.errors import ConfigError
from evenflow.engine.workloads import LengthMixture, LogNormal, LogUniform, step_source
from evenflow.transports import GlooTransport
from evenflow.transports.launch import LaunchError, run_ranks

__all__ = ["main"]

ARMS = ("off", "well", "mis", "calibrating")
MISSPECIFIED = 3.5
_SETTLE = 50  # the steps calibration is given to recover


def _mixture(seq_len: int) -> Any:
    return LengthMixture(
        name="bench-calibration",
        components=(
            LogNormal(0.85, median=max(8, seq_len // 16), sigma=0.9),
            LogUniform(0.15, low=max(16, seq_len // 4), high=seq_len),
        ),
        default_seq_len=seq_len,
    )


def _fit_well(model: Any, seq_len: int) -> tuple[float, float]:
    """``(linear, quadratic)`` seconds per token and per token² fitted to timed bins (timings
    averaged over ranks). At short ``seq_len`` the quadratic term may fit to 0: the arms then
    differ only in scale, which balances alike (a smoke run, not a measurement)."""
    import torch
    import torch.distributed as dist

    bins = calibration_bins(seq_len)
    local = torch.tensor(time_bins(model, bins, repeats=3), dtype=torch.float64)
    dist.all_reduce(local)
    seconds = (local / dist.get_world_size()).numpy()
    features = np.array(
        [[1.0, len(b), sum(b), sum(x * x for x in b)] for b in bins], dtype=np.float64
    )
    fit = fit_coefficients(features, seconds)
    if fit is None or not any(fit.coefficients[2:]):
        raise RuntimeError(f"The start-up fit found no per-token term: {fit!r}.")
    return fit.coefficients[2], fit.coefficients[3]


class _Arm:
    def __init__(self, name: str, spec: dict[str, Any], rank: int, cost: Any, model: Any) -> None:
        import torch

        self.name = name
        self.model = copy.deepcopy(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.transport = GlooTransport(timeout=60.0)
        config = LoaderConfig(
            seq_len=spec["seq_len"],
            bins_per_rank=spec["bins_per_rank"],
            max_steps=spec["steps"],
            timeout=60.0,
            log_stats=False,
            balance=name != "off",
        )
        source = step_source(
            _mixture(spec["seq_len"]),
            "firstfit",
            rank=rank,
            bins_per_rank=spec["bins_per_rank"],
            seq_len=spec["seq_len"],
            seed=spec["seed"],
            num_steps=spec["steps"],
            vocab_size=model.config.vocab_size,
        )
        self.loader = BalancedLoader(
            source, config=config, transport=self.transport, cost_model=cost
        )
        self.calibrates = self.loader.calibration_stats is not None
        self.iterator = iter(self.loader)
        self.rows: list[dict[str, Any]] = []

    def step(self) -> bool:
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        batch = next(self.iterator, None)
        if batch is None:
            return False
        bins, compute = [], 0.0
        for b, packed in enumerate(batch):
            t0 = time.thread_time()
            cu = packed["cu_seq_lens_q"]
            logits = self.model(packed["input_ids"], packed["position_ids"], cu)
            loss, _ = packed_loss(logits, packed["labels"])
            loss.backward()
            seconds = time.thread_time() - t0
            compute += seconds
            if self.calibrates:
                self.loader.record_compute(seconds, bin=b)
            bins.append([torch.diff(cu).tolist(), seconds])
        both = torch.tensor([compute, compute], dtype=torch.float64)
        grads = [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat(grads)
        dist.all_reduce(flat)
        maximum = both[:1].clone()
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
        dist.all_reduce(both[1:])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.rows.append(
            {
                "step_s": time.perf_counter() - started,
                "max_compute_s": float(maximum[0]),
                "mean_compute_s": float(both[1]) / dist.get_world_size(),
                "bins": bins,
            }
        )
        return True

    def close(self) -> dict[str, Any]:
        stats = self.loader.calibration_stats if self.rows else None
        try:
            self.loader.close()
        finally:
            asyncio.run(self.transport.aclose())
        record: dict[str, Any] = {"rows": self.rows}
        if stats is not None:
            record["errors"] = [list(e) for e in stats.errors]
            record["coefficients"] = list(stats.coefficients)
            record["accepted"] = stats.num_accepted
            record["fits"] = stats.num_fits
            record["late"] = stats.num_late
        return record


def _bench_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    config = TinyConfig(
        vocab_size=256,
        hidden_size=spec["hidden_size"],
        num_layers=spec["layers"],
        num_heads=4,
        intermediate_size=3 * spec["hidden_size"],
        max_positions=spec["seq_len"],
    )
    model = TinyCausalLM(config)
    linear, quadratic = _fit_well(model, spec["seq_len"])
    well = QuadraticCost(linear=linear, quadratic=quadratic)
    mis = QuadraticCost(linear=linear / MISSPECIFIED, quadratic=quadratic)
    costs = {
        "off": mis,
        "well": well,
        "mis": mis,
        "calibrating": CalibratedCost(mis, refit_every=5, min_rows=16, history=256),
    }
    arms = {name: _Arm(name, spec, rank, costs[name], model) for name in ARMS}
    try:
        order = list(arms.values())
        for turn in range(spec["steps"]):
            rotated = order[turn % len(order) :] + order[: turn % len(order)]
            if not all([arm.step() for arm in rotated]):
                break
    finally:
        records = {name: arm.close() for name, arm in arms.items()}
    return {"well": [linear, quadratic], "arms": records}


def _errors_of(
    rows: list[dict[str, Any]], linear: float, quadratic: float
) -> list[tuple[int, float]]:
    """Per-bin relative errors of a fixed QuadraticCost after its best common scale."""
    features, seconds, steps = [], [], []
    for step, row in enumerate(rows):
        for lengths, value in row["bins"]:
            values = np.asarray(lengths, dtype=np.float64)
            features.append(linear * values.sum() + quadratic * (values * values).sum())
            seconds.append(value)
            steps.append(step)
    predicted, measured = np.asarray(features), np.asarray(seconds)
    scale = float(np.median(measured / predicted))
    errors = np.abs(measured - scale * predicted) / measured
    return list(zip(steps, errors.tolist(), strict=True))


def _summarize_repeat(ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """One repeat's figures per arm (rank 0's view of group-wide measurements)."""
    first = ranks[0]
    linear, quadratic = first["well"]
    arms: dict[str, Any] = {}
    off_rows = first["arms"]["off"]["rows"]
    # Steps after the settling ones; a run too short to have any (--quick) uses every step.
    settle = _SETTLE if len(off_rows) > _SETTLE else 0
    late = list(range(settle, len(off_rows)))
    for name in ARMS:
        record = first["arms"][name]
        rows = record["rows"]
        if name == "calibrating":
            errors = [(s, e) for s, e in record["errors"]]
        else:
            scale = 1.0 if name == "well" else 1.0 / MISSPECIFIED
            errors = _errors_of(rows, linear * scale, quadratic)
        steps_late = [i for i in late if i < len(rows)]
        max_over_off = [rows[i]["max_compute_s"] / off_rows[i]["max_compute_s"] for i in steps_late]
        # The same step does the same work in every arm, so max/mean against off's on that
        # step is the slowest rank's share, free of the machine's speed drifting between turns.
        imbalance_over_off = [
            (rows[i]["max_compute_s"] / rows[i]["mean_compute_s"])
            / (off_rows[i]["max_compute_s"] / off_rows[i]["mean_compute_s"])
            for i in steps_late
        ]
        blocks = {}
        for s, e in errors:
            blocks.setdefault(s // 10 * 10, []).append(e)
        arms[name] = {
            "steps": len(rows),
            "max_over_mean": statistics.fmean(
                r["max_compute_s"] / r["mean_compute_s"] for r in rows
            ),
            "max_over_mean_late": statistics.fmean(
                rows[i]["max_compute_s"] / rows[i]["mean_compute_s"] for i in late if i < len(rows)
            ),
            "max_compute_vs_off_late": statistics.fmean(max_over_off),
            "imbalance_vs_off_late": statistics.fmean(imbalance_over_off),
            "step_time_vs_off": statistics.median(r["step_s"] for r in rows)
            / statistics.median(r["step_s"] for r in off_rows),
            "median_error_last": float(
                np.median([e for s, e in errors if s >= max(0, steps - _SETTLE)])
            ),
            "error_by_10_steps": {str(k): float(np.median(v)) for k, v in sorted(blocks.items())},
        }
        if "coefficients" in record:
            arms[name].update(
                coefficients=record["coefficients"],
                accepted=record["accepted"],
                fits=record["fits"],
                late=record["late"],
            )
    well = 1.0 - arms["well"]["imbalance_vs_off_late"]
    calibrating = 1.0 - arms["calibrating"]["imbalance_vs_off_late"]
    absolute_well = 1.0 - arms["well"]["max_compute_vs_off_late"]
    absolute_calibrating = 1.0 - arms["calibrating"]["max_compute_vs_off_late"]
    return {
        # The well-specified model's linear/quadratic ratio (None: no quadratic term fitted).
        "well_linear": linear / quadratic if quadratic > 0 else None,
        "from_step": settle,
        "arms": arms,
        "reduction_well": well,
        "reduction_calibrating": calibrating,
        "recovered": calibrating / well if well > 0 else None,
        "absolute_reduction_well": absolute_well,
        "absolute_reduction_calibrating": absolute_calibrating,
    }


def _targets(repeats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    measured = [r["recovered"] for r in repeats if r["recovered"] is not None]
    recovered = statistics.median(measured) if measured else float("nan")
    error = statistics.median(r["arms"]["calibrating"]["median_error_last"] for r in repeats)
    spread = max(
        0.02,
        max(
            (
                abs(a["arms"][n]["step_time_vs_off"] - b["arms"][n]["step_time_vs_off"])
                for a in repeats
                for b in repeats
                for n in ARMS
            ),
            default=0.0,
        ),
    )
    slowest = max(r["arms"][n]["step_time_vs_off"] for r in repeats for n in ARMS if n != "off")
    return [
        {
            "name": "calibrating recovers >= 80% of well's compute reduction after 50 steps",
            "value": recovered,
            "status": "PASS" if recovered >= 0.8 else "MISS",
            "note": "median over repeats of (1 - calibrating/off) / (1 - well/off), slowest "
            "rank's share of the step's compute (max/mean, paired by step), steps >= 50",
        },
        {
            "name": "calibrating median per-bin error <= 10%",
            "value": error,
            "status": "PASS" if error <= 0.10 else "MISS",
            "note": "median over repeats; the last 50 steps",
        },
        {
            "name": "no balanced arm slower than off beyond the run-to-run spread",
            "value": slowest,
            "status": "PASS" if slowest <= 1.0 + spread else "MISS",
            "note": f"largest step time / off over arms and repeats; spread {spread:.3f}",
        },
    ]


def _print(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(
        f"evenflow bench calibration: 2 Gloo ranks, {cfg['steps']} steps x {len(ARMS)} arms, "
        f"{cfg['repeats']} repeat(s), seq_len {cfg['seq_len']}, hidden {cfg['hidden_size']}"
    )
    for i, rep in enumerate(doc["repeats"]):
        ratio = rep["well_linear"]
        shown = "no quadratic term" if ratio is None else f"{ratio:.0f}"
        print(f"\nrepeat {i + 1}: well-specified linear/quadratic = {shown}")
        print(
            f"  {'arm':<12}{'max/mean':>10}{'max/mean>=' + str(rep['from_step']):>14}"
            f"{'max vs off':>12}{'max/mean vs off':>17}"
            f"{'step vs off':>13}{'err last':>10}"
        )
        for name in ARMS:
            a = rep["arms"][name]
            print(
                f"  {name:<12}{a['max_over_mean']:>10.3f}{a['max_over_mean_late']:>14.3f}"
                f"{a['max_compute_vs_off_late']:>12.3f}{a['imbalance_vs_off_late']:>17.3f}"
                f"{a['step_time_vs_off']:>13.3f}"
                f"{a['median_error_last'] * 100:>9.1f}%"
            )
        errs = rep["arms"]["calibrating"]["error_by_10_steps"]
        series = ", ".join(f"{k}: {v * 100:.0f}%" for k, v in errs.items())
        print(f"  calibrating median error by 10 steps: {series}")
        recovered = rep["recovered"]
        print(
            f"  slowest rank's share reduced (steps >= {rep['from_step']}): well "
            f"{rep['reduction_well'] * 100:.1f}%, calibrating "
            f"{rep['reduction_calibrating'] * 100:.1f}% (recovered "
            f"{'n/a' if recovered is None else f'{recovered:.2f}'}); slowest rank's seconds: "
            f"well {rep['absolute_reduction_well'] * 100:.1f}%, calibrating "
            f"{rep['absolute_reduction_calibrating'] * 100:.1f}%"
        )
    print("\ntargets")
    for t in doc["targets"]:
        print(f"  {t['status']:<5} {t['name']}: {t['value']:.3f}  ({t['note']})")
    print(f"\nwall time {doc['wall_s']:.1f} s")


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Online calibration against a well-specified and a misspecified cost "
        "model, on 2 Gloo ranks training a small model, arms alternated in the same processes.",
    )
    parser.add_argument("--quick", action="store_true", help="few steps, one repeat (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per arm (default 120, 30 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="whole runs, for the spread (default 2, 1 quick)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per bin (default 768, 512 quick)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        help="seconds per repeat before its ranks are killed (default 600)",
    )
    add_report_only(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench calibration") -> int:
    """Run the benchmark; 0 when every target passed, 1 on a MISS (unless ``--report-only``)
    or a failure, 2 on bad input."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    steps = args.steps if args.steps is not None else (30 if args.quick else 120)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    seq_len = args.seq_len if args.seq_len is not None else (512 if args.quick else 768)
    try:
        if steps < 10:
            raise ConfigError(f"--steps must be >= 10, but got {steps}.")
        if repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, but got {repeats}.")
        if seq_len < 64:
            raise ConfigError(f"--seq-len must be >= 64, but got {seq_len}.")
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    spec = {
        "steps": steps,
        "seq_len": seq_len,
        "bins_per_rank": 2,
        "hidden_size": 96 if args.quick else 128,
        "layers": 2,
        "seed": args.seed,
    }
    started = time.perf_counter()
    results = []
    for i in range(repeats):
        print(f"{prog}: repeat {i + 1} of {repeats} ...", file=sys.stderr)
        try:
            ranks = run_ranks(_bench_rank, 2, args=[spec], deadline=args.deadline, timeout=60.0)
        except LaunchError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
        results.append(_summarize_repeat(ranks, steps))
    doc = {
        "benchmark": "calibration",
        "config": {**spec, "repeats": repeats},
        "repeats": results,
        "targets": _targets(results),
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print(doc)
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)
