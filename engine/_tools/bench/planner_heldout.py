"""``evenflow bench planner --heldout``: every peer against the default on unseen steps.

The planner's constants were measured on the benchmark's sweep (its three mixes, seed 0), so
that sweep cannot show whether they generalise. This sweep draws steps from other mixes (chat
turns, code, long documents, a heavy-tailed mix) and from the benchmark's ``sft`` and
``longctx`` with other seeds, at 8 x 1, 8 x 4, 64 x 2 and nearly full 256 x 2 (best-fit
decreasing sources, where a plain greedy over samples used to beat the default), under the
costs ``a*L + L^2`` with a = 0, 4,096 and 24,576. Every algorithm and peer is run through the
real planner (``planner_cases``), and the tables report max rank cost over the step's proven
lower bound (``BalanceDecision.lower_bound``) at p50/p90/p99/max per peer, per mix and pooled,
and the steps on which any peer plans a lower max cost than the default. That count is the
target: zero (exit status 1 otherwise, unless ``--report-only``).
"""

from __future__ import annotations

import time
from typing import Any

from evenflow.engine._tools.bench.planner_cases import (
    _LINEAR,
    _TIE,
    PEERS,
    _Case,
    _plan_case,
    _quantiles,
)
from evenflow.engine.workloads import (
    LONGCTX,
    PACKERS,
    SFT,
    LengthMixture,
    LogNormal,
    LogUniform,
)

__all__ = ["HELDOUT_MIXES", "print_heldout", "run_heldout"]

HELDOUT_MIXES: dict[str, LengthMixture] = {
    m.name: m
    for m in (
        LengthMixture(
            name="chat",
            components=(
                LogNormal(0.95, median=400, sigma=1.1),
                LogUniform(0.05, low=8192, high=32768),
            ),
            default_seq_len=16384,
        ),
        LengthMixture(
            name="code",
            components=(
                LogNormal(0.85, median=2000, sigma=0.8),
                LogUniform(0.15, low=16384, high=65536),
            ),
            default_seq_len=32768,
        ),
        LengthMixture(
            name="longdoc",
            components=(
                LogNormal(0.30, median=1000, sigma=1.0),
                LogUniform(0.50, low=4096, high=32768),
                LogUniform(0.20, low=32768, high=131072),
            ),
            default_seq_len=65536,
        ),
        LengthMixture(
            name="heavytail",
            components=(
                LogNormal(0.97, median=600, sigma=1.3),
                LogUniform(0.03, low=16384, high=65536),
            ),
            default_seq_len=32768,
        ),
        SFT,
        LONGCTX,
    )
}
"""The held-out mixes: four the planner was never measured on, and two of the benchmark's own
(drawn with other seeds)."""

# (ranks, bins per rank, steps per case): the nearly full 256 x 2 shape gets the most steps
# after the small ones, since that is where a greedy over samples won before.
_SHAPES = ((8, 1, 8), (8, 4, 8), (64, 2, 3), (256, 2, 3))
# The benchmark draws with seed 0 (and the digests with 7): these seeds are the sweep's own.
_SEED_OFFSET = 1000
_NAMES = ("source", "lpt", *PEERS, "default")


def run_heldout(
    *,
    seed: int,
    steps: int | None = None,
    quick: bool = False,
    planner_cls: Any,
) -> dict[str, Any]:
    """Plan the held-out sweep; its document (cases, pooled quantiles, peer wins, target)."""
    started = time.perf_counter()
    shapes = ((8, 1, 2), (64, 2, 1)) if quick else _SHAPES
    mixes = ("chat", "sft") if quick else tuple(HELDOUT_MIXES)
    linear = (24576.0,) if quick else _LINEAR
    cases: list[_Case] = []
    for ranks, bins, default_steps in shapes:
        for mix in mixes:
            mixture = HELDOUT_MIXES[mix]
            for packer in PACKERS:
                for a in linear:
                    case = _Case(
                        mix,
                        packer,
                        ranks,
                        bins,
                        mixture.default_seq_len,
                        a,
                        steps or default_steps,
                    )
                    _plan_case(case, seed + _SEED_OFFSET, planner_cls, mixture)
                    cases.append(case)
    groups: dict[tuple[str, str, int, int], list[_Case]] = {}
    for case in cases:
        key = (case.distribution, case.packer, case.num_ranks, case.bins_per_rank)
        groups.setdefault(key, []).append(case)
    rows = [
        {
            "mix": mix,
            "packer": packer,
            "num_ranks": ranks,
            "bins_per_rank": bins,
            "steps": sum(c.num_steps for c in group),
            "ratio": {name: _ratios_q(group, name) for name in _NAMES},
            "peer_wins": _wins(group),
        }
        for (mix, packer, ranks, bins), group in sorted(groups.items())
    ]
    wins = _wins(cases)
    any_win = sum(_any_win_steps(c) for c in cases)
    return {
        "benchmark": "planner-heldout",
        "seed": seed + _SEED_OFFSET,
        "mixes": list(mixes),
        "num_steps": sum(c.num_steps for c in cases),
        "pooled": {name: _ratios_q(cases, name) for name in _NAMES},
        "groups": rows,
        "peer_wins": wins,
        "steps_any_peer_wins": any_win,
        "violations": sum(c.violations for c in cases),
        "targets": [
            {
                "name": "no peer plans a lower max cost than default on any step",
                "measured": any_win,
                "status": "PASS" if any_win == 0 else "MISS",
            }
        ],
        "wall_s": time.perf_counter() - started,
    }


