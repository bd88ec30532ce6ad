"""The node agent as a real process: a test ROUTER plays the controller, tests/data/fake_worker.py the workers.

Real sockets on 127.0.0.1; every process and temp dir is cleaned up by the `procs` fixture and `run_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import psutil
import pytest
import zmq

from conftest import gone
from dpcommon.checksum import checksum_chunks
from dpcommon.protocol import (
    Codec, Heartbeat, Inject, Leaving, Ping, Pong, Progress, PutSnapshot, Reconfigure, Register, SnapshotAck,
    SaveSnapshots, SnapshotChunk, SnapshotData, SnapshotFiles, SnapshotStored, Standby, Stop, FetchSnapshot, Welcome, Demote,
    WorkerExited, chunk_views,
)
from dpcommon.snapshot_files import read_snapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(30)]  # real agents and workers: 2-12 s each

REPO = Path(__file__).resolve().parents[1]
FAKE_WORKER = REPO / "tests" / "data" / "fake_worker.py"
TOKEN = "test-token"
JOB = "job-42"


class FakeController:
    """A ROUTER bound where the agent's --controller points; speaks through the real Codec."""

    def __init__(self, port: int, token: str = TOKEN):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.codec = Codec(token)
        self.node = b""

    def recv(self, kind=None, timeout=5.0, skip=(Heartbeat,)):
        """The next message of type `kind` (others of `skip` are passed over; anything else fails)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no {kind.__name__ if kind else 'message'} within {timeout}s")
            identity, *frames = self.sock.recv_multipart()
            msg, payload = self.codec.decode(frames)
            self.node = identity
            if kind is None or isinstance(msg, kind):
                return msg
            if not isinstance(msg, skip):
                raise AssertionError(f"expected {kind.__name__}, got {msg!r}")

    def recv_all(self, kind, count, timeout=5.0, skip=(Heartbeat,)):
        return [self.recv(kind, timeout, skip) for _ in range(count)]

    def quiet(self, kind, seconds) -> bool:
        """True if no message of `kind` arrives within `seconds`."""
        try:
            self.recv(kind, seconds, skip=(object,))
            return False
        except AssertionError:
            return True

    def send(self, msg, codec=None):
        self.sock.send_multipart([self.node, *(codec or self.codec).encode(msg)])

    def send_raw(self, frames):
        self.sock.send_multipart([self.node, *frames])

    def close(self):
        self.ctx.destroy(linger=0)


class AgentRun:
    def __init__(self, proc, ctl, node_id, run_dir, report_dir, stderr_path):
        self.proc, self.ctl, self.node_id = proc, ctl, node_id
        self.run_dir, self.report_dir, self.stderr_path = run_dir, report_dir, stderr_path
        self.register: Register | None = None

    def welcome(self, role="active", interval=0.2, timeout=30.0, save_dir=""):
        self.ctl.send(Welcome(self.node_id, role, JOB, interval, timeout, save_dir=save_dir))

    def reports(self, nproc, timeout=10.0) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = [self.report_dir / f"{r}.json" for r in range(nproc)]
            if all(f.exists() for f in files):
                return {r: json.loads(f.read_text()) for r, f in enumerate(files)}
            time.sleep(0.02)
        raise AssertionError(f"workers did not report within {timeout}s:\n{self.stderr()}")

    def reconfigure(self, generation=0, node_rank=0, nproc=2, restore_step=-1):
        self.ctl.send(Reconfigure(generation, node_rank, 2, nproc, 2 * nproc, restore_step, "127.0.0.1:1", "", {},
                                  "test"))

    def wait(self, timeout=10.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent still running after {timeout}s:\n{self.stderr()}") from None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@pytest.fixture
def run_dir():
    path = Path(tempfile.mkdtemp(prefix="dpa-"))  # short: ipc paths are limited to ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def controller(port):
    ctl = FakeController(port)
    yield ctl
    ctl.close()


@pytest.fixture
def start_agent(procs, controller, run_dir, tmp_path, monkeypatch):
    for key in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "DP_TOTAL_LOCAL_WORKERS", "DP_PDEATHSIG", "DP_JOB_TOKEN"):
        monkeypatch.delenv(key, raising=False)  # the agent's env must not inherit these from ours

    def start(nproc=2, agent_args=(), worker_args=(), env=None, use_run_dir=True, node_id="n1") -> AgentRun:
        report_dir = tmp_path / "reports"
        report_dir.mkdir(exist_ok=True)
        stderr_path = tmp_path / "agent.stderr"
        cmd = [sys.executable, "-m", "dpagent", "--controller", controller.endpoint, "--node-id", node_id,
               "--nproc-per-node", str(nproc), *agent_args]
        if use_run_dir:
            cmd += ["--run-dir", str(run_dir)]
        cmd += ["--", str(FAKE_WORKER), "--report-dir", str(report_dir), *worker_args]
        with open(stderr_path, "wb") as stderr:
            proc = procs.popen(cmd, cwd=REPO, env={"DP_JOB_TOKEN": TOKEN, **(env or {})}, stderr=stderr)
        run = AgentRun(proc, controller, node_id, run_dir, report_dir, stderr_path)
        run.register = controller.recv(Register, timeout=10.0)
        return run

    return start


def wait_gone(pids, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


# ----------------------------------------------------------------------------- tests


def test_register_welcome_spawns_workers_with_env(start_agent, run_dir):
    agent = start_agent(nproc=2, agent_args=["--node-rank", "1"])
    reg = agent.register
    assert (reg.node_id, reg.pid, reg.nproc, reg.want_spare, reg.node_rank) == ("n1", agent.proc.pid, 2, False, 1)
    assert reg.replica_endpoint.startswith("tcp://127.0.0.1:")
    agent.welcome(role="spare")
    beat = agent.ctl.recv(Heartbeat)
    assert beat == Heartbeat("n1", -1)
    reports = agent.reports(2)
    for local_rank, rep in reports.items():
        assert rep["env"] == {
            "DP_NODE_ID": "n1", "DP_AGENT_ENDPOINT": f"ipc://{run_dir}/agent-n1.sock", "DP_JOB_TOKEN": TOKEN,
            "DP_JOB_ID": JOB, "DP_ROLE": "spare", "DP_NPROC_PER_NODE": "2", "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": JOB, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        }
        assert rep["ppid"] == agent.proc.pid and rep["pgid"] == agent.proc.pid  # same process group as the agent
    agent.ctl.send(Stop("done", 0))
    assert agent.wait() == 0
    assert wait_gone([r["pid"] for r in reports.values()])
    assert not (run_dir / "agent-n1.sock").exists()


def test_reconfigure_relayed_progress_forwarded(start_agent):
    agent = start_agent(nproc=2)
    agent.welcome()
    agent.reconfigure(generation=0, node_rank=1)  # before the workers' Hello: relayed when they say it
    progress = agent.ctl.recv_all(Progress, 2)
    assert sorted(p.rank for p in progress) == [2, 3]
    assert {(p.node_id, p.generation, p.step, p.metrics["generation"]) for p in progress} == {("n1", 0, 0, 0)}
    agent.reconfigure(generation=1, node_rank=0)  # after Hello: relayed at once
    progress = agent.ctl.recv_all(Progress, 2)
    assert sorted(p.rank for p in progress) == [0, 1] and {p.generation for p in progress} == {1}
    assert agent.ctl.recv(Heartbeat) == Heartbeat("n1", 1)  # heartbeats carry the current generation
    agent.ctl.send(Stop("done", 0))
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert sorted((e.local_rank, e.exitcode, e.generation) for e in exits) == [(0, 0, 1), (1, 0, 1)]
    assert agent.wait() == 0


def test_a_spare_relays_standby_to_its_workers_until_it_is_promoted(start_agent):
    agent = start_agent(nproc=2)
    agent.welcome(role="spare")
    sizes = [5 << 20, 7 << 20]
    agent.ctl.send(Standby(sizes))  # most likely before the workers' Hello: relayed when they say it
    echoes = agent.ctl.recv_all(Progress, 2, timeout=10.0)
    assert sorted((e.rank, e.metrics["standby"]) for e in echoes) == [(0, sizes), (1, sizes)]
    agent.reconfigure(generation=0, node_rank=1)  # promoted
    assert sorted(p.rank for p in agent.ctl.recv_all(Progress, 2)) == [2, 3]
    agent.ctl.send(Standby([9 << 20, 9 << 20]))  # no longer a spare: not relayed, so no echo before the exits
    agent.ctl.send(Stop("done", 0))
    assert sorted(e.local_rank for e in agent.ctl.recv_all(WorkerExited, 2)) == [0, 1]
    assert agent.wait() == 0


def test_a_demoted_node_replaces_its_workers_by_spare_ones_and_reports_no_exit(start_agent):
    """Demote (a sharded job's shrink took its replica out of the mesh): the workers of the generation it left
    are killed, their exits not reported, and fresh spare ones wait, relayed the next Reconfigure."""
    agent = start_agent(nproc=2)
    agent.welcome()
    agent.reconfigure(generation=0, node_rank=1)
    assert sorted(p.rank for p in agent.ctl.recv_all(Progress, 2)) == [2, 3]
    old = [r["pid"] for r in agent.reports(2).values()]
    agent.ctl.send(Demote("its data-parallel replica left the mesh"))
    assert wait_gone(old)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = agent.reports(2)
        if not {r["pid"] for r in new.values()} & set(old):
            break
        time.sleep(0.02)
    assert {r["env"]["DP_ROLE"] for r in new.values()} == {"spare"}, new
    assert agent.ctl.recv(Heartbeat) == Heartbeat("n1", -1), "a spare's heartbeat"
    agent.reconfigure(generation=1, node_rank=0)  # promoted again
    assert sorted(p.rank for p in agent.ctl.recv_all(Progress, 2, skip=(Heartbeat,))) == [0, 1]
    agent.ctl.send(Stop("done", 0))
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert sorted(e.pid for e in exits) == sorted(r["pid"] for r in new.values()), "no exit of the old workers"
    assert agent.wait() == 0


def test_ping_pong_and_bad_messages_dropped(start_agent):
    agent = start_agent(nproc=1, agent_args=["--verbose"])
    agent.welcome()
    agent.ctl.send(Ping(1), codec=Codec("wrong-token"))
    agent.ctl.send_raw([b"not", b"a", b"deadpool", b"message"])
    agent.ctl.send_raw([b"DP\x07", b"Ping", b'{"seq":1}', b"0" * 32])
    assert agent.ctl.quiet(Pong, 0.3)
    t0 = time.monotonic()
    agent.ctl.send(Ping(5))
    assert agent.ctl.recv(Pong) == Pong("n1", 5)
    pong_s = time.monotonic() - t0
    assert pong_s < 0.5
    agent.ctl.send(Stop("done", 0))
    assert agent.wait() == 0
    log = agent.stderr()
    assert "bad MAC" in log and "(3 dropped in all)" in log
    assert all(line.startswith("[dpagent n1]") for line in log.splitlines() if "dpagent" in line)


def test_kill_worker_reports_exit_within_milliseconds(start_agent):
    agent = start_agent(nproc=2)
    agent.welcome()
    agent.reconfigure(restore_step=7)  # the fake workers report step 7 made
    agent.ctl.recv_all(Progress, 2)
    pid1 = agent.reports(2)[1]["pid"]
    t0 = time.monotonic()
    agent.ctl.send(Inject("kill-worker", 1))
    exited = agent.ctl.recv(WorkerExited, timeout=2.0)
    latency = time.monotonic() - t0
    print(f"WorkerExited {latency * 1000:.1f} ms after Inject(kill-worker)")
    assert (exited.local_rank, exited.pid, exited.exitcode, exited.node_id) == (1, pid1, -9, "n1")
    assert "SIGKILL" in exited.detail
    assert exited.step == 7  # the newest step it made, as its agent heard: the controller's may lag
    assert latency < 0.2
    agent.ctl.send(Inject("no-such-fault"))  # logged and ignored
    agent.ctl.send(Ping(9))
    assert agent.ctl.recv(Pong).seq == 9
    agent.ctl.send(Stop("done", 4))
    assert agent.ctl.recv(WorkerExited).local_rank == 0
    assert agent.wait() == 4
    assert "no-such-fault" in agent.stderr()


def test_kill_node_kills_agent_and_workers(start_agent, run_dir):
    agent = start_agent(nproc=2, worker_args=["--spawn-child"])
    agent.welcome()
    reports = agent.reports(2).values()
    pids = [r["pid"] for r in reports] + [r["child"] for r in reports]
    agent.ctl.send(Inject("kill-node"))
    assert agent.wait(5) == -signal.SIGKILL
    assert wait_gone(pids), "the workers' children too, even in sessions of their own: a node dies whole"


def wait_status(pids, status, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(psutil.Process(p).status() == status for p in pids):
            return True
        time.sleep(0.01)
    return False


def test_hang_worker_and_freeze_node(start_agent):
    agent = start_agent(nproc=2)
    agent.welcome()
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.ctl.send(Inject("hang-worker", 0))
    agent.ctl.send(Ping(1))
    assert agent.ctl.recv(Pong).seq == 1  # the agent is fine
    assert wait_status(pids[:1], psutil.STATUS_STOPPED)
    assert psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED
    agent.ctl.send(Inject("freeze-node"))
    assert wait_status([agent.proc.pid, *pids], psutil.STATUS_STOPPED)
    agent.ctl.send(Ping(2))
    assert agent.ctl.quiet(Pong, 0.3)  # a frozen node does not answer


def test_stop_exit_code_and_grandchildren_cleaned(start_agent):
    agent = start_agent(nproc=2, worker_args=["--spawn-child"])
    agent.welcome()
    reports = agent.reports(2)
    pids = [r["pid"] for r in reports.values()] + [r["child"] for r in reports.values()]
    agent.ctl.send(Stop("job done", 7))
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert {e.exitcode for e in exits} == {0}
    assert agent.wait() == 7
    assert wait_gone(pids)  # the workers' own children too


def test_stop_keeping_the_store_stops_the_workers_but_the_agent_stays_until_a_plain_stop(start_agent):
    """A node fenced for its worker's exit, with --save-dir: its workers go, its store stays (a save may need
    it), it still heartbeats and answers; the job's end (a plain Stop) ends it with that code."""
    agent = start_agent(nproc=2)
    agent.welcome()
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.ctl.send(Stop("node n1 was fenced: worker 0 exit code 1", 1, keep_store=True))
    assert {e.exitcode for e in agent.ctl.recv_all(WorkerExited, 2)} == {0}
    assert wait_gone(pids)
    agent.ctl.send(Ping(9))
    assert agent.ctl.recv(Pong) == Pong("n1", 9)  # answering once its workers are gone ...
    assert agent.ctl.recv(Heartbeat, skip=()).node_id == "n1"  # ... and beating (sent after that Pong)
    assert agent.proc.poll() is None
    agent.ctl.send(Stop("job over", 5))
    assert agent.wait() == 5


