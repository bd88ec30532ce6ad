"""How a simulated dpstate worker restores a generation's step (dpstate.steps.restoring): its own copy, a replica's,
the state before training, and (a job that shrank or grew: Reconfigure.adopt_from) other ranks' parts fetched too.

A part of the WorkerModel (worker_model.py), handed the World's WorkerWorld and what to do once a worker restored.
"""

from __future__ import annotations

import random
from typing import Callable, Protocol

from dpcommon import protocol as p

from .cluster import SimNode
from .shrink_checks import restored_parts


class RestoreWorld(Protocol):
    """What the restores need of the World (a subset of worker_model.WorkerWorld)."""

    rng: random.Random

    def at(self, dt: float, fn: Callable[..., object], *args: object) -> None: ...
    def agent_send(self, node_id: str, *msgs: object) -> None: ...
    def node_of(self, endpoint: str) -> SimNode | None: ...


Restored = Callable[[SimNode, int, int, p.RestoredFrom, dict], None]  # node, local, generation, from, the copy


def frozen(node: SimNode, fn: Callable[..., object], *args: object) -> bool:
    """A frozen node does nothing; what came due runs when it wakes (TCP keeps the bytes meanwhile)."""
    if node.frozen and node.alive:
        node.deferred.append((fn, args))
        return True
    return False


def adoptions(msg: p.Reconfigure) -> dict[int, int]:
    """Reconfigure.adopt_from as ints: logical rank new to this node's process -> the key whose snapshot holds it."""
    return {int(rank): key for rank, key in msg.adopt_from.items()}


