"""The controller's decisions as a pure state machine: membership, failure detection, reconstruction.

Inputs (messages from agents, observations, ticks) go in with the current time; actions (messages to
send, events to publish, the job's end) come out. No sockets, clocks or processes: dprun/server.py and
the simulator drive it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dpagent import protocol as p

from .faults import FaultPlan, FaultSpec
from .ledger import INIT, ReplicaLedger, RestorePlan
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable


MAX_REPLANS = 3  # generations planned again in a row with no node lost before the job gives up
PROGRESS_EVERY_S = 1.0  # at most one "progress" event a second: days-long jobs must not flood the events file

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class JobSpec:
    nnodes: int
    spares: int
    nproc_per_node: int
    store_endpoint: str
    job_id: str = "deadpool"
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    probe_timeout: float = 1.0
    rdzv_timeout: float = 300.0
    faults: tuple[FaultSpec, ...] = ()
    replicas: int = 1  # replica stores holding each node's snapshots (ring: node ranks r+1 .. r+replicas)
    hang_timeout: float = 0.0  # no step anywhere for this long: find the rank that is not waiting on peers
    on_spare_exhausted: str = "fail"  # or "wait": keep the survivors and wait for a node to join as a spare
    spare_wait_timeout: float = 1800.0
    restart_mode: bool = False  # the script does not use dpstate: recover by restarting every worker
    max_restarts: int = 3  # restart mode: restart recoveries allowed (torchrun's --max-restarts)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# ----------------------------------------------------------------------------- inputs and actions


@dataclass(frozen=True)
class Received:
    """A decoded message from the agent whose socket identity is `node_id`."""

    node_id: str
    msg: Any


@dataclass(frozen=True)
class NodeGone:
    """The shell saw a node's agent vanish (its process exited, its connection dropped)."""

    node_id: str
    cause: str


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Shutdown:
    """The launcher was told to stop (a signal, a user's Ctrl-C): stop every node and end the job."""

    exit_code: int
    reason: str


@dataclass(frozen=True)
class Send:
    node_id: str
    msg: Any


@dataclass(frozen=True)
class Publish:
    event: dict


@dataclass(frozen=True)
class Finish:
    exit_code: int
    message: str


# ----------------------------------------------------------------------------- recovery bookkeeping


@dataclass
class Recovery:
    """One reconstruction, from the first failure it covers to the first step after it."""

    failed: list[str]
    t_fail: float
    t_detect: float
    generation: int = -1
    t_decide: float = 0.0
    restore_step: int = -1
    lost_steps: int = 0
    peak_step: int = 0  # the newest step any rank had reached when this recovery's first failure came
    promoted: dict = field(default_factory=dict)  # node rank -> spare node id
    replan: bool = False  # no node to replace, but the plan must change (holder lost, a copy bad)
    waiting_since: float | None = None  # on_spare_exhausted=wait: when waiting for a spare began
    ready: dict = field(default_factory=dict)  # rank -> (rebuild_s, restore_s)
    stepped: set = field(default_factory=set)  # ranks that completed a step after the restore step
    retries: int = 0  # generations planned again with no node lost (a rank failed to connect or restore)
    why: str = ""  # what the last rank that asked for a new plan said
    settle_until: float = 0.0  # a peer error alone: decide no sooner (a dead worker's exit may be on its way)


@dataclass
class Flush:
    """A probe round: every node in `waiting` must Pong(seq >= seq) before `deadline`."""

    seq: int
    deadline: float
    waiting: set


describe_exit = p.describe_exit


# ----------------------------------------------------------------------------- the state machine


