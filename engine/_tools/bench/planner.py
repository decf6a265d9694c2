"""``evenflow bench planner``: plan quality and planning time of ``"lpt"`` and ``"default"``.

For every case of a sweep (distribution x source packer x ranks x bins per rank x cost
``a*L + L^2``) it plans steps made by :func:`~evenflow.engine.workloads.make_step` with both
algorithms and reports, side by side:

* the max rank cost before (source layout) and after planning, relative to the lower bound
  ``max(total / num_ranks, largest sample cost)`` (1.0 is perfect; p50/p90/max over steps);
* how often the gate rejected the candidate and how often LPT dead-ended into the source layout;
* planning time (p50/p99, milliseconds), against two targets: p99 <= 5 ms at 8 ranks x 4 bins
  (~1,000 samples) and p50 <= 500 ms at 1,024 ranks x 4 bins (~100,000 samples);
* the invariant that ``"default"`` is never worse than ``min(source, lpt)`` on any step (any
  violation makes the exit status 1), how often it is strictly better than the source on BFD
  (nearly full) sources, and its mean makespan reduction against LPT on first-fit sources;
* on small instances (4 ranks x 2 bins, <= 24 samples) the gap of both to the exact optimum,
  solved as a MILP with ``scipy.optimize.milp`` (scipy comes with the ``bench`` extra).

The lower bound ignores packing, so a ratio above 1.0 is not necessarily a loss: on BFD sources
with one bin per rank the layout is nearly forced. Limits: planning runs in this process on the
caller's thread, so times include Python's GC and a noisy machine (rerun before comparing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from evenflow.engine._planning import planner as _planner
from evenflow.engine._tools.bench._verdict import add_report_only, targets_status
from evenflow.engine._tools.bench.planner_baseline import _compare, _run_baseline
from evenflow.engine._tools.bench.planner_cases import (
    _BINS,
    _LINEAR,
    _MAX_BINS,
    _RANKS,
    ALGORITHMS,
    _Case,
    _case_json,
    _checks_json,
    _default_steps,
    _plan_case,
    _planners,
    _targets_json,
)
from evenflow.engine._tools.bench.planner_exact import _EXACT_SINGLE_BIN, _run_exact
from evenflow.engine._tools.bench.planner_heldout import print_heldout, run_heldout
from evenflow.engine._tools.bench.planner_lockstep import print_lockstep, run_lockstep
from evenflow.engine._tools.bench.planner_report import _core_name, _print_tables
from evenflow.engine._tools.bench.planner_window import WINDOW_MIXES, print_window, run_window
from evenflow.engine.errors import ConfigError
from evenflow.engine.workloads import DISTRIBUTIONS, PACKERS, make_step

__all__ = ["main"]


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plan quality and planning time of the 'lpt' and 'default' algorithms.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true", help="a tiny sweep (a few seconds)")
    parser.add_argument("--ranks", type=int, nargs="+", help=f"ranks per group {_RANKS}")
    parser.add_argument("--bins", type=int, nargs="+", help=f"bins per rank {_BINS}")
    parser.add_argument(
        "--linear", type=float, nargs="+", help=f"linear coefficients a of a*L+L^2 {_LINEAR}"
    )
    parser.add_argument(
        "--distributions", nargs="+", choices=sorted(DISTRIBUTIONS), help="length distributions"
    )
    parser.add_argument("--packers", nargs="+", choices=PACKERS, help="source packers")
    parser.add_argument("--steps", type=int, help="steps per case (default: 20/4/1 by ranks)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--seq-len", type=int, help="sequence length (default: each distribution's own)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="plan every step this many times and report the least CPU and wall time of "
        "each plan, in this build and the --baseline one (default 1; 3 steadies the "
        "figures on a shared machine)",
    )
    parser.add_argument(
        "--exact-instances", type=int, help="small instances solved exactly (default 50)"
    )
    parser.add_argument(
        "--no-skip",
        action="store_true",
        help=f"also run cases with over {_MAX_BINS:,} bins per step",
    )
    parser.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="also plan every step with the 'default' algorithm of the evenflow build "
        "installed for this interpreter (e.g. an older checkout's venv python) and compare "
        "makespans, movement and CPU time step by step",
    )
    add_objective_arguments(parser)
    add_report_only(parser)
    return parser


def add_objective_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the lockstep and window tables (their own modules)."""
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="instead of the default tables: the lockstep cost of the source, the makespan plan "
        "(in order and with sorted bins) and the lockstep plan, over the same sweep",
    )
    parser.add_argument(
        "--window",
        type=int,
        nargs="+",
        metavar="W",
        help="instead of the default tables: plan windows of W steps (e.g. 1 2 4 8) on the "
        f"mixes {sorted(WINDOW_MIXES)} at 8 and 64 ranks x 1, 2, 4 bins",
    )
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="instead of the default tables: every peer against default on held-out mixes and "
        "seeds (8 x 1, 8 x 4, 64 x 2, nearly full 256 x 2); exit 1 when a peer beats default",
    )
    parser.add_argument(
        "--mixes", nargs="+", choices=sorted(WINDOW_MIXES), help="--window: the length mixes"
    )
    parser.add_argument(
        "--costs", nargs="+", choices=("quadratic", "flops"), help="--window: the cost models"
    )
    parser.add_argument(
        "--objectives",
        nargs="+",
        choices=("makespan", "lockstep"),
        default=["makespan"],
        help="--window: the objectives whose step costs are summed (default makespan)",
    )


