"""The schedule holds every tuning constant of the planner: none is defined anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from evenflow.engine._planning import native, schedule

_PLANNING = Path(schedule.__file__).resolve().parent

# Numeric module constants of planning modules that tune nothing: each is an arithmetic
# margin, a representation limit or a parameter of the reported bound (which changes no plan).
_NOT_TUNING = {
    ("columns.py", "_INT64_MAX"): "the largest int64, a representation limit",
    ("search.py", "_COMPILED_STATE_BINS"): "where numpy's summation order changes (rounding)",
    ("settle.py", "_MARGIN"): "rounding margin between two summation orders",
    ("native.py", "ALL_FAMILIES"): "a bit mask: every entry of a phase's table of families",
    ("bounds.py", "_ROUNDING"): "rounding margin of the reported bound",
    ("bounds.py", "_CAPACITY_CANDIDATES"): "work of the reported bound; plans do not read it",
    ("bounds.py", "_HEAVY_SHARES"): "work of the reported bound; plans do not read it",
    ("bounds.py", "_SHARED_BINS"): "work of the reported bound; plans do not read it",
}
# Cost models define what a plan balances, not how it searches (and have their own tests):
# calibration's Huber constant and ridge are the fit's, vision's the encoder's cost.
_NOT_SEARCH = {"calibration.py", "cost.py", "flops.py", "schedule.py", "vision.py"}
# #defines of the core that tune nothing: its version, arithmetic margins and precision.
_C_NOT_TUNING = {
    "CORE_VERSION": "the core's version, part of the planner's identity",
    "EJECT_MARGIN": "rounding margin under the peak (settle)",
    "ROUNDING": "rounding margin of the compiled bound",
    "RESOLUTION": "precision of the compiled bound's bisection",
    "BISECTIONS": "precision of the compiled bound's bisection",
}
_NAME = re.compile(r"_?[A-Z][A-Z0-9_]*$")


def _is_number(node: ast.AST) -> bool:
    """A literal number, or arithmetic / a tuple of them (``1 << 21``, ``(0.5, 0.6)``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return False


def numeric_constants(source: str) -> list[str]:
    """Module-level upper-case names bound to a literal number (or numbers) in ``source``."""
    found = []
    for node in ast.parse(source).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not _is_number(value):
            continue
        found.extend(
            t.id for t in targets if isinstance(t, ast.Name) and _NAME.match(t.id) is not None
        )
    return found


def c_defines(source: str) -> dict[str, float]:
    """``#define NAME number`` lines of a C source."""
    out = {}
    for name, value in re.findall(r"^#define\s+([A-Z][A-Z0-9_]*)\s+([0-9][0-9eE.+-]*)\s*$",
                                  source, flags=re.MULTILINE):
        out[name] = float(value)
    return out


def test_no_planning_module_defines_a_tuning_constant_outside_the_schedule() -> None:
    stray = [
        f"{path.name}: {name}"
        for path in sorted(_PLANNING.glob("*.py"))
        if path.name not in _NOT_SEARCH
        for name in numeric_constants(path.read_text())
        if (path.name, name) not in _NOT_TUNING
    ]
    assert stray == [], f"tuning constants outside schedule.py: {stray}"


def test_the_scan_finds_a_constant_defined_outside_the_schedule() -> None:
    source = 'import x\n\n_TRIES = 12\nLIMIT: float = 1e-3\nSHARES = (0.5, 0.6)\nname = 3\n'
    assert numeric_constants(source) == ["_TRIES", "LIMIT", "SHARES"]
    assert numeric_constants("CELLS = 1 << 21\nLABEL = 'x'\nFLAG = True\n") == ["CELLS"]


def test_every_tuning_define_of_the_core_is_listed_in_the_schedule_and_matches() -> None:
    listed = {name: (value, file) for name, (value, file, _) in schedule.CORE_CONSTANTS.items()}
    for path in sorted([*_PLANNING.glob("*.c"), *_PLANNING.glob("*.h")]):
        for name, value in c_defines(path.read_text()).items():
            if name in _C_NOT_TUNING:
                continue
            key = name if name in listed else f"SETTLE_{name}"
            assert key in listed, f"{path.name}: #define {name} is not in schedule.CORE_CONSTANTS"
            assert listed[key] == (value, path.name), (name, value, listed[key])


@pytest.mark.parametrize("name", sorted(schedule.CORE_CONSTANTS))
def test_the_compiled_core_exports_the_listed_value(name: str) -> None:
    assert getattr(native._core, name) == schedule.CORE_CONSTANTS[name][0]


def test_budgets_follow_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    # The budgets read the schedule's constants when they run, so a retune is one edit there.
    assert schedule.stay_budget(700, 64) == schedule.STAY_ATTEMPTS + 700 // 64 + 32
    monkeypatch.setattr(schedule, "STAY_ATTEMPTS", 0)
    assert schedule.stay_budget(700, 64) == 700 // 64 + 32


def test_the_default_algorithm_runs_the_stages_the_schedule_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Searches (first phase, then phases alternating) run as the schedule says: the search from
    # the best start with the plan's budget, then the finish's searches from the source with
    # theirs. Without those stages only the first search runs.
    import dataclasses

    from evenflow.engine.planning import Planner, RefineAlgorithm
    from evenflow.engine.workloads import make_step

    budgets: list[int] = []

    class Recording(RefineAlgorithm):
        def _refine(self, problem, origin, budget, **kwargs):  # type: ignore[no-untyped-def]
            budgets.append(budget)
            return super()._refine(problem, origin, budget, **kwargs)

    samples, bins = make_step(
        "longctx", "firstfit", num_ranks=8, bins_per_rank=4, seq_len=131072, seed=0, step=1
    )
    planner = Planner(num_ranks=8, bins_per_rank=4, seq_len=131072, algorithm=Recording())
    with_finish = planner.plan(samples, bins, 1)
    n = len(samples)
    assert n > schedule.MULTI_START_SAMPLES  # one search from the best start
    by_size = max(n // schedule.SAMPLES_PER_ATTEMPT, 8 // schedule.RANKS_PER_ATTEMPT)
    first = min(max(by_size, schedule.MIN_BUDGET), schedule.MAX_BUDGET)
    assert budgets[0] == first
    assert budgets[1] == schedule.stay_budget(n, 8)
    assert len(budgets) >= 2
    plain = dataclasses.replace(
        schedule.DEFAULT,
        finish=(schedule.Settle("finalists", "plain"), schedule.Choose(),
                schedule.Settle("chosen", "thorough")),
    )
    monkeypatch.setattr(schedule, "DEFAULT", plain)
    budgets.clear()
    without = planner.plan(samples, bins, 1)
    assert budgets == [first]
    assert without.num_moved >= with_finish.num_moved  # the finish's searches move less
