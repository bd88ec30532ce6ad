"""The worker side of the reconstruction protocol, end to end: examples/train_gpt.py under fake agents and a
real replica server; a frozen rank is replaced by a spare and the result is bitwise that of a clean run."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import zmq

from dpcommon import protocol as P
from conftest import REPO, free_port
from helpers.fake_agents import FakeAgents, reconfigure, store_master, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # real workers training: 30-90 s each
TRAIN = str(REPO / "examples" / "train_gpt.py")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
        "--max-bytes", "100000", "--log-every", "0", "--seed", "3"]
STEPS = 30


def start(procs, agents: FakeAgents, node: str, summary: Path, role: str = "active"):
    env = worker_env(node, agents.endpoints[node], DP_ROLE=role)
    return procs.popen([sys.executable, TRAIN, "--steps", str(STEPS), "--summary", str(summary), *TINY], env=env)


def hello(agents: FakeAgents, *nodes: str) -> None:
    agents.wait(lambda: all(agents.messages(P.Hello, n) for n in nodes), 60, f"Hello from {nodes}")


def finish(agents: FakeAgents, workers: dict, nodes: list[str]) -> None:
    agents.wait(lambda: all(agents.messages(P.RankFinished, n) for n in nodes), 90, f"RankFinished from {nodes}")
    for node in workers:
        agents.send(node, P.Stop(reason="done", exit_code=0))
    for node in nodes:
        assert workers[node].wait(timeout=30) == 0, f"{node} exit code"


def test_clean_run_then_spares_replace_a_frozen_and_a_killed_rank_bitwise(procs, tmp_path):
    port = free_port()
    store = store_master(port)  # noqa: F841 (kept alive for the test)

    # ---- failure-free reference, world 2
    ref = FakeAgents(tmp_path, ["a0", "a1"])
    try:
        workers = {n: start(procs, ref, n, tmp_path / "ref.json") for n in ("a0", "a1")}
        hello(ref, "a0", "a1")
        for i, node in enumerate(("a0", "a1")):
            ref.send(node, reconfigure(0, i, 2, -1, port, ref.replica_endpoint))
        finish(ref, workers, ["a0", "a1"])
        ready = ref.messages(P.WorkerReady)
        assert sorted((m.rank, m.generation, m.restored_from) for m in ready) == [(0, 0, ""), (1, 0, "")]
        steps = [m.step for m in ref.messages(P.Progress, "a1")]
        assert steps == list(range(1, STEPS + 1))
        assert ref.messages(P.RankFinished, "a0")[0].step == STEPS
        assert ref.store.steps(0) == [STEPS - 1, STEPS]  # every step was replicated; a holder keeps 2
    finally:
        ref.close()
    reference = json.loads((tmp_path / "ref.json").read_text())
    assert reference["final_step"] == STEPS

    # ---- rank 1 freezes; a spare takes its node rank; a second Reconfigure lands during recovery;
    # ---- then that spare is killed and a second spare takes over after the survivor's PeerError
    agents = FakeAgents(tmp_path, ["n0", "n1", "n2", "n3"])
    try:
        workers = {n: start(procs, agents, n, tmp_path / "run.json") for n in ("n0", "n1")}
        for spare in ("n2", "n3"):
            workers[spare] = start(procs, agents, spare, tmp_path / f"{spare}.json", role="spare")
        hello(agents, "n0", "n1", "n2", "n3")
        for i, node in enumerate(("n0", "n1")):
            agents.send(node, reconfigure(1, i, 2, -1, port, agents.replica_endpoint))
        agents.wait(lambda: any(m.step >= 10 for m in agents.messages(P.Progress, "n1")), 60, "step 10")
        os.kill(workers["n1"].pid, signal.SIGSTOP)
        time.sleep(0.5)  # n0 blocks in a collective with the frozen rank
        restore = min(agents.newest_stored(0), agents.newest_stored(1))
        assert restore >= 9
        agents.send("n0", reconfigure(2, 0, 2, restore, port, agents.replica_endpoint, {"0": ""}))
        time.sleep(0.5)  # n0 aborts, builds generation 2 and waits there for a rank that never comes
        agents.send("n0", reconfigure(3, 0, 2, restore, port, agents.replica_endpoint, {"0": ""}))
        agents.send("n2", reconfigure(3, 1, 2, restore, port, agents.replica_endpoint, {"1": agents.replica_endpoint}))
        agents.wait(lambda: any(m.step >= restore + 6 for m in agents.messages(P.Progress, "n2")), 60, "resumed")
        assert not agents.messages(P.PeerError)  # a frozen peer raises nothing: the abort came first
        resumed = [m.step for m in agents.messages(P.Progress, "n2")]
        assert resumed[:6] == list(range(restore + 1, restore + 7))

        workers["n2"].kill()
        peer_error = agents.wait(lambda: agents.messages(P.PeerError, "n0"), 30, "PeerError")[0]
        assert peer_error.generation == 3 and peer_error.rank == 0
        assert "Connection" in peer_error.detail, peer_error.detail
        restore2 = min(agents.newest_stored(0), agents.newest_stored(1))
        agents.send("n0", reconfigure(4, 0, 2, restore2, port, agents.replica_endpoint, {"0": ""}))
        agents.send("n3", reconfigure(4, 1, 2, restore2, port, agents.replica_endpoint, {"1": agents.replica_endpoint}))
        finish(agents, workers, ["n0", "n3"])

        ready = {(m.rank, m.generation): m for m in agents.messages(P.WorkerReady)}
        assert ready[(0, 3)].restored_from == "local" and ready[(1, 3)].restored_from == "replica"
        assert ready[(0, 4)].restored_from == "local" and ready[(1, 4)].restored_from == "replica"
        assert (0, 2) not in ready
        assert [m.step for m in agents.messages(P.Progress, "n3")] == list(range(restore2 + 1, STEPS + 1))
    finally:
        os.kill(workers["n1"].pid, signal.SIGCONT)
        workers["n1"].kill()
        agents.close()
    result = json.loads((tmp_path / "run.json").read_text())
    assert result == reference


RAW_COLLECTIVES = str(REPO / "tests" / "data" / "raw_collective_worker.py")


@pytest.mark.parametrize("script", [[TRAIN, "--steps", "5", *TINY], [RAW_COLLECTIVES, "5"]], ids=["ddp", "raw"])
def test_no_rank_applies_a_step_before_every_rank_snapshot_before_it_is_acked(procs, tmp_path, script):
    """The snapshot gate is global. Rank 1's replica holder never answers, so its snapshot of step 0 is never
    acked: rank 1 waits at the gate, and rank 0, whose own snapshots are acked, cannot finish step 1 either:
    it sits in a collective at step 0. With DDP (train_gpt) rank 1 waits before the all-reduce of its last
    gradient bucket; with a script whose collectives are not dpstate's, in the optimizer's pre-step hook,
    and rank 0 at the barrier that follows it. (With a gate before each rank's own optimizer step only, rank
    0 applied step 1 and waited in step 2; a restore then had to go back 2 steps, hence 3 copies
    everywhere.) A Stop then ends both, stuck as they are, with its exit code."""
    port = free_port()
    store = store_master(port)  # noqa: F841 (kept alive for the test)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a replica holder that takes every message and answers none
    silent.linger = 0
    silent_endpoint = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    agents = FakeAgents(tmp_path, ["a0", "a1"])
    workers = {}
    try:
        for node in ("a0", "a1"):
            env = worker_env(node, agents.endpoints[node], DP_STATUS_INTERVAL="0.1")
            workers[node] = procs.popen([sys.executable, *script], env=env)
        hello(agents, "a0", "a1")
        agents.send("a0", reconfigure(0, 0, 2, -1, port, agents.replica_endpoint))
        agents.send("a1", reconfigure(0, 1, 2, -1, port, silent_endpoint))
        agents.wait(lambda: agents.newest_stored(0) >= 0, 60, "rank 0's snapshot of step 0 acked")

        def statuses(node: str) -> list:
            return [(m.activity, m.step) for m in agents.messages(P.WorkerStatus, node)]

        # rank 0 reports being in a collective at step 0 five times in a row (0.1 s apart), rank 1 at the gate
        agents.wait(lambda: agents.messages(P.Progress) or (statuses("a0")[-5:] == [("collective", 0)] * 5
                                                            and statuses("a1")[-1:] == [("snapshot", 0)]),
                    60, "rank 0 held in step 1's all-reduce by rank 1's gate")
        assert not agents.messages(P.Progress), agents.messages(P.Progress)
        for node in workers:
            agents.send(node, P.Stop(reason="test over", exit_code=3))
        for node, worker in workers.items():
            assert worker.wait(timeout=30) == 3, node
    finally:
        agents.close()
        silent.close(0)
        ctx.term()
