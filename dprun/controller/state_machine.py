"""The controller's decisions as a pure state machine: membership, failure detection, reconstruction.

Inputs (messages from agents, observations, ticks) go in with the current time; actions (messages to
send, events to publish, the job's end) come out. No sockets, clocks or processes: dprun/launcher/controller_shell.py
and the simulator drive it.

The Controller composes parts that each own their state (dprun.controller.timeline, dprun.controller.reconstruction,
dprun.controller.deadlines, dprun.controller.files, dprun.controller.endgame, dprun.controller.fault_firing,
dprun.controller.hang_evidence, ...): it routes each input to them and carries out what they decide (a phase entered, a
node fenced, the job ended).
"""

from __future__ import annotations

from typing import Any

from dpcommon import protocol as p
from dpcommon.exit_wording import the_script_s_exit

from .vocabulary import (  # noqa: F401  (re-exported: the controller's inputs and actions)
    ConnectionDropped, Finish, Flush, JobSpec, NodeGone, Outbox, Paused, Publish, Received, Recovery, Send, Shutdown,
    Tick, WakeNode, out_of_range,
)
from .faults import FaultPlan
from .ledger import ReplicaLedger
from .membership import ANY_GENERATION, Membership  # noqa: F401  (ANY_GENERATION: re-exported, dprun.sim)
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable
from .phase import Phase, check_transition
from .view import ControllerView, view_of
from .fault_firing import FaultFiring, JobNow
from .hang_evidence import HangEvidence
from .deadlines import Deadlines
from .background_saves import BackgroundSaves
from .endgame import Endgame
from .files import WAITING_FOR_FILES, StateFiles
from .reconstruction import AfterExits, FromDisk, GiveUp, NextGeneration, Reconstruction, Unchanged
from .timeline import Timeline
from .repeats import HUNG, RepeatedFailures
from .spare_sizing import SpareSizing


# ----------------------------------------------------------------------------- the state machine


