"""The controller's decisions as a pure state machine: membership, failure detection, reconstruction.

Inputs (messages from agents, observations, ticks) go in with the current time; actions (messages to
send, events to publish, the job's end) come out. No sockets, clocks or processes: dprun/server.py and
the simulator drive it.
"""

from __future__ import annotations

from typing import Any

from dpagent import protocol as p

from .controller_io import (  # noqa: F401  (re-exported: the controller's inputs and actions)
    ConnectionDropped, Finish, Flush, JobSpec, NodeGone, Paused, Publish, Received, Recovery, Send, Shutdown, Tick,
    WakeNode, out_of_range,
)
from .faults import FaultPlan
from .ledger import INIT, ReplicaLedger
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable
from .phase import Phase, check_transition
from .controller_view import ControllerView, view_of
from .fault_firing import FaultFiring, JobNow
from .hang_evidence import HangEvidence
from .deadlines import FORMING_NOTE_EVERY_S, Deadlines
from .background_saves import BackgroundSaves
from .files import FileWork, Files
from .reconstruction import Reconstruction
from . import admission
from .repeats import RepeatedFailures
from .spare_sizing import SpareSizing

# what a node says of its workers stands in any generation: how they are, how they ended, that they finished
ANY_GENERATION = (p.Heartbeat, p.WorkerExited, p.RankFinished, p.Diverged)

PROGRESS_EVERY_S = 1.0  # at most one "progress" event a second: days-long jobs must not flood the events file


# ----------------------------------------------------------------------------- the state machine


