"""Plan digests of a fixed sweep: whether two builds of the planner plan every step alike.

A restructuring of the planner that claims to keep its behaviour must give the same plan on
every step. This module plans a fixed sweep (the benchmark's distributions and packers at
small and mid-sized shapes, both objectives that search, windows, packing budgets, attempt
budgets, tiny multi-start steps and ``lpt``) and prints one line per step: a name and the plan's
digest with its decision's figures (``repr`` of the floats, so a last-bit difference shows).

It uses only the planner's long-standing entry points (``Planner``, ``plan_window``,
``make_step``), so another build can run it unchanged: run it once with each build's package
first on the path and compare the outputs with ``--compare``::

    PYTHONPATH=<checkout>/.shim python3 planner_digests.py > new.txt
    python3 planner_digests.py > old.txt            # the installed build
    python3 planner_digests.py --compare old.txt new.txt

``--quick`` plans a subset (a few seconds) for a first check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from evenflow.engine._model import SampleMetadata
from evenflow.engine._planning.columns import columns_of_samples
from evenflow.engine._planning.cost import FlopsCost, QuadraticCost
from evenflow.engine._planning.planner import Planner
from evenflow.engine._planning.refine import RefineAlgorithm
from evenflow.engine._planning.window import plan_window
from evenflow.engine.workloads import DISTRIBUTIONS, PACKERS, make_step

__all__ = ["main"]

_LINEAR = (0.0, 4096.0, 24576.0)
# (ranks, bins per rank, steps): 8-rank shapes get most steps, as in the benchmark.
_SHAPES = ((2, 1, 4), (4, 2, 4), (8, 1, 6), (8, 4, 6), (8, 16, 2), (64, 1, 2), (64, 4, 2))
_SHAPES_FULL = ((256, 2, 2), (256, 1, 1))
_LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
}


def _line(name: str, plan: Any) -> str:
    d = plan.decision
    figures = (d.accepted, d.original_objective, d.candidate_objective, d.lower_bound)
    return f"{name} {plan.digest} {plan.num_moved} {figures!r}"


def _step(distribution: str, packer: str, ranks: int, bins: int, step: int) -> Any:
    seq_len = DISTRIBUTIONS[distribution].default_seq_len
    return make_step(
        distribution,
        packer,
        num_ranks=ranks,
        bins_per_rank=bins,
        seq_len=seq_len,
        seed=7,
        step=step,
    )


def _with_budget(samples: list[Any], reference: list[list[Any]]) -> tuple[list[Any], float]:
    """The samples with a ``patches`` footprint each, and a budget the source bins meet."""
    out = []
    footprint = {}
    for key, meta in samples:
        value = float((key.index * 7 + key.source_rank * 3) % 5)
        footprint[key] = value
        out.append((key, SampleMetadata(tokens=meta.tokens, packing_costs={"patches": value})))
    most = max(sum(footprint[k] for k in b) for b in reference)
    return out, most


def _sweep(quick: bool) -> Iterator[str]:
    distributions = sorted(DISTRIBUTIONS)
    shapes = _SHAPES[:4] if quick else _SHAPES + _SHAPES_FULL
    linears = _LINEAR[1:2] if quick else _LINEAR
    for distribution in distributions:
        seq_len = DISTRIBUTIONS[distribution].default_seq_len
        for packer in PACKERS:
            for ranks, bins, steps in shapes:
                for linear in linears:
                    model = QuadraticCost(linear=linear)
                    objectives = ["makespan", "lockstep"] if ranks * bins <= 256 else ["makespan"]
                    if ranks * bins <= 32:
                        objectives.append("balance")
                    algorithms: list[tuple[str, Any]] = [("default", "default")]
                    if ranks <= 8:
                        algorithms.append(("lpt", "lpt"))
                        algorithms.append(("it3", RefineAlgorithm(max_iterations=3)))
                    for objective in objectives:
                        for label, algorithm in algorithms:
                            planner = Planner(
                                num_ranks=ranks,
                                bins_per_rank=bins,
                                seq_len=seq_len,
                                cost_model=model,
                                algorithm=algorithm,
                                objective=objective,
                            )
                            for step in range(1 if quick else steps):
                                samples, reference = _step(distribution, packer, ranks, bins, step)
                                name = (
                                    f"{distribution}/{packer}/{ranks}x{bins}/a={linear:g}/"
                                    f"{objective}/{label}/step{step}"
                                )
                                yield _line(name, planner.plan(samples, reference, step))
                    if ranks <= 8 and linear == linears[0]:
                        for step in range(1 if quick else 2):
                            samples, reference = _step(distribution, packer, ranks, bins, step)
                            samples, most = _with_budget(samples, reference)
                            for budget in (most, most * 1.5):
                                planner = Planner(
                                    num_ranks=ranks,
                                    bins_per_rank=bins,
                                    seq_len=seq_len,
                                    cost_model=model,
                                    packing_budgets={"patches": budget},
                                )
                                name = (
                                    f"{distribution}/{packer}/{ranks}x{bins}/budget={budget:g}/"
                                    f"step{step}"
                                )
                                yield _line(name, planner.plan(samples, reference, step))
    if not quick:
        model = QuadraticCost(linear=24576.0)
        planner = Planner(num_ranks=1024, bins_per_rank=4, seq_len=16384, cost_model=model)
        samples, reference = make_step(
            "sft", "firstfit", num_ranks=1024, bins_per_rank=4, seq_len=16384, seed=7, step=0
        )
        yield _line(
            "sft/firstfit/1024x4/a=24576/makespan/default/step0",
            planner.plan(samples, reference, 0),
        )
    yield from _windows(quick)


def _windows(quick: bool) -> Iterator[str]:
    shapes = ((8, 1), (8, 2)) if quick else ((8, 1), (8, 2), (8, 4), (64, 2))
    for distribution in sorted(DISTRIBUTIONS):
        seq_len = DISTRIBUTIONS[distribution].default_seq_len
        for ranks, bins in shapes:
            for cost_name in ("quadratic",) if quick else ("quadratic", "flops"):
                model = (
                    QuadraticCost(linear=4096.0)
                    if cost_name == "quadratic"
                    else FlopsCost(_LLAMA3_8B)
                )
                for objective in ("makespan", "lockstep"):
                    planner = Planner(
                        num_ranks=ranks,
                        bins_per_rank=bins,
                        seq_len=seq_len,
                        cost_model=model,
                        objective=objective,
                    )
                    columns = []
                    for step in range(4):
                        samples, reference = _step(distribution, "firstfit", ranks, bins, step)
                        got, _ = columns_of_samples(
                            samples,
                            reference,
                            num_ranks=ranks,
                            bins_per_rank=bins,
                            constraints=planner.constraints,
                        )
                        columns.append(got)
                    for window in (1, 2, 4):
                        if quick and window == 4:
                            continue
                        for first in range(0, 4 - window + 1, window):
                            result = plan_window(planner, columns[first : first + window], first)
                            for k, plan in enumerate(result.plans):
                                name = (
                                    f"window/{distribution}/{ranks}x{bins}/{cost_name}/"
                                    f"{objective}/W{window}/first{first}/plan{k}"
                                )
                                delays = [int(abs(d).sum()) for d in result.delays]
                                yield _line(name, plan) + f" {delays} {result.step_costs!r}"


def _compare(old_path: str, new_path: str) -> int:
    with open(old_path) as f:
        old = f.read().splitlines()
    with open(new_path) as f:
        new = f.read().splitlines()
    if len(old) != len(new):
        print(f"different step counts: {len(old)} vs {len(new)}")
        return 1
    differ = [(a, b) for a, b in zip(old, new, strict=True) if a != b]
    for a, b in differ[:20]:
        print(f"- {a}\n+ {b}")
    print(f"{len(old)} steps compared, {len(differ)} differ")
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset (a few seconds)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two outputs")
    args = parser.parse_args(argv)
    if args.compare:
        return _compare(*args.compare)
    for line in _sweep(args.quick):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
