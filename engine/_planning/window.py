"""Planning a balance window: every step of the window planned on its own (zero delay).

A placeholder with the window planner's interface, so that the pipeline's window mode can be
built and tested before the cross-step planner exists; each step's plan is exactly
``planner.plan_arrays(columns[i], first_step + i)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from evenflow.engine._plan import Plan
from evenflow.engine._planning.columns import StepColumns

__all__ = ["WindowPlan", "plan_window"]


@dataclass(frozen=True)
class WindowPlan:
    """``plans[i]`` is delivered as step ``first_step + i``."""

    plans: tuple[Plan, ...]


def plan_window(planner: Any, columns: Sequence[StepColumns], first_step: int) -> WindowPlan:
    return WindowPlan(tuple(planner.plan_arrays(c, first_step + i) for i, c in enumerate(columns)))
