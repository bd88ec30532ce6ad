"""The agent's side of its workers: spawning them with their environment, what they send (forwarded, statuses,
hellos), what is sent to them, and the report of each one's exit.

A part that the agent composes: it owns who said Hello, their latest statuses, the newest step each made, and the
OOM killer's count; it is handed the worker group, their socket, the way to the controller and the node's place.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

from .agent_config import AgentConfig
from dpcommon.channel import Channel, Incoming
from dpcommon.exit_wording import describe_exit
from .oom import OomKills
from .output import crash_exception, failure_detail
from .placement import Placement
from dpcommon.protocol import (
    NO_RANK, Diverged, Hello, PeerError, Progress, RankFinished, Reconfigure, RestoreFailed, SnapshotFiles,
    Standby, Stop, ToController, ToWorker, WorkerExited, WorkerReady, WorkerStatus, WorkerSummary,
)
from .shutdown import SENT_BY_PHASE, Shutdown
from .workers import Worker, WorkerDone, WorkerGroup, worker_env

log = logging.getLogger("dpagent")
FORWARDED = (Progress, WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged, SnapshotFiles)  # relayed on


class WorkerLink:
    def __init__(self, cfg: AgentConfig, workers: WorkerGroup, channel: Channel,
                 to_controller: Callable[[ToController], None], place: Placement, *,
                 worker_endpoint: str, replica_endpoint: str) -> None:
        self.cfg = cfg
        self.workers = workers
        self.channel = channel  # the workers' socket (ROUTER)
        self.to_controller = to_controller
        self.place = place  # read only
        self.worker_endpoint = worker_endpoint
        self.replica_endpoint = replica_endpoint
        self.peers: dict[bytes, int] = {}  # worker identity -> local rank, once it said Hello
        self.oom_kills = OomKills()  # its workers' memory cgroup's count: whether a SIGKILL was the OOM killer
        self._statuses: dict[int, tuple[WorkerStatus, float]] = {}  # local rank -> (latest status, when it came)
        self._made: dict[int, int] = {}  # local rank -> the newest step its worker made or restored (WorkerExited.step)

    def base_env(self, local_rank: int, role: str) -> dict[str, str]:
        return worker_env(
            self.cfg.env, node_id=self.cfg.node_id, endpoint=self.worker_endpoint, token=self.cfg.token,
            job_id=self.place.job_id, role=role, nproc=self.cfg.nproc, local_rank=local_rank,
            local_addr=self.cfg.local_addr, replica_endpoint=self.replica_endpoint,
        )

    def spawn(self, local_rank: int, env: dict[str, str], attempt: int) -> Worker | None:
        """Start a worker; None where it cannot start (the controller is told it exited 127)."""
        folder = self.workers.log_folder(self.place.job_id, self.cfg.node_id, attempt, local_rank)
        try:
            worker = self.workers.spawn(local_rank, self.cfg.command, env, folder)
        except OSError as exc:
            log.error("cannot start worker %d (%s): %s", local_rank, " ".join(self.cfg.command), exc)
            self.to_controller(WorkerExited(self.cfg.node_id, self.place.generation, local_rank, 0, 127, str(exc)))
            return None
        log.info("worker %d started (pid %d)%s", local_rank, worker.pid, f"; logs in {folder}" if folder else "")
        return worker

    def forget(self, worker: Worker) -> None:
        """A worker replaced by a restart: what it says from now on is not heard as a peer's, nor its last status
        as its successor's."""
        if worker.identity is not None:
            self.peers.pop(worker.identity, None)
        self._statuses.pop(worker.local_rank, None)

    def statuses(self, now: float) -> dict[str, WorkerSummary]:
        """Each worker's latest status and its age: a stopped or wedged worker's age keeps growing."""
        return {str(local): WorkerSummary(rank=st.rank, step=st.step, activity=st.activity, age=round(now - t, 3),
                                          room=st.room, pid=self._pid(local) or 0)
                for local, (st, t) in self._statuses.items()}

    def _pid(self, local_rank: int) -> int | None:
        worker = self.workers.get(local_rank)
        return None if worker is None else worker.pid

    def to_workers(self, msg: ToWorker) -> None:
        for identity in self.peers:
            self.channel.send(msg, to=identity)

    def on_message(self, incoming: Incoming, greeting: Stop | Reconfigure | Standby | None) -> None:
        """A worker's message; `greeting`: what a worker that says Hello is sent (what the others were told last)."""
        msg = incoming.msg
        if isinstance(msg, FORWARDED):
            self._note_step_made(incoming.sender, msg)
            self.to_controller(msg)
        elif isinstance(msg, WorkerStatus):
            self._statuses[msg.local_rank] = (msg, time.monotonic())
        elif isinstance(msg, Hello) and incoming.sender is not None:
            identity = incoming.sender
            self.peers[identity] = msg.local_rank
            worker = self.workers.get(msg.local_rank)
            if worker is not None and worker.identity is None:
                worker.identity = identity
            log.info("worker %d said hello (pid %d)", msg.local_rank, msg.pid)
            if greeting is not None:
                self.channel.send(greeting, to=identity)
        else:
            self.channel.drop_unexpected(incoming)

    def _note_step_made(self, sender: bytes | None, msg: object) -> None:
        """The newest step a worker made, for its exit's report: the controller's own idea of it lags where the
        worker trained on in a generation it has replaced (its Progress then dropped as stale)."""
        local_rank = self.peers.get(sender) if sender is not None else None
        reconf = self.place.latest
        if local_rank is None:
            return
        if isinstance(msg, Progress):
            self._made[local_rank] = msg.step
        elif isinstance(msg, WorkerReady) and reconf is not None and reconf.generation == msg.generation:
            self._made[local_rank] = reconf.restore_step  # (NO_RANK for a fresh start: none made yet)

    def exit_report(self, done: WorkerDone, shutdown: Shutdown | None) -> WorkerExited | None:
        """What the controller is told of a worker's exit (None: not one of this group's), worded by the
        shutdown under way, if any (an exit it asked for or caused is no failure of the worker's own)."""
        worker = self.workers.mark_done(done)
        if worker is None:
            return None
        self.forget(worker)
        output = worker.output
        failed = output is not None and done.exitcode != 0
        tail = output.tail(lines=1000) if output is not None and failed else ""
        raised = crash_exception(tail, done.exitcode)
        last = failure_detail(tail, raised) if failed else ""
        why = f" ({last})" if last else ""
        sent = False  # by this agent, as it stops
        if shutdown is not None and not raised:  # not its last line where it obeyed, or its agent ended it
            if done.exitcode == shutdown.code:
                why = " (as the job stops)"
            elif done.exitcode in SENT_BY_PHASE[shutdown.phase]:
                why, sent = " (by its agent, as it stops)", True
        oom = done.exitcode == -signal.SIGKILL and not sent and self.oom_kills.claim(time.monotonic())
        log.log(logging.INFO if done.exitcode == 0 or shutdown else logging.WARNING,
                "worker %d (pid %d) exited: %s%s", done.local_rank, done.pid, describe_exit(done.exitcode, oom),
                why)
        return WorkerExited(self.cfg.node_id, self.place.generation, done.local_rank, done.pid, done.exitcode,
                            last or describe_exit(done.exitcode),
                            stderr_tail=output.tail() if output is not None and failed else "",
                            log_path=output.log_path if output is not None else "",
                            raised=raised, oom_killed=oom, step=self._made.pop(done.local_rank, NO_RANK))
