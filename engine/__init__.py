"""evenflow.engine — planning and scheduling of balanced, packed training steps."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from evenflow.engine import errors
from evenflow.engine._model import OversizedPolicy, PackingConstraints, SampleKey, SampleMetadata
from evenflow.engine._plan import BalanceDecision, BinPlan, Plan

if TYPE_CHECKING:
    # The names below are served lazily at run time (see __getattr__); type checkers
    # import them here so that users see the real classes and functions, never Any.
    from evenflow.engine._config import LoaderConfig
    from evenflow.engine._distributed.build import build_loader
    from evenflow.engine._distributed.loader import DistributedLoader
    from evenflow.engine._pipeline.calibration import CalibrationStats
    from evenflow.engine._pipeline.loader import BalancedLoader
    from evenflow.engine._pipeline.loss_tokens import LossTokens
    from evenflow.engine._pipeline.pack import (
        count_loss_tokens,
        default_collate_fn,
        default_pack_fn,
    )
    from evenflow.engine._pipeline.pass_report import PassSummary, RankUnread, UnevenEnd
    from evenflow.engine._pipeline.stats import StepStats
    from evenflow.engine._planning.calibration import CalibratedCost
    from evenflow.engine._planning.cost import ComponentCost, CostModel, QuadraticCost, TokenCost
    from evenflow.engine._planning.flops import FlopsCost
    from evenflow.engine._planning.lpt import LPTAlgorithm
    from evenflow.engine._planning.planner import Planner
    from evenflow.engine._planning.problem import BalanceProblem, BalancingAlgorithm, FlatLayout
    from evenflow.engine._planning.refine import RefineAlgorithm
    from evenflow.engine._planning.vision import VisionLanguageCost
    from evenflow.engine._sources._common import IndexedSample, SourceReport
    from evenflow.engine._sources.dataset import DatasetSource
    from evenflow.engine._sources.iterable import IterableSource
    from evenflow.engine._sources.packing import PackedSteps, pack_lengths
    from evenflow.engine._tracing import NullTracer, Tracer, merge_chrome_traces

# Names served lazily from their modules (resolved on first access).
_LAZY: dict[str, str] = {
    # cost models
    "CostModel": "evenflow.engine._planning.cost",
    "TokenCost": "evenflow.engine._planning.cost",
    "QuadraticCost": "evenflow.engine._planning.cost",
    "ComponentCost": "evenflow.engine._planning.cost",
    "FlopsCost": "evenflow.engine._planning.flops",
    "CalibratedCost": "evenflow.engine._planning.calibration",
    "VisionLanguageCost": "evenflow.engine._planning.vision",
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
    "count_loss_tokens": "evenflow.engine._pipeline.pack",
    "default_collate_fn": "evenflow.engine._pipeline.pack",
    "Tracer": "evenflow.engine._tracing",
    "build_loader": "evenflow.engine._distributed.build",
    "DistributedLoader": "evenflow.engine._distributed.loader",
    "StepStats": "evenflow.engine._pipeline.stats",
    "CalibrationStats": "evenflow.engine._pipeline.calibration",
    "LossTokens": "evenflow.engine._pipeline.loss_tokens",
    "PassSummary": "evenflow.engine._pipeline.pass_report",
    "RankUnread": "evenflow.engine._pipeline.pass_report",
    "UnevenEnd": "evenflow.engine._pipeline.pass_report",
    "NullTracer": "evenflow.engine._tracing",
    "merge_chrome_traces": "evenflow.engine._tracing",
    # step sources
    "DatasetSource": "evenflow.engine._sources.dataset",
    "IterableSource": "evenflow.engine._sources.iterable",
    "IndexedSample": "evenflow.engine._sources._common",
    "SourceReport": "evenflow.engine._sources._common",
    "PackedSteps": "evenflow.engine._sources.packing",
    "pack_lengths": "evenflow.engine._sources.packing",
}

__all__ = [
    "BalanceDecision",
    "BalanceProblem",
    "BalancedLoader",
    "BalancingAlgorithm",
    "BinPlan",
    "CalibratedCost",
    "CalibrationStats",
    "ComponentCost",
    "CostModel",
    "DatasetSource",
    "DistributedLoader",
    "FlatLayout",
    "FlopsCost",
    "IndexedSample",
    "IterableSource",
    "LPTAlgorithm",
    "LoaderConfig",
    "LossTokens",
    "NullTracer",
    "OversizedPolicy",
    "PackedSteps",
    "PackingConstraints",
    "PassSummary",
    "Plan",
    "Planner",
    "QuadraticCost",
    "RankUnread",
    "RefineAlgorithm",
    "SampleKey",
    "SampleMetadata",
    "SourceReport",
    "StepStats",
    "TokenCost",
    "Tracer",
    "UnevenEnd",
    "VisionLanguageCost",
    "build_loader",
    "count_loss_tokens",
    "default_collate_fn",
    "default_pack_fn",
    "errors",
    "merge_chrome_traces",
    "pack_lengths",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evenflow.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
