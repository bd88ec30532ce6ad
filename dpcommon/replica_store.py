"""The replica store: snapshots of other nodes' ranks, held in memory by this node's agent.

Pure logic, no sockets: frames are kept as given (zero-copy zmq.Frames or bytes): the meta and the data's
chunks (dpcommon.protocol.chunk_views). Sizes are checked on arrival;
the checksum (dpcommon.checksum) by the worker that loads a snapshot, and here when asked to keep a held copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .checksum import checksum_chunks
from .protocol import PutSnapshot

KEEP_STEPS = 2


@dataclass(frozen=True)
class Snapshot:
    rank: int
    step: int
    generation: int
    checksum: int
    nbytes: int
    meta: Any  # bytes-like or zmq.Frame
    chunks: tuple  # the data, bytes-like or zmq.Frames, as received (or views of a local copy's blocks)
    base: Any = None  # the dpagent.dedup.LocalCopy some chunks refer to: the copy is stale once it is not valid()

    def stale(self) -> bool:
        return self.base is not None and not self.base.valid()

    @property
    def data(self) -> bytes:
        """The data joined (a copy: for tests and small snapshots)."""
        return b"".join(frame_view(c) for c in self.chunks)


def frame_view(frame: Any) -> memoryview:
    """A memoryview of a received frame (zmq.Frame) or of bytes."""
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def intact(snap: Snapshot, check: Callable[[Any, list], int] = checksum_chunks) -> bool:
    """Do the bytes held still match the checksum they came with? (Seconds at tens of GB.)"""
    return check(frame_view(snap.meta), [frame_view(c) for c in snap.chunks]) == snap.checksum


class ReplicaStore:
    """Keeps the newest `keep` steps of each rank.

    A put from an older generation than the newest held for its rank is refused (a fenced node); a put from a
    newer generation replaces the entries it supersedes (same or later steps of an abandoned timeline).
    """

    def __init__(self, keep: int = KEEP_STEPS):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep = keep
        self._ranks: dict[int, dict[int, Snapshot]] = {}

    def add(self, put: PutSnapshot, meta: Any, *chunks: Any, base: Any = None) -> str:
        """Stores the snapshot (its data in one or more chunks, some perhaps views of `base`, a local copy);
        returns "" or why it was refused."""
        if put.rank < 0 or put.step < 0:
            return f"bad rank/step {put.rank}/{put.step}"
        if not chunks:
            return "no data frame"
        size = frame_view(meta).nbytes + sum(frame_view(c).nbytes for c in chunks)
        if size != put.nbytes:
            return f"size mismatch: got {size} bytes, expected {put.nbytes}"
        held = self._ranks.setdefault(put.rank, {})
        error = self._supersede(put, held, from_step=put.step)
        if error:
            return error
        if held and put.step not in held and len(held) >= self.keep and put.step < min(held):
            return f"step {put.step} is older than the {self.keep} steps kept for rank {put.rank}"
        held[put.step] = Snapshot(put.rank, put.step, put.generation, put.checksum, put.nbytes, meta, tuple(chunks),
                                  base)
        while len(held) > self.keep:
            del held[min(held)]
        return ""

    def make_room(self, rank: int, step: int, generation: int) -> list[Snapshot]:
        """A snapshot of `step` is on its way (ReserveSnapshot): when `keep` steps of `rank` would be held with
        it, drop the oldest, so that it takes that copy's memory. Returns the copies dropped (their memory is
        freed when the caller lets go of them). Safe: its sender finished optimizer step `step`, past the
        snapshot gate, so every rank's snapshot before `step` is acked and no restore goes back past it (see
        dprun.controller.timeline.survivor_floors); the copy of that snapshot stays. Steps the snapshot will
        supersede (newer ones of an older generation) do not count: they go when it is stored."""
        held = self._ranks.get(rank, {})
        if step in held or not held or generation < max(s.generation for s in held.values()):
            return []  # a relabel or a re-put of a step held (no new memory), or a fenced sender
        kept = sorted(s for s, snap in held.items() if s < step or snap.generation >= generation)
        dropped = []
        while len(kept) >= self.keep and kept[0] < step:
            dropped.append(held.pop(kept.pop(0)))
        return dropped

    def relabel(self, put: PutSnapshot) -> str:
        """A PutSnapshot with held=True: the copy of put.step already here becomes the current generation's,
        as if it had been sent again, once its bytes match put.checksum (a corrupt copy is not kept: the
        sender then sends it whole). Returns "" or why it was refused. Checks inline; the agent splits it
        (relabel_candidate, then relabel_checked) so that its loop does not wait for a large checksum."""
        snap = self.relabel_candidate(put)
        if isinstance(snap, str):
            return snap
        return self.relabel_checked(put, snap, intact(snap))

    def relabel_candidate(self, put: PutSnapshot) -> Snapshot | str:
        """The held copy a relabel would keep (its bytes still to be checked), or why there is none."""
        snap = self.get(put.rank, put.step) if put.step >= 0 else None
        if snap is None or snap.checksum != put.checksum or snap.nbytes != put.nbytes:
            return f"step {put.step} of rank {put.rank} is not held here (held: {self.steps(put.rank)})"
        return snap

    def relabel_checked(self, put: PutSnapshot, snap: Snapshot, intact: bool) -> str:
        """Finish a relabel of `snap` once its bytes were checked against put.checksum (`intact`)."""
        held = self._ranks.get(put.rank, {})
        if held.get(put.step) is not snap:
            return f"the copy of step {put.step} of rank {put.rank} changed while it was checked"
        if not intact:
            del held[put.step]
            return f"the copy of step {put.step} of rank {put.rank} held here is corrupt"
        error = self._supersede(put, held, from_step=put.step + 1)
        if error:
            return error
        held[put.step] = dataclasses.replace(snap, generation=put.generation)
        return ""

    @staticmethod
    def _supersede(put: PutSnapshot, held: dict[int, Snapshot], from_step: int) -> str:
        """Refuse a put from an older generation than held; drop older generations' steps >= from_step."""
        if not held:
            return ""
        newest_gen = max(s.generation for s in held.values())
        if put.generation < newest_gen:
            return f"stale generation {put.generation} < {newest_gen} for rank {put.rank}"
        for step in [s for s, snap in held.items() if snap.generation < put.generation and s >= from_step]:
            del held[step]
        return ""

    def get(self, rank: int, step: int) -> Snapshot | None:
        """The snapshot of `rank` at `step`; a negative step means the newest held. A stale one (its local
        copy written since) is dropped, not returned."""
        held = self._ranks.get(rank) or {}  # (none held: nothing to drop, None below)
        for s in [s for s, snap in held.items() if snap.stale()]:
            del held[s]
        if not held:
            return None
        if step < 0:
            return held[max(held)]
        return held.get(step)

    def steps(self, rank: int) -> list[int]:
        return sorted(self._ranks.get(rank, {}))

    def ranks(self) -> list[int]:
        return sorted(r for r, held in self._ranks.items() if held)

    def drop_after(self, rank: int, step: int) -> list[int]:
        """Forget `rank`'s copies past `step` (a load from disk of `step` replaces a timeline that went further,
        or a damaged step that a resume passed over); returns the steps dropped."""
        held = self._ranks.get(rank, {})
        newer = sorted(s for s in held if s > step)
        for s in newer:
            del held[s]
        return newer

    def drop_rank(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def corrupt_all(self) -> int:
        """Fault injection (`corrupt-replicas`): flip one byte in every snapshot held, as bit rot would.
        The checksum no longer matches; a worker that fetches one must detect it. Returns how many."""
        count = 0
        for snapshots in self._ranks.values():
            for step, snap in list(snapshots.items()):
                middle = len(snap.chunks) // 2
                chunk = bytearray(frame_view(snap.chunks[middle]))
                if chunk:
                    chunk[len(chunk) // 2] ^= 0xFF
                    chunks = snap.chunks[:middle] + (bytes(chunk),) + snap.chunks[middle + 1 :]
                    snapshots[step] = dataclasses.replace(snap, chunks=chunks)
                    count += 1
        return count

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for held in self._ranks.values() for s in held.values())

    def __len__(self) -> int:
        return sum(len(held) for held in self._ranks.values())