def test_stop_escalates_to_sigterm_then_sigkill(start_agent):
    agent = start_agent(
        nproc=2, agent_args=["--stop-grace", "0.3", "--term-grace", "0.3"], worker_args=["--ignore-stop", "--ignore-term"]
    )
    agent.welcome()
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.reconfigure()
    agent.ctl.recv_all(Progress, 2)  # both said Hello, so both got Stop
    t0 = time.monotonic()
    agent.ctl.send(Stop("fenced", 5))
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert {e.exitcode for e in exits} == {-9}
    assert agent.wait() == 5
    assert 0.5 < time.monotonic() - t0 < 5
    assert wait_gone(pids)
    assert "SIGTERM" in agent.stderr() and "SIGKILL" in agent.stderr()


def test_controller_silence_exits_3_and_kills_workers(start_agent):
    agent = start_agent(nproc=2, use_run_dir=False)
    agent.welcome(interval=0.1, timeout=30.0)  # (workers start in seconds on a busy host: silent only after)
    reports = agent.reports(2)
    pids = [r["pid"] for r in reports.values()]
    t0 = time.monotonic()
    agent.welcome(interval=0.1, timeout=1.0)  # welcomed again: the new timeout counts from now
    assert agent.wait(10) == 3
    assert 1.0 <= time.monotonic() - t0 < 4.0
    assert wait_gone(pids)
    own_run_dir = Path(reports[0]["env"]["DP_AGENT_ENDPOINT"][len("ipc://"):]).parent
    assert not own_run_dir.exists()  # the default temp run dir is removed
    assert "controller lost" in agent.stderr()


