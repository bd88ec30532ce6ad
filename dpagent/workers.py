"""Spawns and supervises the local workers: environment, command, parent-death signal, exit waiters.

One waiter thread per worker blocks in wait() and posts WorkerDone to the agent loop the moment it exits.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .events import EventPipe
from .process import child_preexec, signal_tree

log = logging.getLogger("dpagent")


@dataclass(frozen=True)
class WorkerDone:
    """Event: worker `local_rank` (pid) ended with `exitcode` (-signal when killed)."""

    local_rank: int
    pid: int
    exitcode: int


def worker_command(script: str, args: Sequence[str], python: str | None) -> list[str]:
    """[python, "-u", script, *args], or [script, *args] when python is None (--no-python)."""
    return ([python, "-u"] if python else []) + [script, *args]


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
        except (OSError, ValueError):
            return False


def worker_env(
    base: Mapping[str, str],
    *,
    node_id: str,
    endpoint: str,
    token: str,
    job_id: str,
    role: str,
    nproc: int,
    local_rank: int,
    local_addr: str,
) -> dict[str, str]:
    """The worker environment of docs/internals.md; the user's own OMP / GLOO settings win."""
    env = dict(base)
    env.update(
        DP_NODE_ID=node_id,
        DP_AGENT_ENDPOINT=endpoint,
        DP_JOB_TOKEN=token,
        DP_JOB_ID=job_id,
        DP_ROLE=role,
        DP_NPROC_PER_NODE=str(nproc),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        TORCHELASTIC_RUN_ID=job_id,
    )
    try:
        sharing = int(base.get("DP_TOTAL_LOCAL_WORKERS") or 0)
    except ValueError:
        sharing = 0
    if "OMP_NUM_THREADS" not in base and max(sharing, nproc) > 1:
        env["OMP_NUM_THREADS"] = "1"
    if "GLOO_SOCKET_IFNAME" not in base and is_loopback(local_addr):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@dataclass
class Worker:
    local_rank: int
    popen: subprocess.Popen
    identity: bytes | None = None  # its DEALER identity, once it said Hello
    exitcode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.exitcode is None


class WorkerGroup:
    """The workers of this node. Spawn from the main thread: PR_SET_PDEATHSIG follows the spawning thread."""

    def __init__(self, events: EventPipe, log_dir: str | None = None):
        self._events = events
        self._log_dir = Path(log_dir) if log_dir else None
        self.workers: dict[int, Worker] = {}

    def spawn(self, local_rank: int, command: list[str], env: dict[str, str], log_name: str = "") -> Worker:
        """Starts one worker (in our process group) and its waiter thread; raises OSError if it cannot start."""
        out = None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self._log_dir / f"{log_name or 'worker'}-{local_rank}.log", "ab", buffering=0)
        try:
            popen = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=child_preexec(os.getpid()),
                close_fds=True,
            )
        finally:
            if out is not None:
                out.close()
        worker = Worker(local_rank, popen)
        self.workers[local_rank] = worker
        threading.Thread(target=self._wait, args=(worker,), name=f"wait-worker-{local_rank}", daemon=True).start()
        return worker

    def _wait(self, worker: Worker) -> None:
        exitcode = worker.popen.wait()
        with self._events.sender() as sender:
            sender.post(WorkerDone(worker.local_rank, worker.pid, exitcode))

    def mark_done(self, done: WorkerDone) -> Worker | None:
        worker = self.workers.get(done.local_rank)
        if worker is None or worker.pid != done.pid:
            return None
        worker.exitcode = done.exitcode
        return worker

    def get(self, local_rank: int) -> Worker | None:
        return self.workers.get(local_rank)

    def by_identity(self, identity: bytes) -> Worker | None:
        for worker in self.workers.values():
            if worker.identity == identity:
                return worker
        return None

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]

    def greeted(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.identity is not None and w.alive]

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values()]

    def signal(self, local_rank: int, sig: int, tree: bool = False) -> bool:
        worker = self.workers.get(local_rank)
        if worker is None or not worker.alive:
            return False
        if tree:
            return signal_tree(worker.pid, sig) > 0
        try:
            os.kill(worker.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def signal_all(self, sig: int) -> None:
        """Signals every live worker and its descendants."""
        for worker in self.alive():
            signal_tree(worker.pid, sig)


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
