"""Sharded state in snapshots: a DTensor travels as its local shard and comes back wrapped like its live twin.

A snapshot holds each rank's unique shards only; restoring wraps each one on the rebuilt parts' own mesh with
their placements, global shape and stride (DTensor.from_local), so the parts built anew in a generation load
it through their ordinary load_state_dict, bit for bit (DESIGN.md, "State"). Each shard's place in its global
tensor is recorded beside it (local_shards' `record`), for what reads a save without the job: `dprun ckpt export`.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .packing import Deferred

if TYPE_CHECKING:  # imported for real only once something else imported it (_dtensor_type)
    from torch.distributed.tensor import DTensor


class ReshardError(RuntimeError):
    """The snapshots at hand do not hold every piece of this rank's shards (dpstate.snapshot.reshard)."""


def _dtensor_type() -> type[DTensor] | None:
    """DTensor, once something imported it (a job without one never pays for the import)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local_shards(tree: Any, record: list | None = None, path: tuple = ()) -> Any:
    """`tree` with every DTensor replaced by its local shard (the same memory, not a copy). `record`: where to
    append, for each DTensor, [its path (the keys from `tree` to it, after `path`), *place(it)] (a Deferred: what
    it says is worked out as the snapshot is packed)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return tree
    return _map_dtensors(tree, dtensor, record, path)


def _map_dtensors(obj: Any, dtensor: type[DTensor], record: list | None, path: tuple) -> Any:
    if isinstance(obj, dtensor):
        if record is not None:
            record.append(_Placed(path, obj))
        with torch.no_grad():
            return obj.to_local()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map_dtensors(v, dtensor, record, (*path, k))
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map_dtensors(v, dtensor, record, (*path, i)) for i, v in enumerate(obj)]
    return obj


class _Placed(Deferred):
    """[path, *place(tensor)], worked out as the snapshot is packed: ~8 us a DTensor, off the main thread."""

    __slots__ = ("path", "tensor")

    def __init__(self, path: tuple, tensor: Any):
        self.path, self.tensor = path, tensor

    def resolve(self) -> list:
        return [list(self.path), *place(self.tensor)]


# (global shape, mesh shape, mesh coordinate, placements, mesh dim names) -> what place() says: a shard's place
# depends on nothing else, and computing it (DTensor.__create_chunk_list__) costs ~55 us a tensor against ~4 us
# for this key, on every capture of every sharded parameter and optimizer state. Plain values only, so that it
# holds no mesh (a mesh holds its groups alive).
_PLACES: dict[tuple, tuple] = {}
_PLACES_MAX = 4096
# DeviceMesh.shape builds its answer anew (5.5 us, most of a cached place()); held weakly, as above
_MESH_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_shape(mesh: Any) -> tuple:
    shape = _MESH_SHAPES.get(mesh)
    if shape is None:
        shape = _MESH_SHAPES[mesh] = tuple(mesh.shape)
    return shape


def place(tensor: Any) -> tuple:
    """Where a DTensor's local shard lies in its global tensor, as plain data: (global shape, the shard's offset
    in it, placements as torch writes them ("S(0)", "R", "_S(0, 2)"...), the mesh's dim names, this rank's
    coordinate in the mesh). The offset is None where torch cannot say (a Partial placement, a rank outside the
    mesh): such a shard cannot be placed by an export. Never raises: a capture must not fail for a record."""
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    try:
        coordinate = mesh.get_coordinate()
        key = (tuple(tensor.shape), _mesh_shape(mesh), tuple(coordinate or ()), placements, mesh.mesh_dim_names)
        found = _PLACES.get(key)
        if found is None:
            if len(_PLACES) >= _PLACES_MAX:
                _PLACES.clear()
            offset = None
            if coordinate is not None:
                (chunk,) = tensor.__create_chunk_list__()  # a DTensor's one local chunk, as DCP places it
                offset = list(chunk.offsets)
            found = _PLACES[key] = (list(key[0]), offset, [str(p) for p in placements], list(key[4] or ()),
                                    list(key[2]))
        return found
    except Exception:  # noqa: BLE001 - torch's own reasons (a Partial placement...): recorded as unplaceable
        return (list(tensor.shape), None, [str(p) for p in placements], [], [])


def like(saved: Any, live: Any) -> Any:
    """`saved` (a local shard) wrapped as a DTensor like `live`, where `live` is one; else `saved`."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(live, dtensor) or not isinstance(saved, torch.Tensor):
        return saved
    if tuple(saved.shape) != tuple(live.to_local().shape):
        raise ValueError(f"a saved shard of shape {tuple(saved.shape)} does not fit this rank's shard of "
                         f"{tuple(live.to_local().shape)} (global {tuple(live.shape)}, {live.placements})")
    return dtensor.from_local(saved, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                              stride=live.stride())


def module_state_like(saved: dict, live: dict) -> dict:
    """A module's saved state dict with each entry wrapped like the live module's entry of that name."""
    return type(saved)((k, like(v, live.get(k))) for k, v in saved.items())


def optimizer_state_like(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer's saved state dict with each per-parameter tensor wrapped like its parameter (the state
    of a parameter is sharded as the parameter is; a scalar such as Adam's step stays a plain tensor)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved.get("state", {}).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        if param is None or not isinstance(entries, dict):
            state[index] = entries
            continue
        state[index] = {name: like(value, param) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                        for name, value in entries.items()}
    return dict(saved, state=state)
