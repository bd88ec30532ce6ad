"""Abort mechanics with real processes: a frozen (SIGSTOP) or killed (SIGKILL) Gloo peer, the survivor's
abortable all-reduce / DDP backward released by the abort signal, then a new group on a new prefix."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port
from helpers.fake_agents import store_master

WORKER = str(Path(__file__).with_name("data") / "abort_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]  # four Gloo worker processes: ~30 s


class Worker:
    """A tests/data/abort_worker.py process with a line reader on its stdout."""

    def __init__(self, procs, port: int, rank: int, generation: int):
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        self.proc = procs.popen([sys.executable, WORKER, str(port), str(rank), str(generation)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {word} from pid {self.proc.pid} (exit {self.proc.poll()})") from None
            if got and got[0] == word:
                return got


@pytest.fixture
def tcp_store():
    port = free_port()
    store = store_master(port)
    yield port
    del store


def _resume_and_kill(proc: subprocess.Popen) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    except ProcessLookupError:
        pass


def _release(survivor: Worker, what: str) -> list[str]:
    """Start `what` on the survivor (its peer is frozen), abort after 0.3 s; the released line."""
    survivor.tell(what)
    survivor.expect("WAITING")
    time.sleep(0.3)
    survivor.tell("abort")
    released = survivor.expect("RELEASED")
    assert released[1] == "abort", released
    assert float(released[3]) < 1.0, released  # seconds from abort to release
    assert "dpstate: aborted" in " ".join(released), released
    return released


def test_frozen_or_killed_peers_then_new_groups(procs, tcp_store):
    """One survivor through four generations (process starts are what this test costs)."""
    survivor = Worker(procs, tcp_store, 0, 0)
    frozen = Worker(procs, tcp_store, 1, 0)
    standby = Worker(procs, tcp_store, 1, -1)  # joins generation 1 in the frozen one's place
    doomed = Worker(procs, tcp_store, 1, -1)  # joins generation 2, then is killed
    try:
        assert survivor.expect("JOINED")[1:] == ["0", "3.0"]
        frozen.expect("JOINED")
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        # DDP backward: the comm hook's future fails, DDP raises a plain RuntimeError naming our message
        assert _release(survivor, "ddp")[2] == "RuntimeError"
        # an abortable all_reduce
        assert _release(survivor, "allreduce")[2] == "Aborted"

        # generation 1 on a new prefix of the same TCPStore, with the stand-in (the old Gloo thread is stuck)
        survivor.tell("join 1 0 1")
        standby.tell("join 1 1 1")
        assert survivor.expect("JOINED")[1:] == ["1", "3.0"]
        standby.expect("JOINED")
        os.kill(standby.proc.pid, signal.SIGSTOP)
        # the second step of a fresh DDP rebuilds its buckets (a blocking broadcast): the barrier before it aborts
        assert _release(survivor, "ddp")[2] == "Aborted"

        # generation 2; its peer is killed during a DDP step: Gloo raises at once, no abort needed
        survivor.tell("join 2 0 2")
        doomed.tell("join 2 1 2")
        assert survivor.expect("JOINED")[1:] == ["2", "3.0"]
        doomed.expect("JOINED")
        survivor.tell("ddp")
        survivor.expect("WAITING")
        time.sleep(0.3)
        doomed.proc.kill()
        released = survivor.expect("RELEASED")
        assert released[1] == "peer" and released[2] == "RuntimeError", released  # a plain RuntimeError
        assert float(released[4]) < 0.3 + 2.0, released
        assert "Connection" in " ".join(released), released

        # generation 3: the frozen ones resume and all three form a world of 3, where a plain all-reduce
        # depends on the bucket layout (which DDP changes after its first step) and the deterministic hook not
        for worker in (frozen, standby):
            os.kill(worker.proc.pid, signal.SIGCONT)
        for rank, worker in enumerate((survivor, frozen, standby)):
            worker.tell(f"join 3 {rank} 1 3")
        for worker in (survivor, frozen, standby):
            assert worker.expect("JOINED")[1:] == ["3", "6.0"]
            worker.tell("layouts")
        for worker in (survivor, frozen, standby):
            deterministic, plain = worker.expect("LAYOUTS")[1:]
            assert deterministic == "True"
            assert plain == "False"  # why the deterministic hook exists (see dpstate/groups/ddp.py)
        for worker in (survivor, frozen, standby):
            worker.tell("exit")
        codes = {name: w.proc.wait(timeout=20) for name, w in
                 (("survivor", survivor), ("frozen", frozen), ("standby", standby))}
        assert codes == {"survivor": 0, "frozen": 0, "standby": 0}
    finally:
        for worker in (frozen, standby, doomed):
            _resume_and_kill(worker.proc)
