"""Snapshots of a restore step taken anew: a process that took other ranks' parts in as it restored replicates its
snapshot of that step with them (dpstate.steps.restoring), so they are in its copies of that step too. Pure.

Which copies: those its holders reported in that generation (a copy from before holds what it held then; one sent
again later may be of another restore) and, once the process said it restored, its local copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Copy = tuple[int, int]  # (key: the rank whose snapshots they are, step)


@dataclass
class Retaken:
    carried: dict[Copy, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # -> (generation, its ranks)
    fresh: dict[Copy, set[str]] = field(default_factory=dict)  # -> holders of the copies taken anew
    local: set[Copy] = field(default_factory=set)  # its process restored: its local copy is the one taken anew

    def began(self, generation: int, step: int, assignment: tuple[tuple[int, ...], ...],
              adopted: dict[int, int]) -> None:
        """Generation `generation` restores `step`: each process that takes in a rank held in another's snapshot
        takes its own anew, with every rank it carries."""
        for ranks in assignment:
            if any(r in adopted for r in ranks):
                self.carried[(ranks[0], step)] = (generation, ranks)
                self.fresh[(ranks[0], step)] = set()
                self.local.discard((ranks[0], step))

    def stored(self, key: int, step: int, generation: int, holder: str) -> None:
        """`holder` stored a copy of `key`'s snapshot of `step` (of `generation`): it replaced the one it held."""
        taken = self.carried.get((key, step))
        if taken is not None:
            if generation == taken[0]:
                self.fresh[(key, step)].add(holder)
            else:
                self.fresh[(key, step)].discard(holder)

    def restored(self, key: int, generation: int, step: int) -> None:
        taken = self.carried.get((key, step))
        if taken is not None and taken[0] == generation:
            self.local.add((key, step))

    def holding(self, rank: int, step: int) -> list[int]:
        """The keys whose snapshots of `step`, taken anew, hold `rank`."""
        return sorted(key for (key, at), (_, ranks) in self.carried.items() if at == step and rank in ranks)

    def trains_from(self, step: int) -> None:
        """The job trains from `step`: snapshots taken anew of older steps will not be planned again."""
        for copy in [c for c in self.carried if c[1] < step]:
            del self.carried[copy], self.fresh[copy]
            self.local.discard(copy)
