"""A simulated cluster for the controller: fake clock, fake agents and workers, a lossy reordering network.

The real Controller runs unchanged inside it; everything else is a small model of what agents and
dpstate workers do (lockstep data-parallel steps, snapshots acked by a replica store, recovery, the stores'
copies written to and read from a shared disk: disk.py).
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any, Callable

from dpcommon import protocol as p
from dprun.controller.state_machine import (ConnectionDropped, Controller, Finish, JobSpec, NodeGone, Publish, Received,
                                            Send, Tick)

from .disk import SimDisk
from .cluster import Put, ScriptError, SimNode, SimWorker
from .schedule import FETCH_TIMEOUT_S
from .worker_model import WorkerModel, frozen

CONTROLLER = "controller"
WORKER_SETUP_S = 0.1  # from a node's start to its workers waiting set up (a spare's heartbeat says so from then)


class World:
    """Discrete-event simulation. `observer(world, event, actions)` is called after every controller input."""

    def __init__(self, spec: JobSpec, nodes: int, steps: int, rng: random.Random,
                 observer: Callable[["World", Any, list], None] | None = None,
                 delay: tuple[float, float] = (0.0005, 0.01), hb_interval: float = 0.5, interval: int = 1,
                 measure_until: int = 0, defer: bool = False, fetch_timeout: float = FETCH_TIMEOUT_S):
        self.spec, self.rng = spec, rng
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
        self.log: list[str] = []
        self.replicated: set = set()  # (rank, step) ever stored on a replica: the truth invariants check
        # (holder, rank, step) a store dropped -> (holder, rank, step, generation) of the put that made it drop
        # it; and the SnapshotStored reports the controller took in (not stale): a copy dropped by a put whose
        # report it never took in (still on its way, lost, or from a fenced generation) may still be planned
        self.dropped_by: dict[tuple, tuple] = {}
        self.reported: set = set()
        self.failures = 0  # nodes that failed by a fault (killed, frozen, a worker killed, the script raising)
        self.errors: list[ScriptError] = []  # armed in the training script (see raise_due)
        self.raised: list[tuple[str, str]] = []  # (node, stderr's last line) of each error the script raised
        self.corrupted = False  # a store's copies were ever damaged (the judge of "state lost" then looks deeper)
        self.disk = SimDisk(spec.world_size)  # save_dir: what every save wrote (a stopping job's, background ones)
        # what lets thousands of nodes simulate in seconds: counters of the changes the per-event checks depend on
        self.owners_changed = 0  # a node's generation, node rank, or running (alive, frozen, stopped) changed
        self.deaths = 0  # a worker died or a node was killed (neither comes back)
        self.set_up_at: dict[str, float] = {}  # node that joined later -> when its workers are set up
        self.workers = WorkerModel(self, steps, interval, measure_until, defer, fetch_timeout)
        for i, node in enumerate(self.nodes.values()):
            node.workers = [SimWorker() for _ in range(node.nproc)]
            want_spare = i >= spec.nnodes
            self.at(rng.uniform(0, 0.05), self.agent_send, node.node_id,
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

    def link_delay(self, src: str, dst: str) -> float:
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
        if isinstance(msg, p.SnapshotStored) and msg.generation >= self.controller.timeline.generation:
            self.reported.add((msg.node_id, msg.rank, msg.step, msg.generation))
        if self.observer is not None and hasattr(self.observer, "before_input"):
            self.observer.before_input(self, event)
        actions = self.controller.handle(event, self.now)
        for action in actions:
            if isinstance(action, Send):
                self.at(self.link_delay(CONTROLLER, action.node_id), self._agent_receive, action.node_id, action.msg)
            elif isinstance(action, Publish):
                self.events.append({**action.event, "time": self.now})
            elif isinstance(action, Finish):
                self.finish = action
        if self.observer:
            self.observer(self, event, actions)

    def _tick(self) -> None:
        self._controller_input(Tick())
        self.at(0.05, self._tick)

    def agent_send(self, node_id: str, *msgs) -> None:
        """Messages from a node's agent to the controller, in order, on one delay of the link."""
        node = self.nodes[node_id]
        if not node.alive or node.frozen or node.stopped:
            return
        delay = self.link_delay(node_id, CONTROLLER)
        for msg in msgs:
            self.at(delay, self._controller_input, Received(node_id, msg))

    def _heartbeat(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.stopped:
            return
        if not node.frozen:
            self.agent_send(node_id, p.Heartbeat(node_id, node.generation, self._set_up(node)))
        self.at(self.hb_interval, self._heartbeat, node_id)

    def _set_up(self, node: SimNode) -> dict:
        """A node's workers not given a generation yet say, once set up (torch imported, the model built:
        WORKER_SETUP_S after the node came), that they wait idle: a spare a grow takes at once."""
        if self.now < self.set_up_at.get(node.node_id, WORKER_SETUP_S) or any(
                w.generation >= 0 or w.phase != "waiting" for w in node.workers):
            return {}
        return {str(local): p.WorkerSummary(activity="idle") for local in range(node.nproc)}

    # -- agent side ------------------------------------------------------------------------------

    def _agent_receive(self, node_id: str, msg) -> None:
        node = self.nodes[node_id]
        if not node.alive or node.stopped:
            return
        if node.frozen:
            node.inbox_while_frozen.append(msg)
            return
        if isinstance(msg, p.Ping):
            self.agent_send(node_id, p.Pong(node_id, msg.seq))
        elif isinstance(msg, p.Welcome):
            node.welcomed = True
        elif isinstance(msg, p.Stop):
            self._stop_node(node, keep_store=msg.keep_store)
        elif isinstance(msg, p.Reconfigure):
            node.generation, node.node_rank = msg.generation, msg.node_rank
            self.owners_changed += 1
            node.replica_to = [msg.replica_to, *msg.replica_also]
            for local, worker in enumerate(node.workers):
                self.at(self.link_delay(node_id, f"{node_id}/{local}"), self.workers.reconfigure, node, local, msg)
        elif isinstance(msg, p.SaveSnapshots) and msg.background:
            self._save_background(node, msg)
        elif isinstance(msg, p.SaveSnapshots):
            self.agent_send(node_id, p.SnapshotFiles(node_id, msg.step, self._save_files(node, msg)))
        elif isinstance(msg, p.LoadSnapshots):
            self._load_files(node, msg)

    def _save_files(self, node: SimNode, msg: p.SaveSnapshots) -> dict[str, str]:
        """As dpcommon.snapshot_files.save_held (from the store; a damaged copy is not saved) or, with `local`,
        dpstate.replication.saving (each worker of those ranks from its local ring), onto the disk."""
        results, copies = {}, {}
        for rank in msg.ranks:
            if msg.local:
                workers = [w for w in node.workers if w.rank == rank and w.phase != "dead"]
                held = bool(workers) and msg.step in workers[0].local
            else:
                held = msg.step in node.store.get(rank, []) and (rank, msg.step) not in node.corrupt
            results[str(rank)] = "" if held else f"rank {rank} step {msg.step} is not held here"
            if held:
                copies[rank] = msg.step
        results.update(self.disk.write(msg.directory, copies))  # (in the order asked: seeds replay as found)
        return results

    def _save_background(self, node: SimNode, msg: p.SaveSnapshots) -> None:
        """A background save (ReplicaServer.files): the copies the store holds now are taken on the agent's loop,
        then written on a thread while training goes on, which takes a while."""
        copies = {rank: msg.step for rank in msg.ranks if msg.step in node.store.get(rank, [])}
        bad = {rank for rank in copies if (rank, msg.step) in node.corrupt}
        # (a disk's pace: most writes take a few steps' time, a few many more, and later saves are skipped)
        self.at(self.rng.expovariate(25.0), self._background_written, node, msg, copies, bad)

    def _background_written(self, node: SimNode, msg: p.SaveSnapshots, copies: dict[int, int], bad: set) -> None:
        """The thread's files and manifest part: a copy damaged when taken or since is not written (write_copies
        checks each; one dropped from the store since is still written, the thread holds it); then, with `keep`
        and no file refused, the prune; the answer. A node that died (or stopped) meanwhile writes nothing."""
        if frozen(node, self._background_written, node, msg, copies, bad):
            return
        if not node.running:
            return
        bad = bad | {rank for rank, step in copies.items() if (rank, step) in node.corrupt}
        written = self.disk.write(msg.directory, {rank: step for rank, step in copies.items() if rank not in bad})
        results = {}
        for rank in msg.ranks:
            if rank not in copies:
                results[str(rank)] = f"rank {rank} step {msg.step} is not held here (held: {node.store.get(rank, [])})"
            elif rank in bad:
                results[str(rank)] = f"the copy of rank {rank} step {msg.step} held here is corrupt"
            else:
                results[str(rank)] = written[str(rank)]
        if msg.keep and not any(results[str(rank)] for rank in copies):
            self.disk.prune(msg.keep)
        self.agent_send(node.node_id, p.SnapshotFiles(node.node_id, msg.step, results))

    def _load_files(self, node: SimNode, msg: p.LoadSnapshots) -> None:
        """ReplicaServer.files for a load: the store drops the ranks' copies past the step at once (what the files
        replace); the files are read on a thread (a while), then stored (`_files_loaded`)."""
        for rank in msg.ranks:
            node.drop_after(rank, msg.step)
        self.at(self.rng.uniform(0.01, 0.2), self._files_loaded, node, msg)

    def _files_loaded(self, node: SimNode, msg: p.LoadSnapshots) -> None:
        """store_loaded: each file read goes into the store as a copy of the load's generation, reported
        (SnapshotStored) before the answer (SnapshotFiles); a rank without its file is answered why."""
        if frozen(node, self._files_loaded, node, msg):
            return
        if not node.running:
            return
        results, reports = {}, []
        for rank in msg.ranks:
            state = self.disk.read(msg.directory, rank, msg.step)
            if isinstance(state, str):
                results[str(rank)] = state
                continue
            put = (rank, state, msg.generation)
            stored, dropped = node.add(put)
            self.record_dropped(node, dropped, put)
            if not stored:
                results[str(rank)] = f"{msg.directory}/rank-{rank}.dpsnap: refused by the store"
                continue
            self.replicated.add((rank, state))
            self.dropped_by.pop((node.node_id, rank, state), None)
            results[str(rank)] = ""
            reports.append(p.SnapshotStored(node.node_id, rank, state, msg.generation))
        self.agent_send(node.node_id, *reports, p.SnapshotFiles(node.node_id, msg.step, results))

    def _stop_node(self, node: SimNode, keep_store: bool = False) -> None:
        """Its workers stop; so does its agent, unless its store is to stay (it still answers, saves)."""
        node.stopped = not keep_store
        self.owners_changed += 1
        self.deaths += 1
        for worker in node.workers:
            worker.phase = "dead" if worker.phase != "done" else "done"

    def record_dropped(self, holder: SimNode, dropped: list[tuple[int, int]], put: Put) -> None:
        for rank, step in dropped:  # which put made the store drop it (invariants: was that reported?)
            self.dropped_by[(holder.node_id, rank, step)] = (holder.node_id, *put)

    def node_of(self, endpoint: str) -> SimNode | None:
        return self.nodes.get(endpoint.removeprefix("sim://"))

    # -- faults ----------------------------------------------------------------------------------

    def join_node(self) -> str:
        """A fresh node registers mid-job (it becomes a spare)."""
        node_id = f"n{len(self.nodes)}"
        node = self.nodes[node_id] = SimNode(node_id, self.spec.nproc_per_node)
        node.workers = [SimWorker() for _ in range(node.nproc)]
        self.log.append(f"{self.now:.3f} join {node_id}")
        self.set_up_at[node_id] = self.now + WORKER_SETUP_S
        self.agent_send(node_id, p.Register(node_id, "sim", 100 + len(self.nodes), node.nproc, True, -1,
                                             node.endpoint))
        self.at(self.hb_interval, self._heartbeat, node_id)
        return node_id

    def kill_node(self, node_id: str, observed_by_parent: bool = True, closes_connections: bool = False) -> None:
        """Its processes die; its parent (a dprun on its host) tells the controller, or none does (its dprun died
        too): then its kernel may close its connections (the controller's socket monitor sees one close) or,
        a host that lost power, not."""
        node = self.nodes[node_id]
        if not node.alive:
            return
        node.alive = False
        self.owners_changed += 1
        self.deaths += 1
        for worker in node.workers:
            if worker.phase != "done":  # a worker that already exited 0 finished; the kill cannot undo that
                worker.phase = "dead"
        self.log.append(f"{self.now:.3f} kill {node_id}")
        if observed_by_parent:
            self.at(self.rng.uniform(0.0005, 0.005), self._controller_input, NodeGone(node_id, "sim: process died"))
        elif closes_connections:  # (no draw from rng: seeds found before replay as they were)
            self.at(0.002, self._controller_input, ConnectionDropped())
        self.workers.recheck_collectives()

    def leave_node(self, node_id: str) -> None:
        """Fault: its agent stops on a signal of its own: it tells the controller (Leaving), then its workers
        stop and it exits, a little later."""
        node = self.nodes[node_id]
        if not node.running:
            return
        self.log.append(f"{self.now:.3f} leave {node_id}")
        self.agent_send(node_id, p.Leaving(node_id, "sim: received SIGTERM; the controller did not stop the job"))
        self.at(self.rng.uniform(0.01, 0.3), self.kill_node, node_id)

    def corrupt_replicas(self, node_id: str, which: str = "all") -> None:
        """Fault: copies this node's store holds now are damaged: "all" (as the agent's corrupt-replicas),
        each rank's "newest", or "all-but-oldest" (the restore falls back copy by copy to the oldest)."""
        self.log.append(f"{self.now:.3f} corrupt {which} on {node_id}")
        self.nodes[node_id].damage(which)
        self.corrupted = True

    def fill_disk(self, full: bool = True) -> None:
        """Fault: the save_dir's disk is full (every file written fails, ENOSPC), or has room again."""
        self.log.append(f"{self.now:.3f} disk {'full' if full else 'has room'}")
        self.disk.full = full

    def kill_worker(self, node_id: str, local: int = 0, code: int = -9, detail: str = "") -> None:
        """A worker ends: killed (by default), or exiting with `code` and this last line of stderr."""
        node = self.nodes[node_id]
        if not node.running or node.workers[local].phase in ("dead", "done"):
            return
        self.log.append(f"{self.now:.3f} {'kill-worker' if code < 0 else detail} {node_id}")
        self.workers.exit(node, local, code, detail)
        self.workers.recheck_collectives()

    def raise_due(self, node: SimNode, local: int) -> bool:
        """If the script raises in the step the worker is about to make: it exits 1 saying so (True)."""
        worker = node.workers[local]
        # (a rank's bug follows it to the process that carries it)
        error = next((e for e in self.errors if e.step == worker.state + 1 and e.rank in (None, *worker.carry)), None)
        if error is None:
            return False
        if error.once:
            self.errors.remove(error)
        if all(w.phase != "dead" for w in node.workers):
            self.failures += 1
        detail = f"[rank{worker.rank}]: {error.detail}"
        self.raised.append((node.node_id, detail))
        self.kill_worker(node.node_id, local, 1, detail)
        return True

    def freeze_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if node.running:
            self.log.append(f"{self.now:.3f} freeze {node_id}")
            node.frozen = True
            self.owners_changed += 1

    def wake_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.alive or not node.frozen:
            return
        self.log.append(f"{self.now:.3f} wake {node_id}")
        node.frozen = False
        self.owners_changed += 1
        # it speaks before it reads what was said while it slept: stale heartbeats and progress first (the
        # step it last applied: a worker never reports a step it has not applied)
        self.agent_send(node_id, p.Heartbeat(node_id, node.generation))
        for worker in node.workers:
            if worker.phase in ("running", "ready", "gated") and worker.rank >= 0:
                self.agent_send(node_id, p.Progress(node_id, worker.generation, worker.rank, worker.state,
                                                     snapshot=self.workers.snapshotted(worker.state)))
        pending, node.inbox_while_frozen = node.inbox_while_frozen, []
        for msg in pending:
            self._agent_receive(node_id, msg)
        deferred, node.deferred = node.deferred, []
        for fn, args in deferred:
            fn(*args)
        self.workers.recheck_collectives()