def test_controller_silence_with_a_save_dir_has_the_workers_save_first_then_exits_3(start_agent, tmp_path):
    agent = start_agent(nproc=2, worker_args=["--answer-save"])
    agent.welcome(interval=0.1, timeout=30.0, save_dir=str(tmp_path / "saved"))
    agent.reconfigure(node_rank=1)
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.welcome(interval=0.1, timeout=1.0, save_dir=str(tmp_path / "saved"))
    assert agent.wait(10) == 3, "the workers answered: no wait for the save's timeout"
    assert wait_gone(pids)
    assert f"controller lost: wrote rank 2 (own) step 5; rank 3 (own) step 5 to {tmp_path / 'saved'}" in agent.stderr()


def test_a_save_after_the_controller_is_lost_is_cut_short_by_a_second_signal_only(start_agent, tmp_path):
    agent = start_agent(nproc=2)  # workers that never answer a save
    agent.welcome(interval=0.1, timeout=30.0, save_dir=str(tmp_path / "saved"))
    agent.reconfigure()
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.welcome(interval=0.1, timeout=1.0, save_dir=str(tmp_path / "saved"))  # silent from now on
    wait_for_text(agent, "saving this node's snapshots to")
    agent.proc.send_signal(signal.SIGTERM)
    wait_for_text(agent, "a second signal cuts the save short")
    assert agent.proc.poll() is None and not any(gone(p) for p in pids), "the first signal lets the save go on"
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(10) == 3
    assert wait_gone(pids)
    assert "the save is cut short" in agent.stderr()
    assert f"controller lost: nothing written to {tmp_path / 'saved'}" in agent.stderr()


