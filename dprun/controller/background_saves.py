"""Background saves (--save-every, --save-interval): when the next one is due, the one being written, and the
newest step known safe on disk. Pure logic; the controller asks the replica stores to write (dprun.controller.files).

One save is written at a time: a disk slower than the schedule skips steps rather than queue them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class SaveInFlight:
    """A background save asked of the stores: the ranks not written yet, each with the node writing it."""

    step: int
    folder: str
    waiting: dict[int, str]
    started: float
    nbytes: int
    errors: list[str] = field(default_factory=list)
    said_no: bool = False  # a writer answered that it did not write a rank: this step is not whole on disk


@dataclass(frozen=True)
class SaveOutcome:
    """How a background save ended: written whole, or why not; its size and time."""

    step: int
    folder: str
    ok: bool
    why: str
    nbytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


class BackgroundSaves:
    """The schedule and the record of a job's background saves."""

    def __init__(self, every: int, interval_s: float, now: float, safe: tuple[str, int] | None = None):
        self.every = every
        self.interval_s = interval_s
        self.last_step = safe[1] if safe else 0  # the newest step a save was started of
        self.last_at = now
        self.safe = safe  # (folder, step): the newest step known complete on disk (a resume's counts)
        self.in_flight: SaveInFlight | None = None
        self.sizes: dict[int, int] = {}  # rank -> bytes of its newest snapshot stored
        self.skipped = 0
        self.slow_said = False
        self.failures_said: set[str] = set()
        self.unsure = 0  # saves failed since the safe step that may be whole on disk all the same (see keep)

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.interval_s > 0

    def due(self, step: int, now: float) -> bool:
        """Is a save of `step` (the newest that the stores hold for every rank) due?"""
        if not self.enabled or step <= self.last_step:
            return False
        return (self.every > 0 and step >= self.last_step + self.every) or (
            self.interval_s > 0 and now - self.last_at >= self.interval_s)

    def skip(self, step: int, now: float) -> str | None:
        """A save of `step` is due while one is still written: it is skipped. The first time, the line that says
        so, with the bandwidth seen so far."""
        work = self.in_flight
        if work is None or step <= self.last_step:
            return None
        self.skipped += 1
        self.last_step, self.last_at = step, now  # (the next one is due a whole period on)
        if self.slow_said:
            return None
        self.slow_said = True
        took = now - work.started
        return (f"the background save of step {work.step} ({work.nbytes / 1e6:.0f} MB) is still being written after "
                f"{took:.1f} s (under {work.nbytes / 1e6 / max(took, 1e-9):.0f} MB/s): step {step} is skipped, and "
                "saves come as often as the disk allows (said once)")

    def begin(self, step: int, folder: str, waiting: dict[int, str], now: float) -> SaveInFlight:
        self.last_step, self.last_at = step, now
        nbytes = sum(self.sizes.get(rank, 0) for rank in waiting)
        self.in_flight = SaveInFlight(step, folder, dict(waiting), now, nbytes)
        return self.in_flight

    def answered(self, node_id: str, step: int, results: dict[str, str], now: float) -> SaveOutcome | None:
        """A node's SnapshotFiles for the save in flight; its outcome once every rank is answered."""
        work = self.in_flight
        if work is None or step != work.step:
            return None
        for rank_text, error in results.items():
            rank = int(rank_text)
            if work.waiting.get(rank) != node_id:
                continue
            del work.waiting[rank]
            if error:
                work.errors.append(f"{node_id}: {error}")
                work.said_no = True
        return self._end(now) if not work.waiting else None

    def node_lost(self, node_id: str, now: float) -> SaveOutcome | None:
        """A node writing part of the save in flight was lost: that save cannot complete."""
        work = self.in_flight
        if work is None or node_id not in work.waiting.values():
            return None
        work.errors.append(f"{node_id}, which was writing ranks "
                           f"{sorted(r for r, n in work.waiting.items() if n == node_id)}, was lost")
        return self._end(now)

    def abandon(self, now: float, why: str) -> SaveOutcome | None:
        """The save in flight no longer counts (a recovery began: its nodes may change)."""
        if self.in_flight is None:
            return None
        self.in_flight.errors.append(why)
        return self._end(now)

    def _end(self, now: float) -> SaveOutcome:
        work, self.in_flight = self.in_flight, None
        assert work is not None
        outcome = SaveOutcome(work.step, work.folder, not work.errors, "; ".join(work.errors), work.nbytes,
                              now - work.started)
        if outcome.ok:
            self.safe, self.unsure = (work.folder, work.step), 0
        elif not work.said_no:  # a writer lost, or abandoned: the others may still complete it
            self.unsure += 1
        return outcome

    def keep(self, asked: int) -> int:
        """The complete steps a writer keeps when it prunes (SaveSnapshots.keep): `asked` (--save-keep), but never so
        few that the safe step goes, the one a restore from disk reads. Newer complete steps may stand before it
        on disk: the save being written, whose last writer prunes before the controller hears it is complete,
        and each save failed since that may be whole all the same (a writer lost after it wrote its files)."""
        return max(asked, self.unsure + 2) if asked > 0 else 0

    def first_time(self, why: str) -> bool:
        """Is this the first failure of its kind (said as a line once; each is an event)?"""
        kind = re.sub(r"\d+", "N", why.split("; ")[0].split(": ", 1)[-1])[:100]  # (whichever node said it first)
        if kind in self.failures_said:
            return False
        self.failures_said.add(kind)
        return True

    def safe_note(self) -> str:
        """What the job's end message says of the disk: its newest complete step."""
        if not self.enabled:
            return ""
        if self.safe is None:
            return "no step was saved whole on disk"
        return f"the newest step safe on disk is step {self.safe[1]} in {self.safe[0]}"
