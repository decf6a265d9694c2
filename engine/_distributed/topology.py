"""Where each rank sits: data-parallel ranks, balance groups and model-parallel peers.

Plain arithmetic on rank numbers, so it runs (and is tested) without torch.distributed.
:func:`~evenflow.engine._distributed.build.build_loader` turns it into process groups and a
loader.

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

import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evenflow.engine.errors import ConfigError

__all__ = [
    "DEFAULT_DP_DIM_NAMES",
    "MeshLayout",
    "Topology",
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
