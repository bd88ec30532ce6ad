"""Resharding: a rank's sharded state (DTensors) filled from the shards that snapshots of another mesh shape hold,
as when a sharded job shrinks or grows (its data-parallel dim narrower or wider than when they were taken).

torch.distributed.checkpoint's load planner works out which piece of which saved shard lands in which part of this
rank's shards; the snapshots are its storage, read in memory (ShardsInMemory) instead of from a checkpoint folder.
"""

from __future__ import annotations

import math
import warnings

from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .shards import ReshardError, _dtensor_type


class ShardsInMemory(StorageReader):
    """A StorageReader over shards held in memory: {fqn: {offset: local tensor}} of global tensors {fqn: shape}."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], chunks: dict[str, dict[tuple[int, ...], torch.Tensor]]):
        super().__init__()
        self._chunks = chunks
        self._metadata = Metadata(state_dict_metadata={
            fqn: TensorStorageMetadata(
                properties=TensorProperties(dtype=next(iter(held.values())).dtype), size=torch.Size(shapes[fqn]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(tensor.shape))
                        for offset, tensor in held.items()])
            for fqn, held in chunks.items()})

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            index: MetadataIndex = item.storage_index
            assert index.offset is not None
            source = narrow_tensor_by_index(self._chunks[index.fqn][tuple(index.offset)], item.storage_offsets,
                                            item.lengths)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _at(tree: Any, path: list) -> Any:
    for key in path:
        if isinstance(tree, dict) and key not in tree and str(key) in tree:
            key = str(key)
        tree = tree[key]
    return tree


def saved_shards(trees: list[dict], name: str) -> Iterator[tuple[tuple, tuple[int, ...], tuple[int, ...], Any]]:
    """(path, global shape, offset, local tensor) of every shard of object `name` that `trees` hold, as each
    tree's layout recorded them (dpstate.snapshot.shards.place)."""
    for tree in trees:
        for entry in tree.get("layout", {}).get("shards", {}).get(name, []):
            path, shape, offset = entry[0], entry[1], entry[2]
            if offset is None:
                raise ReshardError(f"the snapshot of step {tree['step']} holds a shard of {name} at {path} whose "
                                   f"place torch could not say (placements {entry[3]}): it cannot be resharded")
            yield tuple(path), tuple(shape), tuple(offset), _at(tree["state"][name], list(path))


def load_resharded(name: str, targets: dict[tuple, Any], trees: list[dict]) -> None:
    """Fill the DTensors `targets` ({path in object `name`'s state dict: DTensor}) in place from the shards of
    `name` that `trees` hold, whatever mesh those were taken on. Raises ReshardError where a piece is missing."""
    dtensor = _dtensor_type()
    shapes: dict[str, tuple[int, ...]] = {}
    chunks: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    wanted = {_fqn(path) for path in targets}
    for path, shape, offset, local in saved_shards(trees, name):
        fqn = _fqn(path)
        if fqn in wanted:
            shapes[fqn] = shape
            chunks.setdefault(fqn, {}).setdefault(offset, local)  # (replicas of a shard: the first)
    state: dict[str, Any] = {}
    for path, target in targets.items():
        fqn = _fqn(path)
        if dtensor is None or not isinstance(target, dtensor):
            raise TypeError(f"dpstate: {name}{list(path)} is not a DTensor: only sharded state is resharded")
        if fqn not in chunks:
            raise ReshardError(f"no snapshot at hand holds a shard of {name}{list(path)}")
        if tuple(target.shape) != shapes[fqn]:
            raise ReshardError(f"{name}{list(path)} is of global shape {tuple(target.shape)} now and "
                               f"{shapes[fqn]} in the snapshots: the model changed")
        _check_covered(name, path, target, chunks[fqn])
        state[fqn] = target
    with warnings.catch_warnings():  # (no_dist: each rank reads its own pieces, which torch warns of)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=ShardsInMemory(shapes, chunks), planner=DefaultLoadPlanner(), no_dist=True)


def _fqn(path: tuple) -> str:
    return "/".join(map(str, path))


def _check_covered(name: str, path: tuple, target: Any, held: dict[tuple[int, ...], torch.Tensor]) -> None:
    """DCP fills what the saved shards overlap and leaves the rest as it was: a piece missing must fail here."""
    (chunk,) = target.__create_chunk_list__()
    lo, size = tuple(chunk.offsets), tuple(chunk.sizes)
    covered = 0
    for offset, tensor in held.items():
        overlap = 1
        for o, s, mo, ms in zip(offset, tensor.shape, lo, size):
            overlap *= max(0, min(o + s, mo + ms) - max(o, mo))
        covered += overlap
    if covered < math.prod(size):
        raise ReshardError(f"the snapshots at hand hold {covered} of the {math.prod(size)} elements of this rank's "
                           f"shard of {name}{list(path)} (at {list(lo)}): a rank's snapshot is missing")


def module_state_resharded(name: str, saved: dict, live: dict, trees: list[dict]) -> dict:
    """A module's state dict to load: its sharded entries resharded from `trees`, the rest as `saved` has them."""
    dtensor = _dtensor_type()
    targets = {(key,): value for key, value in live.items() if dtensor is not None and isinstance(value, dtensor)}
    load_resharded(name, targets, trees)
    return type(saved)((key, live[key] if (key,) in targets else value) for key, value in saved.items())


def optimizer_state_resharded(name: str, saved: dict, optimizer: torch.optim.Optimizer, trees: list[dict]) -> dict:
    """An optimizer's state dict to load: each per-parameter tensor of a sharded parameter resharded from `trees`
    into a tensor sharded as that parameter now is; scalars (Adam's step) and param_groups as `saved` has them."""
    dtensor = _dtensor_type()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets: dict[tuple, Any] = {}
    state: dict = {}
    for index, entries in saved.get("state", {}).items():
        position = int(index)
        param = params[position] if position < len(params) else None
        state[index] = dict(entries)
        for key, value in entries.items():
            if (dtensor is not None and isinstance(param, dtensor) and isinstance(value, torch.Tensor)
                    and value.dim() > 0):
                target = state[index][key] = torch.empty_like(param, dtype=value.dtype)
                targets[("state", index, key)] = target
            elif isinstance(value, torch.Tensor):
                state[index][key] = value.clone()
    load_resharded(name, targets, trees)
    return dict(saved, state=state)
