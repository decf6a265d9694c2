"""``evenflow bench planner --lockstep``: the lockstep cost of four ways to deliver a step.

Under FSDP and pipeline schedules a step costs ``Σ_b max_r cost(r, b)``. For every case of the
planner sweep (distribution x source packer x ranks x bins per rank x cost ``a·L + L²``) this
reports that cost, relative to its lower bound
(:func:`~evenflow.engine._planning.bounds.lockstep_lower_bound`), of

* ``source``: the source layout in source order;
* ``src sort``: the source with every rank's bins sorted costliest first (moves nothing; the
  lockstep gate's reference);
* ``makespan``: the makespan plan (``objective="makespan"``) in the order it is delivered;
* ``mk sort``: the makespan plan with every rank's bins sorted;
* ``lockstep``: the lockstep plan (``objective="lockstep"``);

as p50/p90 of ``cost / bound - 1`` (the excess) over steps, with planning times, and beside
them the raw cost of the lockstep plan against the makespan plan with sorted bins
(``lock/mk sort - 1``, per step: what choosing ``objective="lockstep"`` saves, whatever the
bound). Target: at 8
ranks x 4 bins, on the ``sft`` and on the ``longctx`` mix, the lockstep plan's p50 excess is at
least 10% lower than the makespan plan's with sorted bins.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from evenflow.engine._planning.bounds import lockstep_lower_bound
from evenflow.engine._planning.cost import QuadraticCost
from evenflow.engine._planning.objectives import lockstep
from evenflow.engine._planning.planner import Planner
from evenflow.engine.workloads import DISTRIBUTIONS, make_step

__all__ = ["COLUMNS", "print_lockstep", "run_lockstep"]

COLUMNS = ("source", "src sort", "makespan", "mk sort", "lockstep")
_TARGET_SHAPE = (8, 4)
_TARGET_MIXES = ("sft", "longctx")
_TARGET_REDUCTION = 0.10


def _bin_costs(plan: Any, cost_of: dict[tuple[int, int, int], float]) -> np.ndarray:
    layout = plan.layout
    values = np.fromiter(
        (cost_of[k] for k in map(tuple, layout.key_fields.tolist())),
        dtype=np.float64,
        count=len(layout.key_fields),
    )
    sums = np.add.reduceat(values, np.cumsum(layout.sizes) - layout.sizes)
    return sums.reshape(layout.num_ranks, layout.bins_per_rank)


def _in_order(matrix: np.ndarray) -> float:
    return float(matrix.max(axis=0).sum())


def _case(
    *,
    distribution: str,
    packer: str,
    num_ranks: int,
    per: int,
    linear: float,
    num_steps: int,
    seed: int,
) -> dict[str, Any]:
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    model = QuadraticCost(linear=linear, quadratic=1.0)
    options: dict[str, Any] = {"num_ranks": num_ranks, "bins_per_rank": per, "seq_len": seq_len}
    make = Planner(**options, cost_model=model)
    lock = Planner(**options, cost_model=model, objective="lockstep")
    excess: dict[str, list[float]] = {name: [] for name in COLUMNS}
    raw: list[float] = []  # lockstep cost / makespan plan's with sorted bins - 1, per step
    times: dict[str, list[float]] = {"makespan": [], "lockstep": []}
    for step in range(num_steps):
        samples, reference = make_step(
            distribution,
            packer,
            num_ranks=num_ranks,
            bins_per_rank=per,
            seq_len=seq_len,
            seed=seed,
            step=step,
        )
        tokens = np.fromiter((m.tokens for _, m in samples), dtype=np.int64, count=len(samples))
        costs = linear * tokens + tokens.astype(np.float64) ** 2
        cost_of = dict(zip((k.as_tuple() for k, _ in samples), costs.tolist(), strict=True))
        bound = lockstep_lower_bound(costs, tokens, num_ranks, per, seq_len)
        source = np.array([sum(cost_of[k.as_tuple()] for k in b) for b in reference]).reshape(
            num_ranks, per
        )
        start = time.process_time()
        planned = make.plan(samples, reference, step)
        times["makespan"].append(1e3 * (time.process_time() - start))
        start = time.process_time()
        aligned = lock.plan(samples, reference, step)
        times["lockstep"].append(1e3 * (time.process_time() - start))
        m = _bin_costs(planned, cost_of)
        values = {
            "source": _in_order(source),
            "src sort": lockstep(source),
            "makespan": _in_order(m),
            "mk sort": lockstep(m),
            "lockstep": _in_order(_bin_costs(aligned, cost_of)),
        }
        for name, value in values.items():
            excess[name].append(value / bound - 1.0)
        raw.append(values["lockstep"] / values["mk sort"] - 1.0)
    return {
        "distribution": distribution,
        "packer": packer,
        "num_ranks": num_ranks,
        "bins_per_rank": per,
        "seq_len": seq_len,
        "linear": linear,
        "excess": excess,
        "raw_vs_mk_sort": raw,
        "plan_cpu_ms": times,
    }


def run_lockstep(
    *,
    ranks: Sequence[int],
    bins: Sequence[int],
    linear: Sequence[float],
    distributions: Sequence[str],
    packers: Sequence[str],
    steps: int | None,
    seed: int,
    max_bins: int | None = None,
) -> dict[str, Any]:
    """Run the sweep; the JSON document :func:`print_lockstep` prints. Shapes with more than
    ``max_bins`` bins per step are skipped and listed (as in the default tables)."""
    started = time.perf_counter()
    skipped = [
        {"num_ranks": r, "bins_per_rank": b}
        for r in ranks
        for b in bins
        if max_bins is not None and r * b > max_bins
    ]
    cases = [
        _case(
            distribution=d,
            packer=p,
            num_ranks=r,
            per=b,
            linear=a,
            num_steps=steps or _default_steps(r),
            seed=seed,
        )
        for r in ranks
        for b in bins
        if max_bins is None or r * b <= max_bins
        for d in distributions
        for p in packers
        for a in linear
    ]
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for case in cases:
        key = (case["distribution"], case["num_ranks"], case["bins_per_rank"])
        groups.setdefault(key, []).append(case)
    rows = []
    for (distribution, num_ranks, per), group in sorted(groups.items()):
        pooled = {name: [x for c in group for x in c["excess"][name]] for name in COLUMNS}
        raw = [x for c in group for x in c["raw_vs_mk_sort"]]
        timing = {
            name: [x for c in group for x in c["plan_cpu_ms"][name]]
            for name in ("makespan", "lockstep")
        }
        rows.append(
            {
                "distribution": distribution,
                "num_ranks": num_ranks,
                "bins_per_rank": per,
                "steps": len(pooled["source"]),
                "excess": {
                    name: {
                        "p50": float(np.percentile(v, 50)),
                        "p90": float(np.percentile(v, 90)),
                    }
                    for name, v in pooled.items()
                },
                "raw_vs_mk_sort": {
                    "p50": float(np.percentile(raw, 50)),
                    "p90": float(np.percentile(raw, 90)),
                },
                "plan_cpu_ms_p50": {n: float(np.percentile(t, 50)) for n, t in timing.items()},
            }
        )
    return {
        "benchmark": "planner --lockstep",
        "config": {
            "ranks": list(ranks),
            "bins": list(bins),
            "linear": list(linear),
            "distributions": list(distributions),
            "packers": list(packers),
            "seed": seed,
        },
        "skipped": skipped,
        "rows": rows,
        "targets": _targets(rows),
        "wall_s": time.perf_counter() - started,
    }


def _default_steps(num_ranks: int) -> int:
    return 10 if num_ranks <= 8 else (3 if num_ranks <= 64 else 1)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for mix in _TARGET_MIXES:
        name = f"lockstep p50 excess >= 10% below makespan with sorted bins ({mix}, 8 x 4)"
        row = next(
            (
                r
                for r in rows
                if (r["distribution"], r["num_ranks"], r["bins_per_rank"]) == (mix, *_TARGET_SHAPE)
            ),
            None,
        )
        if row is None:
            out.append({"name": name, "status": "NOT RUN"})
            continue
        sorted_p50 = row["excess"]["mk sort"]["p50"]
        lock_p50 = row["excess"]["lockstep"]["p50"]
        reduction = 1.0 - lock_p50 / sorted_p50 if sorted_p50 > 0 else 0.0
        out.append(
            {
                "name": name,
                "makespan_sorted_p50": sorted_p50,
                "lockstep_p50": lock_p50,
                "reduction": reduction,
                "status": "PASS" if reduction >= _TARGET_REDUCTION else "MISS",
            }
        )
    return out


def print_lockstep(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(
        f"evenflow planner lockstep benchmark: ranks {cfg['ranks']}, bins {cfg['bins']}, "
        f"cost a*L+L^2 with a in {cfg['linear']}, packers {cfg['packers']}, seed {cfg['seed']}"
    )
    for skip in doc["skipped"]:
        print(
            f"skipped {skip['num_ranks']} ranks x {skip['bins_per_rank']} bins: past the "
            "planning target's scale; pass --no-skip to run it"
        )
    print("lockstep cost / lower bound - 1 (excess), p50/p90 over steps (packers, costs pooled);")
    print("raw: the lockstep plan's cost / the makespan plan's with sorted bins - 1, p50/p90")
    header = (
        f"{'distribution':<14}{'ranks':>6}{'bins':>5}{'steps':>6}  "
        + "".join(f"{name:<15}" for name in COLUMNS)
        + f"{'raw':<16}{'ms mk/lock':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in doc["rows"]:
        cells = "".join(
            f"{row['excess'][n]['p50']:.3f}/{row['excess'][n]['p90']:<9.3f}" for n in COLUMNS
        )
        raw = row["raw_vs_mk_sort"]
        ms = row["plan_cpu_ms_p50"]
        print(
            f"{row['distribution']:<14}{row['num_ranks']:>6}{row['bins_per_rank']:>5}"
            f"{row['steps']:>6}  {cells}{raw['p50']:+.3f}/{raw['p90']:<+10.3f}"
            f"{ms['makespan']:>5.1f}/{ms['lockstep']:<6.1f}"
        )
    for target in doc["targets"]:
        detail = ", ".join(f"{k} {v:.3f}" for k, v in target.items() if isinstance(v, float))
        print(f"target {target['name']}: {detail} {target['status']}")
