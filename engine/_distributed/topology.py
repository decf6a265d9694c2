"""Where each rank sits: data-parallel ranks, balance groups and model-parallel peers.

The first half is plain arithmetic on rank numbers, so it runs (and is tested) without
torch.distributed. The second half, :func:`build_loader`, gathers what it needs over a startup
Gloo group, creates every group, checks that all ranks agree on the build and returns a
:class:`~evenflow.engine._distributed.loader.DistributedLoader`.

Vocabulary:

* **DP coordinate** (``data rank``): the row-major flattening of a rank's coordinates along the
  data-parallel mesh dimensions. Ranks with equal DP coordinates differ only in model-parallel
  coordinates (tp, cp, pp, ...) and must train on the same batch.
* **Constructor**: the rank of a DP coordinate whose every non-DP coordinate is 0. It alone
  reads its source, takes part in balancing and sends each batch to its **MP peers** (all
  ranks of its DP coordinate, in mesh order, constructor first).
* **Balance group**: constructors that balance one step together. By default one group per
  node (payloads stay on intra-node links); ``balance_group_size=k`` forms consecutive blocks
  of ``k`` DP coordinates instead.

Every rank computes the same :class:`Topology` from the same inputs (the mesh and the gathered
node ids), which is what lets every rank create every group in the same global order.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from evenflow.engine._config import LoaderConfig
from evenflow.engine._validate import check_choice, check_number
from evenflow.engine.errors import ConfigError, GroupMismatchError
from evenflow.transports import Transport
from evenflow.transports._remote import RemoteErrorInfo, traceback_note
from evenflow.transports.errors import PeerFailureError, TransportTimeoutError, WireFormatError

if TYPE_CHECKING:
    from evenflow.engine._distributed.loader import DistributedLoader

__all__ = [
    "DEFAULT_DP_DIM_NAMES",
    "MeshLayout",
    "Topology",
    "build_loader",
    "groups_by_node",
    "groups_by_size",
    "layout_from_mesh",
    "mesh_layout",
    "node_id",
    "plain_layout",
]

#: Mesh dimensions treated as data-parallel when ``dp_dim_names`` is not given.
DEFAULT_DP_DIM_NAMES: tuple[str, ...] = ("dp", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshLayout:
    """Data-parallel structure of a rank mesh.

    ``constructors[d]`` is the constructor rank of DP coordinate ``d``; ``mp_groups[d]`` lists
    every rank of that coordinate in mesh order (constructor first). A world without a mesh is
    the layout with one rank per DP coordinate.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    dp_dims: tuple[str, ...]
    constructors: tuple[int, ...]
    mp_groups: tuple[tuple[int, ...], ...]

    @property
    def num_data_ranks(self) -> int:
        return len(self.constructors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names),
            "dp_dims": list(self.dp_dims),
            "mp_groups": [list(g) for g in self.mp_groups],
        }


def plain_layout(world_size: int) -> MeshLayout:
    """The layout of a pure data-parallel world: every rank is its own DP coordinate."""
    ranks = tuple(range(world_size))
    return MeshLayout(
        shape=(world_size,),
        dim_names=("dp",),
        dp_dims=("dp",),
        constructors=ranks,
        mp_groups=tuple((r,) for r in ranks),
    )