def wait_for_text(agent: AgentRun, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in agent.stderr():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in the agent's log within {timeout}s:\n{agent.stderr()}")
        time.sleep(0.02)


def _replica_dealer(ctx: zmq.Context, agent) -> zmq.Socket:
    """A socket to the agent's replica store, as a worker's Replicator has."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(agent.register.replica_endpoint)
    return dealer


def test_replica_put_fetch_round_trip(start_agent):
    agent = start_agent(nproc=1)
    agent.welcome()
    ctx = zmq.Context()
    try:
        dealer = _replica_dealer(ctx, agent)
        codec = Codec(TOKEN)

        def request(msg, payload=(), codec=codec, timeout=5.0):
            dealer.send_multipart(codec.encode(msg, payload), copy=False)
            if not dealer.poll(int(timeout * 1000)):
                return None, []
            return Codec(TOKEN).decode(dealer.recv_multipart())

        def put(rank, step, meta, data, generation=0, checksum=None):
            crc = zlib.crc32(data, zlib.crc32(meta)) if checksum is None else checksum
            return request(PutSnapshot(rank, step, generation, crc, len(meta) + len(data)), [meta, data])

        def chunks(reply):  # the SnapshotChunk messages that follow a found SnapshotData, in order
            out = []
            for index in range(reply.chunks):
                assert dealer.poll(5000)
                chunk, data_frames = Codec(TOKEN).decode(dealer.recv_multipart())
                assert chunk == SnapshotChunk(reply.rank, reply.step, index)
                out += data_frames
            return out

        meta, data = b'{"step": 1}', os.urandom(4 << 20)
        ack, _ = put(3, 1, meta, data)
        assert ack == SnapshotAck(3, 1, ok=True)
        assert agent.ctl.recv(SnapshotStored) == SnapshotStored("n1", 3, 1, 0, nbytes=len(meta) + len(data))
        reply, payload = request(FetchSnapshot(3, 1))
        assert reply == SnapshotData(3, 1, True, zlib.crc32(data, zlib.crc32(meta)), len(meta) + len(data), chunks=1)
        assert payload == [meta] and chunks(reply) == [data]
        reply, payload = request(FetchSnapshot(3, 2))
        assert (reply.found, payload) == (False, [])

        ack, _ = request(PutSnapshot(3, 2, 0, 1, len(meta) + len(data) + 1), [meta, data])
        assert not ack.ok and "size mismatch" in ack.error
        reply, _ = request(FetchSnapshot(3, 1), codec=Codec("wrong"), timeout=0.3)
        assert reply is None  # dropped, no answer
        for step in (2, 3, 4):
            assert put(3, step, b"m", b"d%d" % step)[0].ok
        assert request(FetchSnapshot(3, 2))[0].found is False  # only the newest 2 are kept
        reply, _ = request(FetchSnapshot(3, 3))
        assert reply.found and chunks(reply) == [b"d3"]
        reply, payload = request(FetchSnapshot(3, -1))
        assert (reply.step, payload, chunks(reply)) == (4, [b"m"], [b"d4"])

        # a big snapshot does not stall the loop: a Ping sent behind it is answered promptly
        big = os.urandom(64 << 20)
        dealer.send_multipart(Codec(TOKEN).encode(
            PutSnapshot(5, 1, 0, zlib.crc32(big, zlib.crc32(b"")), len(big)), [b"", big]), copy=False)
        t0 = time.monotonic()
        agent.ctl.send(Ping(77))
        assert agent.ctl.recv(Pong, skip=(Heartbeat, SnapshotStored)).seq == 77
        print(f"Pong {1000 * (time.monotonic() - t0):.1f} ms while a 64 MB snapshot arrives")
        assert dealer.poll(5000)
        assert Codec(TOKEN).decode(dealer.recv_multipart())[0] == SnapshotAck(5, 1, ok=True)
    finally:
        ctx.destroy(linger=0)
    agent.ctl.send(Stop("done", 0))
    assert agent.wait() == 0


@pytest.mark.timeout(90)
def test_an_agent_writing_a_save_goes_on_answering_its_controller(start_agent, tmp_path):
    """A stopping job's files are written on a thread: a large state on a slow disk takes minutes, and an agent
    silent that long would be given up as dead (dprun.controller.files). A Ping sent right behind the SaveSnapshots is
    answered before the file is done; the file then reads back whole."""
    agent = start_agent(nproc=1)
    agent.welcome()
    ctx = zmq.Context()
    try:
        dealer = _replica_dealer(ctx, agent)
        meta, data = b'{"step": 6}', os.urandom(256 << 20)
        crc = checksum_chunks(meta, chunk_views(data))
        dealer.send_multipart(Codec(TOKEN).encode(PutSnapshot(2, 6, 0, crc, len(meta) + len(data)),
                                                  [meta, *chunk_views(data)]), copy=False)
        assert dealer.poll(10_000) and Codec(TOKEN).decode(dealer.recv_multipart())[0] == SnapshotAck(2, 6, ok=True)
        agent.ctl.recv(SnapshotStored)
        t0 = time.monotonic()
        agent.ctl.send(SaveSnapshots(str(tmp_path / "step-6"), 6, [2]))
        agent.ctl.send(Ping(78))
        assert agent.ctl.recv(Pong).seq == 78  # (a SnapshotFiles first fails here)
        answered = time.monotonic() - t0
        assert agent.ctl.recv(SnapshotFiles, timeout=60) == SnapshotFiles("n1", 6, {"2": ""})
        print(f"Pong after {1000 * answered:.1f} ms, the 256 MB file after {time.monotonic() - t0:.2f} s")
    finally:
        ctx.destroy(linger=0)
    put, _, chunks = read_snapshot(tmp_path / "step-6" / "rank-2.dpsnap", generation=0)
    assert (put.rank, put.step, put.checksum) == (2, 6, crc) and b"".join(chunks) == data
    agent.ctl.send(Stop("done", 0))
    assert agent.wait() == 0


def test_missing_token_is_a_clear_error(procs):
    env = {k: v for k, v in os.environ.items() if k != "DP_JOB_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "dpagent", "--controller", "tcp://127.0.0.1:1", "--", "x.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=20,
    )
    assert proc.returncode == 2
    assert "DP_JOB_TOKEN" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_agent_dies_with_its_launcher_when_asked(procs, controller, run_dir, tmp_path):
    """DP_PDEATHSIG=1: the agent gets SIGKILL when its launcher dies, and its workers die with it."""
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    agent_cmd = [sys.executable, "-m", "dpagent", "--controller", controller.endpoint, "--node-id", "n1",
                 "--run-dir", str(run_dir), "--", str(FAKE_WORKER), "--report-dir", str(report_dir)]
    launcher = (
        "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    proc = procs.popen([sys.executable, "-c", launcher, *agent_cmd], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, env={"DP_JOB_TOKEN": TOKEN, "DP_PDEATHSIG": "1"})
    agent_pid = int(proc.stdout.readline())
    controller.recv(Register, timeout=10)
    controller.send(Welcome("n1", "active", JOB, 0.2, 30.0))
    deadline = time.monotonic() + 10
    while not (report_dir / "0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    worker_pid = json.loads((report_dir / "0.json").read_text())["pid"]
    proc.kill()
    proc.wait()
    assert wait_gone([agent_pid, worker_pid])


def _trained_then_sigterm(start_agent, timeout: float) -> tuple[AgentRun, list[int]]:
    agent = start_agent(nproc=2)
    agent.welcome(timeout=30.0)  # (workers start in seconds on a busy host: the timeout asked counts after)
    agent.reconfigure()
    agent.ctl.recv_all(Progress, 2)
    pids = [r["pid"] for r in agent.reports(2).values()]
    agent.welcome(timeout=timeout)
    wait_for_text(agent, "welcomed again")  # (before the signal: it says the timeout it waits)
    agent.proc.send_signal(signal.SIGTERM)
    wait_for_text(agent, f"received SIGTERM: waiting up to {timeout:.1f}s for the controller to stop the job")
    return agent, pids


def test_a_first_sigterm_waits_for_the_controller_which_saves_then_stops_the_job(start_agent, tmp_path):
    """As when Slurm ends a step: the controller got SIGTERM too; its save and its Stop are followed. The save
    stops the workers (which a first SIGTERM leaves training) until the Stop: none trains past the copies."""
    agent, pids = _trained_then_sigterm(start_agent, timeout=30.0)
    agent.ctl.send(SaveSnapshots(str(tmp_path / "saved"), 4, [0, 1]))
    agent.ctl.recv(SnapshotFiles)
    assert agent.proc.poll() is None and not any(gone(p) for p in pids), "the node waits for the controller"
    assert wait_status(pids, psutil.STATUS_STOPPED), "its workers stay stopped once the files are written"
    agent.ctl.send(Stop("dprun received SIGTERM; the state is saved", 143))
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert {e.exitcode for e in exits} == {0}  # they got Stop and left on their own
    assert agent.wait() == 143
    assert wait_gone(pids)


def test_a_sigterm_the_controller_does_not_follow_stops_the_node_after_the_heartbeat_timeout(start_agent):
    """A signal for this node alone (its dprun's, passed on): the job goes on without it."""
    agent, pids = _trained_then_sigterm(start_agent, timeout=2.0)
    deadline = time.monotonic() + 15.0
    while agent.proc.poll() is None and time.monotonic() < deadline:
        agent.ctl.send(Ping(seq=1))  # the controller is alive: only the wait ends it
        time.sleep(0.2)
    assert agent.wait() == 128 + signal.SIGTERM
    assert "received SIGTERM; the controller did not stop the job" in agent.stderr()
    leaving = agent.ctl.recv(Leaving, skip=(Heartbeat, Pong, Progress))  # (its workers' exits come after)
    assert leaving.reason == "received SIGTERM; the controller did not stop the job"
    assert wait_gone(pids)


def test_a_second_sigterm_stops_the_node_at_once(start_agent):
    agent, pids = _trained_then_sigterm(start_agent, timeout=30.0)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.ctl.recv(Leaving).reason == "received SIGTERM"  # the controller fails it for that, at once
    exits = agent.ctl.recv_all(WorkerExited, 2)
    assert {e.exitcode for e in exits} == {0}
    assert agent.wait() == 128 + signal.SIGTERM
    assert wait_gone(pids)


def test_a_worker_that_cannot_start_is_reported(procs, controller, run_dir, monkeypatch):
    monkeypatch.delenv("DP_PDEATHSIG", raising=False)
    cmd = [sys.executable, "-m", "dpagent", "--controller", controller.endpoint, "--node-id", "n1",
           "--run-dir", str(run_dir), "--no-python", "--", str(run_dir / "no-such-program")]
    proc = procs.popen(cmd, cwd=REPO, env={"DP_JOB_TOKEN": TOKEN}, stderr=subprocess.DEVNULL)
    controller.recv(Register, timeout=10)
    controller.send(Welcome("n1", "active", JOB, 0.2, 30.0))
    exited = controller.recv(WorkerExited)
    assert (exited.local_rank, exited.exitcode) == (0, 127) and "no-such-program" in exited.detail
    controller.send(Stop("done", 0))
    assert proc.wait(timeout=10) == 0
