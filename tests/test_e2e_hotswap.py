"""End to end: real dprun, agents and workers on loopback; nodes and workers killed by pid (SIGKILL).

A recovered run must be bitwise identical to the failure-free one (exactly-once training).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from conftest import rss_shmem
from dpstate.snapshot.warmheap import heap_rss
from helpers.cli import in_process
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, wait_for
from helpers.multi_node import multi_node_job

pytestmark = pytest.mark.slow
STEPS = 30


@pytest.fixture(scope="module")
def reference(unbroken):
    """The failure-free run every recovered run is compared with (the session's, which other files share: a
    spare, idle in the runs here, does not change what training computes)."""
    return unbroken(2, STEPS)


def _assert_recovered_exactly_once(run, reference):
    assert run.returncode == 0, run.stderr[-3000:]
    (done,) = run.named("recovery_complete")
    assert done["generation"] == 1
    assert set(done["phases"]) >= {"detect_s", "rebuild_s", "restore_s", "total_s"}
    (promoted,) = run.named("spare_promoted")
    assert promoted == {**promoted, "spare": "node2", "node_rank": 1}
    assert run.summary["final_step"] == STEPS
    assert run.summary["params_sha256"] == reference.summary["params_sha256"], "recovered run diverged"
    assert run.named("job_finished")[-1]["exit_code"] == 0
    return done


def test_kill_node_hot_swaps_the_spare_and_trains_bitwise_identically(procs, tmp_path, reference):
    run = dprun(procs, tmp_path, "kill-node", "--nnodes", "2", "--spares", "1",
                "--inject", "kill-node:1@step=15", steps=STEPS)
    done = _assert_recovered_exactly_once(run, reference)
    (failed,) = run.named("node_failed")
    assert failed["node"] == "node1" and failed["node_rank"] == 1
    assert done["phases"]["total_s"] < 10, done
    assert "recovered into generation 1" in run.stdout


def test_kill_worker_is_handled_as_the_node_failing(procs, tmp_path, reference):
    run = dprun(procs, tmp_path, "kill-worker", "--nnodes", "2", "--spares", "1",
                "--inject", "kill-worker:1@step=15", steps=STEPS)
    _assert_recovered_exactly_once(run, reference)
    (failed,) = run.named("node_failed")
    assert "SIGKILL" in failed["cause"]


def test_failure_without_spare_stops_within_seconds_naming_the_node(procs, tmp_path):
    run = dprun(procs, tmp_path, "no-spare", "--nnodes", "2", "--spares", "0",
                "--inject", "kill-node:1@step=5", steps=STEPS, timeout=90)
    assert run.returncode != 0
    assert "node1" in run.stderr and "no spare left" in run.stderr
    failed_at = run.named("node_failed")[0]["time"]
    finished = run.named("job_finished")[-1]
    assert finished["time"] - failed_at < 5
    assert finished["exit_code"] != 0


def _multi_node_job(procs, tmp_path, *flags):
    """A head (node rank 0: the controller), node rank 1 and a spare as three dprun processes (multi-node mode),
    training until past step 8; returns (head, node 1's dprun, the spare's, events file, summary file)."""
    summary = tmp_path / "summary.json"
    # running at the kill: 0.15 s steps leave 22 steps (> 3 s) after step 8 for the test to act
    script = [TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.15", "--summary", summary]
    job = multi_node_job(procs, tmp_path, "--nnodes", "2", "--spares", "1", *flags, script=script,
                         secret="multi-node-test-secret")
    victim = job.start("--node-rank", "1")
    spare = job.start("--node-rank", "2")
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(job.events)),
             timeout=90, what="training to pass step 8")
    return job.head, victim, spare, job.events, summary


def _assert_finished_as_the_reference(head, spare, events, summary, reference) -> list[dict]:
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0, err[-3000:]
    assert spare.wait(timeout=30) == 0
    events_seen = read_events(events)
    assert len([e for e in events_seen if e["event"] == "recovery_complete"]) == 1
    assert json.loads(summary.read_text())["params_sha256"] == reference.summary["params_sha256"]
    return events_seen


def test_multi_node_mode_survives_a_killed_dprun(procs, tmp_path, reference):
    head, victim, spare, events, summary = _multi_node_job(procs, tmp_path)
    victim_tree = [victim.pid] + [c.pid for c in psutil.Process(victim.pid).children(recursive=True)]
    os.kill(victim.pid, signal.SIGKILL)
    _assert_finished_as_the_reference(head, spare, events, summary, reference)
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                             for pid in victim_tree), timeout=10, what="the killed node's processes to be gone")


def test_a_whole_node_lost_at_once_is_caught_by_its_peers_not_by_the_heartbeat_timeout(procs, tmp_path, reference):
    """Every process of node rank 1 (dprun, agent, worker) stopped, then killed: none can say a word, as when a
    node's processes are killed whole. Its kernel closes their connections: the controller's socket monitor
    sees one close and probes every node, failing the silent one (about 1 s). Its peer, waiting at the snapshot
    gate for the acks of the replica store that died with it, would tell too (dpstate.replication.holders: a PeerError,
    then the same probe; about 2 s). Before both, only --heartbeat-timeout (here 60 s) noticed, unless the kill found
    the peer in a collective (about half the runs; Gloo's error then tells it). The gate's wait alone:
    test_dpstate_replication.py's test_a_holder_whose_process_died_fails_the_wait_for_its_ack_within_seconds."""
    head, victim, spare, events, summary = _multi_node_job(procs, tmp_path, "--heartbeat-timeout", "60")
    victim_tree = [victim.pid] + [c.pid for c in psutil.Process(victim.pid).children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in victim_tree:
            os.kill(pid, sig)
    killed_at = time.time()
    events_seen = _assert_finished_as_the_reference(head, spare, events, summary, reference)
    (failed,) = [e for e in events_seen if e["event"] == "node_failed"]
    assert failed["node_rank"] == 1 and re.search("(no answer to|did not answer) a probe", failed["cause"]), failed
    assert failed["time"] - killed_at < 10, failed
    told = [e["detail"] for e in events_seen if e["event"] == "peer_error"]  # (a rank in a collective then: Gloo's)
    assert all("Unable to cast" not in d for d in told), told  # (a peer that told it first: in its own words)


def test_a_spare_lost_whole_is_noticed_within_seconds_and_the_job_goes_on(procs, tmp_path, reference):
    """The spare's every process killed at once: it holds nothing and takes part in no collective, so no peer
    can tell. Its kernel closes its connection to the controller, whose probe then finds it silent; before,
    only --heartbeat-timeout (here 60 s) did, and a failure meanwhile counted on a spare that was not there."""
    head, victim, spare, events, summary = _multi_node_job(procs, tmp_path, "--heartbeat-timeout", "60")
    spare_tree = [spare.pid] + [c.pid for c in psutil.Process(spare.pid).children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # all stopped first: none lives on to tell (its agent would,
        for pid in spare_tree:  # once its dprun died: Leaving)
            os.kill(pid, sig)
    killed_at = time.time()
    wait_for(lambda: any(e["event"] == "spare_lost" for e in read_events(events)), timeout=10,
             what="the spare's loss to be noticed")
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["role"] == "spare" and "a connection to the controller closed" in failed["cause"], failed
    assert failed["time"] - killed_at < 10, failed
    out, err = head.communicate(timeout=120)
    assert head.returncode == 0 and victim.wait(timeout=30) == 0, err[-3000:]
    assert json.loads(summary.read_text())["params_sha256"] == reference.summary["params_sha256"]


def _snapshot_buffers(pid: int) -> dict[int, int]:
    """inode -> size of the snapshot buffers (dpstate's memfds) that process `pid` holds open."""
    found = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:  # it exited
        return found
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if "dpstate-snapshot" in os.readlink(path):
                found[os.stat(path).st_ino] = os.stat(path).st_size
        except FileNotFoundError:  # closed meanwhile
            continue
    return found


def _workers_by_node(root: int) -> dict[str, psutil.Process]:
    """Node id -> its worker process (the one with DP_AGENT_ENDPOINT in its environment), under dprun `root`."""
    workers = {}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("DP_AGENT_ENDPOINT"):
            workers[env["DP_NODE_ID"]] = proc
    return workers


def test_a_spare_restores_into_memory_it_made_room_in_while_idle(procs, tmp_path, reference):
    """The spare's worker is told the snapshot size (Standby) and reserves + faults in its ring of buffers while
    it idles (which `dprun status` shows), and the heap its first step allocates from; after node1 is SIGKILLed,
    its restore and the captures after it use those very buffers."""
    events, summary = tmp_path / "events.jsonl", tmp_path / "summary.json"
    heap = 256 << 20  # the spare's heap for its first step: more than an idle worker's (~80 MB with torch)
    run = procs.dprun("--nnodes", "2", "--spares", "1", "--events-file", events, TRAIN, "--steps", STEPS,
                      *TRAIN_ARGS, "--step-sleep", "0.3", "--summary", summary, cwd=tmp_path,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env={"DP_SPARE_HEAP_BYTES": str(heap)})
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(events)),
             timeout=90, what="training to pass step 5")
    workers = wait_for(lambda: len(_workers_by_node(run.pid)) == 3 and _workers_by_node(run.pid), timeout=10,
                       what="the 3 workers")
    assert heap_rss(workers["node0"].pid) < heap, "the test cannot tell a warmed heap from a training one"
    spare = workers["node2"].pid
    largest = max(_snapshot_buffers(workers["node0"].pid).values())

    def room_made():
        buffers = _snapshot_buffers(spare)
        ready = len(buffers) == 2 and min(buffers.values()) >= largest
        return buffers if ready and rss_shmem(spare) >= sum(buffers.values()) - (64 << 10) else None

    reserved = wait_for(room_made, timeout=30, what="the spare's worker to reserve and fault in 2 snapshot buffers")
    # and its main thread the heap its first step will allocate from (dpstate.snapshot.warmheap)
    wait_for(lambda: heap_rss(spare) >= heap, timeout=30, what="the spare's worker to fault in its heap")

    def room_on_the_dashboard():
        # `dprun status --json` by dprun.cli.main in this process (a process took ~3 s a poll, most of it imports),
        # finding the job by the status records its dprun keeps in procs' state folder
        code, out, _ = in_process(["status", "--json"], tmp_path,
                                  {"DPRUN_STATE_DIR": str(procs.scratch / "dprun-state")})
        rows = {n["node_id"]: n for n in json.loads(out)["nodes"]} if code == 0 else {}
        return rows.get("node2", {}).get("room") == sum(reserved.values()) - 2 * mmap.PAGESIZE  # less the headers

    wait_for(room_on_the_dashboard, timeout=20, what="dprun status to show the spare's reserved memory")
    victim = workers["node1"]
    for proc in (victim.parent(), victim):  # the node: its agent and its worker
        proc.kill()
    wait_for(lambda: any(e["event"] == "recovery_complete" for e in read_events(events)), timeout=60,
             what="the recovery to complete")
    assert set(_snapshot_buffers(spare)) == set(reserved), "the promoted spare restored into new memory"
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-3000:]
    assert "spare worker 0 made room for a restore while idle" in out + err
    assert f"spare worker 0 faulted in {heap / 1e6:.0f} MB of heap" in out + err
    assert json.loads(summary.read_text())["params_sha256"] == reference.summary["params_sha256"]
