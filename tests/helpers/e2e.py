"""Helpers for end-to-end tests: run `dprun` for real, read its events and the trainer's summary."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from conftest import REPO
from dpcommon import stack_dump

TRAIN = str(REPO / "examples" / "train_gpt.py")
# small and quick, still a real GPT on real text
TRAIN_ARGS = ["--seed", "0", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "32",
              "--batch-size", "8"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    events: list[dict]
    summary: dict | None
    seconds: float
    ended_at: float = 0.0  # wall time (as the events') when dprun had exited

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def controller_up(head, events: Path, timeout: float = 60) -> None:
    """Wait until a head dprun's controller listens (its first event: its own node joined) before starting the
    other nodes: their agents' replica stores, binding any free port, and their connection attempts could
    otherwise take the endpoint's port, which free_port() only found free."""
    wait_for(lambda: head.poll() is not None or read_events(events), timeout=timeout, what="the controller to listen")
    assert head.poll() is None, f"the head dprun exited ({head.returncode}) before its controller listened"


def dprun(procs, tmp: Path, name: str, *options: str, steps: int = 40, timeout: float = 150, env=None,
          train_args: tuple = (), script: str = TRAIN, script_args: list | None = None) -> Run:
    """Runs `dprun OPTIONS script ... script_args train_args` (train_gpt.py with TRAIN_ARGS by default) to its
    end (killed at `timeout`)."""
    events = tmp / f"{name}.events.jsonl"
    summary = tmp / f"{name}.summary.json"
    start = time.monotonic()
    script_args = TRAIN_ARGS if script_args is None else script_args
    proc = procs.dprun(*options, "--events-file", events, script, "--steps", steps, *script_args, *train_args,
                       "--summary", summary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       cwd=tmp, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        asked = ask_for_stacks(proc.pid)
        procs.kill_all()
        out, err = proc.communicate()
        raise AssertionError(f"dprun {name} did not finish in {timeout} s; the stacks of its {asked} processes are "
                             f"in its stderr\n{out[-3000:]}\n{err[-40000:]}")
    return Run(proc.returncode, out, err, read_events(events),
               json.loads(summary.read_text()) if summary.exists() else None, time.monotonic() - start, time.time())


def ask_for_stacks(pid: int, settle_s: float = 2.0) -> int:
    """Ask a job's head dprun and every process under it (agents, workers) to write their threads' stacks to
    their stderr (dpcommon.stack_dump), and give them `settle_s` to do it: what a job that hung was doing.
    How many were asked."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    asked = sum(stack_dump.ask(p.pid) for p in tree)
    time.sleep(settle_s)  # faulthandler writes at once; the agents relay their workers' lines within a tick
    return asked


def the_save(events: list[dict], said: str = "") -> dict:
    """The saving_state event of the step a stopping job saved, as its job_finished says. A stopping job's
    workers may train on past the step first asked (a first SIGTERM lets them): the save is then retried for a
    newer step, never an older one. `said`: the job's output, for a failure's message."""
    savings = [e for e in events if e["event"] == "saving_state"]
    (finished,) = [e for e in events if e["event"] == "job_finished"]
    steps = [e["step"] for e in savings]
    assert steps and steps == sorted(set(steps)), f"{steps}\n{finished['message']}\n{said}"
    assert f"is saved in {savings[-1]['folder']}" in finished["message"], f"{finished['message']}\n{said}"
    return savings[-1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