def _bound_ratios(case: _Case, name: str) -> list[float]:
    """Max rank cost over the proven lower bound, per step (``gap`` is ``ratio - 1``)."""
    default = case.algos["default"]
    if name != "source":
        return [1.0 + g for g in case.algos[name].gaps]
    bounds = [obj / (1.0 + g) for obj, g in zip(default.objectives, default.gaps, strict=True)]
    return [s / b for s, b in zip(case.source_objectives, bounds, strict=True)]


def _ratios_q(cases: list[_Case], name: str) -> dict[str, float | None]:
    values = [r for c in cases for r in _bound_ratios(c, name)]
    return _quantiles(values, "p50", "p90", "p99", "max")


def _others(case: _Case, k: int) -> dict[str, float]:
    """Step ``k``'s max rank cost under the source, ``lpt`` and every peer."""
    out = {"source": case.source_objectives[k]}
    out.update({name: case.algos[name].objectives[k] for name in ("lpt", *PEERS)})
    return out


def _wins(cases: list[_Case]) -> dict[str, int]:
    """Per peer (the source and ``lpt`` included): the steps it is below the default."""
    wins = dict.fromkeys(("source", "lpt", *PEERS), 0)
    for case in cases:
        for k, mine in enumerate(case.algos["default"].objectives):
            for name, value in _others(case, k).items():
                wins[name] += value < mine * (1 - _TIE)
    return wins


def _any_win_steps(case: _Case) -> int:
    """Steps of ``case`` on which the source or any peer is below the default's max cost."""
    default = case.algos["default"].objectives
    return sum(min(_others(case, k).values()) < mine * (1 - _TIE) for k, mine in enumerate(default))


def _fmt(q: dict[str, float | None]) -> str:
    return "/".join("-" if q[n] is None else f"{q[n]:.3f}" for n in ("p50", "p90", "p99", "max"))


def print_heldout(doc: dict[str, Any]) -> None:
    """The held-out sweep's tables."""
    print(
        f"evenflow planner held-out sweep: mixes {doc['mixes']}, seed {doc['seed']}, "
        f"{doc['num_steps']} steps"
    )
    print("max rank cost / proven lower bound, p50/p90/p99/max over steps")
    width = 26
    header = f"{'mix':<11}{'packer':<9}{'shape':>7}{'steps':>6}  " + "".join(
        f"{name:<{width}}" for name in _NAMES
    )
    print(header)
    print("-" * len(header))
    for row in doc["groups"]:
        shape = f"{row['num_ranks']}x{row['bins_per_rank']}"
        cells = "".join(f"{_fmt(row['ratio'][name]):<{width}}" for name in _NAMES)
        print(f"{row['mix']:<11}{row['packer']:<9}{shape:>7}{row['steps']:>6}  {cells}")
    pooled = "".join(f"{_fmt(doc['pooled'][name]):<{width}}" for name in _NAMES)
    print(f"{'all':<11}{'':<9}{'':>7}{doc['num_steps']:>6}  {pooled}")
    print()
    wins = doc["peer_wins"]
    print(
        "steps where a peer plans a lower max cost than default: "
        + ", ".join(f"{name} {count}" for name, count in wins.items())
        + f"; any of them: {doc['steps_any_peer_wins']} of {doc['num_steps']}"
    )
    target = doc["targets"][0]
    print(f"target {target['name']}: {target['measured']} steps {target['status']}")
