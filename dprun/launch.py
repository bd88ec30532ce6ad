"""Starts node agents on this machine, each in its own session (a node that can be killed or frozen whole).

Watches them: an agent that exits while the job runs is reported at once, as a lost node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence


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
        return [*args, "--", *self.script]


class LocalAgents:
    def __init__(self, env: dict[str, str], on_exit: Callable[[str, int], None]):
        self.env = env
        self.on_exit = on_exit
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def start(self, cmd: AgentCommand) -> subprocess.Popen:
        env = dict(os.environ, **self.env, DP_PDEATHSIG="1", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd.argv(), env=env, start_new_session=True)
        self.procs[cmd.node_id] = proc
        threading.Thread(target=self._watch, args=(cmd.node_id, proc), daemon=True,
                         name=f"watch-{cmd.node_id}").start()
        return proc

    def _watch(self, node_id: str, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:
            self.on_exit(node_id, code)

    def wait_all(self, timeout: float) -> None:
        """After the job's Stop: give agents `timeout` seconds to exit, then kill what is left, whole."""
        self.stopping = True
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
            for sig in (signal.SIGKILL, signal.SIGCONT):  # a frozen node must be woken to die
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
