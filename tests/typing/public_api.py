"""User-style code that ``.ci/lint`` checks with ``mypy --strict``; it is never run.

If a public name reached type checkers as ``Any`` (a module-level ``__getattr__`` without a
``TYPE_CHECKING`` import does that), every ``assert_type`` on it fails ("Expression is of type
\"Any\"") and the lint step turns red instead of users silently losing their types.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import assert_type

from evenflow.engine import (
    BalancedLoader,
    DistributedLoader,
    LoaderConfig,
    LossTokens,
    SampleMetadata,
    StepStats,
    Tracer,
    build_loader,
)
from evenflow.engine.planning import FlopsCost, Planner, TokenCost
from evenflow.transports import GlooTransport, Transport


def steps() -> Iterator[list[list[list[int]]]]:
    yield [[[1, 2, 3]], [[4, 5]]]


def check_public_types(transport: GlooTransport) -> None:
    config = LoaderConfig(seq_len=4096, bins_per_rank=2)
    assert_type(config, LoaderConfig)
    assert_type(config.seq_len, int)
    tracer = Tracer()
    assert_type(tracer, Tracer)
    planner = Planner(num_ranks=2, bins_per_rank=2, seq_len=4096)
    assert_type(planner, Planner)
    loader = BalancedLoader(steps(), config=config, transport=transport, tracer=tracer)
    assert_type(loader, BalancedLoader)
    stats = loader.last_stats
    assert_type(stats, StepStats | None)
    tokens = loader.last_loss_tokens
    assert_type(tokens, LossTokens | None)
    if tokens is not None:
        assert_type(tokens.loss_scale(2), float)
    assert_type(transport, GlooTransport)
    generic: Transport = transport
    assert_type(generic, Transport)
    assert_type(build_loader(steps(), config, transport="gloo"), DistributedLoader)
    meta = SampleMetadata(tokens=3)
    assert_type(meta, SampleMetadata)
    assert_type(TokenCost()(meta), float)
    flops = FlopsCost({"model_type": "llama"})
    assert_type(flops.model_id, str)
