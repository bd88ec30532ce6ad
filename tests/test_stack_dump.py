"""A job's processes (dprun, its agent, the workers) write their threads' stacks to stderr when asked
(dpcommon.stack_dump), and go on: what a hung job was doing, for the e2e tests' timeouts and for an operator."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpcommon import stack_dump
from helpers.e2e import ask_for_stacks, wait_for

SCRIPT = """
import os, threading, dpstate
job = dpstate.init()
def waiting_here():
    open(os.environ["READY"], "w").close()
    threading.Event().wait()
waiting_here()
"""


def test_a_process_writes_its_stacks_on_request_and_goes_on(tmp_path: Path):
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", "from dpcommon import stack_dump; import time\n"
                                  "stack_dump.install()\ndef sleeping_here():\n    print('ready', flush=True)\n"
                                  "    time.sleep(60)\nsleeping_here()"],  # (ready once in the frame asked for)
                                 stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert stack_dump.handles(child.pid) and stack_dump.ask(child.pid)
        wait_for(lambda: "sleeping_here" in stderr.read_text() or child.poll() is not None, 10,
                 f"its stacks ({stderr})")
        assert child.poll() is None, "a stack dump ended the process"
        assert "sleeping_here" in stderr.read_text()
    finally:
        child.kill()
        child.communicate(timeout=10)
    assert not stack_dump.ask(child.pid)  # gone: said, not raised


def test_a_process_that_does_not_handle_the_signal_is_not_sent_it():
    """To a process that did not install the handler the real-time signal would be fatal."""
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert not stack_dump.handles(child.pid) and not stack_dump.ask(child.pid)
        assert child.poll() is None
    finally:
        child.kill()
        child.communicate(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_process_of_a_job_dumps_its_stacks_when_asked(procs, tmp_path: Path):
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    proc = procs.dprun("--nnodes", "1", "--nproc-per-node", "1", "--no-tui", script, env={"READY": str(ready)},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: ready.exists() or proc.poll() is not None, 150, "the worker to wait")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    started = time.monotonic()
    asked = ask_for_stacks(proc.pid)
    assert asked >= 3  # dprun, its agent, the worker
    assert proc.poll() is None, "a stack dump ended the job"
    procs.kill_all()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 30
    assert "waiting_here" in err, err[-5000:]  # the worker's, relayed by its agent
    assert "dpagent/" in err and "dprun/" in err, err[-5000:]  # the agent's own and the head's
