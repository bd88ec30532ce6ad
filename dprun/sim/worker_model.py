"""What the simulated cluster's dpstate workers do: restore, lockstep steps behind the snapshot gate, snapshots
sent to replica stores and acked, exits. A part of World (world.py), which keeps the clock and the network.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Protocol

from dpcommon import protocol as p
from dprun.controller.vocabulary import JobSpec

from .cluster import KEEP_LOCAL, Put, SimNode
from .shrink_checks import InvariantViolation
from .restore_model import RestoreModel, frozen

__all__ = ["WorkerModel", "WorkerWorld", "frozen"]


class WorkerWorld(Protocol):
    """What the worker model is handed by the World that runs it: the clock, the network, the nodes, the job
    and the records of what happened that the invariants read."""

    now: float
    rng: random.Random
    nodes: dict[str, SimNode]
    spec: JobSpec
    log: list[str]
    replicated: set  # (rank, step) ever stored on a replica
    dropped_by: dict[tuple, tuple]  # (holder, rank, step) a store dropped -> the put that made it drop it
    deaths: int  # workers died or nodes killed (neither comes back): what the collectives' checks key on

    def at(self, dt: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def link_delay(self, src: str, dst: str) -> float: ...
    def agent_send(self, node_id: str, *msgs: Any) -> None: ...
    def node_of(self, endpoint: str) -> SimNode | None: ...
    def raise_due(self, node: SimNode, local: int) -> bool: ...
    def record_dropped(self, holder: SimNode, dropped: list[tuple[int, int]], put: Put) -> None: ...


class WorkerModel:
    """The simulated workers of every node, handed the World that runs them (WorkerWorld)."""

    def __init__(self, world: WorkerWorld, steps: int, interval: int, measure_until: int, defer: bool,
                 fetch_timeout: float):
        self.world = world
        self.steps = steps
        self.interval = interval  # snapshots at step 0 and every multiple of it ...
        self.measure_until = measure_until  # ... after an auto-like measuring window (see snapshotted)
        self.defer = defer  # the gate waits for acks at snapshot steps only (dpstate.steps.gate: no landing)
        self.restores = RestoreModel(world, fetch_timeout, self._restored)  # (gives up on a silent store after it)
        self.processes: dict[int, int] = {}  # generation -> its processes (Reconfigure.world_size)
        self.entered: dict[tuple[int, int | str], set] = {}  # (generation, step or "final") -> ranks in the all-reduce
        self.ready: dict[int, set] = {}  # generation -> ranks at the post-restore barrier
        self.captured: set = set()  # (rank, step) ever snapshotted by the worker of that rank
        self.restored_at: dict[tuple[int, int], int] = {}  # (generation, rank) -> the step its worker restored
        # what lets thousands of nodes simulate in seconds: caches the per-event checks depend on
        self.members_of: dict[int, list] = {}  # generation -> its workers [(node, local, worker)], until one changes
        self.alive_at: dict[int, int] = {}  # generation -> world.deaths when none of its workers was found dead

    def recheck_collectives(self) -> None:
        """Something died, or woke: every collective in flight looks at its members again."""
        for key in list(self.entered):
            self._check_allreduce(key)

    def reconfigure(self, node: SimNode, local: int, msg: p.Reconfigure) -> None:
        if frozen(node, self.reconfigure, node, local, msg):
            return
        worker = node.workers[local]
        if not node.running or worker.phase in ("dead", "done") or msg.generation <= worker.generation:
            return
        for generation in (worker.generation, msg.generation):  # both generations' workers change
            self.members_of.pop(generation, None)
            self.alive_at.pop(generation, None)
        worker.generation = msg.generation
        process = msg.node_rank * msg.nproc_per_node + local
        worker.carry = tuple(msg.carry[process]) if msg.carry else (process,)  # a narrow job's: told (protocol 22)
        worker.rank = worker.carry[0]  # its own logical rank: the key of its messages and snapshots
        self.processes[msg.generation] = msg.world_size  # (counts processes: the collectives' size)
        worker.phase = "recovering"
        worker.restore = msg
        self.world.at(self.world.rng.uniform(0.001, 0.03), self.restores.start, node, local, msg.generation)

    def _restored(self, node: SimNode, local: int, generation: int, source: p.RestoredFrom, copy: dict) -> None:
        """Restored (RestoreModel): the restored copy (`copy`: the parts it holds) is its local snapshot of that
        step, replicated again at once; then the post-restore barrier."""
        worker = node.workers[local]
        worker.local = [s for s in worker.local if s < worker.state] + [worker.state]  # the restored copy
        worker.local_parts = {s: worker.local_parts.get(s, copy) for s in worker.local}
        worker.local_parts[worker.state] = copy
        worker.phase = "ready"
        self._take_snapshot(node, local)  # re-replicated at once, before the barrier (as dpstate)
        self.ready.setdefault(generation, set()).add(worker.rank)
        worker.made = worker.restore.restore_step
        self.restored_at[(generation, worker.rank)] = worker.state  # (invariants: a restore from disk's step)
        self.world.agent_send(node.node_id, p.WorkerReady(node.node_id, generation, worker.rank, 0.01, 0.01, source))
        self._try_release_barrier(generation)

    def _try_release_barrier(self, generation: int) -> None:
        if len(self.ready.get(generation, ())) < self.processes[generation]:
            return
        for node in self.world.nodes.values():
            for local, worker in enumerate(node.workers):
                if worker.generation == generation and worker.phase == "ready":
                    self._leave_barrier(node, local, generation)

    def _leave_barrier(self, node: SimNode, local: int, generation: int) -> None:
        """The last rank arrived: this one goes on (a frozen node when it wakes: the barrier's bytes wait)."""
        if frozen(node, self._leave_barrier, node, local, generation):
            return
        worker = node.workers[local]
        if node.running and worker.generation == generation and worker.phase == "ready":
            worker.phase = "running"
            self.world.at(self.world.rng.uniform(0.005, 0.02), self._worker_step, node, local, generation)

    def _take_snapshot(self, node: SimNode, local: int) -> None:
        worker = node.workers[local]
        if worker.local[-1:] != [worker.state]:  # a restored snapshot is sent again from its own slot
            worker.local = (worker.local + [worker.state])[-KEEP_LOCAL:]
            worker.local_parts = {s: worker.local_parts.get(s, worker.parts) for s in worker.local}
            worker.local_parts[worker.state] = dict(worker.parts)  # every rank it carries, at this step
        parts = worker.local_parts[worker.state]
        self.captured.add((worker.rank, worker.state))
        holders = [h for h in map(self.world.node_of, node.replica_to) if h is not None]
        worker.awaiting[worker.state] = len(holders)
        # acked once every holder acks it (a restored step sent again too); with none, at once (as dpstate)
        worker.acked = min(worker.acked, worker.state - 1) if holders else max(worker.acked, worker.state)
        put = (worker.rank, worker.state, worker.generation)
        for holder in holders:  # ReserveSnapshot just ahead of the snapshot on the same connection
            delay = self.world.link_delay(node.node_id, holder.node_id)
            self.world.at(delay - 1e-7, self._store_reserve, holder, put)
            self.world.at(delay, self._store_put, holder, node, local, put, parts)

    def _store_reserve(self, holder: SimNode, put: Put) -> None:
        """The holder makes room for the snapshot on its way (SimNode.make_room)."""
        if frozen(holder, self._store_reserve, holder, put):
            return
        if holder.running:
            self.world.record_dropped(holder, holder.make_room(put), put)

    def _store_put(self, holder: SimNode, sender: SimNode, local: int, put: Put, parts: dict) -> None:
        """The snapshot arrives (SimNode.add): stored and acked, or refused (a fenced sender: never acked)."""
        if frozen(holder, self._store_put, holder, sender, local, put, parts):
            return
        if not holder.running:
            return  # the sender waits forever for the ack; recovery will abort it
        rank, step, generation = put
        stored, dropped = holder.add(put, parts)
        self.world.record_dropped(holder, dropped, put)
        if not stored:
            self.world.log.append(f"{self.world.now:.3f} {holder.node_id} refuses rank {rank} step {step} of "
                                  f"generation {generation}")
            return
        self.world.replicated.add((rank, step))
        self.world.dropped_by.pop((holder.node_id, rank, step), None)
        self.world.agent_send(holder.node_id, p.SnapshotStored(holder.node_id, rank, step, generation))
        self.world.at(self.world.link_delay(holder.node_id, sender.node_id), self._snapshot_acked, sender, local,
                      generation, step)

    def _snapshot_acked(self, node: SimNode, local: int, generation: int, step: int) -> None:
        if frozen(node, self._snapshot_acked, node, local, generation, step):
            return
        worker = node.workers[local]
        if node.running and worker.generation == generation:
            missing = worker.awaiting.get(step, 1) - 1
            worker.awaiting[step] = missing
            if missing > 0:
                return  # every replica must hold it before the optimizer may move on
            worker.acked = max(worker.acked, step)
            if worker.phase == "gated":  # waiting at the snapshot gate, before its step's last collective
                worker.phase = "running"
                self._worker_step(node, local, generation)

    def _worker_step(self, node: SimNode, local: int, generation: int) -> None:
        """Forward/backward done: enter the all-reduce of step state+1, once past the snapshot gate (dpstate's
        Job._gate: its newest snapshot acked; so no rank applies step S+1 before every rank's S is held). A
        deferring gate (dpstate.steps.gate) waits only where step state+1 is itself snapshotted; its capture is
        instant here."""
        if frozen(node, self._worker_step, node, local, generation):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "running":
            return
        if self.world.raise_due(node, local):
            return
        due = not self.defer or self.snapshotted(worker.state + 1)
        if due and worker.acked < self.newest_snapshot(worker.state):
            worker.phase = "gated"
            return
        if worker.state >= self.steps:  # dpstate's final barrier: exit 0 only once every rank got here
            key = (generation, "final")
            self.entered.setdefault(key, set()).add(worker.rank)
            self._release_final(key)
            return
        key = (generation, worker.state + 1)
        self.entered.setdefault(key, set()).add(worker.rank)
        self._check_allreduce(key)

    def _members(self, generation: int) -> list:
        """The workers of `generation`, [(node, local, worker)] in node order (kept until one of them changes)."""
        members = self.members_of.get(generation)
        if members is None:
            members = self.members_of[generation] = [(n, i, w) for n in self.world.nodes.values()
                                                     for i, w in enumerate(n.workers)
                                                     if w.generation == generation and w.rank >= 0]
        return members

    def _any_dead(self, generation: int, members: list) -> bool:
        """Is a worker of `generation` dead, or its node? (not looked at again until something dies)"""
        if self.alive_at.get(generation) == self.world.deaths:
            return False
        if any(w.phase == "dead" or not n.alive for n, _, w in members):
            return True
        self.alive_at[generation] = self.world.deaths
        return False

    def _release_final(self, key) -> None:
        generation = key[0]
        if len(self.entered.get(key, ())) < self.processes[generation]:
            return
        members = self._members(generation)
        if any(not n.running for n, _, _ in members):
            return
        for n, i, w in members:
            if w.phase == "running" and w.state >= self.steps:
                self.exit(n, i, 0, "")

    def _check_allreduce(self, key) -> None:
        generation, step = key
        if step == "final":
            self._release_final(key)
            return
        members = self._members(generation)
        if self._any_dead(generation, members):
            for n, i, w in members:  # a dead peer: every survivor's collective raises at once
                if n.running and w.phase == "running" and w.rank in self.entered.get(key, ()):
                    w.phase = "failed-collective"
                    self.world.agent_send(n.node_id, p.PeerError(n.node_id, generation, w.rank, "peer died"))
            return
        if len(self.entered.get(key, ())) < self.processes[generation]:
            return
        if any(n.frozen for n, _, w in members):
            return  # a frozen peer: the all-reduce hangs until the controller reconfigures
        applying = [(n, i, w) for n, i, w in members if w.phase == "running" and w.state == step - 1]
        if len(applying) < self.processes[generation]:
            return  # a peer left for a newer generation (its Reconfigure aborted the collective): it hangs too
        self._every_rank_once(generation, step, [w for _, _, w in applying])
        for n, i, _ in applying:
            self._apply_step(n, i)

    def _every_rank_once(self, generation: int, step: int, workers: list) -> None:
        """Invariant 14: a step's all-reduce trains every logical rank 0..W-1 exactly once (the processes'
        carried ranks partition them), however narrow the generation is."""
        trained = sorted(rank for w in workers for rank in w.carry)
        if trained != list(range(self.world.spec.world_size)):
            raise InvariantViolation(f"invariant 14: generation {generation} makes step {step} training logical "
                                     f"ranks {trained}, not each of 0..{self.world.spec.world_size - 1} once")

    def _apply_step(self, node: SimNode, local: int) -> None:
        worker = node.workers[local]
        if set(worker.parts.values()) != {worker.state}:  # (every rank it carries is at the step it makes)
            raise InvariantViolation(f"invariant 13: {node.node_id}'s process of rank {worker.rank} makes step "
                                     f"{worker.state + 1} with parts {worker.parts} (rank: step)")
        worker.state += 1
        worker.parts = dict.fromkeys(worker.carry, worker.state)
        worker.made = worker.state
        snapshot = self.snapshotted(worker.state)
        self.world.agent_send(node.node_id, p.Progress(node.node_id, worker.generation, worker.rank, worker.state,
                                                  snapshot=snapshot))
        if snapshot:
            self._take_snapshot(node, local)
        self.world.at(self.world.rng.uniform(0.005, 0.02), self._worker_step, node, local, worker.generation)

    def snapshotted(self, step: int) -> bool:
        """Which steps every rank snapshots, as dpstate's policy: step 0; in an auto-like measuring window
        (steps below measure_until) steps 1-3, then every other step; then the multiples of the interval."""
        if step <= 0:
            return True
        if step < self.measure_until:
            return step < 4 or step % 2 == 0
        return step % self.interval == 0

    def newest_snapshot(self, step: int) -> int:
        while not self.snapshotted(step):
            step -= 1
        return step

    def exit(self, node: SimNode, local: int, code: int, detail: str) -> None:
        worker = node.workers[local]
        worker.phase = "done" if code == 0 else "dead"
        self.world.deaths += code != 0
        exited = p.WorkerExited(node.node_id, node.generation, local, 1000 + local, code, detail, step=worker.made)
        if code == 0:  # past the final barrier: dpstate's RankFinished, then the exit
            self.world.agent_send(node.node_id,
                                  p.RankFinished(node.node_id, worker.generation, worker.rank, worker.state), exited)
        else:
            self.world.agent_send(node.node_id, exited)
