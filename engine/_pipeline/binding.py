"""How a loader takes its transports and its source: resolved, checked, and bound.

A transport may be given as an instance or by name (the loader then owns it); the world
transport of the world round must be a separate Gloo (CPU) transport. A step source
(``DatasetSource``, ``IterableSource``, or any source with ``bind_loader``) learns the loader's
step shape and this rank's data-parallel position, and may refuse the loader's values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from evenflow.engine._config import LoaderConfig
from evenflow.engine.errors import ConfigError
from evenflow.transports import Transport, create_transport

__all__ = [
    "bind_source",
    "check_source",
    "check_world_transport",
    "resolve_transport",
    "source_metadata_fn",
]


def check_source(source: object) -> None:
    """Raise a TypeError unless ``source`` can be iterated (sync or async)."""
    if not (hasattr(source, "__iter__") or hasattr(source, "__aiter__")):
        raise TypeError(
            f"source must be an iterable or async iterable of steps, but got "
            f"{type(source).__name__}."
        )


def source_metadata_fn(
    source: Any, metadata_fn: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """``metadata_fn``, or when none is given, the source's own: a step source
    (``DatasetSource``, ``IterableSource``) knows its samples' token counts, and in
    shared-dataset mode its items are indices that only it can describe."""
    own = getattr(source, "metadata_fn", None)
    if metadata_fn is None and callable(own):
        return own  # type: ignore[no-any-return]
    return metadata_fn


def resolve_transport(
    transport: Transport | str | None, config: LoaderConfig
) -> tuple[Transport, bool]:
    """The balance group's transport, and whether the loader owns it (created from a name;
    ``None`` is the one-rank ``"local"`` transport)."""
    if isinstance(transport, Transport):
        return transport, False
    if transport is None:
        transport = "local"
    if isinstance(transport, str):
        return create_transport(transport, timeout=config.timeout), True
    raise TypeError(
        f"transport must be a Transport, a transport name or None, but got {transport!r:.80}."
    )


def check_world_transport(world: object, transport: Transport) -> Transport | None:
    """The world round's transport, checked against the balance group's (``None``: the
    balance group is the whole world)."""
    if world is None:
        return None
    if not isinstance(world, Transport):
        raise TypeError(
            f"world_transport must be a Transport or None, but got {world!r:.80}; pass a "
            "transport over one rank of every data-parallel coordinate, or None when the "
            "balance group is the whole world."
        )
    if world is transport:
        raise ConfigError(
            "world_transport must not be the balance group's transport: each group's "
            "collectives need their own transport (and thread). Pass a separate one, or None."
        )
    if world.launch_on_caller:
        raise ConfigError(
            f"world_transport {world.name!r} launches on the caller's thread; the world round "
            "runs in the background. Pass a Gloo (CPU) transport."
        )
    return world


def bind_source(
    source: Any, config: LoaderConfig, transport: Transport, world: Transport | None
) -> ConfigError | None:
    """Give a step source (``DatasetSource``, ``IterableSource``, or any source with
    ``bind_loader``) the loader's step shape and this rank's data-parallel position: the
    world round's group when there is one (it spans every data-parallel rank), else the
    balance group's."""
    bind = getattr(source, "bind_loader", None)
    if not callable(bind):
        return None
    bind_workers = getattr(source, "bind_workers", None)
    if callable(bind_workers):  # transform worker processes: hung past the loader's timeout
        bind_workers(timeout=config.timeout)
    ranks = world if world is not None else transport
    # A loader with no peers knows nothing of the data-parallel world: a source sharded by
    # hand (explicit rank / num_ranks, one loader per process without a group) keeps them.
    alone = ranks.num_ranks == 1
    refusal = bind(
        seq_len=config.seq_len,
        bins_per_rank=config.bins_per_rank,
        rank=None if alone else ranks.rank,
        num_ranks=None if alone else ranks.num_ranks,
    )
    return refusal if isinstance(refusal, ConfigError) else None
