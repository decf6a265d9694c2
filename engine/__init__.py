"""evenflow.engine — planning and scheduling of balanced, packed training steps."""

from __future__ import annotations

import importlib
from typing import Any

from evenflow.engine import errors
from evenflow.engine._model import OversizedPolicy, PackingConstraints, SampleKey, SampleMetadata
from evenflow.engine._plan import BalanceDecision, BinPlan, Plan

# Names served lazily from their modules (resolved on first access).
_LAZY: dict[str, str] = {
    # cost models
    "CostModel": "evenflow.engine._planning.cost",
    "TokenCost": "evenflow.engine._planning.cost",
    "QuadraticCost": "evenflow.engine._planning.cost",
    "ComponentCost": "evenflow.engine._planning.cost",
    "FlopsCost": "evenflow.engine._planning.flops",
    # balancing
    "BalancingAlgorithm": "evenflow.engine._planning.problem",
    "BalanceProblem": "evenflow.engine._planning.problem",
    "FlatLayout": "evenflow.engine._planning.problem",
    "LPTAlgorithm": "evenflow.engine._planning.lpt",
    "RefineAlgorithm": "evenflow.engine._planning.refine",
    "Planner": "evenflow.engine._planning.planner",
    # pipeline
    "LoaderConfig": "evenflow.engine._config",
    "BalancedLoader": "evenflow.engine._pipeline.loader",
    "default_pack_fn": "evenflow.engine._pipeline.pack",
    "default_collate_fn": "evenflow.engine._pipeline.pack",
    "Tracer": "evenflow.engine._tracing.tracer",
    "build_loader": "evenflow.engine._distributed.topology",
    "DistributedLoader": "evenflow.engine._distributed.loader",
    "StepStats": "evenflow.engine._pipeline.stats",
    "NullTracer": "evenflow.engine._tracing.tracer",
    "merge_chrome_traces": "evenflow.engine._tracing.tracer",
}

__all__ = [
    "BalanceDecision",
    "BalanceProblem",
    "BalancedLoader",
    "BalancingAlgorithm",
    "BinPlan",
    "ComponentCost",
    "CostModel",
    "DistributedLoader",
    "FlatLayout",
    "FlopsCost",
    "LPTAlgorithm",
    "LoaderConfig",
    "NullTracer",
    "OversizedPolicy",
    "PackingConstraints",
    "Plan",
    "Planner",
    "QuadraticCost",
    "RefineAlgorithm",
    "SampleKey",
    "SampleMetadata",
    "StepStats",
    "TokenCost",
    "Tracer",
    "build_loader",
    "default_collate_fn",
    "default_pack_fn",
    "errors",
    "merge_chrome_traces",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evenflow.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
