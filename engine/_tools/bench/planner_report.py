"""The planner benchmark's tables (what ``evenflow bench planner`` prints without ``--json``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._tools.bench.planner_cases import ALGORITHMS, PEERS, _Case, _quantiles

__all__ = ["_core_name", "_print_tables"]


def _fmt(q: dict[str, float | None], *names: str, digits: int = 2) -> str:
    return "/".join("-" if q[n] is None else f"{q[n]:.{digits}f}" for n in names)


def _core_name() -> str:
    """Which implementation of the greedy and the search the timings measure."""
    return f"compiled (core version {native.CORE_VERSION})"


def _print_tables(doc: dict[str, Any], cases: list[_Case]) -> None:
    cfg = doc["config"]
    print(
        f"evenflow planner benchmark: ranks {cfg['ranks']}, bins {cfg['bins']}, "
        f"cost a*L+L^2 with a in {cfg['linear']}, seed {cfg['seed']}, core {cfg['core']}"
    )
    for skip in doc["skipped"]:
        what = f"{skip['num_ranks']} ranks x {skip['bins_per_rank']} bins"
        if "linear" in skip:
            what += f" with a={skip['linear']:g}"
        print(f"skipped {what}: {skip['reason']}")
    print()
    print("max rank cost / lower bound, p50/p90/max over steps (all ranks and costs pooled)")
    header = (
        f"{'distribution':<14}{'packer':<10}{'bins':>5}{'plans':>7}  {'source':<16}"
        f"{'lpt':<16}{'default':<16}{'lpt rej/fb':>11}{'def rej':>9}"
    )
    print(header)
    print("-" * len(header))
    groups: dict[tuple[str, str, int], list[_Case]] = {}
    for case in cases:
        groups.setdefault((case.distribution, case.packer, case.bins_per_rank), []).append(case)
    for (dist, packer, nbins), group in sorted(groups.items()):
        source = _quantiles([r for c in group for r in c.source_ratios], "p50", "p90", "max")
        cols = []
        for name in ALGORITHMS:
            pooled = [r for c in group for r in c.algos[name].ratios]
            cols.append(_fmt(_quantiles(pooled, "p50", "p90", "max"), "p50", "p90", "max"))
        num_steps = sum(len(c.source_ratios) for c in group)
        lpt_rej = sum(c.algos["lpt"].rejected for c in group)
        lpt_fb = sum(c.algos["lpt"].fallbacks for c in group)
        def_rej = sum(c.algos["default"].rejected for c in group)
        print(
            f"{dist:<14}{packer:<10}{nbins:>5}{num_steps:>7}  "
            f"{_fmt(source, 'p50', 'p90', 'max'):<16}{cols[0]:<16}{cols[1]:<16}"
            f"{f'{lpt_rej}/{lpt_fb}':>11}{def_rej:>9}"
        )
    print()
    print(
        "peers: max rank cost / lower bound, p50/p90/max over steps; failed: the peer found no "
        "layout and kept the source"
    )
    header = f"{'distribution':<14}{'packer':<10}{'bins':>5}{'plans':>7}  " + "".join(
        f"{name:<16}{'failed':>7}  " for name in PEERS
    )
    print(header)
    print("-" * len(header))
    for (dist, packer, nbins), group in sorted(groups.items()):
        num_steps = sum(len(c.source_ratios) for c in group)
        row = f"{dist:<14}{packer:<10}{nbins:>5}{num_steps:>7}  "
        for name in PEERS:
            pooled = [r for c in group for r in c.algos[name].ratios]
            failed = sum(c.algos[name].fallbacks for c in group)
            row += f"{_fmt(_quantiles(pooled, 'p50', 'p90', 'max'), 'p50', 'p90', 'max'):<16}"
            row += f"{failed:>7}  "
        print(row)
    print()
    print(
        "samples moved to another rank (fraction of the step) and gap to the proven lower "
        "bound, p50/p90 over steps"
    )
    header = (
        f"{'distribution':<14}{'packer':<10}{'ranks':>6}{'bins':>5}  {'lpt moved':<12}"
        f"{'def moved':<12}{'def tokens':<12}{'def gap':<14}{'outlier-bound':>14}"
    )
    print(header)
    print("-" * len(header))
    shapes_moved: dict[tuple[str, str, int, int], list[_Case]] = {}
    for case in cases:
        key = (case.distribution, case.packer, case.num_ranks, case.bins_per_rank)
        shapes_moved.setdefault(key, []).append(case)
    for (dist, packer, ranks, nbins), group in sorted(shapes_moved.items()):

        def spread(name: str, attr: str, group: list[_Case] = group) -> dict[str, float | None]:
            values = [v for c in group for v in getattr(c.algos[name], attr)]
            return _quantiles(values, "p50", "p90")

        steps = sum(len(c.source_ratios) for c in group)
        outliers = sum(c.outlier_bound for c in group)
        print(
            f"{dist:<14}{packer:<10}{ranks:>6}{nbins:>5}  "
            f"{_fmt(spread('lpt', 'moved'), 'p50', 'p90'):<12}"
            f"{_fmt(spread('default', 'moved'), 'p50', 'p90'):<12}"
            f"{_fmt(spread('default', 'moved_tokens'), 'p50', 'p90'):<12}"
            f"{_fmt(spread('default', 'gaps'), 'p50', 'p90', digits=4):<14}"
            f"{f'{outliers}/{steps}':>14}"
        )
    baseline = doc.get("baseline")
    if baseline:
        print()
        print(
            f"side by side with the baseline build ({baseline['python']}), 'default' on the same "
            "steps: moved fraction p50, max cost / bound p50/p90, CPU ms p50/p99"
        )
        header = (
            f"{'distribution':<14}{'packer':<10}{'ranks':>6}{'bins':>5}{'steps':>6}  "
            f"{'moved base':>11}{'moved new':>10}  {'ratio base':<14}{'ratio new':<14}"
            f"{'ms base':<13}{'ms new':<13}"
        )
        print(header)
        print("-" * len(header))
        for shape in baseline["shapes"]:
            print(
                f"{shape['distribution']:<14}{shape['packer']:<10}{shape['num_ranks']:>6}"
                f"{shape['bins_per_rank']:>5}{shape['steps']:>6}  "
                f"{shape['base_moved']['p50']:>11.3f}{shape['moved']['p50']:>10.3f}  "
                f"{_fmt(shape['base_ratio'], 'p50', 'p90', digits=4):<14}"
                f"{_fmt(shape['ratio'], 'p50', 'p90', digits=4):<14}"
                f"{_fmt(shape['base_ms'], 'p50', 'p99', digits=1):<13}"
                f"{_fmt(shape['ms'], 'p50', 'p99', digits=1):<13}"
            )
        print(
            f"steps where default's max cost exceeds the baseline's: "
            f"{baseline['steps_worse_than_baseline']} "
            f"({baseline['steps_worse_beyond_tie']} by more than the planner's tie, the most "
            f"by {100 * baseline['most_worse']:.3f}%); below it: "
            f"{baseline['steps_better_than_baseline']}"
        )
    print()
    print("planning time (ms, wall clock), p50/p99 over all plans of a shape")
    header = f"{'ranks':>6}{'bins':>6}{'samples':>10}  {'lpt':<18}{'default':<18}"
    print(header)
    print("-" * len(header))
    shapes: dict[tuple[int, int], list[_Case]] = {}
    for case in cases:
        shapes.setdefault((case.num_ranks, case.bins_per_rank), []).append(case)
    for (num_ranks, nbins), group in sorted(shapes.items()):
        mean_samples = np.mean([n for c in group for n in c.num_samples])
        cols = [
            _fmt(
                _quantiles([t for c in group for t in c.algos[name].plan_ms], "p50", "p99"),
                "p50",
                "p99",
                digits=1,
            )
            for name in ALGORITHMS
        ]
        print(f"{num_ranks:>6}{nbins:>6}{mean_samples:>10.0f}  {cols[0]:<18}{cols[1]:<18}")
    print()
    checks = doc["checks"]
    better = checks["bfd_strictly_better_fraction"]
    print(
        f"invariant default <= min(source, lpt, {', '.join(PEERS)}): {checks['violations']} "
        f"violations in {checks['num_steps']} planned steps (each cost counted apart)"
    )
    wins = checks["peer_wins"]
    print(
        "steps where a peer plans a lower max cost than default: "
        + ", ".join(f"{name} {wins[name]}" for name in PEERS)
    )
    if better["default"] is not None:
        print(
            f"strictly better than the source on bfd sources: default {better['default']:.1%}, "
            f"lpt {better['lpt']:.1%} of steps"
        )
    if checks["firstfit_mean_reduction_vs_lpt"] is not None:
        print(
            "mean makespan reduction of default vs lpt on firstfit sources: "
            f"{checks['firstfit_mean_reduction_vs_lpt']:.2%}"
        )
    for exact in (doc["exact"], doc["exact_single_bin"]):
        if "skipped" in exact:
            print(f"exact optimum: skipped: {exact['skipped']}")
        elif exact["num_instances"]:
            gaps = exact["gap"]
            print(
                f"gap to the exact optimum on {exact['num_instances']} instances "
                f"({exact['shape']}, {exact['samples']['min']}-{exact['samples']['max']} "
                f"samples; {exact['num_proven']} proven optimal to 0.1%): "
                f"lpt median {gaps['lpt']['p50']:.2%} max {gaps['lpt']['max']:.2%}, "
                f"default median {gaps['default']['p50']:.2%} p99 {gaps['default']['p99']:.2%} "
                f"max {gaps['default']['max']:.2%}"
            )
            if exact["below_optimum"]:
                print(f"WARNING: {exact['below_optimum']} plans beat a proven optimum; check both.")
    for target in doc["timing_targets"]:
        measured, cpu = target["measured_ms"], target["measured_cpu_ms"]
        shown = "-" if measured is None else f"{measured:.1f} ms (CPU {cpu:.1f} ms)"
        print(
            f"target {target['statistic']} <= {target['limit_ms']:g} ms at "
            f"{target['num_ranks']} ranks x {target['bins_per_rank']} bins "
            f"({target['distribution']}, {target['algorithm']}): {shown} {target['status']}"
        )
