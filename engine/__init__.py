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
    "CostModel": "evenflow.engine._cost",
    "TokenCost": "evenflow.engine._cost",
    "QuadraticCost": "evenflow.engine._cost",
    "ComponentCost": "evenflow.engine._cost",
    "FlopsCost": "evenflow.engine._flops",
    # balancing
    "BalancingAlgorithm": "evenflow.engine._algorithms",
    "BalanceProblem": "evenflow.engine._algorithms",
    "FlatLayout": "evenflow.engine._algorithms",
    "LPTAlgorithm": "evenflow.engine._algorithms",
    "RefineAlgorithm": "evenflow.engine._algorithms",
    "Planner": "evenflow.engine._planner",
    # pipeline
    "LoaderConfig": "evenflow.engine._config",
    "BalancedLoader": "evenflow.engine._loader",
    "default_pack_fn": "evenflow.engine._pack",
    "default_collate_fn": "evenflow.engine._pack",
    "Tracer": "evenflow.engine._tracing",
    "build_loader": "evenflow.engine._topology",
    "DistributedLoader": "evenflow.engine._mp_broadcast",
    "StepStats": "evenflow.engine._stats",
    "NullTracer": "evenflow.engine._tracing",
    "merge_chrome_traces": "evenflow.engine._tracing",
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
