"""The agent's side of its workers: spawning them with their environment, what they send (forwarded, statuses,
hellos), what is sent to them, and their exits reported to the controller.

A part of the Agent (it inherits this), kept apart so each file reads in one sitting.
"""

from __future__ import annotations

import logging
import signal
import time

from .channel import Incoming
from .exit_wording import describe_exit
from .output import crash_exception, failure_detail
from .protocol import (
    NO_RANK, Diverged, Hello, PeerError, Progress, RankFinished, RestoreFailed, SnapshotFiles, Stop, WorkerExited,
    WorkerReady, WorkerStatus, WorkerSummary,
)
from .replica_server import FilesDone, RelabelChecked
from .shutdown import SENT_BY_PHASE, StopPhase
from .workers import WorkerDone, worker_env

log = logging.getLogger("dpagent")
FORWARDED = (Progress, WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged, SnapshotFiles)  # relayed on


class WorkerLink:
    """Needs the agent's cfg, job_id, endpoints, workers, worker_ch, _peers, _statuses, _made, shutdown,
    standby, latest_reconfigure, generation, replica, oom_kills, _to_controller, _hold_exit and held_exits
    (restart mode)."""

    def _base_env(self, local_rank: int, role: str) -> dict[str, str]:
        return worker_env(
            self.cfg.env, node_id=self.cfg.node_id, endpoint=self.worker_endpoint, token=self.cfg.token,
            job_id=self.job_id, role=role, nproc=self.cfg.nproc, local_rank=local_rank,
            local_addr=self.cfg.local_addr, replica_endpoint=self.replica_endpoint,
        )

    def _spawn(self, local_rank: int, env: dict[str, str], attempt: int):
        folder = self.workers.log_folder(self.job_id, self.cfg.node_id, attempt, local_rank)
        try:
            worker = self.workers.spawn(local_rank, self.cfg.command, env, folder)
        except OSError as exc:
            log.error("cannot start worker %d (%s): %s", local_rank, " ".join(self.cfg.command), exc)
            self._to_controller(WorkerExited(self.cfg.node_id, self.generation, local_rank, 0, 127, str(exc)))
            return None
        log.info("worker %d started (pid %d)%s", local_rank, worker.pid, f"; logs in {folder}" if folder else "")
        return worker

    def _worker_statuses(self, now: float) -> dict[str, WorkerSummary]:
        """Each worker's latest status and its age: a stopped or wedged worker's age keeps growing."""
        return {str(local): WorkerSummary(rank=st.rank, step=st.step, activity=st.activity, age=round(now - t, 3),
                                          room=st.room, pid=self._pid(local) or 0)
                for local, (st, t) in self._statuses.items()}

    def _pid(self, local_rank: int) -> int | None:
        worker = self.workers.get(local_rank)
        return None if worker is None else worker.pid

    def _own_ranks(self) -> list[int]:
        """The global ranks of this node's workers in the current generation ([] before one, or on a spare)."""
        reconf = self.latest_reconfigure
        if reconf is None or reconf.node_rank < 0:
            return []
        return list(range(reconf.node_rank * self.cfg.nproc, (reconf.node_rank + 1) * self.cfg.nproc))

    def _to_workers(self, msg) -> None:
        for identity in self._peers:
            self.worker_ch.send(msg, to=identity)

    def _on_worker(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, SnapshotFiles) and self._saved(msg):
            return
        if isinstance(msg, FORWARDED):
            self._note_step_made(incoming.sender, msg)
            self._to_controller(msg)
        elif isinstance(msg, WorkerStatus):
            self._statuses[msg.local_rank] = (msg, time.monotonic())
        elif isinstance(msg, Hello):
            identity = incoming.sender
            self._peers[identity] = msg.local_rank
            worker = self.workers.get(msg.local_rank)
            if worker is not None and worker.identity is None:
                worker.identity = identity
            log.info("worker %d said hello (pid %d)", msg.local_rank, msg.pid)
            if self.shutdown is not None and self.shutdown.phase is StopPhase.STOP:
                self.worker_ch.send(Stop(self.shutdown.reason, self.shutdown.code), to=identity)
            elif self.latest_reconfigure is not None:
                self.worker_ch.send(self.latest_reconfigure, to=identity)
            elif self.standby is not None:
                self.worker_ch.send(self.standby, to=identity)
        else:
            self.worker_ch.drop_unexpected(incoming)

    def _note_step_made(self, sender: bytes, msg) -> None:
        """The newest step a worker made, for its exit's report: the controller's own idea of it lags where the
        worker trained on in a generation it has replaced (its Progress then dropped as stale)."""
        local_rank = self._peers.get(sender)
        reconf = self.latest_reconfigure
        if local_rank is None:
            return
        if isinstance(msg, Progress):
            self._made[local_rank] = msg.step
        elif isinstance(msg, WorkerReady) and reconf is not None and reconf.generation == msg.generation:
            self._made[local_rank] = reconf.restore_step  # (NO_RANK for a fresh start: none made yet)

    def _on_events(self) -> None:
        for event in self.events.drain():
            if isinstance(event, WorkerDone):
                self._on_worker_done(event)
            elif isinstance(event, RelabelChecked):
                self.replica.relabel_checked(event)
            elif isinstance(event, FilesDone):  # (a save's or a resume's files, written or read on a thread)
                self._to_controller(self.replica.files_done(event))

    def _on_worker_done(self, done: WorkerDone) -> None:
        if self.held_exits.retired_exit(done.pid):
            return
        worker = self.workers.mark_done(done)
        if worker is None:
            return
        if worker.identity is not None:
            self._peers.pop(worker.identity, None)
        output = worker.output
        failed = output is not None and done.exitcode != 0
        tail = output.tail(lines=1000) if failed else ""
        raised = crash_exception(tail, done.exitcode)
        last = failure_detail(tail, raised) if failed else ""
        why = f" ({last})" if last else ""
        sent = False  # by this agent, as it stops
        if self.shutdown is not None and not raised:  # not its last line where it obeyed, or its agent ended it
            if done.exitcode == self.shutdown.code:
                why = " (as the job stops)"
            elif done.exitcode in SENT_BY_PHASE[self.shutdown.phase]:
                why, sent = " (by its agent, as it stops)", True
        oom = done.exitcode == -signal.SIGKILL and not sent and self.oom_kills.claim(time.monotonic())
        log.log(logging.INFO if done.exitcode == 0 or self.shutdown else logging.WARNING,
                "worker %d (pid %d) exited: %s%s", done.local_rank, done.pid, describe_exit(done.exitcode, oom),
                why)
        exited = WorkerExited(self.cfg.node_id, self.generation, done.local_rank, done.pid, done.exitcode,
                              last or describe_exit(done.exitcode),
                              stderr_tail=output.tail() if failed else "",
                              log_path=output.log_path if output is not None else "",
                              raised=raised, oom_killed=oom, step=self._made.pop(done.local_rank, NO_RANK))
        if not self._hold_exit(exited):
            self._to_controller(exited)