class RestoreModel:
    def __init__(self, world: RestoreWorld, fetch_timeout: float, restored: Restored):
        self.world, self.fetch_timeout, self.restored = world, fetch_timeout, restored

    def start(self, node: SimNode, local: int, generation: int) -> None:
        """As Restoring.restore: a fresh start, the state before training ("init", which keeps every carried rank's
        initial part: no other snapshot is read), a process whose own rank another trained (a grow: from that
        one's snapshot), its own local copy, or a replica's; then the parts of the ranks it adopts."""
        if frozen(node, self.start, node, local, generation):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        msg = worker.restore
        key, step = worker.rank, msg.restore_step
        source, adopt = msg.restore_from.get(str(key), ""), adoptions(msg)
        worker.fetched = {}
        if step < 0 or (step == 0 and (source == "init" or not source and 0 not in worker.local)):
            # (as dpstate: a process that never snapshotted step 0 keeps its state before training for it)
            worker.state, worker.local, worker.local_parts, worker.acked = 0, [], {}, -1
            worker.parts = dict.fromkeys(worker.carry, 0)
            self.restored(node, local, generation, "" if step < 0 else "init", dict(worker.parts))
        elif key in adopt:
            self._fetch(node, local, generation, adopt[key], self.named(msg, adopt[key]))
        elif step in worker.local and worker.state >= step:
            worker.state = step
            worker.fetched[key] = worker.local_parts[step]
            self._adopt_next(node, local, generation, "local")
        else:
            self._fetch(node, local, generation, key, self.named(msg, key))

    @staticmethod
    def named(msg: p.Reconfigure, key: int) -> list[str]:
        """The stores the plan names for `key`'s snapshot (dpstate.replication.sources.named_sources)."""
        return [s for s in [msg.restore_from.get(str(key), ""), *msg.restore_also.get(str(key), [])]
                if s and s != "init"]

    def _adopt_next(self, node: SimNode, local: int, generation: int, where: p.RestoredFrom) -> None:
        """The next adopted rank's snapshot to fetch (each from the stores named for its key), or, all taken in,
        the worker's parts: each carried rank's from the snapshot the plan said holds it (invariant 13)."""
        worker = node.workers[local]
        msg, key = worker.restore, worker.rank
        adopt = adoptions(msg)
        for rank in worker.carry:
            holder = adopt.get(rank)
            if holder is not None and holder not in worker.fetched:
                self._fetch(node, local, generation, holder, self.named(msg, holder))
                return
        worker.parts = restored_parts(node.node_id, worker.carry, adopt, worker.fetched, msg.restore_step)
        merged = any(rank in adopt for rank in worker.carry)  # a new snapshot in place of the one restored
        # (its own snapshot restored: the new one keeps the parts of the ranks it held and no longer carries)
        copy = dict(worker.parts) if key in adopt else {**worker.fetched[key], **worker.parts} if merged \
            else worker.fetched[key]
        self.restored(node, local, generation, "replica" if merged else where, copy)

    def _fetch(self, node: SimNode, local: int, generation: int, key: int, sources: list) -> None:
        """As dpstate's fetch_any: fetch `key`'s snapshot from the first store named. A store without the copy says
        so at once; a copy takes a while to arrive and the loading worker finds it corrupt only then; either is
        reported (RestoreFailed) and the next store tried. A dead store never answers: the fetch gives up on it
        after its timeout, unless a new plan aborts it first; a frozen one answers when it wakes. None good: a
        missing local copy is reported too if the plan counted on it, and it waits for the next
        reconfiguration."""
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        msg = worker.restore
        step = msg.restore_step
        while sources:
            source, sources = sources[0], sources[1:]
            holder = self.world.node_of(source)
            if holder is None or not holder.alive:  # no answer: wait out the timeout, or a new plan's abort
                self.world.at(self.fetch_timeout, self._timed_out, node, local, generation, key, source, sources)
                return
            if frozen(holder, self._fetch, node, local, generation, key, [source, *sources]):
                return
            if step in holder.store.get(key, []):
                bad = (key, step) in holder.corrupt  # the frames sent are the copy as it is now
                parts = dict(holder.parts[(key, step)])
                self.world.at(self.world.rng.uniform(0.01, 0.25), self._fetched, node, local, generation, key,
                              holder, sources, bad, parts)
                return
            self.world.agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, key, step, source,
                                                                "not held"))
        if not msg.restore_from.get(str(key)) and (key != worker.rank or step not in worker.local):
            # as dpstate: the local copy that the plan counted on (source "") is gone too
            self.world.agent_send(node.node_id,
                                  p.RestoreFailed(node.node_id, generation, key, step, "", "no local copy"))
        worker.phase = "restore-failed"
        self.world.agent_send(node.node_id, p.PeerError(node.node_id, generation, worker.rank,
                                                        f"snapshot of rank {key} at step {step} not found"))

    def _timed_out(self, node: SimNode, local: int, generation: int, key: int, source: str, rest: list) -> None:
        """Nothing came from a dead store in time: reported as a bad copy (as dpstate), the next store tried."""
        if frozen(node, self._timed_out, node, local, generation, key, source, rest):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        self.world.agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, key,
                                                            worker.restore.restore_step, source, "timed out"))
        self._fetch(node, local, generation, key, rest)

    def _fetched(self, node: SimNode, local: int, generation: int, key: int, holder: SimNode, rest: list,
                 bad: bool, parts: dict) -> None:
        """A fetched copy arrived (a holder frozen mid-transfer holds it up; a dead one breaks it off, and the
        fetch times out)."""
        args = (node, local, generation, key, holder, rest, bad, parts)
        if frozen(holder, self._fetched, *args) or frozen(node, self._fetched, *args):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        if not holder.alive:  # broken off: the rest never comes, and the fetch gives up on it in time
            self.world.at(self.fetch_timeout, self._timed_out, node, local, generation, key, holder.endpoint, rest)
            return
        step = worker.restore.restore_step
        if bad or (key, step) in holder.corrupt:  # damaged before or while it was sent
            self.world.agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, key, step,
                                                                holder.endpoint, "corrupt"))
            self._fetch(node, local, generation, key, rest)
            return
        worker.fetched[key] = parts
        if key == adoptions(worker.restore).get(worker.rank, worker.rank):  # the process's own state
            worker.state = step
        self._adopt_next(node, local, generation, "replica")
