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

from .torch_private import check_mesh_group_ranks, dtensor_caches_for, mesh_group_names

DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "dp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Named dims and their sizes, outermost first; their product is the world size."""

    dims: tuple[tuple[str, int], ...]

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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.dims)

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
