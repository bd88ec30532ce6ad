"""Every fault, every time: real dprun jobs on loopback meeting freezes, hangs, cascades and bad input.

Each recovered run must end bitwise identical to the failure-free run of the same shape.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from conftest import free_port
from dpcommon import protocol as p
from helpers.cgroups import counter_in, in_cgroup, memory_cgroup
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, wait_for
from helpers.multi_node import multi_node_job

pytestmark = pytest.mark.slow
STEPS = 30
FAST = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "2"]


@pytest.fixture
def sha2(unbroken):
    """The failure-free run's parameters, 2 nodes (conftest's session-wide runs: test_e2e_saving's too)."""
    return unbroken(2, STEPS).summary["params_sha256"]


@pytest.fixture
def sha3(unbroken):
    return unbroken(3, STEPS).summary["params_sha256"]


def _recovered(run, sha: str, recoveries: int = 1):
    assert run.returncode == 0, run.stderr[-4000:]
    assert len(run.named("recovery_complete")) == recoveries, [e["event"] for e in run.events]
    assert run.summary["final_step"] == STEPS
    assert run.summary["params_sha256"] == sha, "the recovered run diverged from the failure-free one"


def test_frozen_node_is_failed_at_the_heartbeat_deadline_and_survivors_are_released(procs, tmp_path, sha2):
    run = dprun(procs, tmp_path, "freeze", "--nnodes", "2", "--spares", "1", *FAST,
                "--inject", "freeze-node:1@step=8", steps=STEPS)
    _recovered(run, sha2)
    (failed,) = run.named("node_failed")
    assert failed["node"] == "node1" and "heartbeat" in failed["cause"]
    (done,) = run.named("recovery_complete")
    assert 1.5 < done["phases"]["detect_s"] < 4.5, done  # the 2 s heartbeat deadline, not a Gloo timeout
    # the gate's 2 s wait for the frozen node's ack was the failure's: no stall warning charges it to a step (it
    # read 2116 %; a short stall on this busy host after the recovery may still be said, at its own few percent)
    shares = [int(share) for share in re.findall(r"snapshots' replication (\d+)% of the time", run.stderr)]
    assert all(share < 50 for share in shares), run.stderr[-3000:]
    (finished,) = run.named("job_finished")  # its frozen agent is killed at once, not waited for (it was 10 s)
    assert run.ended_at - finished["time"] < 5, run.ended_at - finished["time"]


def test_frozen_node_that_wakes_after_the_swap_is_fenced(procs, tmp_path, sha2):
    run = dprun(procs, tmp_path, "wake", "--nnodes", "2", "--spares", "1", *FAST,
                "--inject", "freeze-node:1@step=6", "--inject", "wake-node:1@step=16", steps=STEPS)
    _recovered(run, sha2)
    assert [e["kind"] for e in run.named("fault_injected")] == ["freeze-node", "wake-node"]
    # it cannot disturb the new generation: its agent leaves (told it is fenced, or finding the controller
    # silent for longer than the heartbeat timeout), taking its workers with it
    assert re.search(r"\[dpagent node1\] exit [13]\b", run.stderr), run.stderr[-3000:]


def test_a_whole_job_paused_past_the_heartbeat_timeout_goes_on_when_continued(procs, tmp_path, sha2):
    """Every process of the job stopped at once for 3x the heartbeat timeout (as a paused VM or a laptop's
    Ctrl-Z of the whole job would) and continued: neither the controller nor an agent takes the other's
    silence for a failure, since each can tell that it did not run itself. The job trains on, unbroken."""
    summary, events = tmp_path / "paused.summary.json", tmp_path / "paused.events.jsonl"
    run = procs.dprun("--nnodes", "2", "--spares", "1", "--no-tui", *FAST, "--events-file", events, TRAIN,
                      "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1", "--summary", summary,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    job = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    for process in job:
        process.suspend()
    try:
        time.sleep(6.0)  # the fault itself: how long the job stays stopped (3x the 2 s heartbeat timeout)
    finally:
        for process in reversed(job):
            process.resume()
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-3000:]
    assert not [e for e in read_events(events) if e["event"] == "node_failed"], err[-3000:]
    (paused,) = [e for e in read_events(events) if e["event"] == "controller_paused"]
    assert paused["seconds"] > 5.0
    assert json.loads(summary.read_text())["params_sha256"] == sha2


