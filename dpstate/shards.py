"""Sharded state in snapshots: a DTensor travels as its local shard and comes back wrapped like its live twin.

A snapshot holds each rank's unique shards only; restoring wraps each one on the rebuilt parts' own mesh with
their placements, global shape and stride (DTensor.from_local), so the parts built anew in a generation load
it through their ordinary load_state_dict, bit for bit (DESIGN.md, "State").
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _dtensor_type() -> type | None:
    """DTensor, once something imported it (a job without one never pays for the import)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local_shards(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard (the same memory, not a copy)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return tree
    return _map_dtensors(tree, dtensor)


def _map_dtensors(obj: Any, dtensor: type) -> Any:
    if isinstance(obj, dtensor):
        with torch.no_grad():
            return obj.to_local()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map_dtensors(v, dtensor)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map_dtensors(v, dtensor) for v in obj]
    return obj


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
