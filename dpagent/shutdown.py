"""The agent's shutdown sequence: relay Stop to the workers, then SIGTERM after a grace, then SIGKILL.

A part of the Agent (it inherits this), kept apart so each file reads in one sitting.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from .protocol import Stop

log = logging.getLogger("dpagent")


@dataclass
class Shutdown:
    code: int
    reason: str
    phase: str  # "stop" (Stop relayed) -> "term" -> "kill"
    deadline: float
    keep_store: bool = False  # once the workers are gone, stay (retired) instead of exiting


class ShutdownSequence:
    """Needs the agent's cfg, workers, shutdown, retired, exit_code and _to_workers."""

    def _exiting(self) -> bool:
        """Stopping to exit: not running, nor only stopping its workers to keep its store (Stop.keep_store)."""
        return self.shutdown is not None and not self.shutdown.keep_store

    def _begin_shutdown(self, code: int, reason: str, phase: str, stop: Stop | None = None) -> None:
        keep_store = stop is not None and stop.keep_store
        if self.shutdown is not None:
            if self.shutdown.keep_store and not keep_store:  # the end while its workers still stop: exit then
                self.shutdown.keep_store, self.shutdown.code, self.shutdown.reason = False, code, reason
            return
        now = time.monotonic()
        alive = self.workers.alive()
        log.info("%s; %d live worker(s); will exit %d", reason, len(alive), code)
        if phase == "stop":
            self._to_workers(stop or Stop(reason, code))
            deadline = now + self.cfg.stop_grace
        else:
            self.workers.signal_all(signal.SIGKILL)
            deadline = now + 2.0
        self.shutdown = Shutdown(code, reason, phase, deadline, keep_store)
        self._advance_shutdown(now)

    def _advance_shutdown(self, now: float) -> None:
        sd = self.shutdown
        alive = self.workers.alive()
        if not alive and sd.keep_store:
            log.info("workers stopped; the replica store stays for the job's end (a save may need its copies)")
            self.shutdown, self.retired = None, True
            return
        if not alive:
            self.exit_code = sd.code
            return
        if now < sd.deadline:
            return
        ranks = ", ".join(str(w.local_rank) for w in alive)
        if sd.phase == "stop":
            log.warning("worker(s) %s still running %.1fs after Stop: SIGTERM", ranks, self.cfg.stop_grace)
            self.workers.signal_all(signal.SIGTERM)
            sd.phase, sd.deadline = "term", now + self.cfg.term_grace
        elif sd.phase == "term":
            log.warning("worker(s) %s still running after SIGTERM: SIGKILL", ranks)
            self.workers.signal_all(signal.SIGKILL)
            sd.phase, sd.deadline = "kill", now + 2.0
        else:
            log.error("worker(s) %s did not die after SIGKILL; giving up on them", ranks)
            self.exit_code = sd.code
