"""The pipeline digests tool: two seeded Gloo runs give the same facts, and its comparison
finds a changed batch, a changed plan and a missing collective."""

from __future__ import annotations

import pytest

from evenflow.engine._tools.bench import pipeline_digests as pd

pytestmark = pytest.mark.multiprocess

NAMES = ["payload", "shared-device1-window2"]


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return pd.run_world(2, NAMES, deadline=120.0)


def test_two_runs_agree_and_record_batches_plans_spans_and_collectives(lines: list[str]) -> None:
    # A second world for one configuration: enough to catch a fact that depends on timing.
    again = pd.run_world(2, NAMES[:1], deadline=120.0)
    first = [line for line in lines if line.startswith(f"2r/{NAMES[0]}/")]
    count, report = pd.compare_lines(first, again)
    assert count == 0, "\n".join(report)
    keys = [line.split(" ", 1)[0] for line in lines]
    for name in NAMES:
        for rank in (0, 1):
            head = f"2r/{name}/r{rank}"
            assert f"{head}/e0/s0" in keys and f"{head}/e1/s0" in keys
            assert f"{head}/resume/s{pd._CUT}" in keys
            assert f"{head}/trace/plan" in keys and f"{head}/call0" in keys
    assert any(k.endswith("/trace/exchange") for k in keys if "/payload/" in k)
    shared = [k for k in keys if "/shared-device1-window2/" in k]
    assert any(k.endswith("/trace/read_assigned") for k in shared)
    assert any(k.endswith("/trace/h2d") for k in shared)  # the device path ran


def test_compare_finds_a_changed_batch_a_changed_plan_and_a_missing_call(
    lines: list[str],
) -> None:
    step = next(i for i, line in enumerate(lines) if line.startswith("2r/payload/r1/e0/s2 "))
    changed = list(lines)
    changed[step] = changed[step].replace("batch=", "batch=0", 1)
    count, report = pd.compare_lines(lines, changed)
    assert count == 1 and report[0].startswith("- 2r/payload/r1/e0/s2 batch="), report

    changed = [line.replace(" plan=", " plan=f") if "/e1/s1 " in line else line for line in lines]
    count, _ = pd.compare_lines(lines, changed)
    assert count == 2 * len(NAMES)  # one step on each rank of each configuration

    last = max(i for i, line in enumerate(lines) if "/shared-device1-window2/r0/call" in line)
    count, report = pd.compare_lines(lines, lines[:last] + lines[last + 1 :])
    assert count == 1 and "(absent)" in report[1], report


def test_compare_refuses_concatenated_outputs(lines: list[str]) -> None:
    with pytest.raises(ValueError, match=r"hold the key .* twice"):
        pd.compare_lines(lines + lines[:1], lines)
