"""The agent's shutdown sequence: relay Stop to the workers, then SIGTERM after a grace, then SIGKILL; or, having
lost the controller, save what the node holds to the job's --save-dir first (dpagent.lost_save), then SIGKILL.
Also what starts it: a stop signal (which first waits for the controller's own stop) or the controller's loss.

A part of the Agent (it inherits this), kept apart so each file reads in one sitting.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from dataclasses import dataclass

from .lost_save import LostSave, save_store
from .protocol import Leaving, Stop

log = logging.getLogger("dpagent")

EXIT_USAGE = 2  # bad options or set-up, or the controller refused the job's shape this node was started with
EXIT_CONTROLLER_LOST = 3  # the controller fell silent (or its dprun died) after welcoming this node
EXIT_NO_CONTROLLER = 4  # no Welcome within --register-timeout: none answered (not started, unreachable)
EXIT_REFUSED = 5  # the controller refused this node before its Welcome: another job's token or DeadPool version


class StopPhase(enum.Enum):
    """Where a shutdown is. STOP (Stop relayed to the workers) -> TERM (SIGTERM after the grace) -> KILL (SIGKILL);
    SAVE (the controller lost: the node writes what it holds) -> KILL. KILL is final: the agent exits (or stays
    retired, Stop.keep_store) once its workers are gone."""

    STOP = "stop"
    SAVE = "save"
    TERM = "term"
    KILL = "kill"


# how a worker ends that the shutdown's own signals killed, by the phase it is in (as a negative exit code)
SENT_BY_PHASE = {StopPhase.STOP: (), StopPhase.SAVE: (), StopPhase.TERM: (-signal.SIGTERM,),
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
    """Needs the agent's cfg, workers, shutdown, retired, exit_code, replica, welcome, liveness, restart_mode,
    _signals, _signalled, _stop_wait, _job_stopping, _to_workers, _to_controller and _own_ranks."""

    shutdown: Shutdown | None  # (the two it sets: typed here as the agent types them)
    exit_code: int | None

    def _stop_signalled(self, now: float) -> None:
        """A signal to stop. When Slurm ends a step (its time limit, scancel) every process gets SIGTERM, the
        controller's dprun too, which saves the job's state from the nodes' stores (--save-dir) and then stops
        them: so a first signal waits up to the heartbeat timeout for the controller to say the job stops (its
        save, its Stop), and stops this node alone if it does not. A second signal stops it at once."""
        name = signal.Signals(self._signalled).name
        if self._signals > 1 or self.liveness is None:
            self._stop_alone(f"received {name}")
        elif self._stop_wait is None:
            self._stop_wait = now + self.liveness.timeout
            log.warning("received %s: waiting up to %.1fs for the controller to stop the job (a save first, with "
                        "--save-dir), else this node stops; a second signal stops it now", name, self.liveness.timeout)
        elif now >= self._stop_wait and not self._job_stopping:
            self._stop_alone(f"received {name}; the controller did not stop the job")

    def _stop_alone(self, reason: str) -> None:
        """This node stops on a signal of its own, the job not stopping with it: the controller, told so (Leaving),
        fails it at once for that reason (a spare takes over), not for its workers' exit codes."""
        if self.welcome is not None and not self._job_stopping:
            self._to_controller(Leaving(self.cfg.node_id, reason))
        self._begin_shutdown(128 + self._signalled, reason, StopPhase.STOP)

    def _lose_controller(self, why: str) -> None:
        """The controller is gone: save what this node holds to the job's --save-dir (if it has one), then exit 3."""
        signals_before = self._signals  # one that comes once the save is told of counts against it (CI: one
        # that came while the store was written before the shutdown began was taken as before it, and not heeded)
        saving = self.welcome is not None and bool(self.welcome.save_dir) and not self.restart_mode
        log.error("controller lost: %s; %skilling workers, exiting %d", why,
                  f"saving this node's snapshots to {self.welcome.save_dir}, then " if saving else "",
                  EXIT_CONTROLLER_LOST)
        self._begin_shutdown(EXIT_CONTROLLER_LOST, "controller lost", StopPhase.SAVE if saving else StopPhase.KILL,
                             signals_before=signals_before)

    def _leave(self, why: str) -> None:
        """This node leaves the job on its own (the dprun that ran it died): the controller, told so, fails it at
        once (a spare takes over from the replicas, as for any lost node); its workers are killed, and it exits 1."""
        log.error("%s: leaving the job (its workers killed), exiting 1", why)
        if self.welcome is not None:
            self._to_controller(Leaving(self.cfg.node_id, why))
        self._begin_shutdown(1, "left the job", StopPhase.KILL)

    def _exiting(self) -> bool:
        """Stopping to exit: not running, nor only stopping its workers to keep its store (Stop.keep_store)."""
        return self.shutdown is not None and not self.shutdown.keep_store

    def _begin_shutdown(self, code: int, reason: str, phase: StopPhase, stop: Stop | None = None,
                        signals_before: int | None = None) -> None:
        signals_before = self._signals if signals_before is None else signals_before
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
            self._to_workers(stop or Stop(reason, code))
            deadline = now + self.cfg.stop_grace
        elif phase is StopPhase.SAVE:
            greeted = {w.local_rank for w in self.workers.greeted()}  # (each answers for its rank)
            save = LostSave(self.welcome.save_dir, {r for r in self._own_ranks() if r % self.cfg.nproc in greeted},
                            self.welcome.world_size, self.cfg.node_id)
            with self.workers.paused():  # (as for a SaveSnapshots: copies here may refer to their buffers)
                save_store(self.replica.store, save)
            self._to_workers(save.request())
            deadline = now + self.cfg.save_timeout
        else:
            self.workers.signal_all(signal.SIGKILL)
            deadline = now + 2.0
        self.shutdown = Shutdown(code, reason, phase, deadline, keep_store, save, signals_before)
        self._advance_shutdown(now)

    def _signal_while_saving(self, now: float) -> None:
        """A signal while the node saves after losing its controller: the first is told it may cut the save
        short (as Slurm's time limit's SIGTERM comes before its SIGKILL, the save goes on), the second does."""
        sd = self.shutdown
        if self._signals - sd.signals == 1 and not sd.save.warned:
            log.warning("received %s while saving (up to %.0fs more); a second signal cuts the save short",
                        signal.Signals(self._signalled).name, sd.deadline - now)
            sd.save.warned = True
        elif self._signals - sd.signals > 1 and sd.deadline > now:
            log.warning("received %s again: the save is cut short", signal.Signals(self._signalled).name)
            sd.deadline = now  # (the files written stay)

    def _saved(self, msg) -> bool:
        """A worker's answer to the save of a node that lost its controller (else False: not ours)."""
        if self.shutdown is None or self.shutdown.save is None:
            return False
        self.shutdown.save.answered(msg)
        return True

    def _advance_shutdown(self, now: float) -> None:
        sd = self.shutdown
        alive = self.workers.alive()
        if not alive and sd.keep_store:
            log.info("workers stopped; the replica store stays for the job's end (a save may need its copies)")
            self.shutdown, self.retired = None, True
            return
        answering = {w.local_rank for w in alive}
        if sd.phase is StopPhase.SAVE and (not any(r % self.cfg.nproc in answering for r in sd.save.waiting)
                                   or now >= sd.deadline):
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
        if sd.phase is StopPhase.STOP:
            log.warning("worker(s) %s still running %.1fs after Stop: SIGTERM", ranks, self.cfg.stop_grace)
            self.workers.signal_all(signal.SIGTERM)
            sd.phase, sd.deadline = StopPhase.TERM, now + self.cfg.term_grace
        elif sd.phase is StopPhase.TERM:
            log.warning("worker(s) %s still running after SIGTERM: SIGKILL", ranks)
            self.workers.signal_all(signal.SIGKILL)
            sd.phase, sd.deadline = StopPhase.KILL, now + 2.0
        else:
            log.error("worker(s) %s did not die after SIGKILL; giving up on them", ranks)
            self.exit_code = sd.code
