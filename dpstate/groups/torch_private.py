"""The private corners of torch.distributed that rebuilding communicators needs, kept in one module.

Group names, groups kept alive past destroy_process_group(), DTensor's caches: tests/test_parallel_units.py checks
that the pinned torch has every one of them; a torch without one leaves that corner alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import zlib
from typing import Any, Iterator

import torch.distributed as dist

# Sub-groups of generation G are named from G * GROUP_NAMES_PER_GENERATION + 1 on: an old DeviceMesh resolves
# its groups by name, and destroy_process_group() restarts the count, so without this an old mesh quietly binds
# to a new group of another membership (DESIGN.md, "Stale wrappers").
GROUP_NAMES_PER_GENERATION = 100_000


def reset_group_names() -> None:
    """Name the next group "0": the default group's name is part of every connect key (see pgroup.build)."""
    dist.distributed_c10d._world.group_count = 0


def name_groups_for(generation: int) -> None:
    """Name the sub-groups made from now on after `generation` (every rank does the same, so names agree)."""
    world = dist.distributed_c10d._world
    world.group_count = max(world.group_count, generation * GROUP_NAMES_PER_GENERATION + 1)


# A DeviceMesh's groups are named by its layout instead, the same in every generation: DTensor's caches key on meshes
# that compare equal when their layouts do, and hand back results holding the first generation's sub-meshes; those
# resolve their groups by name, so under these names they reach the current generation's group of the same ranks,
# and the caches stay valid (a cold cache cost a recovery's first step ~2.7 s here). check_mesh_group_ranks makes
# sure a name never changes its ranks.
_MESH_NAMES_BASE = 10**11
_MESH_GROUP_RANKS: dict[str, tuple[int, ...]] = {}
_CACHES_RANK: list[int] = []  # the global rank whose sub-meshes DTensor's caches hold (empty: none yet)


@contextlib.contextmanager
def mesh_group_names(layout_key: str) -> Iterator[None]:
    """Name the groups made inside from `layout_key` alone (then go on with the generation's own names)."""
    world = dist.distributed_c10d._world
    before = world.group_count
    world.group_count = _MESH_NAMES_BASE + zlib.crc32(layout_key.encode()) * GROUP_NAMES_PER_GENERATION
    try:
        yield
    finally:
        world.group_count = before


def check_mesh_group_ranks(groups: list[Any]) -> None:
    """Refuse a mesh group whose name meant other ranks in an earlier generation of this process: an old sub-mesh
    (in DTensor's caches, or kept by user code) would then reach a group of another membership."""
    for group in groups:
        ranks = tuple(dist.get_process_group_ranks(group))
        known = _MESH_GROUP_RANKS.setdefault(group.group_name, ranks)
        if known != ranks:
            raise RuntimeError(f"dpstate: the mesh group named {group.group_name} holds ranks {list(ranks)} in this "
                               f"generation but held {list(known)} in an earlier one: sub-meshes kept from then "
                               "would reach the wrong ranks; build the mesh with the same layout, or report this")


def dtensor_caches_for(rank: int) -> None:
    """Clear DTensor's caches when this process now plays another global rank than the one that filled them:
    meshes of two ranks compare equal, but a cached sub-mesh keeps its own rank's coordinates and group names."""
    if _CACHES_RANK and _CACHES_RANK[0] != rank:
        clear_dtensor_caches()
    _CACHES_RANK[:] = [rank]


def keep_groups_alive() -> int:
    """Make every registered group's Python handle immortal; returns how many. ProcessGroupGloo's destructor
    joins its threads, which blocks on an op stuck on a frozen peer, and aborts the process if a peer's
    socket closed meanwhile (pgroup.GroupManager.destroy): an old generation's groups are never destroyed."""
    groups: list[Any] = list(dist.distributed_c10d._world.pg_map)
    for pg in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    return len(groups)


def clear_dtensor_caches() -> None:
    """Forget what DTensor cached about meshes (sharding propagation, redistribute plans, mesh topology): for a
    process that plays several ranks in turn (a rank's results name its own sub-meshes)."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    for cached in (_redistribute._gen_transform_infos, _collective_utils.MeshTopoInfo.build_from_mesh,
                   _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached):
        cached.cache_clear()


def fsdp_default_all_gather() -> type | None:
    """FSDP2's default all-gather (its class sits in a private module of torch 2.13, and FSDP2 treats only its
    subclasses as its own: FSDPModule.set_custom_all_gather); None for a torch without it."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    except ImportError:
        return None
    return DefaultAllGather
