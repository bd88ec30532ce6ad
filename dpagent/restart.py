"""Restart mode, for scripts that do not use dpstate (the agent's side of it: a part that dpagent.agent composes).

Each Reconfigure replaces the node's workers by fresh ones with torchrun's environment; a worker's crash is held
back until it is clear it was not a dead peer's doing (in a plain script, a peer's death kills the survivors too).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import Callable

from .agent_config import AgentConfig
from dpcommon.exit_wording import describe_exit
from .output import CRASHES, exception_name, raised_exception
from .placement import Placement
from dpcommon.protocol import Demote, PeerError, Reconfigure, ToController, WorkerExited, WorkerReady
from .worker_link import WorkerLink
from .workers import restart_env

log = logging.getLogger("dpagent")

# errors in the script's code itself: never a dead peer's doing, whatever its peers do
OWN_ERRORS = ("SyntaxError", "IndentationError", "TabError", "ModuleNotFoundError", "ImportError", "NameError")


def may_be_a_peers_doing(exited: WorkerExited, world_size: int) -> bool:
    """Whether a plain script's failed worker may have died of a peer's death: it exits on the exception its
    collective raised (exit code > 0), or crashes (SIGABRT, SIGSEGV: NCCL's watchdog). Not so with no peer, a
    signal from outside (SIGKILL, the OOM killer, SIGTERM), or an error in the script's own code (OWN_ERRORS)."""
    if world_size <= 1 or exited.oom_killed or (exited.exitcode < 0 and exited.exitcode not in CRASHES):
        return False
    return exception_name(raised_exception(exited.stderr_tail)) not in OWN_ERRORS


class HeldExits:
    """Restart mode's exits that are not news yet, or never: a crash held back until its deadline (it may be a
    dead peer's doing, and then a Reconfigure comes first), and the exits of workers that a restart replaced.
    A part of the agent that owns this state alone; the clock is passed in."""

    def __init__(self) -> None:
        self._held: list[tuple[float, WorkerExited]] = []  # (deadline, exit), in deadline order
        self._retired: set[int] = set()  # pids of workers replaced by a restart

    def retire(self, pids: list[int]) -> None:
        """A restart replaces these workers: the exits held so far were its casualties, and theirs are not news."""
        self._held.clear()
        self._retired.update(pids)

    def retired_exit(self, pid: int) -> bool:
        """True (once) for a worker that a restart replaced: its exit is not reported."""
        if pid in self._retired:
            self._retired.discard(pid)
            return True
        return False

    def hold(self, exited: WorkerExited, until: float) -> None:
        self._held.append((until, exited))

    def next_deadline(self) -> float | None:
        return self._held[0][0] if self._held else None

    def due(self, now: float) -> list[WorkerExited]:
        """The held exits whose deadline passed with no recovery: they stand on their own."""
        due = []
        while self._held and self._held[0][0] <= now:
            due.append(self._held.pop(0)[1])
        return due


class RestartMode:
    """A part of the agent that replaces its workers on each Reconfigure and holds back their crashes (it owns
    the HeldExits); it is handed the worker link (which spawns them), the way to the controller and the node's
    place (read only). Used only where place.restart_mode (Welcome(prespawn=False)), but for a demotion."""

    def __init__(self, cfg: AgentConfig, link: WorkerLink, to_controller: Callable[[ToController], None],
                 place: Placement) -> None:
        self.cfg = cfg
        self.link = link
        self.to_controller = to_controller
        self.place = place
        self.held_exits = HeldExits()  # crashes held back, replaced workers' exits

    def _kill_workers(self, started: float) -> int:
        """Kill this node's workers (their exits are not news); how many there were."""
        workers = self.link.workers
        old = workers.alive()
        self.held_exits.retire([w.pid for w in old])
        for worker in old:
            self.link.forget(worker)
        workers.signal_all(signal.SIGKILL)
        for worker in old:
            try:
                worker.popen.wait(timeout=max(0.1, 5.0 - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                log.warning("worker %d (pid %d) did not die after SIGKILL", worker.local_rank, worker.pid)
        return len(old)

    def respawn_spares(self, msg: Demote, attempt: int) -> None:
        """Demoted (in either mode): the workers of the generation it left give way to fresh spare ones, which
        wait set up for a Reconfigure as a spare's do."""
        killed = self._kill_workers(time.monotonic())
        log.info("demoted to spare (%s): %d worker(s) replaced by spare ones", msg.reason, killed)
        for local_rank in range(self.cfg.nproc):
            self.link.spawn(local_rank, self.link.base_env(local_rank, "spare"), attempt=attempt)

    def restart_workers(self, msg: Reconfigure) -> None:
        """Replace this node's workers by fresh ones that know their ranks; WorkerReady for each."""
        started = time.monotonic()
        old = self._kill_workers(started)
        log.info("generation %d (%s): %s %d worker(s) as node rank %d of %d", msg.generation, msg.reason or "start",
                 "restarting" if old else "starting", self.cfg.nproc, msg.node_rank, msg.nnodes)
        for local_rank in range(self.cfg.nproc):
            rank = msg.node_rank * msg.nproc_per_node + local_rank
            env = restart_env(
                self.link.base_env(local_rank, "active"), rank=rank, world_size=msg.world_size,
                local_rank=local_rank, nproc=self.cfg.nproc, node_rank=msg.node_rank, nnodes=msg.nnodes,
                store_endpoint=msg.store_endpoint, restart_count=msg.generation, max_restarts=self.cfg.max_restarts,
                run_id=self.place.job_id,
            )
            if self.link.spawn(local_rank, env, attempt=msg.generation) is not None:
                self.to_controller(WorkerReady(self.cfg.node_id, msg.generation, rank,
                                               round(time.monotonic() - started, 4), 0.0, "restart"))

    def hold_exit(self, exited: WorkerExited) -> bool:
        """A failed worker in restart mode: tell the controller to probe every node now (a PeerError) and
        report the exit only if no Reconfigure comes within a heartbeat timeout. False: report it at once (one
        that no peer's death explains, may_be_a_peers_doing). The agent asks only while it does not stop."""
        welcome = self.place.welcome
        if not self.place.restart_mode or exited.exitcode == 0 or welcome is None:
            return False
        rc = self.place.latest
        if not may_be_a_peers_doing(exited, rc.world_size if rc is not None else 0):
            return False
        self.to_controller(PeerError(self.cfg.node_id, self.place.generation, self.place.rank_of(exited.local_rank),
                                     f"worker {exited.local_rank} {describe_exit(exited.exitcode)}"))
        self.held_exits.hold(exited, time.monotonic() + welcome.heartbeat_timeout)
        return True

    def release_held(self, now: float) -> None:
        for exited in self.held_exits.due(now):
            log.warning("worker %d's exit stands on its own (no recovery followed): reporting it", exited.local_rank)
            self.to_controller(exited)