class Controller:
    def __init__(self, spec: JobSpec, now: float):
        if spec.nnodes < 1 or spec.spares < 0 or spec.nproc_per_node < 1:
            raise ValueError("nnodes and nproc_per_node must be at least 1, spares at least 0")
        self.spec = spec
        self.table = NodeTable()
        self.ledger = ReplicaLedger()
        self.faults = FaultPlan(list(spec.faults))
        self.started_at = now
        self.training_since: float | None = None
        self.generation = -1  # -1 while the first generation forms
        self.layout: list[str] = []  # node rank -> node id
        self.finished = False
        self.recovery: Recovery | None = None  # decided, waiting for its first step
        self.pending: Recovery | None = None  # failures known, decision waiting for the flush
        self.flush: Flush | None = None
        self.seq = 0
        self.next_ping = now
        self.injected_at: dict[str, float] = {}
        self.frozen_at: dict[int, str] = {}  # node rank -> node frozen there by fault injection
        self.holders: dict[int, list[str]] = {}  # node rank -> nodes holding its replicas, this generation
        self.last_progress_at = now  # when the newest step last grew (hang detection)
        self.stepped = False  # a step was made in this generation: start-up and restores are not hangs
        self.unrestored: set[int] = set()  # ranks handed to a new node that has not yet restored their state
        self.rank_step: dict[int, int] = {}  # newest step each rank reported in this generation's timeline
        self.dropped: dict[str, int] = {}
        self.max_step = 0
        self.last_progress_event = float("-inf")
        self.recoveries: list[Recovery] = []
        self.restarts = 0
        self._out: list = []

    # -- entry point -----------------------------------------------------------------------------

    def handle(self, event: Any, now: float) -> list:
        self._out = []
        if self.finished:
            return []
        if isinstance(event, Received):
            self._received(event.node_id, event.msg, now)
        elif isinstance(event, NodeGone):
            self._node_failed(event.node_id, event.cause, now)
        elif isinstance(event, Tick):
            self._tick(now)
        elif isinstance(event, Shutdown):
            self._finish(event.exit_code, event.reason)
        else:
            raise TypeError(f"unknown input {event!r}")
        self._maybe_decide(now)
        out, self._out = self._out, []
        return out

    # -- helpers ---------------------------------------------------------------------------------

    def _send(self, node_id: str, msg: Any) -> None:
        self._out.append(Send(node_id, msg))

    def _publish(self, name: str, **fields) -> None:
        self._out.append(Publish({"event": name, **fields}))

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _finish(self, code: int, message: str) -> None:
        for node in self.table.live():
            self._send(node.node_id, p.Stop(reason=message, exit_code=code))
        self._publish("job_finished", exit_code=code, message=message)
        self._out.append(Finish(code, message))
        self.finished = True

    def ranks_of(self, node_rank: int) -> range:
        n = self.spec.nproc_per_node
        return range(node_rank * n, (node_rank + 1) * n)

    def node_of_rank(self, rank: int) -> str:
        return self.layout[rank // self.spec.nproc_per_node]

    def replica_holders(self, node_rank: int) -> list[str]:
        """Node rank r's snapshots live on node ranks r+1 .. r+replicas (a ring); a single node uses spares."""
        n = self.spec.nnodes
        if n > 1:
            count = min(self.spec.replicas, n - 1)
            return [self.layout[(node_rank + k) % n] for k in range(1, count + 1)]
        spares = [node.node_id for node in self.table.with_role(SPARE)][: self.spec.replicas]
        return spares or [self.layout[node_rank]]

    # -- messages --------------------------------------------------------------------------------

    def _received(self, sender: str, msg: Any, now: float) -> None:
        if isinstance(msg, p.Register):
            self._register(sender, msg, now)
            return
        node = self.table.get(sender)
        if node is None:
            self._drop("unregistered sender")
            return
        if node.role == FAILED:
            self._drop("fenced node")
            if isinstance(msg, (p.Heartbeat, p.Pong)):
                self._send(sender, p.Stop(reason=f"node {sender} was fenced: {node.cause}", exit_code=1))
            return
        node.last_heard = now
        if getattr(msg, "node_id", sender) != sender:
            self._drop("node_id does not match the sender")
            return
        generation = getattr(msg, "generation", None)
        if generation is not None and generation != self.generation and not isinstance(msg, (p.Heartbeat, p.WorkerExited)):
            self._drop("stale generation")
            return
        handler = getattr(self, f"_on_{type(msg).__name__}", None)
        if handler is None:
            self._drop(f"unexpected {type(msg).__name__}")
            return
        handler(node, msg, now)

    def _register(self, sender: str, msg: p.Register, now: float) -> None:
        if msg.node_id != sender:
            self._drop("node_id does not match the sender")
            return
        known = self.table.get(sender)
        if known is not None:
            if known.role == FAILED:
                self._send(sender, p.Stop(reason=f"node {sender} was fenced: {known.cause}", exit_code=1))
            else:  # a re-sent Register (reconnect): answer again
                known.last_heard = now
                self._welcome(known)
            return
        forming = self.generation < 0
        actives = self.table.count(ACTIVE)
        role = ACTIVE if forming and not msg.want_spare and actives < self.spec.nnodes else SPARE
        node = Node(
            node_id=sender, host=msg.host, pid=msg.pid, nproc=msg.nproc, replica_endpoint=msg.replica_endpoint,
            role=role, registered_at=now, last_heard=now, want_rank=msg.node_rank,
        )
        if msg.nproc != self.spec.nproc_per_node:
            self._send(sender, p.Stop(reason=f"node {sender} runs {msg.nproc} workers, the job needs "
                                      f"{self.spec.nproc_per_node} per node (--nproc-per-node)", exit_code=2))
            self._drop("wrong nproc")
            return
        self.table.add(node)
        self._welcome(node)
        self._publish("node_joined", node=sender, host=msg.host, role=role, pid=msg.pid)
        if forming:
            self._maybe_form(now)
        elif self.pending is not None and self.pending.waiting_since is not None and self.flush is None:
            self._start_flush(now)  # a spare arrived for the recovery that waits for one

    def _welcome(self, node: Node) -> None:
        self._send(node.node_id, p.Welcome(
            node_id=node.node_id, role=node.role, job_id=self.spec.job_id,
            heartbeat_interval=self.spec.heartbeat_interval, heartbeat_timeout=self.spec.heartbeat_timeout,
            prespawn=not self.spec.restart_mode,
        ))

    def _on_Heartbeat(self, node: Node, msg: p.Heartbeat, now: float) -> None:
        node.workers = msg.workers  # last_heard is already updated

    def _on_Pong(self, node: Node, msg: p.Pong, now: float) -> None:
        if self.flush is not None and msg.seq >= self.flush.seq:
            self.flush.waiting.discard(node.node_id)

    def _on_Progress(self, node: Node, msg: p.Progress, now: float) -> None:
        node.last_step = max(node.last_step, msg.step)
        self.rank_step[msg.rank] = max(self.rank_step.get(msg.rank, 0), msg.step)
        if msg.step > self.max_step or not self.stepped:
            self.max_step = max(self.max_step, msg.step)
            self.last_progress_at = now
            self.stepped = True
        if now - self.last_progress_event >= PROGRESS_EVERY_S:
            self.last_progress_event = now
            self._publish("progress", generation=self.generation, step=self.max_step, **msg.metrics)
        rec = self.recovery
        if rec is not None and msg.step > rec.restore_step:
            rec.stepped.add(msg.rank)
            if len(rec.stepped) == self.spec.world_size:
                self._recovery_complete(rec, now)
        self._fire_faults(now)

    def _on_SnapshotStored(self, node: Node, msg: p.SnapshotStored, now: float) -> None:
        self.ledger.stored(msg.rank, msg.step, node.node_id)

    def _on_WorkerReady(self, node: Node, msg: p.WorkerReady, now: float) -> None:
        self.unrestored.discard(msg.rank)
        rec = self.recovery
        if rec is not None:
            rec.ready[msg.rank] = (msg.rebuild_s, msg.restore_s)
            if self.spec.restart_mode and len(rec.ready) == self.spec.world_size:
                self._recovery_complete(rec, now)  # restarted scripts report no steps to us

    def _on_PeerError(self, node: Node, msg: p.PeerError, now: float) -> None:
        self._publish("peer_error", node=node.node_id, rank=msg.rank, detail=msg.detail[:200])
        # (one from a replaced generation was dropped as stale: that rank is on its way to the new one)
        if self.spec.restart_mode:  # a crashed worker: its agent reports the exit unless a dead peer explains it
            if self.flush is None:
                self._start_flush(now)
            return
        # dpstate's rank waits for a new generation: probe (a dead peer is failed) and plan one either way,
        # since with every node alive the error was the rank's own (e.g. a connect that timed out)
        self._replan(now, f"rank {msg.rank}: {msg.detail[:200]}")
        if not self.pending.failed:  # the peer that broke the collective may be a worker whose exit is in flight
            self.pending.settle_until = max(self.pending.settle_until, now + self.spec.heartbeat_interval)

    def _on_RestoreFailed(self, node: Node, msg: p.RestoreFailed, now: float) -> None:
        holder = next((n.node_id for n in self.table.nodes.values() if n.replica_endpoint == msg.source), None)
        if holder is not None:
            self.ledger.discard(msg.rank, msg.step, holder)
        self._publish("restore_failed", node=node.node_id, rank=msg.rank, step=msg.step, source=msg.source,
                      reason=msg.reason[:200])
        self._replan(now, f"restoring rank {msg.rank} from {msg.source} failed: {msg.reason[:200]}")

    def _replan(self, now: float, why: str) -> None:
        """A new generation is needed even if no node failed: probe every node, then plan it."""
        if self.pending is None:
            self.pending = Recovery(failed=[], t_fail=now, t_detect=now, peak_step=self.max_step)
            if self.recovery is not None:  # the recovery under way is not complete: this one continues it
                prior, self.recovery = self.recovery, None
                self.pending.t_fail, self.pending.t_detect = prior.t_fail, prior.t_detect
                self.pending.failed, self.pending.peak_step = list(prior.failed), prior.peak_step
                self.pending.retries = prior.retries
        self.pending.replan, self.pending.why = True, why
        if self.flush is None:
            self._start_flush(now)

    def _on_RankFinished(self, node: Node, msg: p.RankFinished, now: float) -> None:
        pass  # the job ends when every active worker has exited 0 (as with torchrun)

    def _on_WorkerExited(self, node: Node, msg: p.WorkerExited, now: float) -> None:
        if node.role == ACTIVE and msg.exitcode == 0:  # finished (its final barrier passed, in any generation)
            node.exited_ok.add(msg.local_rank)
            rec = self.recovery or self.pending
            if rec is not None and rec.failed:  # the job ended under a recovery that now can never complete
                failed = ", ".join(f"{n} ({self.table.nodes[n].cause})" for n in rec.failed)
                self._finish(1, f"training completed (step {max(rec.peak_step, self.max_step)}), but {failed} failed after other "
                                "ranks had finished and exited; the final state is complete on the surviving ranks")
                return
            if all(len(self.table.nodes[n].exited_ok) == self.spec.nproc_per_node for n in self.layout):
                self._finish(0, f"all {self.spec.world_size} ranks finished")
            return
        if node.role == SPARE and msg.exitcode == 0:
            return
        detail = f": {msg.detail}" if msg.detail else ""
        cause = f"worker {msg.local_rank} (pid {msg.pid}) {describe_exit(msg.exitcode)}{detail}"
        self._node_failed(node.node_id, cause, now)

    # -- forming the first generation ------------------------------------------------------------

    def _maybe_form(self, now: float) -> None:
        if self.table.count(ACTIVE) < self.spec.nnodes:
            return
        spares_ready = self.table.count(SPARE) >= self.spec.spares
        if not spares_ready and now - self.started_at < self.spec.rdzv_timeout:
            return
        actives = self.table.with_role(ACTIVE)
        # honour node-rank hints, then fill the gaps in registration order
        layout: list[str | None] = [None] * self.spec.nnodes
        rest = []
        for node in actives:
            if 0 <= node.want_rank < self.spec.nnodes and layout[node.want_rank] is None:
                layout[node.want_rank] = node.node_id
            else:
                rest.append(node.node_id)
        for i, slot in enumerate(layout):
            if slot is None:
                layout[i] = rest.pop(0)
        self.layout = [n for n in layout if n is not None]
        self.generation = 0
        self.training_since = now
        self.last_progress_at = now
        for rank, node_id in enumerate(self.layout):
            self.table.nodes[node_id].node_rank = rank
        self._reconfigure_all(restore_step=p.NO_RANK, sources={}, reason="start")
        self._publish("job_started", generation=0, nnodes=self.spec.nnodes, world_size=self.spec.world_size,
                      spares=len(self.table.with_role(SPARE)), layout=list(self.layout))

    def _reconfigure_all(self, restore_step: int, sources: dict[int, str], reason: str) -> None:
        self.holders = {r: self.replica_holders(r) for r in range(len(self.layout))}
        endpoint = lambda node_id: self.table.nodes[node_id].replica_endpoint  # noqa: E731
        for node_rank, node_id in enumerate(self.layout):
            restore_from, restore_also = {}, {}
            for rank in self.ranks_of(node_rank):
                source = sources.get(rank, "")
                others = [h for h in self.ledger.holders_of(rank, restore_step) if h != source]
                restore_from[str(rank)] = endpoint(source) if source not in ("", INIT) else source
                if others and source != INIT:
                    restore_also[str(rank)] = [endpoint(h) for h in others]
            self._send(node_id, p.Reconfigure(
                generation=self.generation, node_rank=node_rank, nnodes=self.spec.nnodes,
                nproc_per_node=self.spec.nproc_per_node, world_size=self.spec.world_size,
                restore_step=restore_step, store_endpoint=self.spec.store_endpoint,
                replica_to=endpoint(self.holders[node_rank][0]), restore_from=restore_from, reason=reason,
                replica_also=[endpoint(h) for h in self.holders[node_rank][1:]], restore_also=restore_also,
                restart_workers=self.spec.restart_mode,
            ))

    # -- failures --------------------------------------------------------------------------------

    def _node_failed(self, node_id: str, cause: str, now: float) -> None:
        node = self.table.get(node_id)
        if node is None or node.role == FAILED:
            return
        was = node.role
        self.table.set_role(node, FAILED)
        node.cause = cause
        self.ledger.holder_lost(node_id)
        self._send(node_id, p.Stop(reason=f"node {node_id} was fenced: {cause}", exit_code=1))
        self._publish("node_failed", node=node_id, node_rank=node.node_rank if was == ACTIVE else None,
                      role=was, cause=cause)
        if self.flush is not None:
            self.flush.waiting.discard(node_id)
        if was == SPARE:
            self._publish("spare_lost", node=node_id, spares_left=len(self.table.with_role(SPARE)))
            finishing = any(self.table.nodes[n].exited_ok for n in self.layout)
            if self.generation < 0 or finishing or not any(node_id in held for held in self.holders.values()):
                return
        elif self.generation < 0:  # still forming: the slot opens for the next node to register
            return
        if self.pending is None:
            if self.recovery is not None:  # a failure during recovery: one recovery covers both
                prior, self.recovery = self.recovery, None
                self.pending = Recovery(failed=list(prior.failed), t_fail=prior.t_fail, t_detect=prior.t_detect,
                                        peak_step=prior.peak_step)
            else:
                self.pending = Recovery(failed=[], t_fail=now, t_detect=now, peak_step=self.max_step)
        self.pending.failed.append(node_id)
        self.pending.replan |= was == SPARE
        if node_id in self.injected_at:
            self.pending.t_fail = min(self.pending.t_fail, self.injected_at[node_id])
        self._start_flush(now)

    def _start_flush(self, now: float) -> None:
        """Ping every live node: a Pong proves it alive and flushes the SnapshotStored it sent before."""
        self.seq += 1
        waiting = {n.node_id for n in self.table.live()}
        self.flush = Flush(seq=self.seq, deadline=now + self.spec.probe_timeout, waiting=waiting)
        for node_id in sorted(waiting):
            self._send(node_id, p.Ping(seq=self.seq))

    def _maybe_decide(self, now: float) -> None:
        if self.flush is None or self.flush.waiting:
            return
        if self.pending is not None and not self.pending.failed and now < self.pending.settle_until:
            return  # every node answered, but a worker's exit report may still arrive: the next tick decides
        self.flush = None
        if self.pending is not None and not self.finished:
            pending, self.pending = self.pending, None
            self._reconstruct(pending, now)

    def _reconstruct(self, rec: Recovery, now: float) -> None:
        failed_slots = [i for i, n in enumerate(self.layout) if self.table.nodes[n].role == FAILED]
        if not failed_slots and not rec.replan:
            return
        if not failed_slots and not self.spec.restart_mode:
            rec.retries += 1
            if rec.retries > MAX_REPLANS:
                self._finish(1, f"generation {self.generation} could not start: planned {rec.retries} times with "
                                f"every node answering probes (last: {rec.why}); check that the nodes reach each "
                                "other on the Gloo/NCCL ports, or raise DP_CONNECT_TIMEOUT")
                return
        if any(self.table.nodes[n].exited_ok for n in self.layout):
            # a worker exits 0 only after the job's final barrier: training is complete, and the ranks that
            # exited cannot join a new generation. Say so rather than wait for them.
            failed = ", ".join(f"{n} ({self.table.nodes[n].cause})" for n in rec.failed) or rec.why
            self._finish(1, f"training completed (step {self.max_step}), but {failed} failed after other ranks "
                            "had finished and exited; the final state is complete on the surviving ranks")
            return
        spares = self.table.with_role(SPARE)
        if len(spares) < len(failed_slots):
            names = ", ".join(f"{self.layout[i]} (node rank {i}: {self.table.nodes[self.layout[i]].cause})"
                              for i in failed_slots)
            if self.spec.on_spare_exhausted != "wait":
                self._finish(1, f"node failure with no spare left: {names}; rerun with more --spares")
                return
            if rec.waiting_since is None:
                rec.waiting_since = now
                self._publish("waiting_for_spare", needed=len(failed_slots) - len(spares), failed=names,
                              timeout_s=self.spec.spare_wait_timeout)
            self.pending = rec  # decided again when a node registers as a spare
            return
        if self.spec.restart_mode:
            if self.restarts >= self.spec.max_restarts:
                self._finish(1, f"node {', '.join(rec.failed)} failed and --max-restarts {self.spec.max_restarts} "
                                "restarts are used up: " + "; ".join(self.table.nodes[n].cause for n in rec.failed))
                return
            self.restarts += 1
            plan = RestorePlan(step=p.NO_RANK)  # the script restarts from scratch (or its own checkpoint)
        else:
            # a rank whose new node has not restored it yet has its state only on replicas, like a failed one
            failed_ranks = {r for i in failed_slots for r in self.ranks_of(i)} | self.unrestored
            plan = self.ledger.plan(self.spec.world_size, failed_ranks, self._survivor_floors())
        if plan.lost:
            holders = sorted({self.table.nodes[n].node_id for n in rec.failed})
            self._finish(1, f"state lost: ranks {plan.lost} had every copy on failed nodes {holders}; "
                            "rerun with more replicas or restore from disk")
            return
        self.unrestored |= {r for i in failed_slots for r in self.ranks_of(i)}
        for i in failed_slots:
            spare = spares.pop(0)
            self.table.set_role(spare, ACTIVE)
            spare.node_rank = i
            rec.promoted[i] = spare.node_id
            self.layout[i] = spare.node_id
            self._publish("spare_promoted", spare=spare.node_id, node_rank=i, generation=self.generation + 1)
        self.generation += 1
        rec.generation = self.generation
        rec.t_decide = now
        self.last_progress_at, self.stepped = now, False
        rec.restore_step = plan.step
        rec.peak_step = max(rec.peak_step, self.max_step)
        rec.lost_steps = max(0, rec.peak_step - plan.step)
        self.ledger.rollback(plan.step)
        self.rank_step = {rank: max(plan.step, 0) for rank in range(self.spec.world_size)}
        self.max_step = plan.step
        # faults due "during recovery" go out first: a replica corrupted for this plan is damaged before a
        # promoted spare, which fetches as soon as it hears of the plan, can ask for it
        self._fire_faults(now, recovering=True)
        self._reconfigure_all(plan.step, plan.sources, reason="recovery")
        self._publish("reconfigure", generation=self.generation, restore_step=plan.step,
                      layout=list(self.layout), decide_s=round(now - rec.t_detect, 4))
        self.recovery = rec

    def _survivor_floors(self) -> dict[int, int]:
        """A replicated step that every surviving rank still holds locally, from what ranks reported.

        Progress(P) from any rank means every rank passed the all-reduce of step P, so every rank had its
        snapshot of P-2 acked (the optimizer's pre-step wait); no rank is past P_max+1, and a worker keeps
        its newest 4 snapshots. So P_max-2 is replicated and held, whatever the replica reports say (those
        from a holder that died with them can be lost in flight).
        """
        top = max(self.rank_step.values(), default=0)
        return {rank: max(top - 2, 0) for rank in range(self.spec.world_size)}

    def _recovery_complete(self, rec: Recovery, now: float) -> None:
        rebuild = max((r[0] for r in rec.ready.values()), default=0.0)
        restore = max((r[1] for r in rec.ready.values()), default=0.0)
        phases = {
            "detect_s": round(rec.t_detect - rec.t_fail, 4),
            "decide_s": round(rec.t_decide - rec.t_detect, 4),
            "rebuild_s": round(rebuild, 4),
            "restore_s": round(restore, 4),
            "total_s": round(now - rec.t_fail, 4),
        }
        self._publish("recovery_complete", mode="restart" if self.spec.restart_mode else "hot-swap",
                      generation=rec.generation, restore_step=rec.restore_step,
                      lost_steps=rec.lost_steps, failed=rec.failed, promoted=rec.promoted, phases=phases)
        self.recoveries.append(rec)
        self.recovery = None

    # -- time ------------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.generation < 0:
            if now - self.started_at >= self.spec.rdzv_timeout:
                if len(self.table.with_role(ACTIVE)) >= self.spec.nnodes:
                    self._maybe_form(now)
                else:
                    self._finish(1, f"only {len(self.table.with_role(ACTIVE))} of {self.spec.nnodes} nodes "
                                    f"registered within {self.spec.rdzv_timeout:g} s; start the missing nodes "
                                    "or lower --nnodes")
                    return
        for node in self.table.live():
            silent = now - node.last_heard
            if silent > self.spec.heartbeat_timeout:
                self._node_failed(node.node_id, f"no heartbeat for {silent:.1f} s", now)
        if self.flush is not None and now >= self.flush.deadline:
            for node_id in sorted(self.flush.waiting):
                self._node_failed(node_id, f"no answer to a probe within {self.spec.probe_timeout:g} s", now)
            if self.flush is not None:
                self.flush.waiting.clear()
        self._check_waits(now)
        if now >= self.next_ping:
            self.next_ping = now + self.spec.heartbeat_interval
            self.seq += 1
            for node in self.table.live():
                self._send(node.node_id, p.Ping(seq=self.seq))
        self._fire_faults(now)

    def _check_waits(self, now: float) -> None:
        rec = self.pending
        if rec is not None and rec.waiting_since is not None and self.flush is None:
            if now - rec.waiting_since > self.spec.spare_wait_timeout:
                self._finish(1, f"no node joined as a spare within {self.spec.spare_wait_timeout:g} s after "
                                f"{', '.join(rec.failed)} failed; start nodes with --rdzv-endpoint to rejoin")
            return
        if (self.spec.hang_timeout > 0 and self.stepped and rec is None and self.flush is None
                and not self.spec.restart_mode and now - self.last_progress_at > self.spec.hang_timeout):
            self._hung(now)

    def _hung(self, now: float) -> None:
        """No rank stepped for hang_timeout: blame the ranks that are not waiting on their peers."""
        stalled = now - self.last_progress_at
        self.last_progress_at = now
        stale_after = max(3 * self.spec.heartbeat_interval, 2.0)
        culprits: dict[str, str] = {}
        for node_rank, node_id in enumerate(self.layout):
            node = self.table.nodes[node_id]
            for local in range(self.spec.nproc_per_node):
                status = node.workers.get(str(local))
                rank = node_rank * self.spec.nproc_per_node + local
                if status is None or status.get("age", 0) > stale_after:
                    culprits.setdefault(node_id, f"rank {rank} stopped responding")
                elif status.get("activity") not in ("collective", "snapshot"):
                    culprits.setdefault(node_id, f"rank {rank} stuck in {status.get('activity')} at step "
                                                 f"{status.get('step')}")
        if not culprits:
            self._finish(1, f"job hung: no step for {stalled:.0f} s and every rank waits on its peers; "
                            "check the network, or raise --hang-timeout")
            return
        for node_id, why in culprits.items():
            self._node_failed(node_id, f"{why}: no progress for {stalled:.0f} s (--hang-timeout)", now)

    def _fire_faults(self, now: float, recovering: bool = False) -> None:
        if self.generation < 0 or not self.faults.pending:
            return
        steps = {node.node_rank: node.last_step for node in self.table.with_role(ACTIVE)}
        for spec in self.faults.due(steps, now - (self.training_since or now), recovering):
            node_id = self._fault_target(spec)
            if node_id is None:
                self._publish("fault_skipped", spec=str(spec), reason="no such node")
                continue
            if spec.kind == "freeze-node":
                self.frozen_at[spec.node_rank] = node_id
            if spec.kind != "wake-node":
                self.injected_at[node_id] = now
            # wake-node goes to the launcher of a frozen node (its agent cannot act); see dprun/server.py
            self._send(node_id, p.Inject(kind=spec.kind, local_rank=spec.local_rank))
            self._publish("fault_injected", node=node_id, node_rank=spec.node_rank, kind=spec.kind, spec=str(spec))

    def _fault_target(self, spec) -> str | None:
        if spec.on_spare:
            spares = self.table.with_role(SPARE)
            return spares[spec.node_rank].node_id if spec.node_rank < len(spares) else None
        if spec.kind == "wake-node":
            return self.frozen_at.get(spec.node_rank)
        return self.layout[spec.node_rank] if spec.node_rank < len(self.layout) else None

    # -- views -----------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """A read-only view for dashboards and tests."""
        return {
            "generation": self.generation,
            "layout": list(self.layout),
            "nodes": {n: dataclasses.asdict(node) for n, node in self.table.nodes.items()},
            "dropped": dict(self.dropped),
        }
