"""How a process ended, in words: exit codes and signals as people read them, and what a worker last said.

For WorkerExited's reports (dpagent) and the controller's failure messages and summaries (dprun); not wire format.
"""

from __future__ import annotations

import signal

OOM_KILLED = "killed by the kernel's OOM killer: out of memory"
# A worker that ended itself because an old generation's collective never let go (dpstate.steps.release_watch):
# the communication backend's state, not the script's error (not counted as "the script raised", never a repeat)
EXIT_UNRELEASED = 86
OWN_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)  # a process's own fault


def the_script_s_exit(exitcode: int) -> bool:
    """Did the script end itself (an exit code of its own), as against a signal from outside or a worker that
    dpstate ended because the backend never released an old generation's collective (EXIT_UNRELEASED)?"""
    return exitcode > 0 and exitcode != EXIT_UNRELEASED


def describe_exit(exitcode: int, oom_killed: bool = False) -> str:
    """A WorkerExited.exitcode (or any subprocess return code) in words: "exit code 1", "killed by SIGKILL", or
    OOM_KILLED where the kernel's OOM killer sent that SIGKILL (dpagent.oom)."""
    if oom_killed:
        return OOM_KILLED
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode == EXIT_UNRELEASED:
        return f"exit code {exitcode} (a collective of an old generation never let go)"
    return f"exit code {exitcode}"


def describe_end(exitcode: int, detail: str, oom_killed: bool = False) -> str:
    """How a worker ended and what it last said (WorkerExited.detail): after a colon where that may be why (its
    own exit or crash); in parentheses where a signal came from outside (SIGKILL: the OOM killer, a kill -9),
    which its last line cannot explain."""
    how = describe_exit(exitcode, oom_killed)
    if not detail or detail == describe_exit(exitcode):
        return how
    if exitcode < 0 and -exitcode not in OWN_SIGNALS:
        return f"{how} (its last line before: {detail})"
    return f"{how}: {detail}"
