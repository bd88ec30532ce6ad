"""A sharded job's shrink (FSDP2 over dp, with tp): which processes go on, in which order, carrying whole blocks
of the lost data-parallel replicas' ranks, so that the narrowed mesh keeps every tensor-parallel group whole. Pure.

A logical rank is a rank of the mesh asked for (dims outermost first, as dpstate.groups.mesh orders them). The
narrow mesh has the data dim of n (a divisor of its size D): its process at data coordinate i and place t in the
other dims carries the ranks of place t whose data coordinates lie in block i (D/n of them), its own among them.
Every process then computes as many micro-batches as every other, so their collectives match; the shards of a
block are contiguous, so each process's new shards are made of its block's (dpstate.snapshot.reshard).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpcommon.mesh_dims import MeshDims

from .narrowing import Width

@dataclass(frozen=True)
class MeshShrink:
    """width: what each process of the narrow generation carries, by its new process rank; kept: the process
    rank each had before."""

    width: Width
    kept: tuple[int, ...]


def shrink_mesh(width: Width, lost: set[int], mesh: MeshDims, nproc: int, anchored: set[int]) -> MeshShrink | str:
    """The widest narrow mesh without the processes `lost` (process ranks) where every node's processes all go on
    or all leave, and every process in `anchored` (those whose state is on no live replica) goes on."""
    why = mesh.cannot_narrow()
    if why:
        return why
    assert mesh.data_dim is not None
    size = mesh.size(mesh.data_dim)
    own = [ranks[0] for ranks in width.assignment]
    survivors = [p for p in range(len(own)) if p not in lost]
    if not survivors:
        return "no data-parallel replica would be left"
    for n in sorted((d for d in range(1, size) if size % d == 0), reverse=True):
        for choose in (_by_place, _by_row):
            chosen = choose(own, survivors, mesh, size // n, n, anchored)
            if chosen is not None and (shrunk := _ordered(chosen, own, mesh, size // n, nproc, anchored)):
                return shrunk
    return (f"no narrower mesh keeps whole nodes and tensor-parallel groups ({mesh.describe()}, {nproc} "
            "process(es) a node): use --nproc-per-node a multiple of tp, or spares")


def _block(mesh: MeshDims, rank: int, per: int) -> int:
    assert mesh.data_dim is not None
    return mesh.coordinates(rank)[mesh.data_dim] // per


def _by_place(own: list[int], survivors: list[int], mesh: MeshDims, per: int, n: int,
              anchored: set[int]) -> dict[tuple[int, tuple[int, ...]], int] | None:
    """For each block and place, a surviving process of that place in that block (an anchored one first)."""
    chosen: dict[tuple[int, tuple[int, ...]], int] = {}
    places = sorted({mesh.place(r) for r in own})
    for block in range(n):
        for place in places:
            candidates = [p for p in survivors if mesh.place(own[p]) == place and _block(mesh, own[p], per) == block]
            if not candidates:
                return None
            chosen[(block, place)] = min(candidates, key=lambda p: (own[p] not in anchored, own[p]))
    return chosen


def _by_row(own: list[int], survivors: list[int], mesh: MeshDims, per: int, n: int,
            anchored: set[int]) -> dict[tuple[int, tuple[int, ...]], int] | None:
    """For each block, one data coordinate whose every place survives (the processes of a node often are one
    replica's places: they go on together)."""
    assert mesh.data_dim is not None
    by_coordinate: dict[int, list[int]] = {}
    for p in survivors:
        by_coordinate.setdefault(mesh.coordinates(own[p])[mesh.data_dim], []).append(p)
    places = len({mesh.place(r) for r in own})
    chosen: dict[tuple[int, tuple[int, ...]], int] = {}
    for block in range(n):
        rows = [c for c in range(block * per, (block + 1) * per) if len(by_coordinate.get(c, [])) == places]
        if not rows:
            return None
        row = min(rows, key=lambda c: (not any(own[p] in anchored for p in by_coordinate[c]), c))
        for p in by_coordinate[row]:
            chosen[(block, mesh.place(own[p]))] = p
    return chosen


def _ordered(chosen: dict[tuple[int, tuple[int, ...]], int], own: list[int], mesh: MeshDims, per: int, nproc: int,
             anchored: set[int]) -> MeshShrink | None:
    """The chosen processes in the narrow mesh's rank order (block, then place), or None where that order splits
    a node or a process whose state only it holds would leave."""
    assert mesh.data_dim is not None
    order = [chosen[key] for key in sorted(chosen)]
    if any(own[p] in anchored for p in range(len(own)) if p not in order):
        return None
    for start in range(0, len(order), nproc):  # each node's processes in one piece, in local rank order
        node = order[start:start + nproc]
        if node != list(range(node[0] - node[0] % nproc, node[0] - node[0] % nproc + nproc)):
            return None
    data = mesh.data_dim
    assignment = []
    for p in order:
        coordinates = mesh.coordinates(own[p])
        block = range(coordinates[data] // per * per, (coordinates[data] // per + 1) * per)
        others = [mesh.rank({**coordinates, data: c}) for c in block if c != coordinates[data]]
        assignment.append((own[p], *others))
    if mesh.total != sum(map(len, assignment)):
        return None
    return MeshShrink(Width(tuple(assignment)), tuple(order))
