"""The live dashboard in a real terminal: dprun runs inside tmux (80x40), a node is killed, and the screen is
read back with `tmux capture-pane`; `dprun status` attaches from a second tmux window and as a plain command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from conftest import free_port
from helpers.e2e import TRAIN, TRAIN_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),  # a real job under tmux: ~35 s
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")]
WIDTH, HEIGHT = 80, 40


class Tmux:
    """A private tmux server (its own socket, in the test's folder: not left in /tmp/tmux-UID), killed with
    everything under it at the end."""

    def __init__(self, cwd):
        self.socket = str(cwd / "tmux.sock")
        self.cwd = cwd

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=20).stdout

    def shell(self, command: list[str], env: dict[str, str], done_marker: str) -> str:
        """A shell line that runs `command` in cwd with `env`, then prints the marker and its exit code."""
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        return (f"cd {shlex.quote(str(self.cwd))} && env -u COLUMNS -u LINES {assignments} "
                f"{shlex.join(command)}; echo {done_marker}=$?; sleep 600")

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def wait_screen(self, target: str, needles, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen(target)
            if all(n in text for n in needles):
                return text
            time.sleep(0.3)
        raise AssertionError(f"{target}: {needles} not on screen within {timeout} s; screen:\n{text}")

    def kill(self) -> None:
        """SIGKILL every process under every pane, then the server; wait until none is left running."""
        try:
            pids = [int(p) for p in self("list-panes", "-a", "-F", "#{pane_pid}").split()]
        except (subprocess.SubprocessError, ValueError):
            pids = []
        tree: list[psutil.Process] = []
        for pid in pids:
            try:
                root = psutil.Process(pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for proc in tree:
            try:
                proc.resume()
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=20)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(p) for p in tree):
            time.sleep(0.05)
        assert not any(_running(p) for p in tree), f"left running: {[p.pid for p in tree if _running(p)]}"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def tmux(tmp_path):
    session = Tmux(tmp_path)
    try:
        yield session
    finally:
        session.kill()


def test_dashboard_shows_nodes_promoted_spare_and_recovery(tmux, tmp_path):
    port = free_port()
    env = {"DPRUN_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color"}
    job = [sys.executable, "-m", "dprun", "--nnodes", "2", "--spares", "1", "--status-port", str(port),
           "--rdzv-id", "tuijob", "--events-file", "events.jsonl", "--inject", "kill-node:1@step=8",
           "--log-dir", "logs",
           TRAIN, "--steps", "60", *TRAIN_ARGS]
    tmux("new-session", "-d", "-s", "dp", "-x", str(WIDTH), "-y", str(HEIGHT),
         tmux.shell(job, env, "DPRUN-EXIT"))
    tmux.wait_screen("dp:0", ["DeadPool tuijob", "node0", "node1", "node2", "spare"], timeout=60)

    # a second terminal attaches while the job runs, and a script reads the same view as JSON
    status = [sys.executable, "-m", "dprun", "status", "--timeout", "60"]
    tmux("new-window", "-d", "-t", "dp", "-n", "status", tmux.shell(status, env, "STATUS-EXIT"))
    probe = subprocess.run([sys.executable, "-m", "dprun", "status", "--json", "--endpoint", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert probe.returncode == 0, probe.stderr
    model = json.loads(probe.stdout)
    assert model["job_id"] == "tuijob" and {n["node_id"] for n in model["nodes"]} == {"node0", "node1", "node2"}

    screen = tmux.wait_screen("dp:0", ["recovered (hot-swap", "promoted"], timeout=120)
    lines = screen.splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("node0", "node1", "node2")}
    assert " failed " in rows["node1"] and "agent process exited" in rows["node1"]
    assert " promoted " in rows["node2"] and " active " in rows["node0"]
    assert "spare node2 promoted to node rank 1" in screen
    assert "1 recovery (hot-swap" in screen and "steps/s" in screen and "goodput" in screen

    watched = tmux.wait_screen("dp:status", ["DeadPool tuijob", "promoted", "recovered (hot-swap"], timeout=60)
    assert all(len(line) <= WIDTH for line in watched.splitlines())

    final = tmux.wait_screen("dp:0", ["DPRUN-EXIT="], timeout=120)
    assert "DPRUN-EXIT=0" in final, final
    assert "finished (exit 0)" in final and "step 60/60" in final
    assert "dprun: done in" in final and "1 recovery (hot-swap" in final
    console_log = (tmp_path / "logs" / "tuijob" / "console.log").read_text()
    assert re.search(r"step +60 ", console_log), "the workers' output went to the log while the dashboard was up"
    tmux.wait_screen("dp:status", ["STATUS-EXIT=0"], timeout=30)
    assert not list((tmp_path / "state").glob("*.json")), "the job's status record is removed at its end"
