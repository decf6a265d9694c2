"""What a loader is made of besides its source and transport, validated, and its identity.

``BalancedLoader`` builds its parts here, and so does a model-parallel follower
(``DistributedLoader.follower``), which has no source and no balance transport but must
validate the same arguments the same way and hold the same identity as its constructor: the
build agreement compares identities across ranks, and a follower's checkpoint carries the
fingerprint. One function for both makes them equal by construction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._pipeline.h2d import DeviceStager
from evenflow.engine._pipeline.pack import default_collate_fn, default_pack_fn, with_loss_tokens
from evenflow.engine._planning.planner import Planner
from evenflow.engine._tracing import resolve_tracer
from evenflow.engine.errors import ConfigError

if TYPE_CHECKING:
    from evenflow.engine._pipeline.h2d import DeviceStager
    from evenflow.engine._pipeline.stats import StepStats
    from evenflow.engine._planning.planner import Planner
    from evenflow.engine._tracing import NullTracer, Tracer

__all__ = [
    "LIBRARY_VERSION",
    "LoaderParts",
    "check_callables",
    "check_config",
    "default_metadata_fn",
    "fingerprint_of",
    "loader_identity",
    "loader_parts",
    "resume_identity",
]

LIBRARY_VERSION = "0.1.0"
#: Settings that may change across a restart: they decide how long a run goes, how far ahead
#: it reads, how it waits, logs and where it plans, never which samples form which step or
#: where they train (``planning``: the leader computes the very plan every rank would).
RUNTIME_ONLY = (
    "close_timeout",
    "device_prefetch_depth",
    "log_stats",
    "max_steps",
    "on_uneven_end",
    "planning",
    "prefetch_depth",
    "switch_interval",
    "thread_nice",
    "timeout",
)


def default_metadata_fn(sample: Any) -> int:
    """Token count of a sample: ``len(sample["input_ids"])`` for mappings, else ``len(sample)``."""
    if isinstance(sample, Mapping):
        if "input_ids" in sample:
            return len(sample["input_ids"])
        # len() of a mapping counts its keys, not tokens: never guess.
        raise ConfigError(
            f"The default metadata_fn measures a dict sample by its 'input_ids', but this "
            f"sample has keys {sorted(map(str, sample))[:8]}. Pass metadata_fn= (e.g. "
            "lambda s: len(s['tokens'])), or give the source the column to measure "
            "(DatasetSource(length_column=...), IterableSource(length_fn=...))."
        )
    try:
        return len(sample)
    except TypeError:
        if isinstance(sample, (int, np.integer)) and not isinstance(sample, bool):
            raise ConfigError(
                f"A sample is the number {sample!r}: the source's steps are one nesting level "
                "short. A step is a list of bins_per_rank bins, each a list of samples, and a "
                "sample is a sequence of token ids (or a dict with 'input_ids'). Wrap each "
                "step's samples in bins (DatasetSource and IterableSource do it for you)."
            ) from None
        raise TypeError(
            f"The default metadata_fn cannot measure a sample of type {type(sample).__name__}; "
            "pass metadata_fn=lambda sample: SampleMetadata(tokens=...)."
        ) from None


class _KeepSource:
    """The algorithm used with ``balance=False``: always keep the source layout."""

    name = "source"
    algorithm_id = "source-v1"

    def assign(self, problem: Any) -> None:
        return None


@dataclass(frozen=True)
class LoaderParts:
    """The validated, source-independent parts of one loader."""

    config: LoaderConfig
    metadata_fn: Callable[[Any], Any]
    pack_fn: Callable[[list[Any], int], Any]
    collate_fn: Callable[[list[Any]], Any]
    planner: Planner
    stager: DeviceStager
    tracer: Tracer | NullTracer
    stats_callback: Callable[[StepStats], None] | None


def check_config(config: object) -> LoaderConfig:
    if not isinstance(config, LoaderConfig):
        raise TypeError(f"config must be a LoaderConfig, but got {config!r:.80}.")
    return config


def check_callables(**fns: object) -> None:
    """Raise ``TypeError`` naming the first argument that is neither None nor callable."""
    for name, fn in fns.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, but got {fn!r:.80}.")


def loader_parts(
    config: LoaderConfig,
    *,
    num_ranks: int,
    metadata_fn: Callable[[Any], Any] | None = None,
    pack_fn: Callable[[list[Any], int], Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    cost_model: Any = None,
    algorithm: Any = "default",
    device: Any = None,
    move_fn: Callable[[Any, Any], Any] | None = None,
    cpu_fields: Sequence[str] = (),
    tracer: Any = None,
    stats_callback: Callable[[StepStats], None] | None = None,
) -> LoaderParts:
    """Validate a loader's arguments and build its parts for a group of ``num_ranks``.

    Takes exactly ``BalancedLoader``'s keyword arguments besides ``source`` and
    ``transport``, so an unknown or misspelled one fails here as it fails there.
    """

    check_config(config)
    check_callables(
        metadata_fn=metadata_fn,
        pack_fn=pack_fn,
        collate_fn=collate_fn,
        move_fn=move_fn,
        stats_callback=stats_callback,
    )
    planner = Planner(
        num_ranks=num_ranks,
        bins_per_rank=config.bins_per_rank,
        seq_len=config.seq_len,
        cost_model=cost_model,
        algorithm=algorithm if config.balance else _KeepSource(),
        objective=config.objective,
        min_balance_gain=config.min_balance_gain,
        oversized_policy=config.oversized_policy,
        packing_budgets=dict(config.packing_budgets or {}) or None,
    )
    stager = DeviceStager(device, move_fn=move_fn, cpu_fields=tuple(cpu_fields))
    try:
        resolved_tracer = resolve_tracer(tracer)
    except BaseException:
        stager.close()
        raise
    return LoaderParts(
        config=config,
        # The default pack's loss targets are known from the samples: count them, so every
        # step's LossTokens is available without a custom metadata_fn.
        metadata_fn=with_loss_tokens(metadata_fn or default_metadata_fn)
        if pack_fn is None
        else metadata_fn or default_metadata_fn,
        pack_fn=pack_fn or default_pack_fn,
        collate_fn=collate_fn or default_collate_fn,
        planner=planner,
        stager=stager,
        tracer=resolved_tracer,
        stats_callback=stats_callback,
    )


def loader_identity(
    config: LoaderConfig,
    planner: Planner,
    group: Sequence[int],
    transport: str,
    *,
    for_resume: bool = False,
) -> dict[str, Any]:
    """Plain data every rank of a group must agree on: configuration, planner identity
    (cost model and algorithm), group layout, transport name and library version.

    ``for_resume=True`` leaves out the settings that may change across a restart without
    changing what is delivered (prefetch depth, timeout, logging).
    """
    settings = config.to_dict()
    if for_resume:
        for name in RUNTIME_ONLY:
            settings.pop(name, None)
    return {
        "config": settings,
        "planner": planner.identity(),
        "group": list(group),
        "transport": transport,
        "version": LIBRARY_VERSION,
    }


def resume_identity(config: LoaderConfig, planner: Planner) -> dict[str, Any]:
    """What a restore must match, the same on every rank of any layout: the configuration
    without the settings in ``RUNTIME_ONLY``, the planner's identity without its group size,
    and the library version. The group layout is checked apart, by sources that need it."""
    settings = config.to_dict()
    for name in RUNTIME_ONLY:
        settings.pop(name, None)
    planner_identity = dict(planner.identity())
    planner_identity.pop("num_ranks", None)
    return {"config": settings, "planner": planner_identity, "version": LIBRARY_VERSION}


def fingerprint_of(identity: dict[str, Any]) -> str:
    """Digest of an identity (24 hex characters)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
