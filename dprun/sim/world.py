"""A simulated cluster for the controller: fake clock, fake agents and workers, a lossy reordering network.

The real Controller runs unchanged inside it; everything else is a small model of what agents and
dpstate workers do (lockstep data-parallel steps, snapshots acked by a replica store, recovery).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from dpagent import protocol as p
from dprun.controller import Controller, Finish, JobSpec, NodeGone, Publish, Received, Send, Tick

CONTROLLER = "controller"
KEEP_REPLICA = 2  # as dpagent.replica_store.KEEP_STEPS
KEEP_LOCAL = 2  # as dpstate.replication.NSLOTS


@dataclass
class SimWorker:
    rank: int = -1
    generation: int = -1
    state: int = 0  # optimizer steps applied
    phase: str = "waiting"  # waiting (for a Reconfigure), running, gated, recovering, done, dead
    local: list = field(default_factory=list)  # snapshot steps held locally
    acked: int = -1  # newest snapshot acked by every replica store it was sent to
    awaiting: dict = field(default_factory=dict)  # step -> acks still missing
    restore: Any = None  # the Reconfigure being applied


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


class World:
    """Discrete-event simulation. `observer(world, event, actions)` is called after every controller input."""

    def __init__(self, spec: JobSpec, nodes: int, steps: int, rng: random.Random,
                 observer: Callable[["World", Any, list], None] | None = None,
                 delay: tuple[float, float] = (0.0005, 0.01), hb_interval: float = 0.5, interval: int = 1,
                 measure_until: int = 0):
        self.spec, self.steps, self.rng = spec, steps, rng
        self.interval = interval  # snapshots at step 0 and every multiple of it ...
        self.measure_until = measure_until  # ... after an auto-like measuring window (see snapshotted)
        self.now = 0.0
        self.queue: list = []
        self.seq = itertools.count()
        self.delay = delay
        self.channel_clock: dict[tuple[str, str], float] = {}
        self.controller = Controller(spec, self.now)
        self.nodes = {f"n{i}": SimNode(f"n{i}", spec.nproc_per_node) for i in range(nodes)}
        self.observer = observer
        self.finish: Finish | None = None
        self.events: list[dict] = []
        self.hb_interval = hb_interval
        self.entered: dict[tuple[int, int], set] = {}  # (generation, step) -> ranks in the all-reduce
        self.ready: dict[int, set] = {}  # generation -> ranks at the post-restore barrier
        self.log: list[str] = []
        self.replicated: set = set()  # (rank, step) ever stored on a replica: the truth invariants check
        self.captured: set = set()  # (rank, step) ever snapshotted by the worker of that rank
        # (holder, rank, step) a store dropped -> (holder, rank, step, generation) of the put that made it drop
        # it; and the SnapshotStored reports the controller took in (not stale): a copy dropped by a put whose
        # report it never took in (still on its way, lost, or from a fenced generation) may still be planned
        self.dropped_by: dict[tuple, tuple] = {}
        self.reported: set = set()
        self.failures = 0  # nodes that failed by a fault (killed, frozen, a worker killed)
        for i, node in enumerate(self.nodes.values()):
            node.workers = [SimWorker() for _ in range(node.nproc)]
            want_spare = i >= spec.nnodes
            self.at(rng.uniform(0, 0.05), self._agent_send, node.node_id,
                    p.Register(node.node_id, "sim", i, node.nproc, want_spare, -1, node.endpoint))
            self.at(rng.uniform(0, hb_interval), self._heartbeat, node.node_id)
        self.at(0.05, self._tick)

    # -- scheduling ------------------------------------------------------------------------------

    def at(self, dt: float, fn, *args) -> None:
        heapq.heappush(self.queue, (self.now + dt, next(self.seq), fn, args))

    def run(self, until: float) -> None:
        while self.queue and self.finish is None:
            t, _, fn, args = heapq.heappop(self.queue)
            if t > until:
                break
            self.now = t
            fn(*args)

    def _link_delay(self, src: str, dst: str) -> float:
        """FIFO per connection (TCP), random delay, independent across connections (reordering)."""
        base = self.now + self.rng.uniform(*self.delay)
        t = max(base, self.channel_clock.get((src, dst), 0.0) + 1e-6)
        self.channel_clock[(src, dst)] = t
        return t - self.now

    # -- controller side -------------------------------------------------------------------------

    def _controller_input(self, event) -> None:
        if self.finish is not None:
            return
        msg = getattr(event, "msg", None)
        if isinstance(msg, p.SnapshotStored) and msg.generation >= self.controller.generation:
            self.reported.add((msg.node_id, msg.rank, msg.step, msg.generation))
        if self.observer is not None and hasattr(self.observer, "before_input"):
            self.observer.before_input(self, event)
        actions = self.controller.handle(event, self.now)
        for action in actions:
            if isinstance(action, Send):
                self.at(self._link_delay(CONTROLLER, action.node_id), self._agent_receive, action.node_id, action.msg)
            elif isinstance(action, Publish):
                self.events.append({**action.event, "time": self.now})
            elif isinstance(action, Finish):
                self.finish = action
        if self.observer:
            self.observer(self, event, actions)

    def _tick(self) -> None:
        self._controller_input(Tick())
        self.at(0.05, self._tick)

    def _agent_send(self, node_id: str, msg) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.frozen or node.stopped:
            return
        self.at(self._link_delay(node_id, CONTROLLER), self._controller_input, Received(node_id, msg))

    def _heartbeat(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.stopped:
            return
        if not node.frozen:
            self._agent_send(node_id, p.Heartbeat(node_id, node.generation))
        self.at(self.hb_interval, self._heartbeat, node_id)

    # -- agent side ------------------------------------------------------------------------------

    def _agent_receive(self, node_id: str, msg) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.stopped:
            return
        if node.frozen:
            node.inbox_while_frozen.append(msg)
            return
        if isinstance(msg, p.Ping):
            self._agent_send(node_id, p.Pong(node_id, msg.seq))
        elif isinstance(msg, p.Welcome):
            node.welcomed = True
        elif isinstance(msg, p.Stop):
            self._stop_node(node)
        elif isinstance(msg, p.Reconfigure):
            node.generation, node.node_rank = msg.generation, msg.node_rank
            node.replica_to = [msg.replica_to, *msg.replica_also]
            for local, worker in enumerate(node.workers):
                self.at(self._link_delay(node_id, f"{node_id}/{local}"), self._worker_reconfigure, node, local, msg)

    def _stop_node(self, node: SimNode) -> None:
        node.stopped = True
        for worker in node.workers:
            worker.phase = "dead" if worker.phase != "done" else "done"

    @staticmethod
    def _frozen(node: SimNode, fn, *args) -> bool:
        """A frozen node does nothing; what came due runs when it wakes (TCP keeps the bytes meanwhile)."""
        if node.frozen and node.alive:
            node.deferred.append((fn, args))
            return True
        return False

    def node_of(self, endpoint: str) -> SimNode | None:
        return self.nodes.get(endpoint.removeprefix("sim://"))

    # -- worker side -----------------------------------------------------------------------------

    def _worker_reconfigure(self, node: SimNode, local: int, msg: p.Reconfigure) -> None:
        if self._frozen(node, self._worker_reconfigure, node, local, msg):
            return
        worker = node.workers[local]
        if not node.running or worker.phase in ("dead", "done") or msg.generation <= worker.generation:
            return
        worker.generation = msg.generation
        worker.rank = msg.node_rank * msg.nproc_per_node + local
        worker.phase = "recovering"
        worker.restore = msg
        self.at(self.rng.uniform(0.001, 0.03), self._worker_restore, node, local, msg.generation)

    def _worker_restore(self, node: SimNode, local: int, generation: int) -> None:
        if self._frozen(node, self._worker_restore, node, local, generation):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        msg = worker.restore
        step, source = msg.restore_step, msg.restore_from.get(str(worker.rank), "")
        if step < 0:
            worker.state, worker.local, worker.acked = 0, [], -1
        elif source == "init" and step == 0:
            worker.state, worker.local, worker.acked = 0, [], -1
        elif step in worker.local and worker.state >= step:
            worker.state = step
        else:
            sources = [source, *msg.restore_also.get(str(worker.rank), [])]
            self._fetch(node, local, generation, [s for s in sources if s and s != "init"])
            return
        self._restored(node, local, generation)

    def _restored(self, node: SimNode, local: int, generation: int) -> None:
        worker = node.workers[local]
        worker.local = [s for s in worker.local if s < worker.state] + [worker.state]  # the restored copy
        worker.phase = "ready"
        self._take_snapshot(node, local)  # re-replicated at once, before the barrier (as dpstate)
        self.ready.setdefault(generation, set()).add(worker.rank)
        self._agent_send(node.node_id, p.WorkerReady(node.node_id, generation, worker.rank, 0.01, 0.01, "sim"))
        self._try_release_barrier(generation)

    def _fetch(self, node: SimNode, local: int, generation: int, sources: list) -> None:
        """As dpstate's restore: fetch from the first store the plan names. A store without the copy says so at
        once; a copy takes a while to arrive and the loading worker finds it corrupt only then; either is
        reported (RestoreFailed) and the next store tried. A dead store never answers (the fetch waits for a
        new plan), a frozen one answers when it wakes. None good: its missing local copy is reported too if
        the plan counted on it, and it waits for the next reconfiguration."""
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "recovering":
            return
        msg = worker.restore
        rank, step = worker.rank, msg.restore_step
        while sources:
            source, sources = sources[0], sources[1:]
            holder = self.node_of(source)
            if holder is None or not holder.alive:
                return  # no answer: the fetch waits until its timeout, or a new plan aborts it
            if self._frozen(holder, self._fetch, node, local, generation, [source, *sources]):
                return
            if step in holder.store.get(rank, []):
                bad = (rank, step) in holder.corrupt  # the frames sent are the copy as it is now
                self.at(self.rng.uniform(0.01, 0.25), self._fetched, node, local, generation, holder, sources, bad)
                return
            self._agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, rank, step, source, "not held"))
        if not msg.restore_from.get(str(rank)) and step not in worker.local:
            # as dpstate: the local copy that the plan counted on (source "") is gone too
            self._agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, rank, step, "", "no local copy"))
        worker.phase = "restore-failed"
        self._agent_send(node.node_id, p.PeerError(node.node_id, generation, rank,
                                                   f"snapshot of rank {rank} at step {step} not found"))

    def _fetched(self, node: SimNode, local: int, generation: int, holder: SimNode, rest: list, bad: bool) -> None:
        """A fetched copy arrived (a holder frozen mid-transfer holds it up; a dead one breaks it off)."""
        if self._frozen(holder, self._fetched, node, local, generation, holder, rest, bad) or \
                self._frozen(node, self._fetched, node, local, generation, holder, rest, bad):
            return
        worker = node.workers[local]
        if not node.running or not holder.alive or worker.generation != generation or worker.phase != "recovering":
            return
        rank, step = worker.rank, worker.restore.restore_step
        if bad or (rank, step) in holder.corrupt:  # damaged before or while it was sent
            self._agent_send(node.node_id, p.RestoreFailed(node.node_id, generation, rank, step, holder.endpoint,
                                                           "corrupt"))
            self._fetch(node, local, generation, rest)
            return
        worker.state = step
        self._restored(node, local, generation)

    def corrupt_replicas(self, node_id: str, which: str = "all") -> None:
        """Fault: copies this node's store holds now are damaged: "all" (as the agent's corrupt-replicas),
        each rank's "newest", or "all-but-oldest" (the restore falls back copy by copy to the oldest)."""
        node = self.nodes[node_id]
        self.log.append(f"{self.now:.3f} corrupt {which} on {node_id}")
        pick = {"all": slice(None), "newest": slice(-1, None), "all-but-oldest": slice(1, None)}[which]
        node.corrupt |= {(rank, step) for rank, steps in node.store.items() for step in steps[pick]}

    def _try_release_barrier(self, generation: int) -> None:
        if len(self.ready.get(generation, ())) < self.spec.world_size:
            return
        for node in self.nodes.values():
            for local, worker in enumerate(node.workers):
                if worker.generation == generation and worker.phase == "ready":
                    self._leave_barrier(node, local, generation)

    def _leave_barrier(self, node: SimNode, local: int, generation: int) -> None:
        """The last rank arrived: this one goes on (a frozen node when it wakes: the barrier's bytes wait)."""
        if self._frozen(node, self._leave_barrier, node, local, generation):
            return
        worker = node.workers[local]
        if node.running and worker.generation == generation and worker.phase == "ready":
            worker.phase = "running"
            self.at(self.rng.uniform(0.005, 0.02), self._worker_step, node, local, generation)

    def _take_snapshot(self, node: SimNode, local: int) -> None:
        worker = node.workers[local]
        if worker.local[-1:] != [worker.state]:  # a restored snapshot is sent again from its own slot
            worker.local = (worker.local + [worker.state])[-KEEP_LOCAL:]
        self.captured.add((worker.rank, worker.state))
        holders = [h for h in map(self.node_of, node.replica_to) if h is not None]
        worker.awaiting[worker.state] = len(holders)
        # acked once every holder acks it (a restored step sent again too); with none, at once (as dpstate)
        worker.acked = min(worker.acked, worker.state - 1) if holders else max(worker.acked, worker.state)
        put = (worker.rank, worker.state, worker.generation)
        for holder in holders:  # ReserveSnapshot just ahead of the snapshot on the same connection
            delay = self._link_delay(node.node_id, holder.node_id)
            self.at(delay - 1e-7, self._store_reserve, holder, put)
            self.at(delay, self._store_put, holder, node, local, put)

    def _store_reserve(self, holder: SimNode, put) -> None:
        """The holder makes room for the snapshot on its way, as ReplicaStore.make_room: its oldest copies of
        that rank go first; steps the snapshot will supersede do not count; a fenced sender's is ignored."""
        if self._frozen(holder, self._store_reserve, holder, put):
            return
        rank, step, generation = put
        steps = holder.store.get(rank, [])
        if not holder.running or step in steps or not steps or generation < self._newest_generation(holder, rank):
            return
        kept = [s for s in steps if s < step or holder.store_gen[(rank, s)] >= generation]
        while len(kept) >= KEEP_REPLICA and kept[0] < step:
            self._store_drop(holder, rank, kept.pop(0), put)

    def _store_put(self, holder: SimNode, sender: SimNode, local: int, put) -> None:
        """As ReplicaStore.add: a put from an older generation than held for its rank is refused (a fenced
        sender: never acked), a newer one replaces that rank's steps it supersedes (same or later ones)."""
        if self._frozen(holder, self._store_put, holder, sender, local, put):
            return
        if not holder.running:
            return  # the sender waits forever for the ack; recovery will abort it
        rank, step, generation = put
        steps = holder.store.setdefault(rank, [])
        if steps and generation < self._newest_generation(holder, rank):
            self.log.append(f"{self.now:.3f} {holder.node_id} refuses rank {rank} step {step} of generation "
                            f"{generation}")
            return
        for old in [s for s in steps if s >= step and holder.store_gen[(rank, s)] < generation]:
            self._store_drop(holder, rank, old, put)
        self.replicated.add((rank, step))
        holder.corrupt.discard((rank, step))  # a whole new copy replaces a damaged one
        if step not in steps:
            steps.append(step)
            steps.sort()
        holder.store_gen[(rank, step)] = generation
        self.dropped_by.pop((holder.node_id, rank, step), None)
        while len(steps) > KEEP_REPLICA:
            self._store_drop(holder, rank, steps[0], put)
        self._agent_send(holder.node_id, p.SnapshotStored(holder.node_id, rank, step, generation))
        self.at(self._link_delay(holder.node_id, sender.node_id), self._snapshot_acked, sender, local, generation, step)

    @staticmethod
    def _newest_generation(holder: SimNode, rank: int) -> int:
        return max(holder.store_gen[(rank, s)] for s in holder.store.get(rank, []))

    def _store_drop(self, holder: SimNode, rank: int, step: int, put) -> None:
        self.dropped_by[(holder.node_id, rank, step)] = (holder.node_id, *put)
        holder.store[rank].remove(step)
        holder.store_gen.pop((rank, step), None)
        holder.corrupt.discard((rank, step))

    def _snapshot_acked(self, node: SimNode, local: int, generation: int, step: int) -> None:
        if self._frozen(node, self._snapshot_acked, node, local, generation, step):
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
        Job._gate: its newest snapshot acked; so no rank applies step S+1 before every rank's S is held)."""
        if self._frozen(node, self._worker_step, node, local, generation):
            return
        worker = node.workers[local]
        if not node.running or worker.generation != generation or worker.phase != "running":
            return
        if worker.acked < self.newest_snapshot(worker.state):
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

    def _release_final(self, key) -> None:
        generation = key[0]
        members = [(n, i, w) for n in self.nodes.values() for i, w in enumerate(n.workers)
                   if w.generation == generation and w.rank >= 0]
        if len(self.entered.get(key, ())) < self.spec.world_size or any(not n.running for n, _, _ in members):
            return
        for n, i, w in members:
            if w.phase == "running" and w.state >= self.steps:
                self._worker_exit(n, i, 0, "")

    def _check_allreduce(self, key) -> None:
        generation, step = key
        if step == "final":
            self._release_final(key)
            return
        members = [(n, i, w) for n in self.nodes.values() for i, w in enumerate(n.workers)
                   if w.generation == generation and w.rank >= 0]
        if any(w.phase == "dead" or not n.alive for n, _, w in members):
            for n, i, w in members:  # a dead peer: every survivor's collective raises at once
                if n.running and w.phase == "running" and w.rank in self.entered.get(key, ()):
                    w.phase = "failed-collective"
                    self._agent_send(n.node_id, p.PeerError(n.node_id, generation, w.rank, "peer died"))
            return
        if len(self.entered.get(key, ())) < self.spec.world_size:
            return
        if any(n.frozen for n, _, w in members):
            return  # a frozen peer: the all-reduce hangs until the controller reconfigures
        for n, i, w in members:
            if w.phase == "running" and w.state == step - 1:
                self._apply_step(n, i)

    def _apply_step(self, node: SimNode, local: int) -> None:
        worker = node.workers[local]
        worker.state += 1
        snapshot = self.snapshotted(worker.state)
        self._agent_send(node.node_id, p.Progress(node.node_id, worker.generation, worker.rank, worker.state,
                                                  snapshot=snapshot))
        if snapshot:
            self._take_snapshot(node, local)
        self.at(self.rng.uniform(0.005, 0.02), self._worker_step, node, local, worker.generation)

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

    def _worker_exit(self, node: SimNode, local: int, code: int, detail: str) -> None:
        worker = node.workers[local]
        worker.phase = "done" if code == 0 else "dead"
        self._agent_send(node.node_id, p.WorkerExited(node.node_id, node.generation, local, 1000 + local, code, detail))

    # -- faults ----------------------------------------------------------------------------------

    def join_node(self) -> str:
        """A fresh node registers mid-job (it becomes a spare)."""
        node_id = f"n{len(self.nodes)}"
        node = self.nodes[node_id] = SimNode(node_id, self.spec.nproc_per_node)
        node.workers = [SimWorker() for _ in range(node.nproc)]
        self.log.append(f"{self.now:.3f} join {node_id}")
        self._agent_send(node_id, p.Register(node_id, "sim", 100 + len(self.nodes), node.nproc, True, -1,
                                             node.endpoint))
        self.at(self.hb_interval, self._heartbeat, node_id)
        return node_id

    def kill_node(self, node_id: str, observed_by_parent: bool = True) -> None:
        node = self.nodes[node_id]
        if not node.alive:
            return
        node.alive = False
        for worker in node.workers:
            if worker.phase != "done":  # a worker that already exited 0 finished; the kill cannot undo that
                worker.phase = "dead"
        self.log.append(f"{self.now:.3f} kill {node_id}")
        if observed_by_parent:
            self.at(self.rng.uniform(0.0005, 0.005), self._controller_input, NodeGone(node_id, "sim: process died"))
        for key in list(self.entered):
            self._check_allreduce(key)

    def kill_worker(self, node_id: str, local: int = 0) -> None:
        node = self.nodes[node_id]
        if not node.running or node.workers[local].phase in ("dead", "done"):
            return
        self.log.append(f"{self.now:.3f} kill-worker {node_id}")
        self._worker_exit(node, local, -9, "")
        for key in list(self.entered):
            self._check_allreduce(key)

    def freeze_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if node.running:
            self.log.append(f"{self.now:.3f} freeze {node_id}")
            node.frozen = True

    def wake_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.alive or not node.frozen:
            return
        self.log.append(f"{self.now:.3f} wake {node_id}")
        node.frozen = False
        # it speaks before it reads what was said while it slept: stale heartbeats and progress first (the
        # step it last applied: a worker never reports a step it has not applied)
        self._agent_send(node_id, p.Heartbeat(node_id, node.generation))
        for worker in node.workers:
            if worker.phase in ("running", "ready", "gated") and worker.rank >= 0:
                self._agent_send(node_id, p.Progress(node_id, worker.generation, worker.rank, worker.state,
                                                     snapshot=self.snapshotted(worker.state)))
        pending, node.inbox_while_frozen = node.inbox_while_frozen, []
        for msg in pending:
            self._agent_receive(node_id, msg)
        deferred, node.deferred = node.deferred, []
        for fn, args in deferred:
            fn(*args)
        for key in list(self.entered):
            self._check_allreduce(key)
