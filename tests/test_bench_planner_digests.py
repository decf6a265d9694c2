"""The plan-digest sweep: one line per planned step, and a comparison that finds a change."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.engine._tools.bench import planner_digests


def test_the_quick_sweep_is_a_pure_function_of_the_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert planner_digests.main(["--quick"]) == 0
    first = capsys.readouterr().out
    assert planner_digests.main(["--quick"]) == 0
    second = capsys.readouterr().out
    lines = first.splitlines()
    assert first == second and len(lines) > 100
    # Every kind of case is in it: both searching objectives, lpt, budgets, windows.
    for part in ("/makespan/", "/lockstep/", "/balance/", "/lpt/", "/budget=", "window/"):
        assert any(part in line for line in lines), part
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text(first)
    new.write_text(first)
    assert planner_digests.main(["--compare", str(old), str(new)]) == 0
    assert f"{len(lines)} steps compared, 0 differ" in capsys.readouterr().out
    name, digest, rest = lines[7].split(" ", 2)
    changed = [*lines[:7], f"{name} {'0' * len(digest)} {rest}", *lines[8:]]
    new.write_text("\n".join(changed) + "\n")
    assert planner_digests.main(["--compare", str(old), str(new)]) == 1
    assert f"{len(lines)} steps compared, 1 differ" in capsys.readouterr().out
