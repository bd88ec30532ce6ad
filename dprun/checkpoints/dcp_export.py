"""`dprun ckpt export --format dcp`: every rank's saved state merged into the job's global state dict (shards
placed at their global offsets, replicas written once) and written as a torch.distributed.checkpoint folder.

The folder holds what a torchrun job of the same model would have written with dcp.save({"step": S, "model":
model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer), ...}): the optimizer's state keyed by
parameter name, with its param_groups both nested (torch's default) and flattened ("param_groups.NAME.KEY", as
flatten_optimizer_state_dict=True and so torchtitan read them, which pipeline-parallel stages need). Objects that
are neither models nor optimizers (LR schedulers, data samplers) are written once where every rank holds the same,
else as {"rank_R": ...}.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .export import ExportError, Lazy, materialized

LEGACY = ("was saved before DeadPool recorded where each shard lies (dpstate's snapshot \"layout\"): it can be "
          "exported --format torch, not as DCP")


@dataclass
class GlobalTensor:
    """One tensor of the global state: its shape and dtype, and the chunks of it that the ranks hold, by their
    offset (the first rank's copy of each; a replica's is the same). DCP writes each chunk where it lies."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: dict[tuple[int, ...], Lazy] = field(default_factory=dict)
    owners: dict[tuple[int, ...], int] = field(default_factory=dict)  # the rank whose copy each chunk is

    def add(self, offset: tuple[int, ...], local: Lazy, rank: int) -> None:
        if local.dtype != self.dtype:
            raise ExportError(f"rank {rank}'s {self.name} is {local.dtype}, rank {min(self.owners.values())}'s "
                              f"{self.dtype}: the ranks do not hold one tensor", 1)
        ends = [o + s for o, s in zip(offset, local.shape)]
        if len(offset) != len(self.shape) or any(o < 0 for o in offset) or any(
                e > s for e, s in zip(ends, self.shape)):
            raise ExportError(f"rank {rank}'s shard of {self.name} ({tuple(local.shape)} at {offset}) does not lie "
                              f"within its global shape {self.shape}", 1)
        if offset in self.chunks:
            if tuple(self.chunks[offset].shape) != tuple(local.shape):
                raise ExportError(f"rank {rank}'s {self.name} at {offset} is {tuple(local.shape)}, rank "
                                  f"{self.owners[offset]}'s {tuple(self.chunks[offset].shape)}: not one tensor's "
                                  "replicas (export --format torch keeps each rank's own)", 1)
            return  # a replica: written once, from the lowest rank
        self.chunks[offset] = local
        self.owners[offset] = rank

    def coverage_problem(self) -> str | None:
        """Why the chunks do not tile the tensor exactly (DCP would refuse the plan), or None."""
        total = 1
        for s in self.shape:
            total *= s
        held = 0
        for chunk in self.chunks.values():
            n = 1
            for s in chunk.shape:
                n *= s
            held += n
        if held != total:
            return (f"the ranks' shards of {self.name} hold {held} of its {total} elements (global shape "
                    f"{self.shape}): a rank's shard is missing, or two overlap")
        return None

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's hook for objects that write themselves (DTensor has the same): one item per chunk."""
        items = []
        for offset, chunk in self.chunks.items():
            if not all(chunk.shape) and len(self.chunks) > 1:
                continue  # an empty shard (an uneven split): nothing of it to write
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offset), torch.Size(chunk.shape)),
                                            properties=TensorProperties(dtype=self.dtype),
                                            size=torch.Size(self.shape))))
        return items

    def read(self, offset: Any) -> torch.Tensor:
        return self.chunks[tuple(offset)].read()


