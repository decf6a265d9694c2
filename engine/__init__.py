"""evenflow.engine — balanced, packed training steps for data-parallel loops.

This is the face for loop users (build, drive and resume a loader over a source) and for
observers (traces, per-step statistics, the end-of-pass summary). Cost-model and balancing
algorithm authors find their names in :mod:`evenflow.engine.planning`; a source's resume
contract is checked by :mod:`evenflow.engine.testing`.

Every public name is declared once below, as ``from module import name as name``: at top level
when it is imported with the package, under ``TYPE_CHECKING`` when it is served lazily on first
access (type checkers read the same line). ``_serve`` (``transports/_face.py``) derives
``__all__`` and the lazy lookup from these lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenflow.engine import errors as errors
from evenflow.engine._model import OversizedPolicy as OversizedPolicy
from evenflow.engine._model import SampleMetadata as SampleMetadata
from evenflow.engine._plan import BalanceDecision as BalanceDecision
from evenflow.transports.internal import serve as _serve

if TYPE_CHECKING:
    # Loop users: the loader, its configuration and the sources it reads.
    from evenflow.engine._config import LoaderConfig as LoaderConfig
    from evenflow.engine._distributed.build import build_loader as build_loader
    from evenflow.engine._distributed.loader import DistributedLoader as DistributedLoader
    from evenflow.engine._pipeline.loader import BalancedLoader as BalancedLoader
    from evenflow.engine._pipeline.loss_tokens import LossTokens as LossTokens
    from evenflow.engine._pipeline.pack import count_loss_tokens as count_loss_tokens
    from evenflow.engine._pipeline.pack import default_collate_fn as default_collate_fn
    from evenflow.engine._pipeline.pack import default_pack_fn as default_pack_fn
    from evenflow.engine._sources._common import IndexedSample as IndexedSample
    from evenflow.engine._sources.dataset import DatasetSource as DatasetSource
    from evenflow.engine._sources.iterable import IterableSource as IterableSource
    from evenflow.engine._sources.packing import PackedSteps as PackedSteps
    from evenflow.engine._sources.packing import pack_lengths as pack_lengths

    # isort: split
    # Observers: traces, per-step statistics and what a pass or a source reports.
    from evenflow.engine._pipeline.calibration import CalibrationStats as CalibrationStats
    from evenflow.engine._pipeline.pass_report import PassSummary as PassSummary
    from evenflow.engine._pipeline.pass_report import RankUnread as RankUnread
    from evenflow.engine._pipeline.pass_report import UnevenEnd as UnevenEnd
    from evenflow.engine._pipeline.stats import StepStats as StepStats
    from evenflow.engine._sources._common import SourceReport as SourceReport
    from evenflow.engine._sources.transform_pool import StepTransform as StepTransform
    from evenflow.engine._sources.transform_pool import TransformReport as TransformReport
    from evenflow.engine._tracing import NullTracer as NullTracer
    from evenflow.engine._tracing import Tracer as Tracer
    from evenflow.engine._tracing import merge_chrome_traces as merge_chrome_traces

_serve(__name__, moved_to=("evenflow.engine.planning",))
