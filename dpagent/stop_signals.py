"""The agent's stop signals (SIGTERM, SIGINT, SIGHUP; its launcher's passed-on LAUNCHER_STOP; the parent-death
LAUNCHER_GONE): the handlers, which only count, and the socket that wakes the agent's loop when one comes."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

from .process import LAUNCHER_GONE, LAUNCHER_STOP

# a stop signal from outside within this long after the one its launcher passed on is the same request: Slurm,
# ending a step, signals the launcher and the agent alike, in either order (a second request stops the node now)
SAME_STOP_S = 2.0


class StopSignals:
    """A part of the agent that owns what the signals said: the last one, how many (a second cuts a save short),
    and whether its launcher died. Handlers are installed on the main thread only (signals go there)."""

    def __init__(self, watch_launcher: bool) -> None:
        self.watch_launcher = watch_launcher  # its launcher's death is signalled (AgentConfig.launcher)
        self.signalled = 0  # the last one
        self.count = 0
        self.launcher_pid = os.getppid()
        self.launcher_gone = False  # its parent-death signal came
        self._relayed_at: float | None = None  # its launcher passed on a stop signal, this agent's own yet to come
        self._old_handlers: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signalled).name

    def install(self) -> int | None:
        """Install the handlers; the file descriptor that becomes readable when a signal comes (None where this
        is not the main thread, and none is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self._wakeup = socket.socketpair()
        for s in self._wakeup:
            s.setblocking(False)
        signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._old_handlers[LAUNCHER_STOP] = signal.signal(LAUNCHER_STOP, self._on_launcher_stop)
        if self.watch_launcher:
            self._old_handlers[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, self._on_launcher_gone)
        return self._wakeup[0].fileno()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signalled = signum
        relayed, self._relayed_at = self._relayed_at, None
        if relayed is not None and time.monotonic() - relayed < SAME_STOP_S:
            return  # Slurm's SIGTERM to every process of the step: its launcher's, passed on, came first
        self.count += 1

    def _on_launcher_stop(self, _signum: int, _frame: Any) -> None:
        if not self.count:
            self.signalled, self.count, self._relayed_at = signal.SIGTERM, 1, time.monotonic()

    def _on_launcher_gone(self, _signum: int, _frame: Any) -> None:
        self.launcher_gone = True

    def drain_wakeup(self) -> None:
        assert self._wakeup is not None  # (called when its socket is readable)
        try:
            while self._wakeup[0].recv(512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def launcher_died(self) -> bool:
        return self.launcher_gone or os.getppid() != self.launcher_pid  # (its signal may come first)

    def restore(self, launcher_died: bool) -> None:
        """Put the handlers back as they were, and close the wake-up socket."""
        for sig, handler in self._old_handlers.items():
            # a launcher killed whole sends its parent-death signal once per thread it ran: one may still come,
            # and its default action would end this agent before it has closed
            signal.signal(sig, signal.SIG_IGN if sig == LAUNCHER_GONE and launcher_died else handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for s in self._wakeup:
                s.close()