def mesh_layout(
    ranks: Any,
    dim_names: Sequence[str] | None,
    *,
    dp_dim_names: Sequence[str] | None = None,
    world_size: int | None = None,
) -> MeshLayout:
    """The layout of a mesh given as a nested list (or array) of global ranks.

    ``dp_dim_names`` names the data-parallel dimensions (default: those of
    :data:`DEFAULT_DP_DIM_NAMES` present in the mesh). DP coordinates are flattened in mesh
    order of the DP dimensions, whatever order ``dp_dim_names`` lists them in. A mesh without
    DP dimensions has one DP coordinate. With ``world_size``, the mesh must hold every rank
    ``0 .. world_size - 1`` exactly once.
    """
    grid = np.asarray(ranks)
    if grid.ndim == 0 or grid.size == 0 or not np.issubdtype(grid.dtype, np.integer):
        raise ConfigError(
            f"The mesh must be a non-empty grid of integer ranks, but got {ranks!r:.200}."
        )
    if dim_names is None:
        raise ConfigError(
            "The mesh has no dimension names; create it with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) so the data-parallel "
            "dimensions can be found."
        )
    names = tuple(dim_names)
    if len(names) != grid.ndim or len(set(names)) != len(names):
        raise ConfigError(
            f"The mesh has shape {tuple(grid.shape)} but dimension names {names!r}; pass one "
            "unique name per dimension."
        )
    flat = grid.reshape(-1).tolist()
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise ConfigError(f"The mesh must list distinct non-negative ranks, but got {flat!r:.200}.")
    if world_size is not None and sorted(flat) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(flat))
        raise ConfigError(
            f"The mesh must contain every rank of the world (0..{world_size - 1}) exactly "
            f"once, but it lists {sorted(flat)!r:.200} (missing {missing!r:.200}); pass the "
            "root mesh, not a sub-mesh."
        )
    dp_dims = _resolve_dp_dims(names, dp_dim_names)
    dp_axes = [i for i, n in enumerate(names) if n in dp_dims]
    mp_axes = [i for i, n in enumerate(names) if n not in dp_dims]
    num_dp = math.prod(grid.shape[i] for i in dp_axes)
    # Rows: DP coordinates (row-major over DP dims); columns: MP peers in mesh order.
    rows = grid.transpose(dp_axes + mp_axes).reshape(num_dp, -1).tolist()
    return MeshLayout(
        shape=tuple(int(s) for s in grid.shape),
        dim_names=names,
        dp_dims=tuple(n for n in names if n in dp_dims),
        constructors=tuple(int(row[0]) for row in rows),
        mp_groups=tuple(tuple(int(r) for r in row) for row in rows),
    )


def _resolve_dp_dims(names: tuple[str, ...], dp_dim_names: Sequence[str] | None) -> set[str]:
    if dp_dim_names is None:
        return {n for n in names if n in DEFAULT_DP_DIM_NAMES}
    if isinstance(dp_dim_names, str) or not all(isinstance(n, str) for n in dp_dim_names):
        raise ConfigError(
            f"dp_dim_names must be a sequence of mesh dimension names such as ('dp',), but got "
            f"{dp_dim_names!r}."
        )
    chosen = tuple(dp_dim_names)
    unknown = [n for n in chosen if n not in names]
    if unknown or len(set(chosen)) != len(chosen):
        problem = f"unknown names {unknown!r}" if unknown else "repeated names"
        raise ConfigError(
            f"dp_dim_names={chosen!r} has {problem}; the mesh's dimension names are "
            f"{list(names)!r}. Pass data-parallel dimensions from that list."
        )
    return set(chosen)


def layout_from_mesh(
    mesh: Any, *, dp_dim_names: Sequence[str] | None, world_size: int
) -> MeshLayout:
    """:func:`mesh_layout` of a ``torch.distributed.device_mesh.DeviceMesh`` (or any object
    with a ``mesh`` rank tensor and ``mesh_dim_names``)."""
    grid = getattr(mesh, "mesh", None)
    if grid is None or not hasattr(mesh, "mesh_dim_names"):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh (with .mesh and .mesh_dim_names), "
            f"but got {mesh!r:.100} ({type(mesh).__name__})."
        )
    ranks = grid.tolist() if hasattr(grid, "tolist") else grid
    return mesh_layout(ranks, mesh.mesh_dim_names, dp_dim_names=dp_dim_names, world_size=world_size)


