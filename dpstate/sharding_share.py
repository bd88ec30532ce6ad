"""A promoted spare's first step without DTensor's cold start: when a generation begins, two survivors of every
pipeline stage publish the sharding decisions they recorded, and a rank that has none (a spare) adopts its stage's.

A decision is a pure function of its OpSchema, and those of one stage's ranks are the same up to their meshes,
which the spare's own replace (dpstate.torch_private.adopt_sharding_decisions): what it adopts is what it would
have computed (2.3 s of a 3D job's first step here). Survivors publish before they meet at the mesh, which the
spare reaches after them, so it never waits; a stage whose donors both died computes its decisions, as before.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch.distributed as dist

from .abort import AbortSignal
from .mesh import MeshLayout
from .torch_private import adopt_sharding_decisions, recorded_sharding_decisions, sharding_decisions_blob


def coordinates(layout: MeshLayout, rank: int) -> dict[str, int]:
    """A global rank's coordinate in each dim (ranks laid out row-major, outermost dim first, as the mesh is)."""
    out = {}
    for name, size in layout.dims:
        inner = math.prod(s for n, s in layout.dims[layout.names.index(name) + 1:])
        out[name] = rank // inner % size
    return out


def is_donor(layout: MeshLayout, rank: int) -> bool:
    """The two ranks of each stage that publish: every coordinate but pp's 0, or the outermost one of those 1
    (a data-parallel neighbour: on another node where replicas span nodes, so one survives a node's loss)."""
    rest = [c for name, c in coordinates(layout, rank).items() if name != "pp"]
    return not any(rest) or (bool(rest) and rest[0] == 1 and not any(rest[1:]))


def _key(layout: MeshLayout, rank: int) -> str:
    return f"sharding-decisions/pp{coordinates(layout, rank).get('pp', 0)}"


def publish(store: dist.Store, layout: MeshLayout, rank: int, abort: AbortSignal) -> None:
    """(a generation's start, before the mesh) A donor that recorded decisions publishes them for its stage."""
    if recorded_sharding_decisions() and is_donor(layout, rank):
        _safely(lambda: store.check([_key(layout, rank)]) or store.set(_key(layout, rank),
                                                                           sharding_decisions_blob()), abort)


def adopt(store: dist.Store, layout: MeshLayout, rank: int, mesh: Any, abort: AbortSignal) -> None:
    """(after this rank built its parts) A rank that recorded none takes its stage's, if published."""
    if not recorded_sharding_decisions():
        key = _key(layout, rank)
        _safely(lambda: store.check([key]) and adopt_sharding_decisions(store.get(key), mesh), abort)


def _safely(work: Any, abort: AbortSignal) -> None:
    """An optimisation never fails a generation: a problem is said, and the first step computes what is missing."""
    try:
        work()
    except Exception as exc:  # noqa: BLE001
        if abort.is_set():
            raise
        print(f"dpstate: sharing DTensor's sharding decisions failed; the first step computes them "
              f"({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr, flush=True)
