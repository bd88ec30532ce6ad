"""Fault injection carried out by the agent on its own node: kill or freeze the node, kill or hang a worker.

The controller sends Inject(kind, local_rank); a node is this agent's process group, workers included.
"""

from __future__ import annotations

import logging
import os
import signal

from .process import own_group_is_ours, signal_tree
from .workers import WorkerGroup

log = logging.getLogger("dpagent")

KINDS = ("kill-node", "kill-spare", "freeze-node", "kill-worker", "hang-worker", "resume-worker", "corrupt-replicas")


def _flush_logs() -> None:
    for handler in logging.getLogger("dpagent").handlers:
        handler.flush()


def _signal_node(workers: WorkerGroup, sig: int) -> None:
    """Signals the agent and its workers as a unit. If we do not lead our process group (started without
    a session of our own), killpg would hit our launcher too, so signal the workers and then ourselves."""
    _flush_logs()
    signal_tree(os.getpid(), sig, include_root=False)  # (those in sessions of their own too: a node dies whole)
    if own_group_is_ours():
        os.killpg(os.getpgid(0), sig)
    else:
        workers.signal_all(sig)
        os.kill(os.getpid(), sig)


def inject(kind: str, local_rank: int, workers: WorkerGroup) -> bool:
    """Carries out one fault; returns False (and logs) when the kind or the worker is unknown."""
    if kind in ("kill-node", "kill-spare"):
        log.warning("injected fault: %s (SIGKILL to agent and workers)", kind)
        _signal_node(workers, signal.SIGKILL)
        return True
    if kind == "freeze-node":
        log.warning("injected fault: freeze-node (SIGSTOP to agent and workers)")
        _signal_node(workers, signal.SIGSTOP)
        return True
    per_worker = {"kill-worker": signal.SIGKILL, "hang-worker": signal.SIGSTOP, "resume-worker": signal.SIGCONT}
    if kind in per_worker:
        worker = workers.get(local_rank)
        if worker is None or not workers.signal(local_rank, per_worker[kind]):
            log.warning("injected fault %s: no live worker with local rank %d", kind, local_rank)
            return False
        log.warning("injected fault: %s local rank %d (pid %d)", kind, local_rank, worker.pid)
        return True
    log.warning("injected fault %r is unknown (known: %s); ignored", kind, ", ".join(KINDS))
    return False