def test_hung_worker_is_found_by_the_hang_timeout(procs, tmp_path, sha2):
    # (8 s: the same timeout bounds each worker's exit after the last step, which took over 3 s on a busy 2-core host)
    run = dprun(procs, tmp_path, "hang", "--nnodes", "2", "--spares", "1", "--hang-timeout", "8",
                "--inject", "hang-worker:1@step=8", steps=STEPS)
    _recovered(run, sha2)
    (failed,) = run.named("node_failed")
    assert failed["node"] == "node1" and "--hang-timeout" in failed["cause"] and "rank 1" in failed["cause"]


def test_a_worker_stopped_as_a_recovery_begins_is_found_at_the_rendezvous_by_the_hang_timeout(procs, tmp_path, sha3):
    """Node 1 dies; as the new generation is sent, node 0's worker is stopped (SIGSTOP). The other ranks wait for it
    at the generation's rendezvous, where no step is made: before, no hang clock ran there and the job hung for
    ever. Now node 0 is failed at --hang-timeout, the second spare takes its rank from its other replica, and the
    job ends bit for bit."""
    run = dprun(procs, tmp_path, "rendezvous", "--nnodes", "3", "--spares", "2", "--replicas", "2",
                "--hang-timeout", "8", "--inject", "kill-node:1@step=8", "--inject", "hang-worker:0@during-recovery",
                steps=STEPS)
    _recovered(run, sha3)
    failed = {e["node"]: e["cause"] for e in run.named("node_failed")}
    assert set(failed) == {"node0", "node1"}, failed
    assert "--hang-timeout" in failed["node0"] and "rank 0 stopped responding" in failed["node0"], failed


