"""A logical rank's own part of a snapshot tree (each per-rank object's entry, its RNG state), taken from the
snapshot of the process that trained it, and put into the tree that the process training it next restores.

A tree's own RNG ("rng") is that of its first rank (tree["ranks"]); the others' are tracked under RANKS_RNG_NAME
(dpstate.groups.narrow.RanksRng); job.per_rank objects keep an entry per rank under "per_rank".
"""

from __future__ import annotations

import copy
from typing import Any

RANKS_RNG_NAME = "__dpstate_ranks_rng__"  # the name under which the other carried ranks' RNG states are tracked


def _entries(state: Any) -> dict | None:
    """A per-rank state's entries by str(rank); None for any other state."""
    return state["per_rank"] if isinstance(state, dict) and set(state) == {"per_rank"} else None


def carried_by(tree: dict) -> list[int]:
    """The logical ranks a snapshot holds, its own first (a tree from before logical ranks: none said)."""
    return list(tree.get("ranks", []))


def rank_part(tree: dict, rank: int) -> dict:
    """`rank`'s part of `tree`: {"objects": {name: its entry}, "rng": its RNG state}."""
    ranks = carried_by(tree)
    if rank not in ranks:
        raise KeyError(f"the snapshot of step {tree['step']} holds logical ranks {ranks}, not {rank}")
    objects = {}
    for name, state in tree["state"].items():
        entries = _entries(state)
        if entries is not None and name != RANKS_RNG_NAME:
            objects[name] = entries[str(rank)]
    rng = tree["rng"] if rank == ranks[0] else tree["state"][RANKS_RNG_NAME]["per_rank"][str(rank)]
    return {"objects": objects, "rng": rng}


def with_part(tree: dict, rank: int, part: dict) -> dict:
    """A copy of `tree` that also holds `rank` (not its own), from `part` (rank_part of another tree)."""
    out = copy.copy(tree)
    out["state"] = dict(tree["state"])
    for name, entry in part["objects"].items():
        entries = _entries(out["state"].get(name))
        if entries is None:
            raise KeyError(f"the snapshot of step {tree['step']} has no per-rank object {name!r} to add rank {rank} to")
        out["state"][name] = {"per_rank": {**entries, str(rank): entry}}
    others = _entries(out["state"].get(RANKS_RNG_NAME)) or {}
    out["state"][RANKS_RNG_NAME] = {"per_rank": {**others, str(rank): part["rng"]}}
    out["ranks"] = [*(r for r in carried_by(tree) if r != rank), rank]  # (a stale part it held is replaced)
    return out


def as_own(tree: dict, rank: int) -> dict:
    """A copy of `tree` (which holds `rank`) whose own rank is `rank`: its RNG becomes the process's, and the
    tree holds that rank alone (a process that takes a carried rank as its own, as the job grows)."""
    part = rank_part(tree, rank)
    out = copy.copy(tree)
    out["state"] = {name: ({"per_rank": {str(rank): part["objects"][name]}} if name in part["objects"] else state)
                    for name, state in tree["state"].items() if name != RANKS_RNG_NAME}
    out["rng"], out["ranks"] = part["rng"], [rank]
    return out