def _check_args(args: argparse.Namespace) -> None:
    for name in ("ranks", "bins"):
        for value in getattr(args, name) or ():
            if value < 1:
                raise ConfigError(f"--{name} values must be >= 1, but got {value!r}.")
    for value in args.linear or ():
        if not (np.isfinite(value) and value >= 0):
            raise ConfigError(f"--linear values must be finite and >= 0, but got {value!r}.")
    for name in ("steps", "seq_len", "repeat"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, but got {value!r}.")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, but got {args.seed!r}.")
    if args.exact_instances is not None and args.exact_instances < 0:
        raise ConfigError(f"--exact-instances must be >= 0, but got {args.exact_instances!r}.")


def _sweep(args: argparse.Namespace) -> tuple[list[_Case], list[dict[str, Any]]]:
    quick = args.quick
    ranks = args.ranks or ((8,) if quick else _RANKS)
    bins = args.bins or ((1, 4) if quick else _BINS)
    linear = args.linear or ((0.0, 24576.0) if quick else _LINEAR)
    distributions = args.distributions or sorted(DISTRIBUTIONS)
    packers = args.packers or PACKERS
    cases: list[_Case] = []
    skipped: list[dict[str, Any]] = []
    for num_ranks in ranks:
        for bins_per_rank in bins:
            if num_ranks * bins_per_rank > _MAX_BINS and not args.no_skip:
                skipped.append(
                    {
                        "num_ranks": num_ranks,
                        "bins_per_rank": bins_per_rank,
                        "reason": (
                            f"{num_ranks * bins_per_rank} bins per step (up to ~400,000 "
                            "samples) is past the 100,000-sample planning target and "
                            "would take longer than the whole sweep; pass --no-skip to run it"
                        ),
                    }
                )
                continue
            steps = args.steps or (2 if quick else _default_steps(num_ranks))
            costs = linear
            if args.linear is None and num_ranks >= 1024 and not (quick or args.no_skip):
                costs = tuple(a for a in linear if a != 4096.0)
                skipped.append(
                    {
                        "num_ranks": num_ranks,
                        "bins_per_rank": bins_per_rank,
                        "linear": 4096.0,
                        "reason": (
                            "the middle cost adds ~1 CPU-minute at this scale and lies between "
                            "the two extremes measured; pass --no-skip or --linear to run it"
                        ),
                    }
                )
            for distribution in distributions:
                seq_len = args.seq_len or DISTRIBUTIONS[distribution].default_seq_len
                for packer in packers:
                    cases.extend(
                        _Case(distribution, packer, num_ranks, bins_per_rank, seq_len, a, steps)
                        for a in costs
                    )
    return cases, skipped


def _warm_up(planner_cls: Any) -> None:
    # One untimed plan so first-call costs (imports, caches) do not land in a timed step.
    samples, reference_bins = make_step(
        "sft", "firstfit", num_ranks=2, bins_per_rank=2, seq_len=32768, seed=0
    )
    for planner, _ in _planners(planner_cls, 2, 2, 32768, 0.0).values():
        planner.plan(samples, reference_bins, 0)


