"""OS process plumbing for the agent: parent-death signals, child subreaping and signalling process trees.

Linux prctl through ctypes; elsewhere these helpers quietly do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from typing import Callable, Iterable

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# An agent's parent-death signal when its launcher ran the controller: handled as the controller's loss. A
# real-time signal, not SIGUSR1, which Slurm's --signal and schedulers' preemption notices often use.
LAUNCHER_GONE = int(signal.SIGRTMIN) + 2
# A joining node's dprun, told to stop (SIGTERM, Ctrl-C), passes it on to its agent (in a session of its own) as
# this signal: one stop request with the SIGTERM that Slurm, ending a step, also sends the agent itself
LAUNCHER_STOP = int(signal.SIGRTMIN) + 3

_prctl: Callable[..., int] | None
try:  # resolved here, before any fork: a preexec_fn must not load libraries
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _prctl = _libc.prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _call_prctl(option: int, value: int) -> bool:
    if _prctl is None:
        return False
    return _prctl(option, value, 0, 0, 0) == 0


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """This process gets `sig` when the thread that started it ends."""
    return _call_prctl(PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> bool:
    """Orphaned descendants (a dead worker's children) are re-parented to us, so we can still kill them."""
    return _call_prctl(PR_SET_CHILD_SUBREAPER, 1)


def child_preexec(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn: the child dies with its parent (SIGKILL), also if the parent is already gone."""

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(137)

    return preexec


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def signal_procs(procs: Iterable[psutil.Process], sig: int) -> int:
    """Sends `sig` to each; a stopped process is continued after SIGTERM/SIGINT so it can act on it."""
    sent = 0
    for proc in procs:
        try:
            proc.send_signal(sig)
            if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                proc.send_signal(signal.SIGCONT)
            sent += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sent


def signal_tree(pid: int, sig: int, include_root: bool = True) -> int:
    """Signals `pid` and all its descendants (found first, so a dying root does not hide its children)."""
    tree = descendants(pid)
    if include_root:
        try:
            tree.insert(0, psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return signal_procs(tree, sig)


def reap_orphans(keep: Iterable[int]) -> int:
    """Reaps zombie children that are not ours to wait for (orphans inherited as subreaper)."""
    keep = set(keep)
    reaped = 0
    for child in psutil.Process().children():
        if child.pid in keep:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE and os.waitpid(child.pid, os.WNOHANG)[0]:
                reaped += 1
        except (psutil.NoSuchProcess, ChildProcessError):
            pass
    return reaped


def own_group_is_ours() -> bool:
    """True when this process leads its process group, so killpg(own group) spares our launcher."""
    return os.getpgid(0) == os.getpid()
