"""The node agent's event loop: sockets, timers and dispatch between the controller, workers and replica store.

Thin by design: it composes parts that own their state (worker_link.py talks with the workers that workers.py
spawns and watches, restart.py, shutdown.py, stop_signals.py), replica_server.py serves snapshots, fault_actions.py
injects; it alone writes the node's place in the job (placement.py), which the parts read.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import psutil
import zmq

from . import fault_actions
from .agent_config import AgentConfig as AgentConfig  # (re-exported: dpagent's command line names it here)
from dpcommon import traffic_class
from dpcommon.channel import Channel, Incoming, poll_ms
from .loop_events import EventPipe
from .liveness import Liveness
from .placement import Placement
from .process import descendants, reap_orphans, set_child_subreaper, signal_procs
from dpcommon.protocol import (
    NO_RANK, REFUSALS, Codec, Demote, Heartbeat, Hello, Inject, LoadSnapshots, Ping, Pong, Reconfigure, Register,
    SaveSnapshots, SnapshotFiles, Standby, Stop, ToController, Welcome,
)
from .replica_server import FilesDone, RelabelChecked, ReplicaServer
from dpcommon.replica_store import ReplicaStore
from .restart import RestartMode
from .shutdown import EXIT_CONTROLLER_LOST, EXIT_NO_CONTROLLER, EXIT_REFUSED, ShutdownSequence, StopPhase
from .stop_signals import StopSignals
from .worker_link import WorkerLink
from .workers import WorkerDone, WorkerGroup

log = logging.getLogger("dpagent")

IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux
REAP_EVERY = 10.0
WELCOME_NOTE_EVERY_S = 30.0  # a node still not welcomed says so this often (a quarter of a shorter timeout)


def _remove_empty_run_dirs(run_dir: Path) -> None:
    """Remove this agent's run dir, and the dprun-* folder above it (a standalone job's nodes' folders), where
    nothing else is left in them: the last agent of a killed dprun leaves no folder behind."""
    folders = [run_dir, run_dir.parent] if run_dir.parent.name.startswith("dprun-") else [run_dir]
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (another agent's, a user's file) or gone already
            return


class AgentError(RuntimeError):
    """A setup problem worth one clear line (bad run dir, unusable address)."""


class Agent:
    """Composes its parts (built as its sockets open): the worker link, restart mode, the shutdown sequence and
    the stop signals; it alone writes the node's place in the job (`place`), which they read."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.codec = Codec(cfg.token)
        self.place = Placement(cfg.nproc, "spare" if cfg.spare else "active")
        self.liveness: Liveness | None = None
        self.signals = StopSignals(watch_launcher=bool(cfg.launcher))
        self._writing_own: set[int] = set()  # local ranks asked to write their own copies in the job's save
        self._owns_run_dir = False
        self.ctx: zmq.Context | None = None

    # ------------------------------------------------------------------ setup / teardown

    def _open(self) -> None:
        cfg = self.cfg
        if cfg.run_dir:
            self.run_dir = Path(cfg.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix="dpagent-"))
            self._owns_run_dir = True
        self.ipc_path = self.run_dir / f"agent-{cfg.node_id}.sock"
        if len(str(self.ipc_path)) > IPC_PATH_MAX:
            raise AgentError(f"ipc socket path too long ({len(str(self.ipc_path))} > {IPC_PATH_MAX}): {self.ipc_path}")
        self.worker_endpoint = f"ipc://{self.ipc_path}"

        self.ctx = zmq.Context()
        self.events = EventPipe(self.ctx)
        self.control = self._channel(zmq.DEALER, "control")
        self.control.sock.setsockopt(zmq.IDENTITY, cfg.node_id.encode())
        self.control.sock.connect(cfg.controller)
        self.worker_ch = self._channel(zmq.ROUTER, "workers")
        self.worker_ch.sock.bind(self.worker_endpoint)
        self.replica_ch = self._channel(zmq.ROUTER, "replica", zero_copy=True)
        traffic_class.mark(self.replica_ch.sock)  # before its bind: the connections it accepts are marked
        try:
            port = self.replica_ch.sock.bind_to_random_port(f"tcp://{cfg.local_addr}")
        except zmq.ZMQError as exc:
            raise AgentError(f"cannot bind the replica store on {cfg.local_addr}: {exc}") from None
        host = cfg.local_addr if cfg.local_addr not in ("0.0.0.0", "*") else socket.gethostname()
        self.replica_endpoint = f"tcp://{host}:{port}"

        self.workers = WorkerGroup(self.events, cfg.output)
        self.replica = ReplicaServer(self.replica_ch, ReplicaStore(), cfg.node_id, self._to_controller, self.events,
                                     local_pids=self.workers.pids)
        self.link = WorkerLink(cfg, self.workers, self.worker_ch, self._to_controller, self.place,
                               worker_endpoint=self.worker_endpoint, replica_endpoint=self.replica_endpoint)
        self.restart = RestartMode(cfg, self.link, self._to_controller, self.place)
        self.stopping = ShutdownSequence(cfg, self.workers, self.link.to_workers, self._to_controller,
                                         self.replica.store, self.place, self.signals)
        self.poller = zmq.Poller()
        for sock in (self.control.sock, self.events.wake, self.worker_ch.sock, self.replica_ch.sock):
            self.poller.register(sock, zmq.POLLIN)
        self._wakeup_fd = self.signals.install()
        if self._wakeup_fd is not None:
            self.poller.register(self._wakeup_fd, zmq.POLLIN)
        set_child_subreaper()

    def _abandon_open(self) -> None:
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _channel(self, kind: int, name: str, zero_copy: bool = False) -> Channel:
        assert self.ctx is not None  # (made in _open first)
        sock = self.ctx.socket(kind)
        sock.linger = 0
        return Channel(sock, self.codec, name, zero_copy=zero_copy, on_drop=self._on_drop)

    def _close(self, exit_code: int) -> None:
        launcher_died = self.signals.launcher_died()
        self.signals.restore(launcher_died)
        leftovers = descendants()
        if leftovers:  # a worker's children, orphans inherited as subreaper
            signal_procs(leftovers, signal.SIGKILL)
            psutil.wait_procs(leftovers, timeout=2.0)
        self.workers.drain_output(1.0)  # their last lines reach the console and the log files
        lost = exit_code == EXIT_CONTROLLER_LOST
        self.control.sock.close(linger=0 if lost else 500)  # let the last reports out
        self.worker_ch.sock.close(linger=0)
        self.replica_ch.sock.close(linger=0)
        self.replica.close()
        self.events.close()
        assert self.ctx is not None
        term = threading.Thread(target=self.ctx.term, daemon=True)
        term.start()
        term.join(timeout=2.0)
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:
            self.ipc_path.unlink(missing_ok=True)
            if launcher_died:  # its dprun died first (kill -9): the run dir it made is left to us
                _remove_empty_run_dirs(self.run_dir)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        try:
            self._open()
        except BaseException:
            self._abandon_open()
            raise
        try:
            self.started = time.monotonic()
            self._next_reap = self.started + REAP_EVERY
            self._welcome_note_every = min(WELCOME_NOTE_EVERY_S, self.cfg.register_timeout / 4)
            self._welcome_note_at = self.started + self._welcome_note_every
            log.info(
                "registering with %s (nproc %d%s); replica store %s; workers %s",
                self.cfg.controller, self.cfg.nproc, ", spare" if self.cfg.spare else "",
                self.replica_endpoint, self.worker_endpoint,
            )
            self._to_controller(Register(
                self.cfg.node_id, socket.gethostname(), os.getpid(), self.cfg.nproc, self.cfg.spare,
                self.cfg.node_rank, self.replica_endpoint, self.cfg.terms,
            ))
            while self.stopping.exit_code is None:
                ready = dict(self.poller.poll(self._poll_timeout_ms()))
                if self.control.sock in ready:
                    for incoming in self.control.recv_ready():
                        self._on_control(incoming)
                if self.events.wake in ready:
                    self._on_events()
                if self._wakeup_fd is not None and self._wakeup_fd in ready:
                    self.signals.drain_wakeup()
                if self.worker_ch.sock in ready:
                    for incoming in self.worker_ch.recv_ready():
                        self._on_worker(incoming)
                if self.replica_ch.sock in ready:
                    for incoming in self.replica_ch.recv_ready():
                        self.replica.handle(incoming)
                self._tick(time.monotonic())
        finally:
            if self.stopping.exit_code is None:
                self.stopping.exit_code = 1
            self.workers.signal_all(signal.SIGKILL)
            self._close(self.stopping.exit_code)
        return self.stopping.exit_code

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        stopping = self.stopping
        due = [self._next_reap]
        if (held_due := self.restart.held_exits.next_deadline()) is not None:
            due.append(held_due)
        if (offers_due := self.replica.next_deadline()) is not None:
            due.append(offers_due)
        if stopping.shutdown is not None:
            due.append(stopping.shutdown.deadline)
        if stopping.stop_wait is not None and not stopping.exiting():
            due.append(stopping.stop_wait)
        if not stopping.exiting():  # heartbeats due, or the Welcome still awaited
            due.append(self.liveness.next_deadline() if self.liveness is not None
                       else min(self._welcome_note_at, self.started + self.cfg.register_timeout))
        return poll_ms(min(due), now)

    def _tick(self, now: float) -> None:
        stopping, signals = self.stopping, self.signals
        if self.liveness is not None:
            self.liveness.turned(now)
        if signals.signalled and not stopping.exiting():
            stopping.stop_signalled(now, self.liveness)
        elif signals.count and stopping.shutdown is not None and stopping.shutdown.phase is StopPhase.SAVE:
            stopping.signal_while_saving(now)
        if not stopping.exiting():  # (a node whose store stays heartbeats while its workers stop)
            self._tick_running(now)
        if stopping.shutdown is None:
            self.restart.release_held(now)
        if stopping.shutdown is not None:
            stopping.advance(now)
        self.replica.tick(now)
        self.link.oom_kills.sample(now)
        if now >= self._next_reap:
            reap_orphans(self.workers.pids())
            self._next_reap = now + REAP_EVERY

    def _tick_running(self, now: float) -> None:
        """Its launcher's death, the controller's silence, heartbeats; or, before the Welcome, giving up on it."""
        if self.signals.launcher_gone and self.cfg.launcher == "member":
            self.stopping.leave(f"the dprun that ran it (pid {self.signals.launcher_pid}) died")
        elif self.signals.launcher_gone:
            self.stopping.lose_controller(f"the dprun that ran it (pid {self.signals.launcher_pid}) died")
        elif self.liveness is not None:
            if self.liveness.lost(now):
                silent = self.liveness.silent_for(now)
                self.stopping.lose_controller(f"nothing from {self.cfg.controller} for {silent:.1f}s "
                                              f"(timeout {self.liveness.timeout:.1f}s)")
            elif self.liveness.beat_due(now):
                self._to_controller(Heartbeat(self.cfg.node_id, self.place.generation, self.link.statuses(now)))
                self.liveness.beat_sent(now)
        elif self.control.refused:
            log.error("%s refused this node: %s; exiting %d", self.cfg.controller,
                      REFUSALS[self.control.refused], EXIT_REFUSED)
            self.stopping.begin(EXIT_REFUSED, "refused", StopPhase.KILL)
        elif now - self.started >= self.cfg.register_timeout:
            log.error("no Welcome from %s within %.0fs; exiting %d",
                      self.cfg.controller, self.cfg.register_timeout, EXIT_NO_CONTROLLER)
            self.stopping.begin(EXIT_NO_CONTROLLER, "no welcome", StopPhase.KILL)
        elif now >= self._welcome_note_at:
            self._welcome_note_at = now + self._welcome_note_every
            log.warning("no Welcome from %s yet after %.3gs (is the dprun that runs the controller up there, "
                        "with this job's token?); giving up in %.3gs", self.cfg.controller, now - self.started,
                        self.cfg.register_timeout - (now - self.started))

    # ------------------------------------------------------------------ controller

    def _to_controller(self, msg: ToController) -> None:
        self.control.send(msg)

    def _on_control(self, incoming: Incoming) -> None:
        msg = incoming.msg
        now = time.monotonic()
        place = self.place
        if self.liveness is not None:
            self.liveness.heard(now)
        if isinstance(msg, Ping):
            self._to_controller(Pong(self.cfg.node_id, msg.seq))
        elif isinstance(msg, Welcome):
            self._on_welcome(msg, now)
        elif self.stopping.retired and isinstance(msg, (Reconfigure, Standby, Inject, Demote)):
            self.control.drop_unexpected(incoming)
        elif isinstance(msg, Reconfigure):
            place.generation, place.role, place.latest = msg.generation, "active", msg
            if msg.restart_workers:
                self.restart.restart_workers(msg)
                return
            if msg.restore_step >= 0:  # its workers will hold that step: peers' offers of it can wait for it
                self.replica.expect_local(msg.restore_step, now)
            log.info("reconfigure: generation %d, node rank %d, restore step %d%s; relaying to %d worker(s)",
                     msg.generation, msg.node_rank, msg.restore_step,
                     f" ({msg.reason})" if msg.reason else "", len(self.link.peers))
            self.link.to_workers(msg)
        elif isinstance(msg, Standby):
            if place.latest is None:  # still a spare: its workers make room for a restore
                place.standby = msg
                self.link.to_workers(msg)
        elif isinstance(msg, Demote):  # out of the layout, alive: a spare again, its store kept
            attempt = place.generation + 1
            place.generation, place.role, place.latest, place.standby = NO_RANK, "spare", None, None
            self.restart.respawn_spares(msg, attempt)
        elif isinstance(msg, Stop):
            self.stopping.begin(msg.exit_code, f"stop from controller: {msg.reason}", StopPhase.STOP, msg)
        elif isinstance(msg, SaveSnapshots) and msg.background:  # written on a thread; training goes on
            self.replica.files(msg)
        elif isinstance(msg, SaveSnapshots):  # the job stops (its Stop follows); its state outlives it
            self.stopping.job_stopping = True
            if msg.local:  # the workers write their own copies
                asked = {rank % self.cfg.nproc for rank in msg.ranks if rank in place.own_ranks()}
                self._writing_own |= asked
                self.workers.thaw(asked)
                self.link.to_workers(msg)
            else:  # training stops here (workers that trained on would move past the copies asked); the files
                # are written on a thread, the workers still stopped: copies here may refer to their buffers (dedup)
                self.workers.freeze(spare=self._writing_own)
                self.replica.files(msg, pause=self.workers.paused)
        elif isinstance(msg, LoadSnapshots):  # a resumed job's files read on a thread, then into the store
            self.replica.files(msg)
        elif isinstance(msg, Inject) and msg.kind == "corrupt-replicas":
            log.warning("injected fault: corrupt-replicas (%d snapshots damaged)", self.replica.store.corrupt_all())
        elif isinstance(msg, Inject):
            fault_actions.inject(msg.kind, msg.local_rank, self.workers)
        else:
            self.control.drop_unexpected(incoming)

    def _on_welcome(self, msg: Welcome, now: float) -> None:
        self.liveness = Liveness(msg.heartbeat_interval, msg.heartbeat_timeout, now)
        place = self.place
        if place.welcome is not None:
            log.info("welcomed again as %s; workers already running", msg.role)
            place.welcome = msg
            return
        place.welcome, place.role, place.job_id = msg, msg.role, msg.job_id
        place.restart_mode = not msg.prespawn
        log.info("welcomed as %s in job %s (heartbeat %.2fs, timeout %.1fs); %s",
                 msg.role, msg.job_id, msg.heartbeat_interval, msg.heartbeat_timeout,
                 f"spawning {self.cfg.nproc} worker(s)" if msg.prespawn
                 else "restart mode: workers start with their ranks on Reconfigure")
        if self.stopping.shutdown is not None or not msg.prespawn:
            return
        for local_rank in range(self.cfg.nproc):
            self.link.spawn(local_rank, self.link.base_env(local_rank, msg.role), attempt=0)

    # ------------------------------------------------------------------ workers

    def _on_worker(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, SnapshotFiles) and self.stopping.saved(msg):
            return
        self.link.on_message(incoming, self._greeting() if isinstance(msg, Hello) else None)

    def _greeting(self) -> Stop | Reconfigure | Standby | None:
        """What a worker that says Hello is told: what its peers were told last."""
        stop = self.stopping.greeting()
        if stop is not None:
            return stop
        return self.place.latest if self.place.latest is not None else self.place.standby

    def _on_events(self) -> None:
        for event in self.events.drain():
            if isinstance(event, WorkerDone):
                self._on_worker_done(event)
            elif isinstance(event, RelabelChecked):
                self.replica.relabel_checked(event)
            elif isinstance(event, FilesDone):  # (a save's or a resume's files, written or read on a thread)
                self._to_controller(self.replica.files_done(event))

    def _on_worker_done(self, done: WorkerDone) -> None:
        if self.restart.held_exits.retired_exit(done.pid):
            return
        exited = self.link.exit_report(done, self.stopping.shutdown)
        if exited is None:
            return
        # restart mode holds a crash back while the node runs (a Reconfigure may follow: a peer's doing)
        if self.stopping.shutdown is None and self.restart.hold_exit(exited):
            return
        self._to_controller(exited)

    # ------------------------------------------------------------------ diagnostics

    def _on_drop(self, channel: Channel, reason: str) -> None:
        total = sum(c.dropped for c in (self.control, self.worker_ch, self.replica_ch) if c is not None)
        level = logging.WARNING if channel.dropped == 1 else logging.DEBUG
        log.log(level, "dropped a message on the %s socket: %s (%d dropped in all)", channel.name, reason, total)
