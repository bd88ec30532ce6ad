"""A survivor still inside an old generation's step a while after a newer one was asked for says so, once, with
every thread's stack: what holds it (a collective that an abort did not release) is then in its log, not a mystery.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from dpcommon import stack_dump

from .abort import AbortSignal


def warn_after_s() -> float:
    """DP_RELEASE_WARN_S (default 60; 0: never)."""
    return float(os.environ.get("DP_RELEASE_WARN_S", "60"))


class ReleaseWatch:
    """on_abort (an AbortSignal callback) starts a timer; if the step has not let go when it fires, one line and
    the stacks go to stderr. Decides nothing else: --hang-timeout, in the controller, ends a real hang."""

    def __init__(self, abort: AbortSignal, in_step: Callable[[], bool], where: Callable[[], str],
                 warn_s: float | None = None):
        self._abort, self._in_step, self._where = abort, in_step, where
        self.warn_s = warn_after_s() if warn_s is None else warn_s
        self._lock = threading.Lock()
        self._watching = -1  # the generation asked for that the timer runs for
        self.checked = self.warned = 0

    def on_abort(self) -> None:
        target = self._abort.target
        if self.warn_s <= 0 or not self._abort.superseded():
            return
        with self._lock:
            if target <= self._watching:
                return
            self._watching = target
        timer = threading.Timer(self.warn_s, self._check, args=(target,))
        timer.daemon = True
        timer.start()

    def _check(self, target: int) -> None:
        self.checked += 1
        if not self._abort.superseded() or not self._in_step():
            return
        self.warned += 1
        print(f"dpstate: {self._where()} is still in its step {self.warn_s:g} s after generation {target} was asked "
              "for: a collective the abort did not release, or a step that long without one (its stacks follow; "
              "--hang-timeout ends a hang)", file=sys.stderr, flush=True)
        stack_dump.write_now()
