"""Every process of a DeadPool job writes its threads' Python stacks to its stderr on STACK_DUMP (faulthandler): what
a job's processes were doing when it hung, asked for by whoever is about to kill them (tests; `kill -RTMIN+4 PID`).
"""

from __future__ import annotations

import faulthandler
import os
import signal

# A real-time signal: SIGUSR1/2 belong to schedulers' preemption notices and users' own handlers
STACK_DUMP = int(signal.SIGRTMIN) + 4


def install() -> None:
    """Dump every thread's stack to stderr on STACK_DUMP; the process goes on (faulthandler writes from its own
    signal handler, so a main thread stuck in C code, a collective or a lock still answers)."""
    if hasattr(faulthandler, "register"):  # not on Windows
        faulthandler.register(STACK_DUMP, file=2, all_threads=True, chain=False)  # the process's stderr, whatever
        # sys.stderr is now (a test's capture has no file descriptor)


def ask(pid: int) -> bool:
    """Ask process `pid` for its stacks; False where it is gone or not ours."""
    try:
        os.kill(pid, STACK_DUMP)
        return True
    except (ProcessLookupError, PermissionError):
        return False