class _Planner(DefaultSavePlanner):
    """DefaultSavePlanner that reads a GlobalTensor's chunk from its rank file when DCP writes it
    (lookup_object is the planner's extension point for this), one at a time."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, GlobalTensor):
            return obj.read(index.offset)
        return super().lookup_object(index)


@dataclass
class Written:
    """What an export wrote: tensors, chunks and their bytes, and what it took from each rank."""

    folder: Path
    step: int
    world_size: int
    tensors: int
    chunks: int
    nbytes: int
    per_rank: dict[str, list[int]]  # objects kept per rank (not the same on every rank): name -> ranks


class GlobalState:
    """The global state dict, built rank by rank from each rank's state tree (tensors Lazy)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.ranks: list[int] = []
        self.modules: dict[str, dict] = {}
        self.optimizers: dict[str, dict] = {}
        self.others: dict[str, dict[int, Any]] = {}
        self.tensors: list[GlobalTensor] = []
        self._by_name: dict[str, GlobalTensor] = {}

    def add_rank(self, rank: int, tree: dict) -> None:
        layout = tree.get("layout")
        if not isinstance(layout, dict):
            raise ExportError(f"rank {rank}'s file {LEGACY}", 1)
        if self.step is not None and tree["step"] != self.step:
            raise ExportError(f"rank {rank}'s file holds step {tree['step']}, rank {self.ranks[0]}'s step "
                              f"{self.step}: not one step", 1)
        self.step = tree["step"]
        self.ranks.append(rank)
        modules, optimizers = list(layout.get("modules", [])), dict(layout.get("optimizers", {}))
        places = {name: {tuple(entry[0]): entry[1:] for entry in entries}
                  for name, entries in layout.get("shards", {}).items()}
        for name, sd in tree["state"].items():
            where = places.get(name, {})
            if name in modules:
                target = self.modules.setdefault(name, {})
                for key, value in sd.items():
                    self._put(target, key, value, f"{name}.{key}", where.get((key,)), rank)
            elif name in optimizers:
                self._optimizer(name, sd, optimizers[name], modules, where, rank)
            else:
                self.others.setdefault(name, {})[rank] = sd

    def _put(self, target: dict, key: Any, value: Any, name: str, place: list | None, rank: int) -> None:
        """target[key] = value as the global state holds it: a tensor joins its GlobalTensor (placed by
        `place`, shards.place()'s record, where it is a shard), anything else is the first rank's."""
        if not isinstance(value, Lazy):
            target.setdefault(key, materialized(value))
            return
        if place is None:
            shape, offset = tuple(value.shape), (0,) * len(value.shape)
        else:
            shape, offset = tuple(place[0]), place[1]
            if offset is None:
                raise ExportError(f"rank {rank}'s {name} is a shard whose place torch could not say "
                                  f"(placements {place[2]}): it cannot be placed in its global tensor", 1)
            offset = tuple(offset)
        tensor = self._by_name.get(name)
        if tensor is None:
            tensor = self._by_name[name] = GlobalTensor(name, shape, value.dtype)
            self.tensors.append(tensor)
            target[key] = tensor
        elif tensor.shape != shape:
            raise ExportError(f"rank {rank}'s {name} is of global shape {shape}, rank {min(tensor.owners.values())}"
                              f"'s {tensor.shape}: the ranks do not hold one tensor (export --format torch)", 1)
        tensor.add(offset, value, rank)

    def _optimizer(self, name: str, sd: dict, params: list, modules: list, where: dict, rank: int) -> None:
        """An optimizer's state keyed by its parameters' names, as get_optimizer_state_dict() says it."""
        def fqn(index: Any) -> str:
            owner = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
            if owner is None:
                raise ExportError(f"rank {rank}'s optimizer {name!r} holds a parameter (index {index}) of no "
                                  "tracked model: its state has no name in a global state dict "
                                  "(export --format torch)", 1)
            return owner[1] if len(modules) == 1 else f"{owner[0]}.{owner[1]}"

        target = self.optimizers.setdefault(name, {"state": {}, "param_groups": []})
        for index, entries in sd.get("state", {}).items():
            key = fqn(index)
            slot = target["state"].setdefault(key, {})
            for state_name, value in entries.items():
                self._put(slot, state_name, value, f"{name}.state.{key}.{state_name}",
                          where.get(("state", index, state_name)), rank)
        for i, group in enumerate(sd.get("param_groups", [])):
            names = [fqn(index) for index in group["params"]]
            settings = {k: materialized(v) for k, v in group.items() if k != "params"}
            if i == len(target["param_groups"]):
                target["param_groups"].append({**settings, "params": []})
            merged = target["param_groups"][i]["params"]
            merged.extend(n for n in names if n not in merged)
            for n in names:
                for k, v in settings.items():
                    target.setdefault(f"param_groups.{n}.{k}", v)

    def state_dict(self) -> dict:
        """The global state dict to save (every rank added)."""
        if "step" in set(self.modules) | set(self.optimizers) | set(self.others):
            raise ExportError("the job tracked state under the name 'step', which the export keeps for the step "
                              "(export --format torch)")
        for tensor in self.tensors:
            problem = tensor.coverage_problem()
            if problem:
                raise ExportError(problem, 1)
        out: dict[str, Any] = {"step": self.step}
        out.update(self.modules)
        out.update(self.optimizers)
        for name, per_rank in self.others.items():
            trees = {rank: materialized(tree) for rank, tree in per_rank.items()}
            first = trees[min(trees)]
            out[name] = first if all(_same(first, t) for t in trees.values()) else {
                f"rank_{rank}": tree for rank, tree in sorted(trees.items())}
        return out

    def per_rank(self, state_dict: dict) -> dict[str, list[int]]:
        return {name: sorted(per_rank) for name, per_rank in self.others.items()
                if isinstance(state_dict.get(name), dict) and f"rank_{min(per_rank)}" in state_dict[name]
                and len(per_rank) > 1}


def _same(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def save(state_dict: dict, folder: Path, state: GlobalState) -> Written:
    """Write `state_dict` (GlobalState.state_dict()) into `folder` with DCP, in this process alone (no process
    group): one .distcp file and the .metadata that dcp.load and dcp_to_torch_save read."""
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, thread_count=1)
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... save in a single process": it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state_dict, storage_writer=writer, planner=_Planner(), no_dist=True)
    except ValueError as exc:  # DCP's own check of the plan: say it in one line
        raise ExportError(f"torch.distributed.checkpoint refused the export: {' '.join(str(exc).split())[:300]}",
                          1) from exc
    chunks = sum(len(t.chunks) for t in state.tensors)
    nbytes = sum(c.source.specs[c.index].nbytes for t in state.tensors for c in t.chunks.values())
    return Written(folder, int(state.step or 0), len(state.ranks), len(state.tensors), chunks, nbytes,
                   state.per_rank(state_dict))
