"""The job's width: which logical data-parallel ranks each process of a generation trains; how it shrinks when a
replica is lost with no spare left (--on-spare-exhausted shrink) and grows back when nodes join. Pure.

A logical rank keeps its data order and RNG for life (dpstate.groups.carried); a shrink hands a lost process's
ranks to the survivors that train the fewest, so a step takes as long as the busiest process's count of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

Assignment = tuple[tuple[int, ...], ...]  # per process rank: the logical ranks it trains, its own first


@dataclass(frozen=True)
class Width:
    assignment: Assignment

    @classmethod
    def full(cls, world: int) -> "Width":
        return cls(tuple((r,) for r in range(world)))

    @property
    def logical_world(self) -> int:
        return sum(len(ranks) for ranks in self.assignment)

    @property
    def processes(self) -> int:
        return len(self.assignment)

    @property
    def narrow(self) -> bool:
        return self.processes < self.logical_world

    @property
    def in_order(self) -> bool:
        """Process r trains logical rank r alone: workers need not be told (Reconfigure.carry stays empty)."""
        return all(ranks == (r,) for r, ranks in enumerate(self.assignment))

    @property
    def slowdown(self) -> int:
        """How many ranks' micro-batches the busiest process computes in a step (1 at full width)."""
        return max(len(ranks) for ranks in self.assignment)

    def own_ranks(self) -> list[int]:
        """Each process's own logical rank, by process rank."""
        return [ranks[0] for ranks in self.assignment]

    def shrink(self, lost: set[int]) -> "Width | str":
        """Without the processes `lost` (process ranks): their logical ranks go, in order, each to the survivor
        that trains the fewest (the lowest process rank among equals); survivors keep their order. A reason
        instead where nothing survives."""
        survivors = [list(ranks) for p, ranks in enumerate(self.assignment) if p not in lost]
        if not survivors:
            return "no data-parallel replica would be left"
        orphans = sorted(r for p in sorted(lost) for r in self.assignment[p])
        for rank in orphans:
            min(survivors, key=len).append(rank)
        return Width(tuple(tuple(ranks) for ranks in survivors))

    def grow(self, joining: int) -> "Width":
        """With `joining` more processes (appended after the others): each takes as its own one of the ranks
        carried by the busiest process (its last), until none is left over or no process joins any more."""
        carriers = [list(ranks) for ranks in self.assignment]
        added: list[list[int]] = []
        for _ in range(joining):
            busiest = max(carriers, key=len)
            if len(busiest) == 1:
                break
            added.append([busiest.pop()])
        return Width(tuple(tuple(ranks) for ranks in carriers + added))


@dataclass(frozen=True)
class Narrowing:
    """A shrink: the width the job goes on at, the node ranks that go on (in their new order) and those that
    leave (the nodes lost and, in a sharded job, the other nodes of their data-parallel replicas)."""

    width: Width
    nodes: tuple[int, ...]
    leaving: tuple[int, ...]
