"""The layout of a sharded or 3D-parallel job (named mesh dims and their sizes) and its DeviceMesh per generation.

Dims run outermost to innermost in DIM_ORDER, torchtitan's order: consecutive global ranks share a tensor parallel
group, which so stays inside a node when --nproc-per-node is a multiple of its size.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch.distributed as dist

from dpcommon.mesh_dims import MeshDims

from .carried import Carried
from .torch_private import check_mesh_group_ranks, dtensor_caches_for, mesh_group_names

DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "dp", "tp")


@dataclass(frozen=True)
class MeshLayout(MeshDims):
    """Named dims and their sizes, outermost first (dpcommon.mesh_dims: their coordinates, as the controller reads
    them too); their product is the world size."""

    @classmethod
    def parse(cls, dims: Mapping[str, int], world_size: int) -> "MeshLayout":
        """The layout of `dims` (any of DIM_ORDER, in any order), checked against the job's world size."""
        unknown = sorted(set(dims) - set(DIM_ORDER))
        if unknown:
            raise ValueError(f"dpstate: unknown mesh dim(s) {unknown}: name dims from {', '.join(DIM_ORDER)}")
        if "dp" in dims and ({"dp_replicate", "dp_shard"} & set(dims)):
            raise ValueError("dpstate: give either dp or dp_replicate/dp_shard (HSDP), not both")
        for name, size in dims.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"dpstate: mesh dim {name}={size!r} must be a whole number >= 1")
        if not dims:
            raise ValueError(f"dpstate: no mesh dims: give at least one of {', '.join(DIM_ORDER)}")
        product = math.prod(dims.values())
        if product != world_size:
            shown = " x ".join(f"{n}={dims[n]}" for n in DIM_ORDER if n in dims)
            raise ValueError(f"dpstate: the mesh {shown} holds {product} ranks but the job has {world_size}: "
                             "make the product of the dims the world size (--nnodes x --nproc-per-node)")
        return cls(tuple((name, dims[name]) for name in DIM_ORDER if name in dims))

    def at_width(self, world_size: int) -> "MeshLayout":
        """This layout over `world_size` ranks: its data dim narrowed (or as asked, at full width)."""
        total, name = self.total, self.data_dim
        if world_size == total:
            return self
        others = total // self.size(name) if name else total
        if name is None or world_size % others:
            raise ValueError(f"dpstate: the mesh {self.describe()} cannot run on {world_size} ranks: only its "
                             "data-parallel dim (dp or dp_shard) can narrow")
        return MeshLayout(tuple((n, world_size // others if n == name else size) for n, size in self.dims))

    def tp_span_warning(self, nproc_per_node: int) -> str | None:
        """A warning when a tensor parallel group spans nodes (each group's ranks are consecutive)."""
        tp = self.size("tp")
        if tp <= 1 or nproc_per_node % tp == 0:
            return None
        return (f"dpstate: tensor parallel groups of {tp} ranks span nodes of {nproc_per_node} worker(s): every "
                "tensor parallel collective crosses the network, and a lost node breaks two groups; use "
                f"--nproc-per-node a multiple of {tp}, or a smaller tp")


def build_mesh(layout: MeshLayout, device_type: str, backend: str, connect_timeout: datetime.timedelta,
               timeout: datetime.timedelta) -> Any:
    """The DeviceMesh of `layout` over the current default group: one new group per dim (never the default
    group itself, whose collectives dpstate's own waits use), named by the layout (torch_private says why),
    connected under `connect_timeout` (a rank that died while connecting fails the build rather than holding
    it), then given the collective `timeout`."""
    from torch.distributed.device_mesh import init_device_mesh

    override: dict[int | str, Any] = {}
    if backend == "gloo":
        # torch's stubs declare Gloo's options as ProcessGroupGloo.Options; at runtime they are _Options (and
        # Options is Backend's)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = connect_timeout
        override = {name: ("gloo", options) for name in layout.names}
    dtensor_caches_for(dist.get_rank())
    with mesh_group_names(layout.describe()):
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names, backend_override=override)
    check_mesh_group_ranks([mesh[name].get_group() for name in layout.names])
    for name in layout.names:
        dist.distributed_c10d._set_pg_timeout(timeout, mesh[name].get_group())
    return mesh


def narrow_mesh_problem(layout: MeshLayout, carried: Carried, rank: int, world_size: int) -> str | None:
    """Why process `rank` of a sharded job cannot train the ranks of `carried` on a narrowed mesh of `world_size`
    ranks, or None.
    Each process must carry whole data-parallel replicas' ranks that share its place in every other dim, as
    many as every other process (dprun.controller.narrowing plans so: this guards the assumption)."""
    why = layout.cannot_narrow()
    if why:
        return f"the mesh {layout.describe()} cannot run narrow: {why}"
    name = layout.data_dim
    try:
        narrow = layout.at_width(world_size)
    except ValueError as exc:
        return str(exc)
    if carried.logical_world != len(carried.ranks) * world_size:
        return f"processes carry unequal numbers of ranks ({carried.ranks} here, of {carried.logical_world})"
    own = {n: c for n, c in layout.coordinates(carried.ranks[0]).items() if n != name}
    here = {n: c for n, c in narrow.coordinates(rank).items() if n != name}
    if here != own:
        return f"its own logical rank {carried.ranks[0]} ({own}) is not at its place in the narrow mesh ({here})"
    for rank in carried.ranks[1:]:
        other = {n: c for n, c in layout.coordinates(rank).items() if n != name}
        if other != own:
            return f"logical rank {rank} ({other}) is not in this process's place of the mesh ({own})"
    return None