class Controller(Reconstruction, Deadlines, Files):
    def __init__(self, spec: JobSpec, now: float):
        if spec.nnodes < 1 or spec.spares < 0 or spec.nproc_per_node < 1:
            raise ValueError("nnodes and nproc_per_node must be at least 1, spares at least 0")
        self.spec = spec
        self.table = NodeTable()
        self.ledger = ReplicaLedger()
        self.sizing = SpareSizing(spec.nproc_per_node)  # what spares reserve memory for (Standby)
        self.faults = FaultFiring(FaultPlan(list(spec.faults)))  # --inject: what is still to fire, what fired
        self.started_at = now
        self.forming_note_at = now + FORMING_NOTE_EVERY_S  # while nodes are missing, say so this often
        self.training_since: float | None = None
        self.generation = -1  # -1 while the first generation forms
        self.layout: list[str] = []  # node rank -> node id
        self.phase = Phase.FORMING  # (dprun.phase: the phases and the transitions between them)
        self.recovery: Recovery | None = None  # decided, waiting for its first step
        self.pending: Recovery | None = None  # failures known, decision waiting for the flush
        self.flush: Flush | None = None
        self.seq = 0
        self.next_ping = now
        self.crashed_at: dict[str, float] = {}  # restart mode: node -> its first held-back crash, this generation
        self.holders: dict[int, list[str]] = {}  # node rank -> nodes holding its replicas, this generation
        self.last_progress_at = now  # when the newest step last grew (hang detection)
        self.stepped = False  # a step was made in this generation: start-up and restores are not hangs
        self.unrestored: set[int] = set()  # ranks handed to a new node that has not yet restored their state
        self.restores_answered: set[int] = set()  # ranks that said restored or failed to, this generation
        self.rank_step: dict[int, int] = {}  # newest step each rank reported in this generation's timeline
        self.trained_generation = -1  # the newest generation that any rank made a step in
        self.late_copies: list[tuple[int, int, str]] = []  # (rank, step, holder) reported in an older one
        self.dropped: dict[str, int] = {}
        self.max_step = 0
        self.peaks: dict[int, int] = {}  # generation -> the newest step made in it, once a newer one was planned
        self.last_progress_event = float("-inf")
        self.progress_said = 0  # the step the last "progress" event named
        self.recoveries: list[Recovery] = []
        self.restarts = 0
        self.finished_ranks: dict[int, int] = {}  # rank -> its last step, once past job.steps()' final barrier
        self.mesh = ""  # the layout of a sharded or 3D-parallel job, as its workers said (WorkerReady.mesh)
        self.diverged: dict[int, int] = {}  # rank -> the step at which a holder found it unlike its peers
        self.all_finished_at: float | None = None  # when the last rank passed it: then the job waits for exits
        self.exit_notes = 0  # how often it said which workers the finished job still waits for
        self.repeats = RepeatedFailures()  # workers' errors by signature: one that follows a rank is the script's
        self.files: FileWork | None = None  # snapshot files being written (the job ends) or read (it resumes)
        self.saved = False  # the state was saved (or there was none to save): the job ends as it is
        self.saved_in = ""  # the step folder that save wrote, once every rank's file is there
        self.resumed_from = spec.resume_from  # the step folder a resumed job goes on from (an older one if that was
        # found damaged when read)
        self.resume_older = list(spec.resume_older)  # complete steps to go on from should the newest be damaged
        self.saves = BackgroundSaves(spec.save_every, spec.save_interval, now,
                                     (spec.resume_from, spec.resume_step) if spec.resume_from else None)
        self.now = now  # the time of the input being handled
        self.paused: tuple[float, float] | None = None  # (when, seconds) the controller last stopped running
        self.dropped_at: float | None = None  # a connection closed then: nodes not heard since are probed
        self.hangs = HangEvidence(spec.heartbeat_interval, now)  # what workers' statuses say of a hang
        self._out: list = []

    # -- entry point -----------------------------------------------------------------------------

    def handle(self, event: Any, now: float) -> list:
        self._out = []
        if self.phase is Phase.FINISHED:
            return []
        self.now = now
        if self.phase in (Phase.SAVING, Phase.LOADING):
            self._while_files(event, now)
        elif isinstance(event, Received):
            self._received(event.node_id, event.msg, now)
        elif isinstance(event, NodeGone):
            self._node_failed(event.node_id, event.cause, now)
        elif isinstance(event, Tick):
            self._tick(now)
        elif isinstance(event, Paused):
            self._paused(event.seconds, now)
        elif isinstance(event, ConnectionDropped):
            self._connection_dropped(now)
        elif isinstance(event, Shutdown):
            self._finish(event.exit_code, event.reason)
        else:
            raise TypeError(f"unknown input {event!r}")
        if self.phase not in (Phase.SAVING, Phase.LOADING):
            self._maybe_decide(now)
        out, self._out = self._out, []
        return out

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The job's end was decided (Finish returned): nothing more is handled."""
        return self.phase is Phase.FINISHED

    def _enter(self, phase: Phase) -> None:
        self.phase = check_transition(self.phase, phase)

    def _fire_faults(self, now: float, recovering: bool = False) -> None:
        """--inject: fire the faults now due (recovering: those due "during recovery" too)."""
        if self.phase is Phase.FORMING or not self.faults.plan.pending:
            return
        job = JobNow(steps={node.node_rank: node.last_step for node in self.table.with_role(ACTIVE)},
                     trained_s=now - (self.training_since or now), layout=self.layout,
                     spares=[node.node_id for node in self.table.with_role(SPARE)])
        self._out.extend(self.faults.fire(now, job, recovering))

    def _send(self, node_id: str, msg: Any) -> None:
        self._out.append(Send(node_id, msg))

    def _publish(self, name: str, **fields) -> None:
        self._out.append(Publish({"event": name, **fields}))

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _paused_lately(self) -> bool:
        """dprun itself did not run lately, for long enough that its nodes may have taken it for lost: a job that
        ends now ends for that (`_finish` says so first), not for what its nodes then did."""
        return self.paused is not None and self.now - self.paused[0] <= 2 * self.spec.heartbeat_timeout

    def _finish(self, code: int, message: str) -> None:
        if code != 0 and self._paused_lately():
            cause = (f"dprun itself did not run for {self.paused[1]:.1f} s (stopped with SIGSTOP or Ctrl-Z, its "
                     f"machine paused, or starved of CPU), long enough for its nodes (--heartbeat-timeout "
                     f"{self.spec.heartbeat_timeout:g} s) to take the controller for lost and leave")
            if self.spec.save_dir:
                cause += f", each writing the copies it held to {self.spec.save_dir}"
            message = message if message.startswith(cause) else f"{cause}; then: {message}"
        message = self._save_first(code, message)
        if message is None:
            return  # it ends once the nodes wrote its state (dprun.files)
        if self.saves.enabled and not self.saved_in:
            message = f"{message}; {self.saves.safe_note()}"
        for node in self.table.live():
            self._send(node.node_id, p.Stop(reason=message, exit_code=code))
        self._release_kept(message, code)
        self._out.extend(self.faults.never_fired())
        if self.max_step > self.progress_said:  # (progress events are throttled: the last step is said too)
            self._publish("progress", generation=self.generation, step=self.max_step,
                          made_before_s=round(self.now - self.last_progress_at, 6))
        self._publish("job_finished", exit_code=code, message=message)
        self._out.append(Finish(code, message, self.saved_in))
        self._enter(Phase.FINISHED)

    def ranks_of(self, node_rank: int) -> range:
        n = self.spec.nproc_per_node
        return range(node_rank * n, (node_rank + 1) * n)

    def rank_of(self, node: Node, local_rank: int) -> int:
        """The global rank of a node's local worker: NO_RANK where the node holds no node rank (a spare)."""
        return self.ranks_of(node.node_rank)[local_rank] if node.node_rank >= 0 else p.NO_RANK

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
            if node.keeps_store and self._kept_heard(node, msg, now):
                return
            self._drop("fenced node")
            if isinstance(msg, (p.Heartbeat, p.Pong)):
                self._send(sender, p.Stop(reason=f"node {sender} was fenced: {node.cause}", exit_code=1))
            return
        node.last_heard = now
        if getattr(msg, "node_id", sender) != sender:
            self._drop("node_id does not match the sender")
            return
        if (why := out_of_range(msg, self.spec.nproc_per_node, self.spec.world_size)) is not None:
            self._drop(why)  # a buggy agent's: no rank of this job
            if self.dropped[why] == 1:  # said once per reason: never normal, but never to flood the log either
                self._publish("message_refused", node=sender, kind=type(msg).__name__, reason=why)
            return
        generation = getattr(msg, "generation", None)
        if generation is not None and generation != self.generation and not isinstance(msg, ANY_GENERATION) \
                and not self._late_copy(msg):
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
        if (why := admission.refusal(self.spec, msg)) is not None:
            self._send(sender, p.Stop(reason=why, exit_code=2))
            self._publish("node_refused", node=sender, host=msg.host, reason=why)
            return
        forming = self.phase is Phase.FORMING
        claimed = [(n.node_id, n.want_rank) for n in self.table.nodes.values() if n.role != FAILED] if forming else []
        for warning in admission.warnings(self.spec, msg, claimed):  # (once formed, a rank goes where room is)
            self._publish("node_warning", node=sender, warning=warning)
        actives = self.table.count(ACTIVE)
        role = ACTIVE if forming and not msg.want_spare and actives < self.spec.nnodes else SPARE
        node = Node(
            node_id=sender, host=msg.host, pid=msg.pid, nproc=msg.nproc, replica_endpoint=msg.replica_endpoint,
            role=role, registered_at=now, last_heard=now, want_rank=msg.node_rank,
        )
        self.table.add(node)
        self._welcome(node)
        self._publish("node_joined", node=sender, host=msg.host, role=role, pid=msg.pid)
        if forming:
            self._maybe_form(now)
        elif self.pending is not None and self.pending.waiting_since is not None and self.flush is None:
            self._start_flush(now)  # a spare arrived for the recovery that waits for one

    def _welcome(self, node: Node) -> None:
        self._send(node.node_id, p.Welcome(
            node_id=node.node_id, role="active" if node.role == ACTIVE else "spare", job_id=self.spec.job_id,
            heartbeat_interval=self.spec.heartbeat_interval, heartbeat_timeout=self.spec.heartbeat_timeout,
            prespawn=not self.spec.restart_mode, save_dir=self.spec.save_dir, world_size=self.spec.world_size,
        ))
        standby = self.sizing.message()
        if node.role == SPARE and standby is not None:
            self._send(node.node_id, standby)

    def _on_Heartbeat(self, node: Node, msg: p.Heartbeat, now: float) -> None:
        node.workers = msg.workers  # last_heard is already updated

    def _on_Pong(self, node: Node, msg: p.Pong, now: float) -> None:
        if self.flush is not None and msg.seq >= self.flush.seq:
            self.flush.waiting.discard(node.node_id)

    def _on_Progress(self, node: Node, msg: p.Progress, now: float) -> None:
        if msg.generation > self.trained_generation:
            self._first_step_of_generation()
        node.last_step = max(node.last_step, msg.step)
        self.rank_step[msg.rank] = max(self.rank_step.get(msg.rank, 0), msg.step)
        if msg.snapshot:
            self.ledger.snapshot_taken(msg.step)
        if msg.step > self.max_step or not self.stepped:
            self.max_step = max(self.max_step, msg.step)
            self.last_progress_at = now
            self.stepped = True
        if now - self.last_progress_event >= PROGRESS_EVERY_S:
            self.last_progress_event, self.progress_said = now, self.max_step
            self._publish("progress", generation=self.generation, step=self.max_step, **msg.metrics)
        rec = self.recovery
        if rec is not None and msg.step > rec.restore_step:
            rec.stepped.add(msg.rank)
            if len(rec.stepped) == self.spec.world_size:
                self._recovery_complete(rec, now)
        self._fire_faults(now)

    def _on_SnapshotStored(self, node: Node, msg: p.SnapshotStored, now: float) -> None:
        if msg.generation != self.generation:
            self.late_copies.append((msg.rank, msg.step, node.node_id))
        else:
            self._late_copies_superseded(msg.rank, msg.step, node.node_id)
        self.ledger.stored(msg.rank, msg.step, node.node_id)
        self.saves.sizes[msg.rank] = msg.nbytes
        self._restore_news(now)  # (a restored rank replicates its step again before its barrier)
        self._save_if_due(now)
        if self.sizing.stored(msg.rank, msg.nbytes):
            for spare in self.table.with_role(SPARE):
                self._send(spare.node_id, self.sizing.message())

    def _restore_news(self, now: float) -> None:
        """A plan that waits for restores in flight (its state looked lost, dprun.reconstruction) decides again."""
        rec = self.pending
        if rec is not None and rec.restoring_until is not None and rec.waiting_since is None and self.flush is None:
            self._start_flush(now)

    def _on_WorkerReady(self, node: Node, msg: p.WorkerReady, now: float) -> None:
        if msg.mesh and msg.mesh != self.mesh:  # said once: each rank's snapshots hold its own shards, whole
            self.mesh = msg.mesh
            self._publish("mesh", layout=msg.mesh)
        self.unrestored.discard(msg.rank)
        self.restores_answered.add(msg.rank)
        self._restore_news(now)
        rec = self.recovery
        if rec is not None:
            rec.ready[msg.rank] = (msg.rebuild_s, msg.restore_s)
            if self.spec.restart_mode and len(rec.ready) == self.spec.world_size:
                self._recovery_complete(rec, now)  # restarted scripts report no steps to us

    def _on_Leaving(self, node: Node, msg: p.Leaving, now: float) -> None:
        self._node_failed(node.node_id, f"its agent left the job: {msg.reason[:200]}", now)

    def _on_PeerError(self, node: Node, msg: p.PeerError, now: float) -> None:
        self._publish("peer_error", node=node.node_id, rank=msg.rank, detail=msg.detail[:200],
                      **({"held": True} if self.spec.restart_mode else {}))
        # (before its WorkerReady: the rank left this generation unrestored, and takes no copy to the next)
        self.restores_answered.add(msg.rank)
        # (one from a replaced generation was dropped as stale: that rank is on its way to the new one)
        if self.spec.restart_mode:  # a crashed worker: its agent reports the exit unless a dead peer explains it
            self.crashed_at.setdefault(node.node_id, now)  # (the failure that follows began no later)
            if self.flush is None:
                self._start_flush(now)
            return
        # dpstate's rank waits for a new generation: probe (a dead peer is failed) and plan one either way,
        # since with every node alive the error was the rank's own (e.g. a connect that timed out)
        self._replan(now, f"rank {msg.rank}: {msg.detail[:200]}")
        if not self.pending.failed:  # the peer that broke the collective may be a worker whose exit is in flight
            self.pending.settle_until = max(self.pending.settle_until, now + self.spec.heartbeat_interval)

    def _on_RestoreFailed(self, node: Node, msg: p.RestoreFailed, now: float) -> None:
        self.restores_answered.add(msg.rank)
        self._publish("restore_failed", node=node.node_id, rank=msg.rank, step=msg.step, source=msg.source,
                      reason=msg.reason[:200])
        self._replan(now, f"restoring rank {msg.rank} from {msg.source or 'its local copy'} failed: {msg.reason[:200]}")
        rec = self.pending
        if msg.source:
            holder = next((n.node_id for n in self.table.nodes.values() if n.replica_endpoint == msg.source), None)
            dropped = holder is not None and self.ledger.discard(msg.rank, msg.step, holder)
        else:  # the rank's own copy: it holds only newer steps (a survivor asked to walk back past its ring)
            holder, dropped = f"{node.node_id} (local)", rec.no_local.get(msg.rank, -1) < msg.step
            rec.no_local[msg.rank] = max(rec.no_local.get(msg.rank, -1), msg.step)
        rec.bad_copies.append(f"rank {msg.rank} step {msg.step} on {holder or msg.source}: {msg.reason[:80]}")
        if dropped:  # each such plan has one copy fewer to choose from: they end, with a plan or "state lost"
            rec.free_replans += 1

    def _on_RankFinished(self, node: Node, msg: p.RankFinished, now: float) -> None:
        # the job ends when every active worker has exited 0 (as with torchrun); this tells a rank that finished
        # job.steps() from one that exited 0 early, should the others fail without it
        self.finished_ranks[msg.rank] = msg.step
        if self.all_finished_at is None and len(self.finished_ranks) == self.spec.world_size:
            self.all_finished_at = now

    def _on_Diverged(self, node: Node, msg: p.Diverged, now: float) -> None:
        if msg.rank not in self.diverged:
            self.diverged[msg.rank] = msg.step
            self._publish("divergence", node=node.node_id, rank=msg.rank, step=msg.step, blocks=msg.blocks)

    def _divergence_note(self) -> str:
        if not self.diverged:
            return ""
        ranks = sorted(self.diverged)
        named = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        return (f"; but the parameters or optimizer state of rank(s) {named} differed from a data parallel peer's "
                f"(first at step {min(self.diverged.values())}): a faulty GPU or memory on one of their nodes, or "
                "code that changes one rank's copy only; do not trust a model saved from them")

    def _on_WorkerExited(self, node: Node, msg: p.WorkerExited, now: float) -> None:
        if node.role == ACTIVE and msg.exitcode == 0:  # finished (its final barrier passed, in any generation)
            node.exited_ok.add(msg.local_rank)
            if self.spec.restart_mode and self.all_finished_at is None:  # no RankFinished: a first exit 0 says it
                self.all_finished_at = now
            rec = self.recovery or self.pending
            if rec is not None and rec.failed:  # the job ended under a recovery that now can never complete
                self._failed_after_exits(rec, max(rec.peak_step, self.max_step))
                return
            if all(len(self.table.nodes[n].exited_ok) == self.spec.nproc_per_node for n in self.layout):
                self._finish(0, f"all {self.spec.world_size} ranks finished{self._divergence_note()}")
            return
        if node.role == SPARE and msg.exitcode == 0:
            return
        self._worker_exit_said(node, msg)
        how = p.describe_end(msg.exitcode, msg.detail, msg.oom_killed)
        cause = f"worker {msg.local_rank} (pid {msg.pid}) {how}"
        # a crash as it exited on a Python exception counts as the exit 1 of that exception (p.WorkerExited.raised)
        code, last_line = (1, msg.raised) if msg.raised else (msg.exitcode, msg.detail)
        if msg.oom_killed:  # the OOM killer's SIGKILL is counted as such (repeats.signature)
            last_line = p.OOM_KILLED
        same = None
        if not self.spec.restart_mode:  # (restarts are --max-restarts' to count) a spare's script fails alike
            rank = self.rank_of(node, msg.local_rank)
            # (the step it struck after: its own generation's, not one a newer plan already rolled back; or the
            # one its agent heard it make, where it trained on in a generation since replaced)
            step = max(self.peaks.get(msg.generation, self.max_step), msg.step)
            same = self.repeats.seen(code, last_line, node.node_id, rank, step)
        node.raised = code > 0
        self._node_failed(node.node_id, cause, now, agent_alive=True)
        if same is not None and not self.finished:
            self._finish(1, same)

    def _worker_exit_said(self, node: Node, msg: p.WorkerExited) -> None:
        """A live node's worker ended with an error or a signal: said as an event (the job's failure summary,
        `dprun report`) before what comes of it."""
        if msg.exitcode == 0 or node.role == FAILED:
            return
        rank = self.rank_of(node, msg.local_rank)
        self._publish("worker_exited", node=node.node_id, local_rank=msg.local_rank,
                      rank=rank if rank != p.NO_RANK else None, pid=msg.pid,
                      exitcode=msg.exitcode, cause=p.describe_end(msg.exitcode, msg.detail, msg.oom_killed),
                      tail=msg.stderr_tail, log=msg.log_path)

    # -- forming the first generation ------------------------------------------------------------

    def _maybe_form(self, now: float) -> None:
        if self.table.count(ACTIVE) < self.spec.nnodes:
            return
        spares_ready = self.table.count(SPARE) >= self.spec.spares
        if not spares_ready and now - self.started_at < self.spec.rdzv_timeout:
            return
        self.layout = self.table.first_layout(self.spec.nnodes)
        self.generation = 0
        for node_rank, node_id in enumerate(self.layout):
            self.table.nodes[node_id].node_rank = node_rank
        if self.spec.resume_from:
            self._load_first(self.spec.resume_from, self.spec.resume_step)  # then _start_first_generation
        else:
            self._start_first_generation(p.NO_RANK, {})

    def _start_first_generation(self, restore_step: int, sources: dict[int, str]) -> None:
        """Generation 0: a fresh start, or every rank restores `restore_step` from `sources` (resumed)."""
        self.training_since = self.last_progress_at = self.now
        self._enter(Phase.TRAINING)
        if restore_step >= 0:
            self.max_step = restore_step
            self.rank_step = {rank: restore_step for rank in range(self.spec.world_size)}
        self._reconfigure_all(restore_step, sources, reason="resume" if restore_step >= 0 else "start")
        self._publish("job_started", generation=0, nnodes=self.spec.nnodes, world_size=self.spec.world_size,
                      spares=len(self.table.with_role(SPARE)), layout=list(self.layout),
                      **({"resumed_from": self.resumed_from, "step": restore_step} if restore_step >= 0 else {}))

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

    # -- views -----------------------------------------------------------------------------------

    def view(self, now: float) -> ControllerView:
        """What the operator sees of the controller at `now`, frozen (dprun.controller_view)."""
        return view_of(self, now)