def node_id(rank: int, environ: Mapping[str, str] | None = None) -> str:
    """Which machine ``rank`` runs on, from torchrun's environment.

    ``GROUP_RANK`` (torchrun's node rank) if set; else the block ``rank // LOCAL_WORLD_SIZE``
    (torchrun places a node's ranks consecutively); else the host name.
    """
    env = os.environ if environ is None else environ
    group_rank = env.get("GROUP_RANK", "").strip()
    if group_rank:
        return f"node:{group_rank}"
    local_size = env.get("LOCAL_WORLD_SIZE", "").strip()
    if local_size:
        try:
            size = int(local_size)
        except ValueError:
            size = 0
        if size < 1:
            raise ConfigError(
                f"The environment variable LOCAL_WORLD_SIZE must be a positive integer, but it "
                f"is {local_size!r}; fix the launcher's environment or set GROUP_RANK."
            )
        return f"block:{rank // size}"
    return f"host:{socket.gethostname()}"


def groups_by_size(data_ranks: Sequence[int], size: object) -> tuple[tuple[int, ...], ...]:
    """Consecutive blocks of ``size`` DP coordinates; each group lists its ranks ascending."""
    count = len(data_ranks)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or count % size:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ConfigError(
            f"balance_group_size must be a positive integer that divides the number of "
            f"data-parallel ranks ({count}), but got {size!r}; use one of {divisors!r} or None "
            "for one group per node."
        )
    return tuple(tuple(sorted(data_ranks[i : i + size])) for i in range(0, count, size))


def groups_by_node(
    data_ranks: Sequence[int], node_ids: Mapping[int, str]
) -> tuple[tuple[int, ...], ...]:
    """The DP coordinates' constructors bucketed by node, in order of first appearance."""
    buckets: dict[str, list[int]] = {}
    for rank in data_ranks:
        buckets.setdefault(node_ids[rank], []).append(rank)
    return tuple(tuple(sorted(b)) for b in buckets.values())


@dataclass(frozen=True)
class Topology:
    """This rank's place in the layout, and the layout itself (identical on every rank).

    ``balance_groups`` and ``layout.mp_groups`` are the groups every rank creates, in this
    order; groups of one rank need no process group.
    """

    rank: int
    world_size: int
    layout: MeshLayout
    balance_groups: tuple[tuple[int, ...], ...]
    grouping: str  # "node" | "size"

    @property
    def data_rank(self) -> int:
        """This rank's DP coordinate."""
        return next(d for d, g in enumerate(self.layout.mp_groups) if self.rank in g)

    @property
    def mp_group(self) -> tuple[int, ...]:
        """Every rank sharing this rank's DP coordinate, constructor first."""
        return self.layout.mp_groups[self.data_rank]

    @property
    def constructor(self) -> int:
        """The rank that reads and balances for this rank's DP coordinate."""
        return self.mp_group[0]

    @property
    def is_constructor(self) -> bool:
        return self.rank == self.constructor

    @property
    def balance_group(self) -> tuple[int, ...]:
        """The balance group of this rank's constructor (the ranks it balances with)."""
        return next(g for g in self.balance_groups if self.constructor in g)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data description of the whole layout (the same on every rank)."""
        return {
            "world_size": self.world_size,
            "grouping": self.grouping,
            "mesh": self.layout.to_dict(),
            "balance_groups": [list(g) for g in self.balance_groups],
        }


# -- building a loader over torch.distributed --------------------------------------------------

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
    created here. ``loader_kwargs`` go to :class:`~evenflow.engine.BalancedLoader`
    (``metadata_fn``, ``pack_fn``, ``collate_fn``, ``cost_model``, ``algorithm``, ``device``,
    ``move_fn``, ``cpu_fields``, ``tracer``, ``stats_callback``).

    Before returning, all ranks exchange what they built; a build error on any rank raises the
    same :class:`ConfigError` on every rank, and any disagreement (configuration, cost model,
    algorithm, mesh, layout, library version) the same ``GroupMismatchError`` naming the first
    differing rank and field. Nothing here uses the training process groups.
    """
    import torch.distributed as dist

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
            identity = _agreed_identity(loader.identity(), transport, topology)
        except Exception as exc:
            error = exc
        records = _gather(startup, rank, {"error": _describe_error(error), "agree": identity})
        _raise_on_error(records, error)
        _raise_on_mismatch(records)
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
        import torch
        import torch.distributed as dist

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
    from evenflow.engine._distributed.loader import BatchBroadcaster, DistributedLoader
    from evenflow.engine._pipeline.loader import BalancedLoader

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
    data_transport = _make_transport(
        transport, mine.get("balance"), topology, seconds, loader_kwargs
    )
    try:
        inner = BalancedLoader(source, config=config, transport=data_transport, **loader_kwargs)
    except BaseException:
        _close_transport(data_transport)
        if broadcaster is not None:
            broadcaster.close()
        raise
    return DistributedLoader.constructor(
        inner=inner,
        topology=topology,
        transport=data_transport,
        broadcaster=broadcaster,
        release=groups.destroy,
    )


