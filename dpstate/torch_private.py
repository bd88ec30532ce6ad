"""The private corners of torch.distributed that rebuilding communicators needs, kept in one module.

Group names, groups kept alive past destroy_process_group(), DTensor's caches: tests/test_parallel_units.py checks
that the pinned torch has every one of them; a torch without one leaves that corner alone.
"""

from __future__ import annotations

import ctypes
from typing import Any

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


def keep_groups_alive() -> int:
    """Make every registered group's Python handle immortal; returns how many. ProcessGroupGloo's destructor
    joins its threads, which blocks on an op stuck on a frozen peer, and aborts the process if a peer's
    socket closed meanwhile (pgroup.GroupManager.destroy): an old generation's groups are never destroyed."""
    groups: list[Any] = list(dist.distributed_c10d._world.pg_map)
    for pg in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    return len(groups)


def clear_dtensor_caches() -> None:
    """Forget what DTensor cached about old meshes (sharding propagation, redistribute plans, mesh topology):
    those caches hold old meshes, and so their groups and wrappers, after every user reference is gone."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    for cached in (_redistribute._gen_transform_infos, _collective_utils.MeshTopoInfo.build_from_mesh,
                   _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached):
        cached.cache_clear()
