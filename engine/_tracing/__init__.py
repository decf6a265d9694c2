"""Tracing: spans for every stage step, their sinks and summaries, and the data-stall meter.

``tracer`` holds :class:`Tracer` (spans and their sinks: logging, JSONL, Chrome trace,
``torch.profiler``) and :class:`NullTracer`; ``stall`` the per-stage statistics and the
:class:`StallMeter`; ``chrome`` :func:`merge_chrome_traces`.
"""

from evenflow.engine._tracing.chrome import merge_chrome_traces
from evenflow.engine._tracing.stall import StallMeter
from evenflow.engine._tracing.tracer import (
    COMPUTE_STAGE,
    WAIT_STAGE,
    NullTracer,
    Span,
    Tracer,
    resolve_tracer,
)

__all__ = [
    "COMPUTE_STAGE",
    "WAIT_STAGE",
    "NullTracer",
    "Span",
    "StallMeter",
    "Tracer",
    "merge_chrome_traces",
    "resolve_tracer",
]
