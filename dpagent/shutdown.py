"""The agent's shutdown sequence: relay Stop to the workers, then SIGTERM after a grace, then SIGKILL; or, having
lost the controller, save what the node holds to the job's --save-dir first (dpagent.lost_save), then SIGKILL.
Also what starts it: a stop signal (which first waits for the controller's own stop) or the controller's loss.

A part that the agent composes (ShutdownSequence); the Shutdown under way is its own state.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .lost_save import LostSave, save_store
from dpcommon.protocol import Leaving, Stop

if TYPE_CHECKING:  # (types only: dprun imports this module for the exit codes)
    from .agent_config import AgentConfig
    from .liveness import Liveness
    from .placement import Placement
    from dpcommon.protocol import SnapshotFiles, ToController, ToWorker
    from dpcommon.replica_store import ReplicaStore
    from .stop_signals import StopSignals
    from .workers import WorkerGroup

log = logging.getLogger("dpagent")

EXIT_USAGE = 2  # bad options or set-up, or the controller refused the job's shape this node was started with
EXIT_CONTROLLER_LOST = 3  # the controller fell silent (or its dprun died) after welcoming this node
EXIT_NO_CONTROLLER = 4  # no Welcome within --register-timeout: none answered (not started, unreachable)
EXIT_REFUSED = 5  # the controller refused this node before its Welcome: another job's token or DeadPool version


class StopPhase(enum.Enum):
    """Where a shutdown is. STOP (Stop relayed to the workers) -> STACKS (the workers still running after the
    grace asked for their stacks, dpcommon.stack_dump) -> TERM (SIGTERM a moment later) -> KILL (SIGKILL);
    SAVE (the controller lost: the node writes what it holds) -> KILL. KILL is final: the agent exits (or stays
    retired, Stop.keep_store) once its workers are gone."""

    STOP = "stop"
    SAVE = "save"
    STACKS = "stacks"
    TERM = "term"
    KILL = "kill"


STACKS_S = 1.0  # for a worker's stacks to be written and relayed before its SIGTERM, which Linux delivers first


# how a worker ends that the shutdown's own signals killed, by the phase it is in (as a negative exit code)
SENT_BY_PHASE = {StopPhase.STOP: (), StopPhase.SAVE: (), StopPhase.STACKS: (), StopPhase.TERM: (-signal.SIGTERM,),
                 StopPhase.KILL: (-signal.SIGTERM, -signal.SIGKILL)}


@dataclass
class Shutdown:
    code: int
    reason: str
    phase: StopPhase
    deadline: float
    keep_store: bool = False  # once the workers are gone, stay (retired) instead of exiting
    save: LostSave | None = None  # phase SAVE: what the node writes before it kills its workers
    signals: int = 0  # signals the agent had received when it began


class ShutdownSequence:
    """A part of the agent that owns its shutdown (the one under way, the wait a first stop signal allows for the
    controller's own stop), and the outcome: retired, or the exit code that ends the agent's loop. It is handed
    the workers, the ways to them and to the controller, the replica store (a lost controller's save writes its
    copies), the node's place in the job and its stop signals (read only)."""

    def __init__(self, cfg: AgentConfig, workers: WorkerGroup, to_workers: Callable[[ToWorker], None],
                 to_controller: Callable[[ToController], None], store: ReplicaStore, place: Placement,
                 signals: StopSignals) -> None:
        self.cfg = cfg
        self.workers = workers
        self.to_workers = to_workers
        self.to_controller = to_controller
        self.store = store
        self.place = place
        self.signals = signals
        self.shutdown: Shutdown | None = None
        self.retired = False  # its workers stopped by Stop(keep_store): only its replica store serves
        self.exit_code: int | None = None  # set: the agent exits with it
        self.stop_wait: float | None = None  # a first stop signal: until then the controller may stop the job
        self.job_stopping = False  # the controller asked for the job's save: its Stop follows

    def stop_signalled(self, now: float, liveness: Liveness | None) -> None:
        """A signal to stop. When Slurm ends a step (its time limit, scancel) every process gets SIGTERM, the
        controller's dprun too, which saves the job's state from the nodes' stores (--save-dir) and then stops
        them: so a first signal waits up to the heartbeat timeout for the controller to say the job stops (its
        save, its Stop), and stops this node alone if it does not. A second signal stops it at once."""
        name = self.signals.name
        if self.signals.count > 1 or liveness is None:
            self._stop_alone(f"received {name}")
        elif self.stop_wait is None:
            self.stop_wait = now + liveness.timeout
            log.warning("received %s: waiting up to %.1fs for the controller to stop the job (a save first, with "
                        "--save-dir), else this node stops; a second signal stops it now", name, liveness.timeout)
        elif now >= self.stop_wait and not self.job_stopping:
            self._stop_alone(f"received {name}; the controller did not stop the job")

    def _stop_alone(self, reason: str) -> None:
        """This node stops on a signal of its own, the job not stopping with it: the controller, told so (Leaving),
        fails it at once for that reason (a spare takes over), not for its workers' exit codes."""
        if self.place.welcome is not None and not self.job_stopping:
            self.to_controller(Leaving(self.cfg.node_id, reason))
        self.begin(128 + self.signals.signalled, reason, StopPhase.STOP)

    def lose_controller(self, why: str) -> None:
        """The controller is gone: save what this node holds to the job's --save-dir (if it has one), then exit 3."""
        signals_before = self.signals.count  # one that comes once the save is told of counts against it (CI: one
        # that came while the store was written before the shutdown began was taken as before it, and not heeded)
        welcome = self.place.welcome
        save_dir = welcome.save_dir if welcome is not None and not self.place.restart_mode else ""
        log.error("controller lost: %s; %skilling workers, exiting %d", why,
                  f"saving this node's snapshots to {save_dir}, then " if save_dir else "", EXIT_CONTROLLER_LOST)
        self.begin(EXIT_CONTROLLER_LOST, "controller lost", StopPhase.SAVE if save_dir else StopPhase.KILL,
                   signals_before=signals_before)

    def leave(self, why: str) -> None:
        """This node leaves the job on its own (the dprun that ran it died): the controller, told so, fails it at
        once (a spare takes over from the replicas, as for any lost node); its workers are killed, and it exits 1."""
        log.error("%s: leaving the job (its workers killed), exiting 1", why)
        if self.place.welcome is not None:
            self.to_controller(Leaving(self.cfg.node_id, why))
        self.begin(1, "left the job", StopPhase.KILL)

    def exiting(self) -> bool:
        """Stopping to exit: not running, nor only stopping its workers to keep its store (Stop.keep_store)."""
        return self.shutdown is not None and not self.shutdown.keep_store

    def begin(self, code: int, reason: str, phase: StopPhase, stop: Stop | None = None,
              signals_before: int | None = None) -> None:
        signals_before = self.signals.count if signals_before is None else signals_before
        keep_store = stop is not None and stop.keep_store
        if self.shutdown is not None:
            if self.shutdown.keep_store and not keep_store:  # the end while its workers still stop: exit then
                self.shutdown.keep_store, self.shutdown.code, self.shutdown.reason = False, code, reason
            return
        now = time.monotonic()
        self.workers.thaw()  # (stopped for a save: they act on the Stop, or write their own copies)
        alive = self.workers.alive()
        log.info("%s; %d live worker(s); will exit %d", reason, len(alive), code)
        save = None
        if phase is StopPhase.STOP:
            self.to_workers(stop or Stop(reason, code))
            deadline = now + self.cfg.stop_grace
        elif phase is StopPhase.SAVE:
            welcome = self.place.welcome
            assert welcome is not None  # (lose_controller saves only where the Welcome named a --save-dir)
            greeted = {w.local_rank for w in self.workers.greeted()}  # (each answers for its rank)
            save = LostSave(welcome.save_dir, {r for r in self.place.own_ranks() if r % self.cfg.nproc in greeted},
                            welcome.world_size, self.cfg.node_id)
            with self.workers.paused():  # (as for a SaveSnapshots: copies here may refer to their buffers)
                save_store(self.store, save)
            self.to_workers(save.request())
            deadline = now + self.cfg.save_timeout
        else:
            self.workers.signal_all(signal.SIGKILL)
            deadline = now + 2.0
        self.shutdown = Shutdown(code, reason, phase, deadline, keep_store, save, signals_before)
        self.advance(now)

    def signal_while_saving(self, now: float) -> None:
        """A signal while the node saves after losing its controller: the first is told it may cut the save
        short (as Slurm's time limit's SIGTERM comes before its SIGKILL, the save goes on), the second does."""
        sd = self.shutdown
        assert sd is not None and sd.save is not None  # (the agent asks in phase SAVE)
        if self.signals.count - sd.signals == 1 and not sd.save.warned:
            log.warning("received %s while saving (up to %.0fs more); a second signal cuts the save short",
                        self.signals.name, sd.deadline - now)
            sd.save.warned = True
        elif self.signals.count - sd.signals > 1 and sd.deadline > now:
            log.warning("received %s again: the save is cut short", self.signals.name)
            sd.deadline = now  # (the files written stay)

    def saved(self, msg: SnapshotFiles) -> bool:
        """A worker's answer to the save of a node that lost its controller (else False: not ours)."""
        if self.shutdown is None or self.shutdown.save is None:
            return False
        self.shutdown.save.answered(msg)
        return True

    def greeting(self) -> Stop | None:
        """What a worker that says Hello now is told of the shutdown: the Stop its peers were sent, if any."""
        sd = self.shutdown
        return Stop(sd.reason, sd.code) if sd is not None and sd.phase is StopPhase.STOP else None

    def advance(self, now: float) -> None:
        sd = self.shutdown
        assert sd is not None  # (the agent advances one under way)
        alive = self.workers.alive()
        if not alive and sd.keep_store:
            log.info("workers stopped; the replica store stays for the job's end (a save may need its copies)")
            self.shutdown, self.retired = None, True
            return
        answering = {w.local_rank for w in alive}
        if sd.phase is StopPhase.SAVE and sd.save is not None and (
                not any(r % self.cfg.nproc in answering for r in sd.save.waiting) or now >= sd.deadline):
            log.log(logging.WARNING if sd.save.waiting or sd.save.errors else logging.INFO, "controller lost: %s",
                    sd.save.summary())
            self.workers.signal_all(signal.SIGKILL)
            sd.phase, sd.deadline = StopPhase.KILL, now + 2.0
        if not alive:
            self.exit_code = sd.code
            return
        if now < sd.deadline:
            return
        ranks = ", ".join(str(w.local_rank) for w in alive)
        if sd.phase is StopPhase.STOP:  # stuck somewhere: where is said before it is ended
            log.warning("worker(s) %s still running %.1fs after Stop: their stacks follow, then SIGTERM", ranks,
                        self.cfg.stop_grace)
            self.workers.ask_for_stacks()
            sd.phase, sd.deadline = StopPhase.STACKS, now + STACKS_S
        elif sd.phase is StopPhase.STACKS:
            self.workers.signal_all(signal.SIGTERM)
            sd.phase, sd.deadline = StopPhase.TERM, now + self.cfg.term_grace
        elif sd.phase is StopPhase.TERM:
            log.warning("worker(s) %s still running after SIGTERM: SIGKILL", ranks)
            self.workers.signal_all(signal.SIGKILL)
            sd.phase, sd.deadline = StopPhase.KILL, now + 2.0
        else:
            log.error("worker(s) %s did not die after SIGKILL; giving up on them", ranks)
            self.exit_code = sd.code