def main(argv: Sequence[str] | None = None, prog: str = "evenflow bench planner") -> int:
    """Run the planner benchmark; return 0, or 1 on an invariant violation, 2 on bad input."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        _check_args(args)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.window:
        return _window_main(args, prog)
    if args.lockstep:
        return _lockstep_main(args, prog)
    if args.heldout:
        return _heldout_main(args, prog)
    planner_cls = _planner.Planner  # looked up per run, so a test may substitute one
    cases, skipped = _sweep(args)
    started = time.perf_counter()
    _warm_up(planner_cls)
    for case in cases:
        _plan_case(case, args.seed, planner_cls, repeat=args.repeat)
    exact_instances = args.exact_instances
    if exact_instances is None:
        exact_instances = 4 if args.quick else 50
    exact = _run_exact(planner_cls, num_instances=exact_instances, seed=args.seed)
    exact_single = _run_exact(
        planner_cls, num_instances=exact_instances, seed=args.seed, shape=_EXACT_SINGLE_BIN
    )
    checks = _checks_json(cases)
    comparison = None
    if args.baseline:
        try:
            baseline = _run_baseline(args.baseline, cases, args.seed, repeat=args.repeat)
            comparison = _compare(cases, baseline)
        except ConfigError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    doc: dict[str, Any] = {
        "benchmark": "planner",
        "config": {
            "ranks": sorted({c.num_ranks for c in cases}),
            "bins": sorted({c.bins_per_rank for c in cases}),
            "linear": sorted({c.linear for c in cases}),
            "distributions": sorted({c.distribution for c in cases}),
            "packers": sorted({c.packer for c in cases}),
            "seed": args.seed,
            "quick": args.quick,
            "repeat": args.repeat,
            "algorithms": list(ALGORITHMS),
            "core": _core_name(),
        },
        "skipped": skipped,
        "cases": [_case_json(c) for c in cases],
        "checks": checks,
        "timing_targets": _targets_json(cases),
        "exact": exact,
        "exact_single_bin": exact_single,
        "baseline": None if comparison is None else {"python": args.baseline, **comparison},
        "wall_s": time.perf_counter() - started,
        "ok": checks["violations"] == 0,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_tables(doc, cases)
        print(f"wall time {doc['wall_s']:.1f} s; {'OK' if doc['ok'] else 'INVARIANT VIOLATED'}")
    return 0 if doc["ok"] else 1


def _window_main(args: argparse.Namespace, prog: str) -> int:
    for value in args.window:
        if value < 1:
            print(f"{prog}: --window values must be >= 1, but got {value!r}.", file=sys.stderr)
            return 2
    doc = run_window(
        windows=args.window,
        ranks=args.ranks,
        bins=args.bins,
        mixes=args.mixes,
        costs=args.costs,
        objectives=args.objectives,
        steps=args.steps,
        seed=args.seed,
        quick=args.quick,
    )
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_window(doc)
        print(f"wall time {doc['wall_s']:.1f} s")
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)


def _heldout_main(args: argparse.Namespace, prog: str) -> int:
    doc = run_heldout(
        seed=args.seed, steps=args.steps, quick=args.quick, planner_cls=_planner.Planner
    )
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_heldout(doc)
        print(f"wall time {doc['wall_s']:.1f} s")
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)


def _lockstep_main(args: argparse.Namespace, prog: str) -> int:
    quick = args.quick
    doc = run_lockstep(
        ranks=args.ranks or ((8,) if quick else _RANKS),
        bins=args.bins or ((4,) if quick else _BINS),
        linear=args.linear or ((0.0, 24576.0) if quick else _LINEAR),
        distributions=args.distributions or sorted(DISTRIBUTIONS),
        packers=args.packers or PACKERS,
        steps=args.steps or (2 if quick else None),
        seed=args.seed,
        max_bins=None if args.no_skip else _MAX_BINS,
    )
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_lockstep(doc)
        print(f"wall time {doc['wall_s']:.1f} s")
    return targets_status(doc["targets"], report_only=args.report_only, prog=prog)
