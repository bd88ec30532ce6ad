"""Starts node agents on this machine, each in its own session (a node that can be killed or frozen whole).

Watches them: an agent that exits while the job runs is reported at once, as a lost node (and whether the
kernel's OOM killer ended it, as their memory cgroup counted: dpagent.oom).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, BinaryIO, Callable, Sequence

import psutil

from dpcommon import protocol as p
from dpagent.oom import SAMPLE_EVERY_S, OomKills


@dataclass
class AgentCommand:
    node_id: str
    controller: str  # tcp://host:port
    nproc_per_node: int
    script: Sequence[str]  # what the agent runs per worker, after "--"
    spare: bool = False
    node_rank: int = -1
    local_addr: str = "127.0.0.1"
    run_dir: str | None = None
    no_python: bool = False
    module: bool = False
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    max_restarts: int = 3
    register_timeout: float = 300.0  # --rdzv-timeout: no Welcome by then, the agent exits 4
    env: dict[str, str] = field(default_factory=dict)  # this node's own environment (dprun.launcher.gpus)
    terms: p.JobTerms | None = None  # what this dprun was told of the job (Register.terms)

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "dpagent", "--controller", self.controller, "--node-id", self.node_id,
                "--nproc-per-node", str(self.nproc_per_node), "--node-rank", str(self.node_rank),
                "--local-addr", self.local_addr]
        if self.spare:
            args.append("--spare")
        if self.run_dir:
            args += ["--run-dir", self.run_dir]
        if self.no_python:
            args.append("--no-python")
        if self.module:
            args.append("--module")
        if self.log_dir:
            args += ["--log-dir", self.log_dir]
        if self.local_ranks_filter:
            args += ["--local-ranks-filter", self.local_ranks_filter]
        args += ["--redirects", self.redirects, "--tee", self.tee, "--max-restarts", str(self.max_restarts),
                 "--register-timeout", str(self.register_timeout)]
        if self.terms is not None:
            args += ["--job-terms", json.dumps(dataclasses.asdict(self.terms))]
        return [*args, "--", *self.script]


class OutputTail:
    """Collects the output of local agents and workers while the dashboard owns the terminal: the newest
    lines for its output panel, every line in `path`."""

    def __init__(self, path: str, keep: int = 200):
        self.path = path
        self.lines: collections.deque = collections.deque(maxlen=keep)
        self._file: BinaryIO = open(path, "ab", buffering=0)
        self._lock = threading.Lock()

    def read_from(self, pipe: IO[bytes]) -> None:
        threading.Thread(target=self._pump, args=(pipe,), daemon=True, name="output-tail").start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            with self._lock:
                try:
                    self._file.write(raw)
                except (OSError, ValueError):
                    pass
                line = raw.decode(errors="replace").rstrip()
                if not line.startswith("[dpagent "):  # the agents' news is in the event log already
                    self.lines.append(line)
        pipe.close()

    def latest(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class LocalAgents:
    """on_exit(node_id, exit code, whether the OOM killer ended it) for an agent that exits while not stopping."""

    def __init__(self, env: dict[str, str], on_exit: Callable[[str, int, bool], None],
                 capture: OutputTail | None = None, hosts_controller: bool = False):
        self.env = env
        # this process runs the controller: should it die (kill -9), its agents save what they hold, as they do
        # when they lose a controller elsewhere, instead of dying with it; a member's agent leaves the job, saying
        # so to the controller (which fails its node at once) and removing its run folder
        self.parent_death = "controller" if hosts_controller else "member"
        self.on_exit = on_exit
        self.capture = capture  # the dashboard owns the terminal: agents' and workers' output goes here
        self.procs: dict[str, subprocess.Popen] = {}
        self.watchers: dict[str, threading.Thread] = {}
        self.oom_kills = OomKills()
        self.oom_killed: set[str] = set()  # the nodes whose agent the OOM killer ended
        self.stopping = False

    def start(self, cmd: AgentCommand) -> subprocess.Popen:
        env = dict(os.environ, **self.env, **cmd.env, DP_PDEATHSIG=self.parent_death, PYTHONUNBUFFERED="1")
        captured = self.capture is not None
        proc = subprocess.Popen(cmd.argv(), env=env, start_new_session=True,
                                stdout=subprocess.PIPE if captured else None,
                                stderr=subprocess.STDOUT if captured else None)
        if self.capture is not None:
            assert proc.stdout is not None  # (piped above)
            self.capture.read_from(proc.stdout)
        self.procs[cmd.node_id] = proc
        self.watchers[cmd.node_id] = watcher = threading.Thread(target=self._watch, args=(cmd.node_id, proc),
                                                                daemon=True, name=f"watch-{cmd.node_id}")
        watcher.start()
        return proc

    def _watch(self, node_id: str, proc: subprocess.Popen) -> None:
        while True:
            try:
                code = proc.wait(SAMPLE_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                self.oom_kills.sample(time.monotonic())
        if code == -signal.SIGKILL and not self.stopping and self.oom_kills.claim(time.monotonic()):
            self.oom_killed.add(node_id)
        if not self.stopping:
            self.on_exit(node_id, code, node_id in self.oom_killed)

    def ended_by_oom_killer(self, node_id: str) -> bool:
        """Whether the OOM killer ended this node's agent, once its watcher saw it exit."""
        watcher = self.watchers.get(node_id)
        if watcher is not None:
            watcher.join(timeout=5.0)
        return node_id in self.oom_killed

    def signal_agent(self, node_id: str, sig: int) -> bool:
        """Send `sig` to a node's agent alone; False if it is not ours or gone."""
        proc = self.procs.get(node_id)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(sig)
        return True

    def signal_node(self, node_id: str, sig: int) -> bool:
        """Send `sig` to a node's whole process group (agent and workers); False if it is not ours."""
        proc = self.procs.get(node_id)
        if proc is None:
            return False
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def wait_all(self, timeout: float) -> None:
        """After the job's Stop: give agents `timeout` seconds to exit, then kill what is left, whole. A frozen
        one (SIGSTOP: a freeze-node fault, or Ctrl-Z'd) cannot exit by itself: killed at once, not waited for."""
        self.stopping = True
        for proc in self.procs.values():
            if _stopped(proc.pid):
                _kill_group(proc)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()

    def kill_all(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL an agent's whole process group (its workers too), and wait for the agent."""
    for sig in (signal.SIGKILL, signal.SIGCONT):  # a frozen node must be woken to die
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False
