"""Every process of a DeadPool job writes its threads' Python stacks to its stderr on STACK_DUMP (faulthandler): what
a job's processes were doing when it hung, asked for by whoever is about to kill them (tests; `kill -RTMIN+4 PID`).
"""

from __future__ import annotations

import faulthandler
import os
import signal

# A real-time signal: SIGUSR1/2 belong to schedulers' preemption notices and users' own handlers
STACK_DUMP = int(signal.SIGRTMIN) + 4


STDERR_FD = 2  # the process's stderr, whatever sys.stderr is now (a test's capture has no file descriptor)


def install() -> None:
    """Dump every thread's stack to stderr on STACK_DUMP; the process goes on (faulthandler writes from its own
    signal handler, so a main thread stuck in C code, a collective or a lock still answers)."""
    if hasattr(faulthandler, "register"):  # not on Windows
        faulthandler.register(STACK_DUMP, file=STDERR_FD, all_threads=True, chain=False)


def write_now() -> None:
    """Write every thread's stack to stderr now, as STACK_DUMP would (a process about to end itself)."""
    faulthandler.dump_traceback(STDERR_FD, all_threads=True)


def ask(pid: int) -> bool:
    """Ask process `pid` for its stacks; False where it is gone, not ours, or does not handle the signal (to such a
    process, one that did not install() it, the signal is fatal)."""
    if not handles(pid):
        return False
    try:
        os.kill(pid, STACK_DUMP)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def handles(pid: int) -> bool:
    """Whether process `pid` catches STACK_DUMP (Linux: its SigCgt mask in /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((line.split()[1] for line in f if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(caught, 16) >> (STACK_DUMP - 1) & 1)
