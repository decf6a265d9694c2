"""``build_loader``: the loader of one rank of an initialised torch.distributed world.

Every rank gathers what it needs over a start-up Gloo group (the byte protocol of
:class:`~evenflow.transports.internal.Protocol`), computes the same
:class:`~evenflow.engine._distributed.topology.Topology`, creates every process group in the
same global order, builds its part locally, and checks that all ranks agree on the build
before returning a :class:`~evenflow.engine._distributed.loader.DistributedLoader`. A build
error on any rank raises the same error on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from evenflow.engine._config import LoaderConfig
from evenflow.engine._distributed.loader import DistributedLoader
from evenflow.engine._distributed.topology import (
    MeshLayout,
    Topology,
    groups_by_node,
    groups_by_size,
    layout_from_mesh,
    node_id,
    plain_layout,
)
from evenflow.engine._pipeline.loader import BalancedLoader
from evenflow.engine._pipeline.loop_thread import run_coroutine
from evenflow.engine._pipeline.read_assigned import dataset_mismatch, shared_identity
from evenflow.engine._validate import check_choice, check_number
from evenflow.engine.errors import ConfigError, GroupMismatchError
from evenflow.transports import DeviceTransport, GlooTransport, LocalTransport, Transport
from evenflow.transports.errors import WireFormatError
from evenflow.transports.internal import (
    BatchBroadcaster,
    Channel,
    Protocol,
    RemoteErrorInfo,
    destroy_group,
    new_group,
    traceback_note,
)

__all__ = ["build_loader"]

_TRANSPORTS = ("gloo", "device")
_DEFAULT_TIMEOUT = 300.0
#: Largest agreement record a rank accepts from a peer (records are a few KiB).
_MAX_RECORD_BYTES = 16 << 20


def build_loader(
    source: Any,
    config: LoaderConfig,
    *,
    mesh: Any = None,
    balance_group_size: int | None = None,
    dp_dim_names: Sequence[str] | None = None,
    transport: str = "gloo",
    timeout: float | None = None,
    **loader_kwargs: Any,
) -> DistributedLoader:
    """A balanced loader for this rank of an initialised torch.distributed world.

    Call it on EVERY rank of the world, in the same order relative to other group creations:
    it creates process groups, which torch requires of every rank. Ranks are grouped into
    balance groups (default: one per node, from torchrun's ``GROUP_RANK`` /
    ``LOCAL_WORLD_SIZE`` / host name; ``balance_group_size=k``: consecutive blocks of ``k``
    data-parallel ranks). With ``mesh`` (a ``DeviceMesh`` with named dimensions), only the
    data-parallel dimensions (``dp_dim_names``, default ``dp``/``dp_replicate``/``dp_shard``)
    spread data; ranks differing only in other coordinates receive the batch of their
    constructor (the rank whose non-DP coordinates are all 0), and may pass ``source=None``.

    ``transport`` is ``"gloo"`` (CPU data plane) or ``"device"`` (collectives on the training
    device). ``timeout`` (default ``config.timeout``) bounds every collective of every group
    created here. With more than one balance group it also creates a Gloo group of every
    constructor for the per-step world round (loss-token totals, ends and failures across
    groups). ``loader_kwargs`` go to :class:`~evenflow.engine.BalancedLoader`
    (``metadata_fn``, ``pack_fn``, ``collate_fn``, ``cost_model``, ``algorithm``, ``device``,
    ``move_fn``, ``cpu_fields``, ``tracer``, ``stats_callback``).

    Before returning, all ranks exchange what they built; a build error on any rank raises the
    same :class:`ConfigError` on every rank, and any disagreement (configuration, cost model,
    algorithm, mesh, layout, library version) the same ``GroupMismatchError`` naming the first
    differing rank and field. Nothing here uses the training process groups.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "build_loader needs an initialised torch.distributed world; call "
            "torch.distributed.init_process_group() first (torchrun sets the environment), or "
            "use BalancedLoader directly in a single process."
        )
    # Checked locally, before any collective: the startup group itself needs the timeout.
    seconds = _startup_timeout(timeout, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = _Groups(seconds)
    built: list[Any] = []  # what to release if the build fails after creating it
    try:
        startup = groups.create(range(world), "gloo")
        assert startup is not None

        # Round 1: everything that can be decided locally, and the node id.
        error: BaseException | None = None
        layout: MeshLayout | None = None
        node = backend = None
        try:
            layout, backend = _local_checks(
                config,
                mesh=mesh,
                balance_group_size=balance_group_size,
                dp_dim_names=dp_dim_names,
                transport=transport,
                loader_kwargs=loader_kwargs,
                world=world,
            )
            node = node_id(rank)
        except Exception as exc:
            error = exc
        records = _gather(
            startup,
            rank,
            {"error": _describe_error(error), "node": node, "agree": {"mesh": _mesh_dict(layout)}},
        )
        _raise_on_error(records, error)
        _raise_on_mismatch(records)
        assert layout is not None and backend is not None
        if balance_group_size is None:
            nodes = {r: str(rec["node"]) for r, rec in enumerate(records)}
            balance, grouping = groups_by_node(layout.constructors, nodes), "node"
        else:
            balance, grouping = groups_by_size(layout.constructors, balance_group_size), "size"
        topology = Topology(
            rank=rank, world_size=world, layout=layout, balance_groups=balance, grouping=grouping
        )

        # Every rank creates every group, balance groups first, in the layout's order.
        mine: dict[str, Any] = {}
        for group in balance:
            pg = groups.create(group, backend) if len(group) > 1 else None
            if topology.is_constructor and group == topology.balance_group:
                mine["balance"] = pg
        for group in layout.mp_groups:
            pg = groups.create(group, "gloo") if len(group) > 1 else None
            if rank in group:
                mine["mp"] = pg
        if len(balance) > 1:
            # The world round of loss-token totals (and of ends and failures) across balance
            # groups: one Gloo group of every constructor, never a training group.
            world_ranks = sorted(layout.constructors)
            pg = groups.create(world_ranks, "gloo")
            if topology.is_constructor:
                mine["world"] = pg

        # Round 2: build locally, then compare what every rank built.
        error = None
        loader: DistributedLoader | None = None
        identity: dict[str, Any] | None = None
        try:
            loader = _build_local(
                source,
                config,
                topology=topology,
                transport=transport,
                mine=mine,
                seconds=seconds,
                groups=groups,
                loader_kwargs=loader_kwargs,
            )
            built.append(loader)
            inner = loader._inner
            if inner is not None and inner.bind_refusal is not None:
                # A source's rank, num_ranks, seq_len or bins disagree with this loader:
                # refused here, so that every rank raises the same error naming the values.
                raise inner.bind_refusal
            identity = _agreed_identity(loader.identity(), transport, topology)
        except Exception as exc:
            error = exc
        dataset = shared_identity(source) if topology.is_constructor else None
        records = _gather(
            startup,
            rank,
            {"error": _describe_error(error), "agree": identity, "dataset": dataset},
        )
        _raise_on_error(records, error)
        _raise_on_mismatch(records)
        _raise_on_dataset_mismatch(records, topology)
        assert loader is not None
        return loader
    except BaseException:
        for item in built:
            with contextlib.suppress(Exception):
                item.close()
        groups.destroy()
        raise


def _startup_timeout(timeout: object, config: object) -> float:
    if timeout is None:
        return config.timeout if isinstance(config, LoaderConfig) else _DEFAULT_TIMEOUT
    return check_number("timeout", timeout, minimum=0.0, strict_minimum=True)


def _local_checks(
    config: object,
    *,
    mesh: Any,
    balance_group_size: object,
    dp_dim_names: Sequence[str] | None,
    transport: object,
    loader_kwargs: dict[str, Any],
    world: int,
) -> tuple[MeshLayout, str]:
    """Validate the arguments; return the mesh layout and the balance groups' backend."""
    if not isinstance(config, LoaderConfig):
        raise TypeError(f"config must be a LoaderConfig, but got {config!r:.80}.")
    check_choice("transport", transport, _TRANSPORTS)
    for name in ("transport", "world_transport"):
        if name in loader_kwargs:
            raise TypeError(
                f"build_loader got {name}= among the loader's arguments, but it creates the "
                "loader's transports itself; drop it (choose the data plane with transport="
                "'gloo' or 'device')."
            )
    if mesh is None:
        if dp_dim_names is not None:
            raise ConfigError(
                f"dp_dim_names={dp_dim_names!r} only applies together with mesh=; pass a "
                "DeviceMesh or drop dp_dim_names."
            )
        layout = plain_layout(world)
    else:
        layout = layout_from_mesh(mesh, dp_dim_names=dp_dim_names, world_size=world)
    if balance_group_size is not None:
        groups_by_size(layout.constructors, balance_group_size)
    backend = "gloo"
    device = loader_kwargs.get("device")
    if transport == "device" and device is not None:
        resolved = torch.device(device)
        if resolved.type != "cpu":
            backend = str(dist.get_default_backend_for_device(resolved))
    return layout, backend


def _mesh_dict(layout: MeshLayout | None) -> dict[str, Any] | None:
    return None if layout is None else layout.to_dict()


def _build_local(
    source: Any,
    config: LoaderConfig,
    *,
    topology: Topology,
    transport: str,
    mine: dict[str, Any],
    seconds: float,
    groups: _Groups,
    loader_kwargs: dict[str, Any],
) -> DistributedLoader:
    mp_pg = mine.get("mp")
    broadcaster = (
        None
        if mp_pg is None
        else BatchBroadcaster(mp_pg, ranks=topology.mp_group, rank=topology.rank, timeout=seconds)
    )
    if not topology.is_constructor:
        try:
            return DistributedLoader.follower(
                config=config,
                topology=topology,
                broadcaster=broadcaster,
                loader_kwargs=loader_kwargs,
                release=groups.destroy,
                transport=transport,
            )
        except BaseException:
            if broadcaster is not None:
                broadcaster.close()
            raise
    # The source's data-parallel position is this constructor's place among all of them (the
    # order of the world round's group and of a single balance group), also when no group
    # spans ranks (tensor or pipeline parallelism only): the loader alone cannot know it.
    bind = getattr(source, "bind_loader", None)
    if callable(bind):
        constructors = sorted(topology.layout.constructors)
        refusal = bind(
            seq_len=config.seq_len,
            bins_per_rank=config.bins_per_rank,
            rank=constructors.index(topology.rank),
            num_ranks=len(constructors),
        )
        if isinstance(refusal, ConfigError):
            if broadcaster is not None:
                broadcaster.close()
            raise refusal
    data_transport = _make_transport(
        transport, mine.get("balance"), topology, seconds, loader_kwargs
    )
    world_pg = mine.get("world")
    world = None if world_pg is None else GlooTransport(world_pg, timeout=seconds)
    try:
        inner = BalancedLoader(
            source,
            config=config,
            transport=data_transport,
            world_transport=world,
            **loader_kwargs,
        )
    except BaseException:
        _close_transport(data_transport)
        if world is not None:
            _close_transport(world)
        if broadcaster is not None:
            broadcaster.close()
        raise
    return DistributedLoader.constructor(
        inner=inner,
        topology=topology,
        transport=data_transport,
        broadcaster=broadcaster,
        release=groups.destroy,
        world_transport=world,
    )


def _make_transport(
    transport: str,
    process_group: Any,
    topology: Topology,
    seconds: float,
    loader_kwargs: dict[str, Any],
) -> Transport:
    if process_group is None:  # a balance group of one rank
        return LocalTransport(global_rank=topology.rank, timeout=seconds)
    if transport == "device":
        return DeviceTransport(process_group, device=loader_kwargs.get("device"), timeout=seconds)
    return GlooTransport(process_group, timeout=seconds)


def _close_transport(transport: Transport) -> None:
    run_coroutine(transport.aclose())


def _agreed_identity(
    identity: dict[str, Any], transport: str, topology: Topology
) -> dict[str, Any]:
    """What must be identical on every rank (group-specific fields removed)."""
    planner = dict(identity.get("planner") or {})
    planner.pop("num_ranks", None)  # node groups may differ in size
    return {
        "version": identity.get("version"),
        "transport": transport,
        "layout": topology.to_dict(),
        "config": identity.get("config"),
        "planner": planner,
    }


# -- the startup exchange --------------------------------------------------------------------------


class _Groups:
    """The process groups one build created (member groups only), destroyed together."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._owned: list[Any] = []

    def create(self, ranks: Iterable[int], backend: str) -> Any:
        """``new_group`` on every rank (members and not); the group on members, else None."""
        group = new_group(ranks, timeout=self._seconds, backend=backend)
        if group is not None:
            self._owned.append(group)
        return group

    def destroy(self) -> None:
        """Destroy the groups (local for Gloo subgroups). Idempotent."""
        owned, self._owned = self._owned, []
        for group in reversed(owned):
            with contextlib.suppress(Exception):
                destroy_group(group)


def _gather(group: Any, rank: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's plain-data ``record``, by the sizes-first protocol (sizes validated)."""
    channel = Channel(
        group,
        Protocol(
            rank=rank,
            num_ranks=dist.get_world_size(group),
            global_ranks=tuple(dist.get_process_group_ranks(group)),
            name="build_loader start-up",
            limit=_MAX_RECORD_BYTES,
            advice=(
                "Every rank of the world must call build_loader at the same point; are all "
                "ranks running the same evenflow version?"
            ),
        ),
    )
    records = channel.all_gather(record, op="build_loader")
    for r, value in enumerate(records):
        if not isinstance(value, dict):
            raise WireFormatError(f"Rank {rank}: the build record of rank {r} is not a mapping.")
    return records


def _describe_error(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    return RemoteErrorInfo.from_exception(exc, rank=None, stage="build", step=None).to_wire()


def _raise_on_error(records: list[dict[str, Any]], local: BaseException | None) -> None:
    """Raise the same error on every rank if any rank failed to build."""
    failed = [
        (r, RemoteErrorInfo.from_wire(rec["error"], sender=f"rank {r}"))
        for r, rec in enumerate(records)
        if rec.get("error")
    ]
    if not failed:
        return
    first, info = failed[0]
    everywhere = len(failed) == len(records) and all(e.message == info.message for _, e in failed)
    where = "every rank" if everywhere else f"rank {first}"
    others = "" if everywhere or len(failed) == 1 else f" (ranks failing: {[r for r, _ in failed]})"
    text = f"build_loader failed on {where}{others}: {info.summary()}"
    error: Exception = TypeError(text) if info.derives_from(TypeError) else ConfigError(text)
    if local is None and info.traceback:  # a failing rank has its own error as the cause
        error.add_note(traceback_note(f"rank {first}", info.traceback))
    raise error from local


def _raise_on_dataset_mismatch(records: list[dict[str, Any]], topology: Topology) -> None:
    """Shared-dataset mode: every rank of a balance group must see the same dataset."""
    for group in topology.balance_groups:
        error = dataset_mismatch(
            [records[r].get("dataset") for r in group], group, where="build_loader"
        )
        if error is not None:
            raise error


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(_flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


_MISSING = "<missing>"


def _raise_on_mismatch(records: list[dict[str, Any]]) -> None:
    """Raise GroupMismatchError naming the first rank and field that differ from rank 0."""
    reference = _flatten(records[0].get("agree"))
    for rank, record in enumerate(records[1:], start=1):
        fields = _flatten(record.get("agree"))
        for name in [*reference, *(k for k in fields if k not in reference)]:
            mine, theirs = fields.get(name, _MISSING), reference.get(name, _MISSING)
            if mine != theirs:
                raise GroupMismatchError(
                    f"Ranks disagree on the loader build: rank {rank} differs in {name}: "
                    f"{mine!r} vs {theirs!r} on rank 0. Every rank must call build_loader with "
                    "the same configuration, cost model, algorithm, mesh and evenflow version."
                )