def _make_transport(
    transport: str,
    process_group: Any,
    topology: Topology,
    seconds: float,
    loader_kwargs: dict[str, Any],
) -> Transport:
    if process_group is None:  # a balance group of one rank
        from evenflow.transports._local import LocalTransport

        return LocalTransport(global_rank=topology.rank, timeout=seconds)
    if transport == "device":
        from evenflow.transports._device import DeviceTransport

        return DeviceTransport(process_group, device=loader_kwargs.get("device"), timeout=seconds)
    from evenflow.transports._gloo import GlooTransport

    return GlooTransport(process_group, timeout=seconds)


def _close_transport(transport: Transport) -> None:
    from evenflow.engine._distributed.loader import run_coroutine

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
        self._timeout = timedelta(seconds=seconds)
        self._owned: list[Any] = []

    def create(self, ranks: Iterable[int], backend: str) -> Any:
        """``new_group`` on every rank (members and not); the group on members, else None."""
        import torch.distributed as dist

        members = list(ranks)
        group = dist.new_group(members, timeout=self._timeout, backend=backend)
        if dist.get_rank() not in members:
            return None
        self._owned.append(group)
        return group

    def destroy(self) -> None:
        """Destroy the groups (local for Gloo subgroups). Idempotent."""
        import torch.distributed as dist

        owned, self._owned = self._owned, []
        if not dist.is_initialized():
            return
        for group in reversed(owned):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


def _gather(group: Any, rank: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's plain-data ``record`` (wire frames; sizes first, then padded bytes)."""
    import torch
    import torch.distributed as dist

    from evenflow.transports import _wire

    frame = torch.from_numpy(_wire.encode(record))
    num = dist.get_world_size(group)
    try:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(num)]
        dist.all_gather(sizes, torch.tensor([frame.numel()], dtype=torch.int64), group=group)
        lengths = [int(s.item()) for s in sizes]
        if not all(0 < n <= _MAX_RECORD_BYTES for n in lengths):
            raise WireFormatError(
                f"Rank {rank}: build_loader received record sizes {lengths!r}; each must be in "
                f"(0, {_MAX_RECORD_BYTES}]. Are all ranks running the same evenflow version?"
            )
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: frame.numel()] = frame
        received = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(num)]
        dist.all_gather(received, padded, group=group)
    except RuntimeError as exc:
        text = str(exc)
        cls = TransportTimeoutError if "timeout" in text.lower() else PeerFailureError
        raise cls(
            f"Rank {rank}: build_loader could not exchange its build record with the other "
            f"ranks: {text}. Every rank of the world must call build_loader at the same point.",
            rank=rank,
            op="build_loader",
        ) from exc
    out = []
    for r, (buffer, n) in enumerate(zip(received, lengths, strict=True)):
        value = _wire.decode(buffer[:n].numpy())
        if not isinstance(value, dict):
            raise WireFormatError(f"Rank {rank}: the build record of rank {r} is not a mapping.")
        out.append(value)
    return out


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