def test_idle_spare_dying_shrinks_the_pool_and_nothing_else(procs, tmp_path, sha2):
    run = dprun(procs, tmp_path, "spare", "--nnodes", "2", "--spares", "2",
                "--inject", "kill-spare:0@step=5", steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.named("spare_lost")[0]["spares_left"] == 1
    assert not run.named("recovery_complete")
    assert run.summary["params_sha256"] == sha2


HOG = """
import sys, pathlib
counter = pathlib.Path(sys.argv[1])
def kills():
    return int(next(l.split()[1] for l in counter.read_text().splitlines() if l.split()[0] == "oom_kill"))
before, held = kills(), []
while kills() == before:  # until the OOM killer has ended one process of the cgroup: then stop asking
    held.append(bytearray(1 << 20))
"""


def test_an_agent_ended_by_the_oom_killer_is_named_so_and_a_spare_takes_over(procs, tmp_path, sha2):
    """The job in a memory cgroup of its own; node1's agent made the OOM killer's first choice (oom_score_adj
    1000); another process of the cgroup asks for memory until the OOM killer has ended one. dprun names the node's
    loss by the cgroup's count of OOM kills, and the run recovers to the failure-free result."""
    events, summary = tmp_path / "oom.events.jsonl", tmp_path / "oom.summary.json"
    with memory_cgroup(3 << 30) as cgroup:
        command = [sys.executable, "-m", "dprun", "--nnodes", "2", "--spares", "1", "--no-tui", "--events-file",
                   events, TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.3", "--summary", summary]
        job = procs.popen(in_cgroup(cgroup, command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path)
        wait_for(lambda: job.poll() is not None or any(e["event"] == "progress" and e["step"] >= 3
                                                       for e in read_events(events)), 60, "step 3")
        assert job.poll() is None, job.communicate()[1][-3000:]
        (agent,) = [e["pid"] for e in read_events(events) if e["event"] == "node_joined" and e["node"] == "node1"]
        Path(f"/proc/{agent}/oom_score_adj").write_text("1000")
        # (the asking process may be killed next, should it ask again before the agent's memory is back)
        subprocess.run(in_cgroup(cgroup, [sys.executable, "-c", HOG, counter_in(cgroup)]), timeout=60)
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-4000:]
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["node"] == "node1", failed
    assert failed["cause"] == "agent process exited (killed by the kernel's OOM killer: out of memory)", failed
    assert json.loads(summary.read_text())["params_sha256"] == sha2


def test_spare_dying_during_its_promotion_makes_the_next_spare_take_over(procs, tmp_path, sha2):
    run = dprun(procs, tmp_path, "promote", "--nnodes", "2", "--spares", "2",
                "--inject", "kill-node:1@step=8", "--inject", "kill-node:1@during-recovery", steps=STEPS)
    _recovered(run, sha2)
    assert {e["cause"] for e in run.named("node_failed")} == {"agent process exited (killed by SIGKILL)"}, \
        "a kill -9 is not taken for the OOM killer"
    promoted = [e["spare"] for e in run.named("spare_promoted")]
    assert sorted(promoted) == ["node2", "node3"], "both spares, one after the other (either may register first)"
    assert run.named("recovery_complete")[0]["generation"] == 2


def test_second_failure_during_recovery_restarts_from_the_newer_view(procs, tmp_path, sha3):
    run = dprun(procs, tmp_path, "cascade", "--nnodes", "3", "--spares", "2", "--replicas", "2",
                "--inject", "kill-node:1@step=8", "--inject", "kill-node:2@during-recovery", steps=STEPS)
    _recovered(run, sha3)
    assert {e["node"] for e in run.named("node_failed")} == {"node1", "node2"}


def test_a_node_and_its_replica_holder_dying_together_survive_with_two_replicas(procs, tmp_path, sha3):
    run = dprun(procs, tmp_path, "pair2", "--nnodes", "3", "--spares", "2", "--replicas", "2",
                "--inject", "kill-node:1@step=8", "--inject", "kill-node:2@step=8", steps=STEPS)
    _recovered(run, sha3)


def test_a_node_and_its_only_replica_holder_dying_together_stop_naming_the_lost_state(procs, tmp_path):
    run = dprun(procs, tmp_path, "pair1", "--nnodes", "3", "--spares", "2",
                "--inject", "kill-node:1@step=8", "--inject", "kill-node:2@step=8", steps=STEPS, timeout=90)
    assert run.returncode == 1
    assert "state lost" in run.stderr and "ranks [1]" in run.stderr
    assert not run.named("recovery_complete"), "never resumes from inconsistent state"


def test_a_second_failure_that_takes_a_ranks_last_copy_during_a_recovery_stops_the_job_at_once(procs, tmp_path):
    """Node 1 dies and a spare is handed rank 1, whose only copy is on node 0; node 0 dies as the recovery
    begins, taking rank 1's copy and its own rank 0 (whose copy was on node 1). Rank 0 is gone whatever the
    spare says of rank 1: the job stops at once, naming both (it once waited 120 s in silence for the spare)."""
    run = dprun(procs, tmp_path, "lastcopy", "--nnodes", "2", "--spares", "2",
                "--inject", "kill-node:1@step=8", "--inject", "kill-node:0@during-recovery", steps=STEPS, timeout=60)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "state lost: ranks [0, 1]" in run.stderr
    last_failure = max(e["time"] for e in run.named("node_failed"))
    (finished,) = run.named("job_finished")
    assert finished["time"] - last_failure < 10, run.stderr[-3000:]
    # the spares' workers obeyed the Stop: their agents say so, not the last line they printed before it
    assert re.search(r"\[dpagent node[23]\] worker 0 \(pid \d+\) exited: exit code 1 \(as the job stops\)",
                     run.stderr), run.stderr[-3000:]


def test_workers_lost_on_both_nodes_in_one_recovery_restore_from_the_stores_their_nodes_keep(procs, tmp_path, sha2):
    """Node 1's worker dies; as the spare takes its place, node 0's worker dies too. Each node held the other's
    only copy, and neither node died: a node fenced for its worker's exit keeps its store, which serves the
    restore. The job trains on from it, bitwise (it said "state lost", and, without --save-dir, did until a
    node's store was kept for restores too, not only for a save)."""
    run = dprun(procs, tmp_path, "kept", "--nnodes", "2", "--spares", "2",
                "--inject", "kill-worker:1@step=8", "--inject", "kill-worker:0@during-recovery", steps=STEPS)
    _recovered(run, sha2)
    assert {e["node"] for e in run.named("node_failed")} == {"node0", "node1"}


def test_a_corrupt_replica_is_detected_and_another_copy_used(procs, tmp_path, sha3):
    # Snapshots every 10 steps; node 1 dies around step 14, far from the next snapshot (20), so rank 1's
    # newest snapshot (10) was acked, hence reported, by both its holders (node 2 and node 0) before any rank
    # passed step 11's gate. The plan names the first holder in order, node 0, whose store is corrupted as
    # the recovery begins (the fault is sent before the plan): the fetch must find the bad checksum, report
    # it, and take node 2's copy instead. Each fetch runs over 3 connections (DP_FETCH_STREAMS), each bringing
    # every third chunk of a copy that its holder keeps partly by reference (chunks of uneven sizes).
    run = dprun(procs, tmp_path, "corrupt", "--nnodes", "3", "--spares", "1", "--replicas", "2",
                "--snapshot-interval", "10", "--inject", "kill-node:1@step=14",
                "--inject", "corrupt-replicas:0@during-recovery", steps=STEPS, env={"DP_FETCH_STREAMS": "3"})
    assert run.returncode == 0, run.stderr[-4000:]
    plans = run.named("reconfigure")
    assert plans and all(p["restore_step"] == 10 for p in plans), plans
    bad = run.named("restore_failed")
    assert bad and bad[0]["rank"] == 1 and bad[0]["step"] == 10 and "checksum" in bad[0]["reason"], bad
    assert [e["generation"] for e in run.named("recovery_complete")] == [plans[-1]["generation"]]
    assert run.summary["params_sha256"] == sha3, bad


def test_a_corrupt_only_copy_stops_the_job_instead_of_loading_it(procs, tmp_path):
    run = dprun(procs, tmp_path, "corrupt1", "--nnodes", "2", "--spares", "1",
                "--inject", "kill-node:1@step=10", "--inject", "corrupt-replicas:0@during-recovery", steps=STEPS, timeout=90)
    assert run.returncode == 1
    assert run.named("restore_failed") and "state lost" in run.stderr


def _multi_node(procs, tmp_path, *extra: str, step_sleep: float = 0.1):
    """(endpoint, events file, head, start(*options) for another node) of a job of dprun processes."""
    # these tests act on the running job from outside: 0.1 s steps (or longer) keep it running until they do
    script = [TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", step_sleep, "--summary", tmp_path / "summary.json"]
    job = multi_node_job(procs, tmp_path, *extra, script=script, secret="fault-tests-secret")
    return job.endpoint, job.events, job.head, job.start


def test_out_of_spares_waits_for_a_node_to_join_the_running_job(procs, tmp_path, sha2):
    endpoint, events, head, start = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "0",
                                                "--on-spare-exhausted", "wait")
    victim = start("--node-rank", "1")
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(events)),
             timeout=90, what="training to pass step 5")
    victim.kill()
    wait_for(lambda: any(e["event"] == "waiting_for_spare" for e in read_events(events)), timeout=30,
             what="the controller to wait for a spare")
    start()  # a node joins the running job: it becomes the spare and is promoted
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == sha2


