"""Which replica store holds which rank's snapshot at which step, and the restore step that follows.

Pure logic used by the controller when it reconstructs a generation (DESIGN.md, protocol step 3).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dpcommon.replica_store import KEEP_STEPS as KEEP_PER_HOLDER  # what each replica store keeps per rank
KEEP_SNAPSHOT_STEPS = 64  # newest distinct snapshot steps remembered (survivor floors look a few steps back)
NEWEST = 1 << 62  # a step past any: keys_at(NEWEST) names the ranks whose snapshots hold the newest state
INIT = "init"  # restore source: keep the freshly initialised state (a rank that never had a snapshot)


@dataclass
class RestorePlan:
    step: int
    sources: dict[int, str] = field(default_factory=dict)  # rank -> holder node id, "" (own local copy) or INIT
    lost: list[int] = field(default_factory=list)  # ranks whose state is gone


class ReplicaLedger:
    def __init__(self, keep: int = KEEP_PER_HOLDER):
        self.keep = keep
        self.held: dict[int, dict[str, list[int]]] = {}  # rank -> holder -> newest steps, ascending
        self.newest_ever: dict[int, int] = {}  # rank -> newest step ever replicated (bounded by its live state)
        self.snapshot_steps: list[int] = [0]  # steps any rank was snapshotted at, ascending (the interval's grid)

    def stored(self, rank: int, step: int, holder: str) -> None:
        steps = self.held.setdefault(rank, {}).setdefault(holder, [])
        if step not in steps:
            steps.append(step)
            steps.sort()
            del steps[: -self.keep]
        self.newest_ever[rank] = max(step, self.newest_ever.get(rank, -1))
        self.snapshot_taken(step)

    def snapshot_taken(self, step: int) -> None:
        """A rank said it snapshots `step` (Progress): a step on the grid even if no replica report of it
        ever arrives (its holder died with the reports in flight)."""
        if step not in self.snapshot_steps:
            bisect.insort(self.snapshot_steps, step)
            del self.snapshot_steps[:-KEEP_SNAPSHOT_STEPS]

    def snapshot_step_at_or_before(self, step: int) -> int:
        """The newest step at or before `step` that snapshots were taken at (every rank snapshots the same
        steps: every N, or auto's interval decided together), as far as any report tells; 0 if none."""
        i = bisect.bisect_right(self.snapshot_steps, step)
        return self.snapshot_steps[i - 1] if i else 0

    def holder_lost(self, holder: str) -> None:
        for by_holder in self.held.values():
            by_holder.pop(holder, None)

    def rollback(self, step: int) -> None:
        """All ranks go back to `step`: copies of later steps no longer bound anyone's live state."""
        for steps in self._step_lists():
            steps[:] = [s for s in steps if s <= step]
        for rank in self.held:
            if self.newest_ever.get(rank, -1) > step:
                self.newest_ever[rank] = step
        self.snapshot_steps[:] = [s for s in self.snapshot_steps if s <= step] or [0]

    def trains_from(self, step: int) -> None:
        """The job trains again from `step` (its abandoned timeline's copies already discarded): the newest step
        ever replicated and the grid are those of the copies still held past it (the new timeline's own)."""
        for rank, newest in self.newest_ever.items():
            if newest > step:
                self.newest_ever[rank] = max(step, max((s for s in self._steps_of(rank) if s > step), default=step))
        held = {s for steps in self._step_lists() for s in steps}
        self.snapshot_steps[:] = [s for s in self.snapshot_steps if s <= step or s in held] or [0]

    def _steps_of(self, rank: int) -> list[int]:
        return [s for steps in self.held.get(rank, {}).values() for s in steps]

    def forget(self, step: int) -> None:
        """No copy of `step` is to be counted on any more (a save of it failed: its copies damaged, or moved
        past by workers that trained on): plans pass it by, for an older step or a newer one reported since."""
        for steps in self._step_lists():
            if step in steps:
                steps.remove(step)
        self.snapshot_steps[:] = [s for s in self.snapshot_steps if s != step] or [0]

    def _step_lists(self) -> list[list[int]]:
        """Every list of steps a holder holds of a rank (to be edited in place)."""
        return [steps for by_holder in self.held.values() for steps in by_holder.values()]

    def newest_live(self, rank: int) -> int | None:
        return max(self._steps_of(rank), default=None)

    def newest_held_by(self, rank: int, holder: str) -> int:
        """The newest step of `rank` that `holder` reported it stores (-1: none)."""
        return max(self.held.get(rank, {}).get(holder, []), default=-1)

    def holders_of(self, rank: int, step: int) -> list[str]:
        return [holder for holder, steps in sorted(self.held.get(rank, {}).items()) if step in steps]

    def holder_of(self, rank: int, step: int) -> str | None:
        holders = self.holders_of(rank, step)
        return holders[0] if holders else None

    def discard(self, rank: int, step: int, holder: str) -> bool:
        """That copy turned out missing or corrupt. False if it was not listed (nothing changes)."""
        steps = self.held.get(rank, {}).get(holder)
        if steps and step in steps:
            steps.remove(step)
            return True
        return False

    def plan(self, ranks: Sequence[int], failed_ranks: set[int], floors: dict[int, int] | None = None,
             no_local: dict[int, int] | None = None,
             keys_at: Callable[[int], Sequence[int]] | None = None) -> RestorePlan:
        """The newest step every one of `ranks` (whose snapshots hold the job's state) can come back to; failed
        nodes must already be `holder_lost`. `keys_at(step)`: the ranks whose snapshots of an older step hold
        the job's state, where they were others (a job that shrank or grew since): those not of `ranks` come
        from their replicas; where it has holders(rank, step) (dprun.controller.timeline.StepHolding), those are
        the holders of its copies that hold what is taken from them (else: every holder of a copy of that step).

        A failed rank comes back from a live replica; one that never had a snapshot comes back from its
        fresh initial state at step 0; one whose every copy is gone is lost. A surviving rank is bounded
        by its newest replicated step, or by `floors` (a step it is known to hold locally) where higher:
        replica reports from a holder that died with them can be lost. It comes back from a replica that
        holds the step, else from its local copy, unless it said it has none at or before `no_local[rank]`.
        Where some rank has no copy of the newest such step (copies found bad, a survivor's ring passed),
        the plan goes down the snapshot grid to the newest step that every rank has a copy of.
        """
        floors, no_local = floors or {}, no_local or {}
        holders = getattr(keys_at, "holders", self.holders_of)
        local: dict[int, set[int]] = getattr(keys_at, "local", {})  # rank -> steps it may hold, no_local aside
        bounds: dict[int, int] = {}
        lost = []
        # the ranks whose snapshots hold the newest state: those of the width that trained last (a process
        # that a grow or shrink planned but has not trained yet holds none of it)
        bounded = ranks if keys_at is None else keys_at(NEWEST)
        for rank in bounded:
            if rank in failed_ranks or rank not in ranks:
                live = self.newest_live(rank)
                if live is not None:
                    bounds[rank] = live
                elif rank in self.newest_ever:
                    lost.append(rank)
                else:
                    bounds[rank] = 0
            else:
                bounds[rank] = max(self.newest_ever.get(rank, 0), floors.get(rank, 0), 0)
        if lost and keys_at is None:
            return RestorePlan(step=-1, lost=lost)
        # (with keys_at, a rank whose every copy is gone may be in another's snapshot of an older step, taken
        # anew as that one restored it: dprun.controller.retaken; the steps below say, else it is lost)
        newest = min(bounds.values()) if bounds else 0
        first_lost: list[int] | None = None
        for step in [newest, *(s for s in reversed(self.snapshot_steps) if s < newest)]:
            keys = ranks if keys_at is None else keys_at(step)
            gone = failed_ranks | (set(keys) - set(ranks))
            sources, lost = self._sources_at(step, keys, gone, no_local, holders, local)
            if not lost:
                return RestorePlan(step=step, sources=sources)
            first_lost = lost if first_lost is None else first_lost
        return RestorePlan(step=-1, lost=[rank for rank in bounded if rank not in bounds] or first_lost or [])

    def _sources_at(self, step: int, ranks: Sequence[int], failed_ranks: set[int], no_local: dict[int, int],
                    holders: Callable[[int, int], list[str]],
                    local: dict[int, set[int]]) -> tuple[dict[int, str], list[int]]:
        """Where each rank's copy of `step` comes from (one of `holders`), and the ranks that have none."""
        sources: dict[int, str] = {}
        lost = []
        for rank in ranks:
            holder = next(iter(holders(rank, step)), None)
            if rank in failed_ranks:
                if holder is not None:
                    sources[rank] = holder
                elif step == 0 and rank not in self.newest_ever:
                    sources[rank] = INIT
                else:
                    lost.append(rank)
            elif holder is None and step <= no_local.get(rank, -1) and step not in local.get(rank, ()):
                lost.append(rank)
            else:
                sources[rank] = holder or ""
        return sources, lost