class Controller:
    def __init__(self, spec: JobSpec, now: float):
        if spec.nnodes < 1 or spec.spares < 0 or spec.nproc_per_node < 1:
            raise ValueError("nnodes and nproc_per_node must be at least 1, spares at least 0")
        self.spec = spec
        self.phase = Phase.FORMING  # (dprun.controller.phase: the phases and the transitions between them)
        self.now = now  # the time of the input being handled
        self.out = Outbox()
        self.table = NodeTable()
        self.ledger = ReplicaLedger()
        self.sizing = SpareSizing(spec.nproc_per_node)  # what spares reserve memory for (Standby)
        self.faults = FaultFiring(FaultPlan(list(spec.faults)))  # --inject: what is still to fire, what fired
        self.repeats = RepeatedFailures()  # workers' errors by signature: one that follows a rank is the script's
        self.hangs = HangEvidence(spec.heartbeat_interval, now)  # what workers' statuses say of a hang
        self.saves = BackgroundSaves(spec.save_every, spec.save_interval, now,
                                     (spec.resume_from, spec.resume_step) if spec.resume_from else None)
        self.timeline = Timeline(spec.nproc_per_node, spec.world_size, last_progress_at=now)
        self.reconstruction = Reconstruction(spec, self.table, self.ledger, self.timeline, self.out, self._enter)
        self.members = Membership(spec, self.table, self.ledger, self.sizing, self.out)
        self.files = StateFiles(spec, self.table, self.ledger, self.timeline, self.saves, self.out, self._enter,
                                control=self)
        self.deadlines = Deadlines(spec, self.table, self.timeline, self.hangs, self.out, now)
        self.endgame = Endgame(spec, self.table, self.timeline, self.out)

    # -- entry point -----------------------------------------------------------------------------

    def handle(self, event: Any, now: float) -> list[Any]:
        self.out.take()
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
            if self.phase is Phase.TRAINING and self.reconstruction.flush is None \
                    and self.deadlines.connection_dropped(now):
                self._ping_due(now)  # (in a recovery every node is probed anyway)
        elif isinstance(event, Shutdown):
            self.finish_job(event.exit_code, event.reason)
        else:
            raise TypeError(f"unknown input {event!r}")
        if self.phase not in (Phase.SAVING, Phase.LOADING):
            if (rec := self.reconstruction.to_decide(now, self.finished)) is not None:
                self._reconstruct(rec, now)
        return self.out.take()

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
                     trained_s=now - (self.timeline.training_since or now), layout=self.timeline.layout,
                     spares=[node.node_id for node in self.table.with_role(SPARE)])
        self.out.extend(self.faults.fire(now, job, recovering))

    def finish_job(self, code: int, message: str) -> None:
        """End the job (with --save-dir, an error or a signal: once the nodes wrote its state,
        dprun.controller.files)."""
        if code != 0:  # its nodes may have left for dprun's own pause: said first
            message = self.deadlines.pause_said(message, self.now)
        said = self.files.save_first(code, message, self.phase is Phase.FORMING, self.now)
        if said is None:
            return  # it ends once the nodes wrote its state (dprun.controller.files)
        if self.saves.enabled and not self.files.saved_in:
            said = f"{said}; {self.saves.safe_note()}"
        for node in self.table.live():
            self.out.send(node.node_id, p.Stop(reason=said, exit_code=code))
        self.files.release_kept(said, code)
        self.out.extend(self.faults.never_fired())
        timeline = self.timeline
        if timeline.max_step > timeline.progress_said:  # (progress events are throttled: the last step is said too)
            self.out.publish("progress", generation=timeline.generation, step=timeline.max_step,
                             made_before_s=round(self.now - timeline.last_progress_at, 6))
        self.out.publish("job_finished", exit_code=code, message=said)
        self.out.extend([Finish(code, said, self.files.saved_in)])
        self._enter(Phase.FINISHED)

    # -- messages --------------------------------------------------------------------------------

    def _received(self, sender: str, msg: Any, now: float) -> None:
        if isinstance(msg, p.Register):
            forming = self.phase is Phase.FORMING
            if self.members.register(sender, msg, now, forming) is not None:
                if forming:
                    self._maybe_form(now)
                else:
                    self.reconstruction.spare_came(now)  # (a recovery may wait for one)
            return
        kept = self.table.get(sender)
        if kept is not None and kept.role == FAILED and kept.keeps_store and self._kept_heard(kept, msg, now):
            return
        node = self.members.sender(sender, msg, now, self.timeline)
        if node is None:
            return
        handler = getattr(self, f"_on_{type(msg).__name__}", None)
        if handler is None:
            self.members.drop(f"unexpected {type(msg).__name__}")
            return
        handler(node, msg, now)

    def _on_Heartbeat(self, node: Node, msg: p.Heartbeat, now: float) -> None:
        node.workers = msg.workers  # last_heard is already updated
        if node.role == SPARE and node.initialized:  # (a narrow job grows onto it once it is set up)
            self.reconstruction.grow_if_due(now)

    def _on_Pong(self, node: Node, msg: p.Pong, now: float) -> None:
        self.reconstruction.answered(node.node_id, msg.seq)

    def _on_Progress(self, node: Node, msg: p.Progress, now: float) -> None:
        timeline = self.timeline
        if msg.generation > timeline.trained_generation:  # (a generation after the first comes of a recovery)
            rec = self.reconstruction.recovery
            timeline.first_step(self.ledger, rec.restore_step if rec is not None else None)
        node.last_step = max(node.last_step, msg.step)
        if msg.snapshot:
            self.ledger.snapshot_taken(msg.step)
        timeline.progressed(msg.rank, msg.step, now)
        if timeline.progress_note_due(now):
            self.out.publish("progress", generation=timeline.generation, step=timeline.max_step, **msg.metrics)
        if (rec := self.reconstruction.stepped(msg.rank, msg.step)) is not None:
            self._recovery_complete(rec, now)
        self._fire_faults(now)

    def _on_SnapshotStored(self, node: Node, msg: p.SnapshotStored, now: float) -> None:
        self.timeline.copy_stored(self.ledger, msg, node.node_id)
        self.saves.sizes[msg.rank] = msg.nbytes
        self.reconstruction.news(now)  # (a restored rank replicates its step again before its barrier)
        self.files.save_if_due(now, self.phase is Phase.TRAINING)
        self.members.snapshot_sized(msg.rank, msg.nbytes)

    def _on_WorkerReady(self, node: Node, msg: p.WorkerReady, now: float) -> None:
        if msg.mesh and msg.mesh != self.timeline.mesh:  # said once: each rank's snapshots hold its own shards
            self.timeline.mesh = msg.mesh
            self.out.publish("mesh", layout=msg.mesh)
        self.timeline.restored(msg.rank, msg.generation)
        self.reconstruction.news(now)
        if (rec := self.reconstruction.ready(msg.rank, msg.rebuild_s, msg.restore_s)) is not None:
            self._recovery_complete(rec, now)

    def _recovery_complete(self, rec: Recovery, now: float) -> None:
        self.reconstruction.complete(rec, now)
        self.files.release_kept("the recovery that replaced it completed")

    def _on_Leaving(self, node: Node, msg: p.Leaving, now: float) -> None:
        self._node_failed(node.node_id, f"its agent left the job: {msg.reason[:200]}", now)

    def _on_PeerError(self, node: Node, msg: p.PeerError, now: float) -> None:
        self.out.publish("peer_error", node=node.node_id, rank=msg.rank, detail=msg.detail[:200],
                         **({"held": True} if self.spec.restart_mode else {}))
        # (before its WorkerReady: the rank left this generation unrestored, and takes no copy to the next)
        self.timeline.restores_answered.add(msg.rank)
        # (one from a replaced generation was dropped as stale: that rank is on its way to the new one)
        self.reconstruction.peer_error(node.node_id, msg, now)

    def _on_RestoreFailed(self, node: Node, msg: p.RestoreFailed, now: float) -> None:
        self.timeline.restores_answered.add(msg.rank)
        self.out.publish("restore_failed", node=node.node_id, rank=msg.rank, step=msg.step, source=msg.source,
                         reason=msg.reason[:200])
        self.reconstruction.restore_failed(node.node_id, msg, now)

    def _on_RankFinished(self, node: Node, msg: p.RankFinished, now: float) -> None:
        self.endgame.rank_finished(msg.rank, msg.step, now, msg.generation)

    def _on_Diverged(self, node: Node, msg: p.Diverged, now: float) -> None:
        self.endgame.rank_diverged(node.node_id, msg.rank, msg.step, msg.blocks)

    def _on_WorkerExited(self, node: Node, msg: p.WorkerExited, now: float) -> None:
        timeline = self.timeline
        if node.role == ACTIVE and msg.exitcode == 0:  # finished (its final barrier passed, in any generation)
            ended = self.endgame.worker_finished(node, msg.local_rank, now,
                                                 self.reconstruction.recovery or self.reconstruction.pending)
            if ended is not None:
                self.finish_job(*ended)
            return
        if node.role == SPARE and msg.exitcode == 0:
            return
        rank = timeline.rank_of(node, msg.local_rank)
        self.members.worker_exit_said(node, msg, rank)
        how = p.describe_end(msg.exitcode, msg.detail, msg.oom_killed)
        cause = f"worker {msg.local_rank} (pid {msg.pid}) {how}"
        # a crash as it exited on a Python exception counts as the exit 1 of that exception (p.WorkerExited.raised)
        code, last_line = (1, msg.raised) if msg.raised else (msg.exitcode, msg.detail)
        if msg.oom_killed:  # the OOM killer's SIGKILL is counted as such (repeats.signature)
            last_line = p.OOM_KILLED
        same = None
        if not self.spec.restart_mode:  # (restarts are --max-restarts' to count) a spare's script fails alike
            # (the step it struck after: its own generation's, not one a newer plan already rolled back; or the
            # one its agent heard it make, where it trained on in a generation since replaced)
            step = max(timeline.peaks.get(msg.generation, timeline.max_step), msg.step)
            same = self.repeats.seen(code, last_line, node.node_id, rank, step)
        node.raised = the_script_s_exit(code)
        self._node_failed(node.node_id, cause, now, agent_alive=True)
        if same is not None and not self.finished:
            self.finish_job(1, same)

    # -- forming the first generation ------------------------------------------------------------

    def _maybe_form(self, now: float) -> None:
        if self.table.count(ACTIVE) < self.spec.nnodes:
            return
        spares_ready = self.table.count(SPARE) >= self.spec.spares
        if not spares_ready and now - self.deadlines.started_at < self.spec.rdzv_timeout:
            return
        self.timeline.form(self.table.first_layout(self.spec.nnodes), self.table)
        if self.spec.resume_from:  # each node reads its ranks' files first (then _start_first_generation)
            self.files.load(self.spec.resume_from, self.spec.resume_step, 0, None, self.now)
        else:
            self._start_first_generation(p.NO_RANK, {})

    def _start_first_generation(self, restore_step: int, sources: dict[int, str]) -> None:
        """Generation 0: a fresh start, or every rank restores `restore_step` from `sources` (resumed)."""
        timeline = self.timeline
        timeline.training_since = timeline.last_progress_at = self.now
        self._enter(Phase.TRAINING)
        if restore_step >= 0:
            timeline.max_step = restore_step
            timeline.rank_step = dict.fromkeys(range(self.spec.world_size), restore_step)
        self.out.extend(timeline.reconfigures(self.spec, self.table, self.ledger, restore_step, sources,
                                              reason="resume" if restore_step >= 0 else "start"))
        self.out.publish("job_started", generation=0, nnodes=self.spec.nnodes, world_size=self.spec.world_size,
                         spares=len(self.table.with_role(SPARE)), layout=list(timeline.layout),
                         **({"resumed_from": self.files.resumed_from, "step": restore_step}
                            if restore_step >= 0 else {}))

    # -- failures and recoveries (dprun.controller.reconstruction decides) ----------------------------------

    def _node_failed(self, node_id: str, cause: str, now: float, agent_alive: bool = False,
                     since: float | None = None) -> None:
        """Fence the node (its agent told to stop) and plan without it. agent_alive: its agent reported its
        worker's exit, so its replica store may stay (dprun.controller.files.keeps_store). since: when it was last known
        well (its last heartbeat, for a silent node): the recovery's downtime counts from then."""
        node = self.table.get(node_id)
        if node is not None and node.keeps_store:  # fenced already; now its store is lost too
            self._kept_gone(node_id, cause, now)
        if node is None or node.role == FAILED:
            return
        was = node.role
        self.table.set_role(node, FAILED)
        self.files.background_saved(self.saves.node_lost(node_id, now))
        keep = agent_alive and self.files.keeps_store(node, self.phase is Phase.FORMING)
        self.members.fenced(node, was, cause, keep)
        # when it failed: when injected, or last heard (or, restart mode, the generation's first crash)
        began = [self.faults.injected_at.get(node_id, now), now if since is None else since]
        end = self.reconstruction.node_lost(node_id, was, cause, now, began, forming=self.phase is Phase.FORMING,
                                            training_over=self.endgame.all_finished_at is not None)
        if end is not None and not self.finished:  # (the first of several failed at once says it)
            self.finish_job(1, end)

    def _reconstruct(self, rec: Recovery, now: float) -> None:
        paused = self.deadlines.paused_lately(self.now) is not None
        decision = self.reconstruction.decide(rec, now, paused, self.saves.safe,
                                              training_over=self.endgame.all_finished_at is not None)
        if isinstance(decision, Unchanged):
            self._enter(Phase.TRAINING)
        elif isinstance(decision, AfterExits):
            self.finish_job(1, self.endgame.after_exits(rec, self.timeline.max_step))
        elif isinstance(decision, GiveUp):
            self.finish_job(1, decision.message)
        elif isinstance(decision, FromDisk):  # (the background save in flight is abandoned: an event says so)
            self.files.background_saved(self.saves.abandon(now, "a recovery from disk began"))
            self.reconstruction.begin_generation(rec, now, decision.failed_slots, decision.spares, decision.step,
                                                 from_disk=True)
            rec.from_disk = decision.folder
            self.files.load(decision.folder, decision.step, self.timeline.generation, rec, self.now)
        elif isinstance(decision, NextGeneration):
            self.reconstruction.begin_generation(rec, now, decision.failed_slots, decision.spares, decision.step,
                                                 decision.shrink, decision.grow)
            self._launch(rec, decision.step, decision.sources, "recovery", now)

    def _launch(self, rec: Recovery, step: int, sources: dict[int, str], reason: str, now: float) -> None:
        """Send out `rec`'s generation: every rank goes back to `step` from `sources`."""
        rec.sources = sources
        # faults due "during recovery" go out first: a replica corrupted for this plan is damaged before a
        # promoted spare, which fetches as soon as it hears of the plan, can ask for it
        self._fire_faults(now, recovering=True)
        timeline = self.timeline
        self.out.extend(timeline.reconfigures(self.spec, self.table, self.ledger, step, sources, reason))
        self.out.publish("reconfigure", generation=timeline.generation, restore_step=step,
                         layout=list(timeline.layout), decide_s=round(now - rec.t_detect, 4))
        self.reconstruction.launched(rec)

    # -- time (dprun.controller.deadlines keeps the clocks) --------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.phase is Phase.FORMING:
            due = self.deadlines.forming(now)
            if isinstance(due, str):
                self.finish_job(1, due)
                return
            if due:
                self._maybe_form(now)
        for node_id, cause, since in self.deadlines.overdue(now):
            self._node_failed(node_id, cause, now, since=since)
        flush = self.reconstruction.flush
        if flush is not None and now >= flush.deadline:
            for node_id in sorted(flush.waiting):
                self._node_failed(node_id, f"no answer to a probe within {self.spec.probe_timeout:g} s", now)
            if self.reconstruction.flush is not None:
                self.reconstruction.flush.waiting.clear()
        self._check_waits(now)
        self._ping_due(now)
        self._fire_faults(now)
        self.files.save_if_due(now, self.phase is Phase.TRAINING)
        if self.phase is Phase.TRAINING:  # (a joining node whose workers did not say they are set up in time)
            self.reconstruction.grow_if_due(now)

    def _ping_due(self, now: float) -> None:
        if self.deadlines.ping_due(now):
            seq = self.reconstruction.next_seq()
            for node in self.table.live():
                self.out.send(node.node_id, p.Ping(seq=seq))

    def _paused(self, seconds: float, now: float) -> None:
        """The controller itself did not run for `seconds`: no node is blamed for that silence, nor a rank for
        not stepping; every deadline moves on by as much. Near --heartbeat-timeout its nodes take the controller
        for lost (they leave, saving what they hold with --save-dir): a job that then ends says why."""
        nodes_left = self.deadlines.pause(seconds, now)
        self.endgame.pause(seconds, now)
        self.reconstruction.pause(seconds, now)
        self.files.pause(seconds)
        self.out.publish("controller_paused", seconds=round(seconds, 2), nodes_left=nodes_left)

    def _check_waits(self, now: float) -> None:
        if (end := self.reconstruction.waits_over(now)) is not None:
            self.finish_job(1, end)
        if not self.reconstruction.idle:
            return
        if self.endgame.all_finished_at is not None:
            if (end := self.endgame.waiting_for_exit(now)) is not None:
                self.finish_job(1, end)
        elif self.spec.restart_mode:
            return
        elif (end := self.deadlines.hung_at_end(now)) is not None:
            self.finish_job(1, end)
        elif self.deadlines.hang_due(now):
            self._hung(now)

    def _hung(self, now: float) -> None:
        """No rank stepped for hang_timeout: blame the ranks that are not waiting on their peers."""
        stalled, culprits = self.deadlines.hung(now)
        if not culprits:
            self.finish_job(1, self.deadlines.all_waiting(stalled))
            return
        same = None
        for node_id, (why, rank, step) in culprits.items():
            self._node_failed(node_id, f"{why}: no progress for {stalled:.0f} s (--hang-timeout)", now)
            same = same or self.repeats.seen(1, HUNG, node_id, rank, step)  # hung again where the rank went
        if same is not None and not self.finished:
            self.finish_job(1, same)

    # -- files written or read (dprun.controller.files decides) ---------------------------------------------

    def _while_files(self, event: Any, now: float) -> None:
        """Inputs while files are written or read: their answers and what keeps the nodes known alive count;
        a second stop, a lost node or the deadline end the wait."""
        if isinstance(event, Received) and isinstance(event.msg, WAITING_FOR_FILES):
            self._received(event.node_id, event.msg, now)
        elif isinstance(event, Received) and isinstance(event.msg, p.WorkerExited):
            if (node := self.table.get(event.node_id)) is not None:
                self.members.worker_exit_said(node, event.msg, self.timeline.rank_of(node, event.msg.local_rank))
            self.files.worker_exited(event.node_id, event.msg, now)
        elif isinstance(event, NodeGone):
            self.files.node_failed(event.node_id, event.cause, now)
        elif isinstance(event, Shutdown):
            self.files.stop(event.reason, now)
        elif isinstance(event, Paused):
            self._paused(event.seconds, now)
        elif isinstance(event, Tick) and self.files.tick(now):
            self._ping_due(now)

    def go_on_from_files(self, step: int, recovery: Recovery | None) -> None:
        """Every node's store holds its ranks' files of `step` (dprun.controller.files): `recovery` goes on from them,
        or the resumed job's first generation starts (each rank restores from its own node's store)."""
        sources = {rank: self.timeline.node_of_rank(rank) for rank in range(self.spec.world_size)}
        if recovery is not None:
            self._launch(recovery, step, sources, "recovery from disk", self.now)
        else:
            self._start_first_generation(step, sources)

    def read_interrupted(self, node_id: str, cause: str, exited: p.WorkerExited | None) -> None:
        """A node (or a worker) was lost while a recovery's files were read: the read is abandoned and the recovery
        carries on as one that a failure interrupted: the loss handled as any other (the node fenced, every node
        probed), then a plan made again (from the copies read so far, or the disk once more), or the job ended
        for want of a spare. A node fenced before the read (a store kept for a save) read nothing: the read goes
        on."""
        work, node = self.files.work, self.table.get(node_id)
        assert work is not None and work.recovery is not None
        work.gone.add(node_id)
        if node is None or node.role == FAILED:
            self.ledger.holder_lost(node_id)
            return
        self.files.abandon()
        self.reconstruction.launched(work.recovery)  # (the loss carries it on: Reconstruction.open_pending)
        if exited is not None:
            self._received(node_id, exited, self.now)
        else:
            self._node_failed(node_id, cause, self.now)
        if self.reconstruction.pending is None and not self.finished:  # (a spare that held none of the copies)
            self.reconstruction.replan(self.now, f"{node_id} was lost while the recovery's files were read: "
                                                 f"{cause[:200]}")
            self.reconstruction.replanned_for_a_loss()

    def _on_SnapshotFiles(self, node: Node, msg: p.SnapshotFiles, now: float) -> None:
        if not self.files.snapshot_files(node.node_id, msg, now):
            self.members.drop("unexpected SnapshotFiles")

    def _kept_heard(self, node: Node, msg: Any, now: float) -> bool:
        """A message from a fenced node whose store stays: True if taken (what shows it alive, its files)."""
        if isinstance(msg, (p.Heartbeat, p.Pong)):
            node.last_heard = now
            return True
        if isinstance(msg, p.SnapshotFiles):  # (one that comes after the save is dropped there)
            self._on_SnapshotFiles(node, msg, now)
            return True
        if isinstance(msg, p.Leaving):  # its agent stops after all (a signal of its own): its store goes with it
            self._kept_gone(node.node_id, f"its agent left the job: {msg.reason[:200]}", now)
            return True
        return False

    def _kept_gone(self, node_id: str, cause: str, now: float) -> None:
        """A fenced node whose store stayed was lost too: its copies with it (dprun.controller.files), and a recovery
        that restores ranks from it plans again at once (dprun.controller.reconstruction)."""
        self.files.kept_gone(node_id, cause, now)
        if not self.finished:
            self.reconstruction.store_lost(node_id, cause, now)

    # -- views -----------------------------------------------------------------------------------

    def view(self, now: float) -> ControllerView:
        """What the operator sees of the controller at `now`, frozen (dprun.controller.view)."""
        return view_of(self, now)