def test_a_member_whose_dprun_is_killed_leaves_the_job_at_once_and_a_spare_takes_over(procs, tmp_path, sha2):
    """kill -9 of a member node's dprun alone: its agent (the parent-death signal) tells the controller it leaves,
    kills its workers and removes its run folder; the controller fails the node at once, not at the heartbeat
    timeout, and the spare takes over."""
    endpoint, events, head, start = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "1",
                                                "--heartbeat-timeout", "20")
    member = start("--node-rank", "1")
    start("--node-rank", "2")  # the spare (a node rank past --nnodes; one without may register first)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(events)), timeout=90,
             what="training to pass step 5")
    (agent,) = psutil.Process(member.pid).children()
    procs.adopt([agent])
    run_dir = Path(agent.cmdline()[agent.cmdline().index("--run-dir") + 1])
    assert run_dir.is_dir()
    member.kill()
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["node_rank"] == 1 and "its agent left the job: the dprun that ran it" in failed["cause"], failed
    (done,) = [e for e in read_events(events) if e["event"] == "recovery_complete"]
    assert done["phases"]["detect_s"] < 5, done  # told, not found silent at the 20 s heartbeat timeout
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == sha2
    assert not psutil.wait_procs([agent], timeout=10)[1], "the agent outlived its dprun"
    assert not run_dir.exists(), "the agent removes the run folder its dead dprun made"


