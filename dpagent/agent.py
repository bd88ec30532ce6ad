"""The node agent's event loop: sockets, timers and dispatch between the controller, workers and replica store.

Thin by design: workers.py spawns and watches workers (worker_link.py talks with them), replica_server.py serves
snapshots, fault_actions.py injects.
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
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import zmq

from . import fault_actions
from .channel import Channel, Incoming, poll_ms
from .loop_events import EventPipe
from .liveness import Liveness
from .oom import OomKills
from .process import LAUNCHER_GONE, LAUNCHER_STOP, descendants, reap_orphans, set_child_subreaper, signal_procs
from .protocol import (
    NO_RANK, REFUSALS, Codec, Heartbeat, Inject, JobTerms, LoadSnapshots, Ping, Pong, Reconfigure, Register,
    SaveSnapshots, Standby, Stop, Welcome,
)
from .output import OutputSpec
from .replica_server import ReplicaServer
from .replica_store import ReplicaStore
from .restart import HeldExits, RestartMode
from .shutdown import (
    EXIT_CONTROLLER_LOST, EXIT_NO_CONTROLLER, EXIT_REFUSED, Shutdown, ShutdownSequence, StopPhase,
)
from .worker_link import WorkerLink
from .workers import WorkerGroup

log = logging.getLogger("dpagent")

IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux
REAP_EVERY = 10.0
WELCOME_NOTE_EVERY_S = 30.0  # a node still not welcomed says so this often (a quarter of a shorter timeout)
# a stop signal from outside within this long after the one its launcher passed on is the same request: Slurm,
# ending a step, signals the launcher and the agent alike, in either order (a second request stops the node now)
SAME_STOP_S = 2.0


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


@dataclass
class AgentConfig:
    controller: str
    node_id: str
    token: str
    command: list[str]
    nproc: int = 1
    spare: bool = False
    node_rank: int = NO_RANK
    local_addr: str = "127.0.0.1"
    run_dir: str | None = None
    stop_grace: float = 3.0  # after Stop is relayed, before SIGTERM
    term_grace: float = 2.0  # after SIGTERM, before SIGKILL
    save_timeout: float = 300.0  # the controller lost: how long the workers may take to write their snapshots
    register_timeout: float = 300.0  # no Welcome by then: exit 4
    output: OutputSpec = field(default_factory=OutputSpec)  # log files, console filter (torchrun's -r/-t)
    max_restarts: int = 3  # restart mode: for TORCHELASTIC_MAX_RESTARTS
    terms: JobTerms = field(default_factory=JobTerms)  # Register.terms: what its launcher was told of the job
    # what the death of the dprun that ran it (LAUNCHER_GONE) means: "controller", the controller's (save at
    # once); "member", this node leaves the job (Leaving; its workers killed); "": none is signalled
    launcher: str = ""
    env: dict = field(default_factory=lambda: dict(os.environ))


class Agent(RestartMode, ShutdownSequence, WorkerLink):
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.codec = Codec(cfg.token)
        self.generation = NO_RANK
        self.job_id = ""
        self.role = "spare" if cfg.spare else "active"
        self.welcome: Welcome | None = None
        self.liveness: Liveness | None = None
        self.latest_reconfigure: Reconfigure | None = None
        self.standby: Standby | None = None  # a spare's: the snapshot sizes its workers make room for
        self.shutdown: Shutdown | None = None
        self.retired = False  # its workers stopped by Stop(keep_store): only its replica store serves
        self.exit_code: int | None = None
        self._peers: dict[bytes, int] = {}  # worker identity -> local rank, once it said Hello
        self.oom_kills = OomKills()  # its workers' memory cgroup's count: whether a SIGKILL was the OOM killer
        self._statuses: dict[int, tuple] = {}  # local rank -> (latest WorkerStatus, when it came)
        self._made: dict[int, int] = {}  # local rank -> the newest step its worker made or restored (WorkerExited.step)
        self._signalled = 0
        self._signals = 0  # how many (a second one cuts a save short)
        self._relayed_at: float | None = None  # its launcher passed on a stop signal, this agent's own yet to come
        self._stop_wait: float | None = None  # a first stop signal: until then the controller may stop the job
        self._job_stopping = False  # the controller asked for the job's save: its Stop follows
        self._writing_own: set[int] = set()  # local ranks asked to write their own copies in that save
        self._launcher_pid = os.getppid()
        self._launcher_gone = False  # its parent-death signal came (cfg.launcher says what that means)
        self._old_handlers: dict = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None  # signals wake the loop (main thread only)
        self._owns_run_dir = False
        self.held_exits = HeldExits()  # restart mode: crashes held back, replaced workers' exits

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
        try:
            port = self.replica_ch.sock.bind_to_random_port(f"tcp://{cfg.local_addr}")
        except zmq.ZMQError as exc:
            raise AgentError(f"cannot bind the replica store on {cfg.local_addr}: {exc}") from None
        host = cfg.local_addr if cfg.local_addr not in ("0.0.0.0", "*") else socket.gethostname()
        self.replica_endpoint = f"tcp://{host}:{port}"

        self.workers = WorkerGroup(self.events, cfg.output)
        self.replica = ReplicaServer(self.replica_ch, ReplicaStore(), cfg.node_id, self._to_controller, self.events,
                                     local_pids=self.workers.pids)
        self.poller = zmq.Poller()
        for sock in (self.control.sock, self.events.wake, self.worker_ch.sock, self.replica_ch.sock):
            self.poller.register(sock, zmq.POLLIN)
        self._install_signals()
        set_child_subreaper()

    def _abandon_open(self) -> None:
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _channel(self, kind: int, name: str, zero_copy: bool = False) -> Channel:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        return Channel(sock, self.codec, name, zero_copy=zero_copy, on_drop=self._on_drop)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._wakeup = socket.socketpair()
        for s in self._wakeup:
            s.setblocking(False)
        signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)
        self.poller.register(self._wakeup[0].fileno(), zmq.POLLIN)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._old_handlers[LAUNCHER_STOP] = signal.signal(LAUNCHER_STOP, self._on_launcher_stop)
        if self.cfg.launcher:
            self._old_handlers[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, self._on_launcher_gone)

    def _on_signal(self, signum, _frame) -> None:
        self._signalled = signum
        relayed, self._relayed_at = self._relayed_at, None
        if relayed is not None and time.monotonic() - relayed < SAME_STOP_S:
            return  # Slurm's SIGTERM to every process of the step: its launcher's, passed on, came first
        self._signals += 1

    def _on_launcher_stop(self, _signum, _frame) -> None:
        if not self._signals:
            self._signalled, self._signals, self._relayed_at = signal.SIGTERM, 1, time.monotonic()

    def _on_launcher_gone(self, _signum, _frame) -> None:
        self._launcher_gone = True

    def _close(self) -> None:
        launcher_died = self._launcher_gone or os.getppid() != self._launcher_pid  # (its signal may come first)
        for sig, handler in self._old_handlers.items():
            # a launcher killed whole sends its parent-death signal once per thread it ran: one may still come,
            # and its default action would end this agent before it has closed
            signal.signal(sig, signal.SIG_IGN if sig == LAUNCHER_GONE and launcher_died else handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for s in self._wakeup:
                s.close()
        leftovers = descendants()
        if leftovers:  # a worker's children, orphans inherited as subreaper
            signal_procs(leftovers, signal.SIGKILL)
            psutil.wait_procs(leftovers, timeout=2.0)
        self.workers.drain_output(1.0)  # their last lines reach the console and the log files
        lost = self.exit_code == EXIT_CONTROLLER_LOST
        self.control.sock.close(linger=0 if lost else 500)  # let the last reports out
        self.worker_ch.sock.close(linger=0)
        self.replica_ch.sock.close(linger=0)
        self.replica.close()
        self.events.close()
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
            while self.exit_code is None:
                ready = dict(self.poller.poll(self._poll_timeout_ms()))
                if self.control.sock in ready:
                    for incoming in self.control.recv_ready():
                        self._on_control(incoming)
                if self.events.wake in ready:
                    self._on_events()
                if self._wakeup is not None and self._wakeup[0].fileno() in ready:
                    self._drain_wakeup()
                if self.worker_ch.sock in ready:
                    for incoming in self.worker_ch.recv_ready():
                        self._on_worker(incoming)
                if self.replica_ch.sock in ready:
                    for incoming in self.replica_ch.recv_ready():
                        self.replica.handle(incoming)
                self._tick(time.monotonic())
        finally:
            if self.exit_code is None:
                self.exit_code = 1
            self.workers.signal_all(signal.SIGKILL)
            self._close()
        return self.exit_code

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        due = [self._next_reap]
        if (held_due := self.held_exits.next_deadline()) is not None:
            due.append(held_due)
        if (offers_due := self.replica.next_deadline()) is not None:
            due.append(offers_due)
        if self.shutdown is not None:
            due.append(self.shutdown.deadline)
        if self._stop_wait is not None and not self._exiting():
            due.append(self._stop_wait)
        if not self._exiting():  # heartbeats due, or the Welcome still awaited
            due.append(self.liveness.next_deadline() if self.liveness is not None
                       else min(self._welcome_note_at, self.started + self.cfg.register_timeout))
        return poll_ms(min(due), now)

    def _tick(self, now: float) -> None:
        if self.liveness is not None:
            self.liveness.turned(now)
        if self._signalled and not self._exiting():
            self._stop_signalled(now)
        elif self._signals and self.shutdown is not None and self.shutdown.phase is StopPhase.SAVE:
            self._signal_while_saving(now)
        if not self._exiting():  # (a node whose store stays heartbeats while its workers stop)
            if self._launcher_gone and self.cfg.launcher == "member":
                self._leave(f"the dprun that ran it (pid {self._launcher_pid}) died")
            elif self._launcher_gone:
                self._lose_controller(f"the dprun that ran it (pid {self._launcher_pid}) died")
            elif self.liveness is not None:
                if self.liveness.lost(now):
                    silent = self.liveness.silent_for(now)
                    self._lose_controller(f"nothing from {self.cfg.controller} for {silent:.1f}s "
                                          f"(timeout {self.liveness.timeout:.1f}s)")
                elif self.liveness.beat_due(now):
                    self._to_controller(Heartbeat(self.cfg.node_id, self.generation, self._worker_statuses(now)))
                    self.liveness.beat_sent(now)
            elif self.control.refused:
                log.error("%s refused this node: %s; exiting %d", self.cfg.controller,
                          REFUSALS[self.control.refused], EXIT_REFUSED)
                self._begin_shutdown(EXIT_REFUSED, "refused", StopPhase.KILL)
            elif now - self.started >= self.cfg.register_timeout:
                log.error("no Welcome from %s within %.0fs; exiting %d",
                          self.cfg.controller, self.cfg.register_timeout, EXIT_NO_CONTROLLER)
                self._begin_shutdown(EXIT_NO_CONTROLLER, "no welcome", StopPhase.KILL)
            elif now >= self._welcome_note_at:
                self._welcome_note_at = now + self._welcome_note_every
                log.warning("no Welcome from %s yet after %.3gs (is the dprun that runs the controller up there, "
                            "with this job's token?); giving up in %.3gs", self.cfg.controller, now - self.started,
                            self.cfg.register_timeout - (now - self.started))
        if self.shutdown is None:
            self._release_held(now)
        if self.shutdown is not None:
            self._advance_shutdown(now)
        self.replica.tick(now)
        self.oom_kills.sample(now)
        if now >= self._next_reap:
            reap_orphans(self.workers.pids())
            self._next_reap = now + REAP_EVERY

    def _drain_wakeup(self) -> None:
        assert self._wakeup is not None  # (called when its socket is readable)
        try:
            while self._wakeup[0].recv(512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # ------------------------------------------------------------------ controller

    def _to_controller(self, msg) -> None:
        self.control.send(msg)

    def _on_control(self, incoming: Incoming) -> None:
        msg = incoming.msg
        now = time.monotonic()
        if self.liveness is not None:
            self.liveness.heard(now)
        if isinstance(msg, Ping):
            self._to_controller(Pong(self.cfg.node_id, msg.seq))
        elif isinstance(msg, Welcome):
            self._on_welcome(msg, now)
        elif self.retired and isinstance(msg, (Reconfigure, Standby, Inject)):
            self.control.drop_unexpected(incoming)
        elif isinstance(msg, Reconfigure):
            self.generation = msg.generation
            self.role = "active"
            self.latest_reconfigure = msg
            if msg.restart_workers:
                self._restart_workers(msg)
                return
            if msg.restore_step >= 0:  # its workers will hold that step: peers' offers of it can wait for it
                self.replica.expect_local(msg.restore_step, now)
            log.info("reconfigure: generation %d, node rank %d, restore step %d%s; relaying to %d worker(s)",
                     msg.generation, msg.node_rank, msg.restore_step,
                     f" ({msg.reason})" if msg.reason else "", len(self._peers))
            self._to_workers(msg)
        elif isinstance(msg, Standby):
            if self.latest_reconfigure is None:  # still a spare: its workers make room for a restore
                self.standby = msg
                self._to_workers(msg)
        elif isinstance(msg, Stop):
            self._begin_shutdown(msg.exit_code, f"stop from controller: {msg.reason}", StopPhase.STOP, msg)
        elif isinstance(msg, SaveSnapshots) and msg.background:  # written on a thread; training goes on
            self.replica.files(msg)
        elif isinstance(msg, SaveSnapshots):  # the job stops (its Stop follows); its state outlives it
            self._job_stopping = True
            if msg.local:  # the workers write their own copies
                asked = {rank % self.cfg.nproc for rank in msg.ranks if rank in self._own_ranks()}
                self._writing_own |= asked
                self.workers.thaw(asked)
                self._to_workers(msg)
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
        if self.welcome is not None:
            log.info("welcomed again as %s; workers already running", msg.role)
            self.welcome = msg
            return
        self.welcome, self.role, self.job_id = msg, msg.role, msg.job_id
        self.restart_mode = not msg.prespawn
        log.info("welcomed as %s in job %s (heartbeat %.2fs, timeout %.1fs); %s",
                 msg.role, msg.job_id, msg.heartbeat_interval, msg.heartbeat_timeout,
                 f"spawning {self.cfg.nproc} worker(s)" if msg.prespawn
                 else "restart mode: workers start with their ranks on Reconfigure")
        if self.shutdown is not None or not msg.prespawn:
            return
        for local_rank in range(self.cfg.nproc):
            self._spawn(local_rank, self._base_env(local_rank, msg.role), attempt=0)

    # ------------------------------------------------------------------ diagnostics

    def _on_drop(self, channel: Channel, reason: str) -> None:
        total = sum(c.dropped for c in (self.control, self.worker_ch, self.replica_ch) if c is not None)
        level = logging.WARNING if channel.dropped == 1 else logging.DEBUG
        log.log(level, "dropped a message on the %s socket: %s (%d dropped in all)", channel.name, reason, total)
