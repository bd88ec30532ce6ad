"""The simulated cluster's nodes and workers, and the rules of a node's replica store (as dpagent's ReplicaStore).

Plain state and decisions only: the World (world.py) moves the messages and keeps the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpcommon.replica_store import KEEP_STEPS as KEEP_REPLICA  # the store's own rule, not a copy of it

KEEP_LOCAL = 2  # as dpstate.replication.replicator.NSLOTS

Put = tuple[int, int, int]  # (rank, step, generation) of a snapshot sent to a holder


@dataclass
class SimWorker:
    rank: int = -1
    generation: int = -1
    state: int = 0  # optimizer steps applied
    made: int = -1  # the newest step it reported made (Progress) or restored (WorkerReady): WorkerExited.step
    phase: str = "waiting"  # waiting (for a Reconfigure), running, gated, recovering, done, dead
    local: list = field(default_factory=list)  # snapshot steps held locally
    acked: int = -1  # newest snapshot acked by every replica store it was sent to
    awaiting: dict = field(default_factory=dict)  # step -> acks still missing
    restore: Any = None  # the Reconfigure being applied
    carry: tuple = ()  # the logical ranks it trains, its own (`rank`, the key of its messages and snapshots) first
    parts: dict = field(default_factory=dict)  # logical rank -> the step its part of the training state is at
    local_parts: dict = field(default_factory=dict)  # step of a local snapshot -> the parts it holds
    fetched: dict = field(default_factory=dict)  # a restore: key -> the parts of its snapshot taken in so far


@dataclass
class ScriptError:
    """The training script raises when a worker of `rank` (None: every rank) is about to make `step`: every time
    (a bug) or once (a flaky error). `detail` is the exception's line."""

    rank: int | None
    step: int
    once: bool
    detail: str


@dataclass
class SimNode:
    node_id: str
    nproc: int
    alive: bool = True
    frozen: bool = False
    stopped: bool = False
    welcomed: bool = False
    generation: int = -1
    node_rank: int = -1
    replica_to: list = field(default_factory=list)
    store: dict = field(default_factory=dict)  # rank -> sorted steps held
    store_gen: dict = field(default_factory=dict)  # (rank, step) held -> generation of its put
    parts: dict = field(default_factory=dict)  # (rank, step) held -> the logical ranks' parts it holds {rank: step}
    corrupt: set = field(default_factory=set)  # (rank, step) held but damaged (a loading worker finds out)
    workers: list = field(default_factory=list)
    inbox_while_frozen: list = field(default_factory=list)
    deferred: list = field(default_factory=list)  # its own work that came due while it was frozen

    @property
    def running(self) -> bool:
        return self.alive and not self.frozen and not self.stopped

    @property
    def endpoint(self) -> str:
        return f"sim://{self.node_id}"

    # -- its replica store: each returns the steps it dropped, [(rank, step)] -------------------------

    def make_room(self, put: Put) -> list[tuple[int, int]]:
        """ReserveSnapshot, as ReplicaStore.make_room: the rank's oldest copies go first; steps the snapshot
        will supersede do not count; a fenced sender's (an older generation than held) is ignored."""
        rank, step, generation = put
        steps = self.store.get(rank, [])
        if step in steps or not steps or generation < self.newest_generation(rank):
            return []
        kept = [s for s in steps if s < step or self.store_gen[(rank, s)] >= generation]
        dropped = []
        while len(kept) >= KEEP_REPLICA and kept[0] < step:
            dropped.append(self.drop(rank, kept.pop(0)))
        return dropped

    def add(self, put: Put, parts: dict | None = None) -> tuple[bool, list[tuple[int, int]]]:
        """As ReplicaStore.add: (stored, the steps dropped). A put from an older generation than held for its
        rank is refused (a fenced sender: never acked); a newer one first drops that rank's steps it supersedes
        (same or later ones of an older generation); then a step older than the KEEP steps held is refused;
        a stored copy replaces a damaged one of the same step, and the oldest beyond KEEP go. `parts`: what the
        copy holds (a narrow job's snapshot holds its carried ranks' parts too); by default its own rank's."""
        rank, step, generation = put
        steps = self.store.setdefault(rank, [])
        if steps and generation < self.newest_generation(rank):
            return False, []
        superseded = [s for s in steps if s >= step and self.store_gen[(rank, s)] < generation]
        dropped = [self.drop(rank, old) for old in superseded]
        if step not in steps and len(steps) >= KEEP_REPLICA and step < steps[0]:
            return False, dropped
        self.corrupt.discard((rank, step))
        if step not in steps:
            steps.append(step)
            steps.sort()
        self.store_gen[(rank, step)] = generation
        self.parts[(rank, step)] = parts if parts is not None else {rank: step}
        while len(steps) > KEEP_REPLICA:
            dropped.append(self.drop(rank, steps[0]))
        return True, dropped

    def drop_after(self, rank: int, step: int) -> list[tuple[int, int]]:
        """As ReplicaStore.drop_after: a load from disk of `step` replaces the rank's copies past it."""
        return [self.drop(rank, s) for s in list(self.store.get(rank, [])) if s > step]

    def newest_generation(self, rank: int) -> int:
        return max(self.store_gen[(rank, s)] for s in self.store.get(rank, []))

    def drop(self, rank: int, step: int) -> tuple[int, int]:
        self.store[rank].remove(step)
        self.store_gen.pop((rank, step), None)
        self.parts.pop((rank, step), None)
        self.corrupt.discard((rank, step))
        return rank, step

    def damage(self, which: str) -> None:
        """The copies held now are damaged: "all", each rank's "newest", or "all-but-oldest"."""
        pick = {"all": slice(None), "newest": slice(-1, None), "all-but-oldest": slice(1, None)}[which]
        self.corrupt |= {(rank, step) for rank, steps in self.store.items() for step in steps[pick]}