def test_a_member_whose_agent_alone_is_killed_is_failed_at_once_as_its_dprun_says_and_a_spare_takes_over(
        procs, tmp_path, sha2):
    """kill -9 of a member node's agent alone (the OOM killer's choice, say), its dprun alive: the agent could tell
    no one, so its dprun tells the controller (AgentExited); the node is failed at once for that, not at the
    20 s heartbeat timeout, and the spare takes over. The dprun passes the agent's end on (128 + 9)."""
    endpoint, events, head, start = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "1",
                                                "--heartbeat-timeout", "20")
    member = start("--node-rank", "1")
    start("--node-rank", "2")
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(events)), timeout=90,
             what="training to pass step 5")
    (agent,) = psutil.Process(member.pid).children()
    procs.adopt([agent, *agent.children(recursive=True)])
    agent.kill()
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["node_rank"] == 1 and failed["cause"] == "agent process exited (killed by SIGKILL)", failed
    (done,) = [e for e in read_events(events) if e["event"] == "recovery_complete"]
    assert done["phases"]["detect_s"] < 5, done  # told, not found silent at the 20 s heartbeat timeout
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == sha2
    assert member.wait(timeout=30) == 128 + signal.SIGKILL


def test_a_member_whose_agent_alone_gets_sigterm_leaves_saying_so_and_a_spare_takes_over(procs, tmp_path, sha2):
    """SIGTERM to one node's agent, not to the job (its host shutting down, a stray kill): it waits the heartbeat
    timeout for the job to stop, then tells the controller it leaves and why (Leaving), and stops its workers;
    the node is failed for that reason, not for its workers' exit codes (143 is no error of the script's)."""
    endpoint, events, head, start = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "1", *FAST,
                                                step_sleep=0.2)
    member = start("--node-rank", "1")
    start("--node-rank", "2")
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(events)), timeout=90,
             what="training to pass step 5")
    (agent,) = psutil.Process(member.pid).children()
    procs.adopt([agent])
    agent.send_signal(signal.SIGTERM)
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    assert member.wait(timeout=30) == 128 + signal.SIGTERM
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["node_rank"] == 1, failed
    assert failed["cause"] == "its agent left the job: received SIGTERM; the controller did not stop the job"
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == sha2


def test_bad_messages_to_a_running_job_are_dropped_and_it_finishes_unharmed(procs, tmp_path, sha2):
    # 0.5 s steps: the job runs on for 15 s after its first step, where the bad messages take well under 0.1 s
    # to be dropped here
    endpoint, events, head, start = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "0", step_sleep=0.5)
    start("--node-rank", "1")
    wait_for(lambda: any(e["event"] == "progress" for e in read_events(events)), timeout=90, what="training")
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.setsockopt(zmq.IDENTITY, b"node-intruder")
    intruder.connect(f"tcp://{endpoint}")
    wrong = p.Codec(b"not-the-job-token")
    right = p.Codec(b"fault-tests-secret")
    bad = [
        wrong.encode(p.Register("node-intruder", "evil", 1, 1, False, 0, "tcp://127.0.0.1:9")),  # wrong token
        [b"garbage"],  # malformed
        [b"DP\x07", b"Ping", b"{}", b"x" * 32],  # another protocol version
        [p.MAGIC, b"Ping", b"{" * (p.MAX_BODY_BYTES + 10), b"x" * 32],  # oversized
        [p.MAGIC, b"NoSuchType", b"{}", b"x" * 32],  # unknown type (and a bad MAC)
        right.encode(p.Progress("node-intruder", 0, 0, 10**6)),  # authenticated but never registered
        right.encode(p.Progress("node0", 0, 0, 10**6)),  # claims another node's identity
    ]
    dropped = lambda: [e for e in read_events(events) if e["event"] == "message_dropped"]  # noqa: E731
    ended = lambda: any(e["event"] == "job_finished" for e in read_events(events))  # noqa: E731
    # the intruder stays connected until its messages are counted, so that none can be lost with its connection
    try:
        for frames in bad * 3:
            intruder.send_multipart(frames)
        sent_at = time.time()
        wait_for(lambda: len(dropped()) >= 10 or ended(), timeout=30, what="every bad message to be dropped and counted")
    finally:
        intruder.close()
        ctx.term()
    assert len(dropped()) >= 10, [(e["event"], round(e["time"] - sent_at, 2), e.get("step"), e.get("reason"))
                                  for e in read_events(events)]  # (times since the last bad message was sent)
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    assert {e["sender"] for e in dropped()} == {"node-intruder"}
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == sha2


