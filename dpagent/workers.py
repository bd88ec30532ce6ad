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
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Sequence

import psutil

from .loop_events import EventPipe
from dpcommon import stack_dump
from dpcommon.exit_wording import describe_exit as describe_exit  # (re-exported: tests name it here)
from .output import OutputSpec, WorkerOutput
from .process import child_preexec, signal_tree

log = logging.getLogger("dpagent")


@dataclass(frozen=True)
class WorkerDone:
    """Event: worker `local_rank` (pid) ended with `exitcode` (-signal when killed)."""

    local_rank: int
    pid: int
    exitcode: int


def worker_command(script: str, args: Sequence[str], python: str | None, module: bool = False) -> list[str]:
    """[python, "-u", script, *args]; [python, "-u", "-m", module, *args] with module (-m);
    [script, *args] when python is None (--no-python)."""
    if python is None:
        return [script, *args]
    return [python, "-u", *(["-m"] if module else []), script, *args]


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
    replica_endpoint: str = "",
) -> dict[str, str]:
    """The worker environment of docs/sequences.md; the user's own OMP / GLOO settings win."""
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
    if replica_endpoint:  # this node's replica store: told of each local snapshot (dedup, dpstate.snapshot.shared)
        env["DP_LOCAL_REPLICA"] = replica_endpoint
    try:
        sharing = int(base.get("DP_TOTAL_LOCAL_WORKERS") or 0)
    except ValueError:
        sharing = 0
    if "OMP_NUM_THREADS" not in base and max(sharing, nproc) > 1:
        env["OMP_NUM_THREADS"] = "1"
    if "GLOO_SOCKET_IFNAME" not in base and is_loopback(local_addr):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def restart_env(base: Mapping[str, str], *, rank: int, world_size: int, local_rank: int, nproc: int,
                node_rank: int, nnodes: int, store_endpoint: str, restart_count: int, max_restarts: int,
                run_id: str) -> dict[str, str]:
    """torchrun's worker environment, for scripts that do not use dpstate (restart mode): the ranks are known
    at spawn, and init_process_group(env://) joins the head's TCPStore as a client (TORCHELASTIC_USE_AGENT_STORE)."""
    host, _, port = store_endpoint.rpartition(":")
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank), NODE_RANK=str(node_rank), GROUP_WORLD_SIZE=str(nnodes), ROLE_RANK=str(rank),
        ROLE_NAME="default", ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=port,
        TORCHELASTIC_RESTART_COUNT=str(restart_count), TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_USE_AGENT_STORE="True",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    return env


@dataclass
class Worker:
    local_rank: int
    popen: subprocess.Popen
    output: WorkerOutput | None = None
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

    def __init__(self, events: EventPipe, output: OutputSpec | None = None):
        self._events = events
        self.output = output or OutputSpec()
        self.workers: dict[int, Worker] = {}
        self._frozen: dict[int, int] = {}  # local rank -> pid, stopped by freeze() until thaw()

    def log_folder(self, job_id: str, node_id: str, attempt: int, local_rank: int) -> Path | None:
        """torchrun's layout plus the node: <log_dir>/<job>/<node>/attempt_<k>/<local_rank>/."""
        if not self.output.log_dir:
            return None
        return Path(self.output.log_dir) / (job_id or "job") / node_id / f"attempt_{attempt}" / str(local_rank)

    def spawn(self, local_rank: int, command: list[str], env: dict[str, str], log_folder: Path | None = None) -> Worker:
        """Starts one worker (in our process group) and its waiter thread; raises OSError if it cannot start."""
        output = WorkerOutput(self.output, local_rank, log_folder)
        popen = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_preexec(os.getpid()),
            close_fds=True,
            **output.popen_kwargs(),
        )
        output.start(popen)
        worker = Worker(local_rank, popen, output)
        self.workers[local_rank] = worker
        threading.Thread(target=self._wait, args=(worker,), name=f"wait-worker-{local_rank}", daemon=True).start()
        return worker

    def _wait(self, worker: Worker) -> None:
        exitcode = worker.popen.wait()
        if worker.output is not None:  # what it wrote before it exited, for the tail (a killed one wrote little)
            worker.output.join(0.5 if exitcode >= 0 else 0.05)
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

    def drain_output(self, timeout: float) -> None:
        """Lets the pumps copy what the workers wrote before they ended (at most `timeout` s in all)."""
        deadline = time.monotonic() + timeout
        for worker in self.workers.values():
            if worker.output is not None:
                worker.output.join(max(0.0, deadline - time.monotonic()))

    def freeze(self, spare: Collection[int] = ()) -> None:
        """Stop (SIGSTOP) the live workers, but those of the local ranks in `spare`, until thaw(): a stopping
        job's save, whose copies workers that train on would move past (a first SIGTERM, or a Ctrl-C to dprun
        alone, leaves them training until the Stop)."""
        for worker in self.alive():
            if worker.local_rank not in spare and worker.local_rank not in self._frozen:
                self._frozen[worker.local_rank] = worker.pid
                self._signal([worker.pid], signal.SIGSTOP)

    def thaw(self, local_ranks: Collection[int] | None = None) -> None:
        """Continue the workers freeze() stopped (all, or those of `local_ranks`): they must act on what comes
        next (a Stop; a save of their own copies)."""
        ranks = [r for r in self._frozen if local_ranks is None or r in local_ranks]
        self._signal([self._frozen.pop(r) for r in ranks], signal.SIGCONT)

    @contextmanager
    def paused(self, timeout: float = 5.0):
        """Every live worker stopped (SIGSTOP, until the kernel says so) for the block, then continued unless
        frozen: the agent writes files of copies that refer to their snapshot buffers (dpagent.dedup) while a
        stopping job's workers may still train, and a buffer they wrote meanwhile would tear the file."""
        stopped = self._signal([w.pid for w in self.alive()], signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        try:
            for pid in stopped:
                while _running(pid) and time.monotonic() < deadline:
                    time.sleep(0.001)
            yield
        finally:
            self._signal([pid for pid in stopped if pid not in self._frozen.values()], signal.SIGCONT)

    @staticmethod
    def _signal(pids: list[int], sig: int) -> list[int]:
        """Sends `sig` to each of `pids`; returns those it reached."""
        reached = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                reached.append(pid)
            except ProcessLookupError:
                pass
        return reached

    def ask_for_stacks(self) -> None:
        """Each live worker that handles the signal (dpstate's: to another process it is fatal) writes its threads'
        stacks to its stderr (dpcommon.stack_dump); their children are not asked."""
        for worker in self.alive():
            stack_dump.ask(worker.pid)

    def signal_all(self, sig: int) -> None:
        """Signals every live worker and its descendants."""
        for worker in self.alive():
            signal_tree(worker.pid, sig)


def _running(pid: int) -> bool:
    """Not yet stopped (nor gone)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