@pytest.mark.timeout(150)
def test_nodes_with_another_token_or_nnodes_are_refused_at_once_and_nodes_given_different_steps_are_warned_of(
        procs, tmp_path):
    """One head, waiting for its node rank 1 (--nnodes 2):

    A joining node whose token is not the head's: the controller cannot authenticate it, drops its messages
    and tells it so (an unauthenticated refusal, heeded before a Welcome only); it exits 5 at once, saying to
    give every node the job's token. One whose endpoint has nobody listening gets no Welcome: it ends after
    --rdzv-timeout with exit 4 and a line naming the endpoint, not 3 (which says a controller was lost, and
    under Slurm sets off the job's settling).

    The right token but --nnodes 3 where the head has 2: as a spare it would leave the head waiting for an
    active node until --rdzv-timeout. The controller refuses it at its Register (dprun.controller.admission); it
    exits 2, its agent's line saying which flag to make the same, the head's log naming the refused node.

    Then node 1 joins, running the script with --steps 14, the head with 30: rank 0 trains on while rank 1 waits
    at the final barrier. Both wait on a peer, so --hang-timeout (600 s) blamed no one and said "check the
    network"; now the head warns as node 1 joins, and the job ends within seconds of the hang, naming the ranks
    that finished and the step counts as the cause.
    (train_gpt's learning rate schedule follows --steps: the ranks' parameters differ too, and are said to.)"""
    endpoint, events, head, _ = _multi_node(procs, tmp_path, "--nnodes", "2", "--spares", "0")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-jobs-secret")
    nobody = f"127.0.0.1:{free_port()}"
    script = [TRAIN, "--steps", "5", *TRAIN_ARGS]
    members = {where: procs.dprun("--rdzv-endpoint", where, "--node-rank", "1", "--token-file", wrong,
                                  "--nnodes", "2", "--rdzv-timeout", timeout, *script, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for where, timeout in ((endpoint, "40"), (nobody, "3"))}
    started = time.monotonic()
    _, err = members[endpoint].communicate(timeout=40)
    assert members[endpoint].returncode == 5, err[-2000:]
    assert time.monotonic() - started < 20, "refused at its first message, not at --rdzv-timeout (40 s)"
    assert "refused this node: its messages fail authentication with the job's token" in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"dprun: the controller at tcp://{endpoint} refused this node"), err
    _, err = members[nobody].communicate(timeout=40)
    assert members[nobody].returncode == 4, err[-2000:]
    assert f"dprun: no controller answered at tcp://{nobody} within 3 s" in err, err[-2000:]
    assert re.search(f"no Welcome from tcp://{nobody} yet after [0-9.]+s .*giving up in", err), "said as it waited"
    assert head.poll() is None  # the head still waits for a node with the right token

    member = procs.dprun("--rdzv-endpoint", endpoint, "--node-rank", "2", "--token-file", tmp_path / "token",
                         "--nnodes", "3", "--rdzv-timeout", "40", TRAIN, "--steps", "5", *TRAIN_ARGS, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    _, err = member.communicate(timeout=40)
    assert member.returncode == 2, err[-2000:]
    assert time.monotonic() - started < 20, "refused at its Register, not at --rdzv-timeout (40 s)"
    assert "was started with --nnodes 3, the job has 2: give every node the same --nnodes" in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("dprun: this node did not join the job"), err[-2000:]
    (refused,) = [e for e in read_events(events) if e["event"] == "node_refused"]
    assert "--nnodes 3" in refused["reason"]
    assert head.poll() is None  # the head still waits for its node rank 1

    member = procs.dprun("--rdzv-endpoint", endpoint, "--node-rank", "1", "--token-file", tmp_path / "token",
                         "--nnodes", "2", TRAIN, "--steps", "14", *TRAIN_ARGS, cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out, err = head.communicate(timeout=80)
    assert head.returncode == 1 and member.wait(timeout=30) == 1, err[-3000:]
    (warning,) = [e["warning"] for e in read_events(events) if e["event"] == "node_warning"]
    assert "--steps 14" in warning and f"--steps {STEPS}" in warning
    assert "job hung at its end: ranks [1] finished their steps (after step 14) and wait at the end for ranks [0]" \
        in err, err[-3000:]
