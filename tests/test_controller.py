"""Unit tests of the controller's state machine: forming, failures, spare promotion, fencing, restore step."""

from __future__ import annotations

import copy

import pytest

from dpcommon import protocol as p
from dprun.controller.state_machine import ConnectionDropped, NodeGone, Received, Tick
from dprun.controller.faults import parse_fault
from dprun.controller.ledger import ReplicaLedger
from helpers.controller_harness import Harness, finished_but_rank_1_lingers, formed, spec


def test_first_generation_forms_when_every_node_registered():
    h = Harness(spec())
    h.register("a", rank=0)
    h.register("b", rank=1)
    assert h.c.timeline.generation == -1, "waits for the spare"
    h.register("s", spare=True)
    assert h.c.timeline.generation == 0
    assert h.c.timeline.layout == ["a", "b"]
    (ra,) = h.sent_to("a", p.Reconfigure)
    assert (ra.node_rank, ra.world_size, ra.restore_step) == (0, 2, -1)
    assert ra.replica_to == "tcp://b:1", "node 0's snapshots live on node 1"
    assert h.sent_to("s", p.Welcome)[0].role == "spare"
    assert not h.sent_to("s", p.Reconfigure)


def test_forms_without_spares_at_rendezvous_timeout_and_fails_without_actives():
    h = Harness(spec())
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.feed(Tick(), dt=31)
    assert h.c.timeline.generation == 0
    lonely = Harness(spec())
    lonely.register("a")
    lonely.feed(Tick(), dt=31)
    assert lonely.finish and lonely.finish.exit_code == 1
    assert "only 1 of 2 nodes" in lonely.finish.message


def test_while_nodes_are_missing_the_controller_says_whom_it_waits_for_and_until_when():
    h = Harness(spec(rdzv_timeout=60.0))
    h.register("a", rank=0)
    while h.now < 14.5:
        h.alive({"a": {}})
    assert not h.named("waiting_for_nodes"), "not at once: nodes start over a few seconds"
    h.alive({"a": {}})
    (first,) = h.named("waiting_for_nodes")
    assert first == {"event": "waiting_for_nodes", "active": 1, "nnodes": 2, "spares": 0, "spares_wanted": 1,
                     "timeout_s": 45}
    h.register("b", rank=1)
    while h.now < 30:
        h.alive({"a": {}, "b": {}})
    assert h.named("waiting_for_nodes")[-1]["active"] == 2 and h.c.timeline.generation == -1, "the spare is still awaited"
    h.register("s", spare=True)
    while h.now < 60:
        h.alive({"a": {}, "b": {}, "s": {}})
    assert h.c.timeline.generation == 0 and len(h.named("waiting_for_nodes")) == 2, "formed: no more notes"


def test_node_failure_promotes_spare_into_same_node_rank_and_restores_newest_common_step():
    h = formed()
    for step in range(0, 6):
        h.msg("b", p.SnapshotStored("b", 0, step, 0))  # rank 0's copies on b
        h.msg("a", p.SnapshotStored("a", 1, step, 0))  # rank 1's copies on a
    h.msg("a", p.SnapshotStored("a", 1, 6, 0))
    h.msg("a", p.Progress("a", 0, 0, 7))
    h.feed(NodeGone("b", "agent process exited"), dt=1)
    assert h.named("node_failed")[0]["node"] == "b"
    assert h.c.timeline.generation == 0, "decision waits for the probe round"
    h.pong_all()
    assert h.c.timeline.generation == 1
    assert h.c.timeline.layout == ["a", "s"]
    (rs,) = h.sent_to("s", p.Reconfigure)
    # rank 0's report of step 6 died with b, but its Progress(7) proves 6 acked (its optimizer waited for it)
    assert rs.node_rank == 1 and rs.restore_step == 6
    assert rs.restore_from == {"1": "tcp://a:1"}, "the spare fetches node 1's state from its replica on a"
    ra = h.sent_to("a", p.Reconfigure)[-1]
    assert ra.generation == 1 and ra.restore_from == {"0": ""}, "rank 0's replicas died with b: local copy"
    assert ra.replica_to == "tcp://s:1"
    assert h.sent_to("b", p.Stop), "the failed node is fenced"
    assert h.named("spare_promoted")[0] == {"event": "spare_promoted", "spare": "s", "node_rank": 1,
                                             "generation": 1}


def test_recovery_complete_after_every_rank_steps_past_restore_step():
    h = formed()
    h.msg("a", p.SnapshotStored("a", 1, 3, 0))
    h.msg("b", p.SnapshotStored("b", 0, 3, 0))
    h.msg("a", p.Progress("a", 0, 0, 4))
    h.msg("b", p.Progress("b", 0, 1, 4))
    h.c.faults.injected_at["b"] = h.now
    h.msg("b", p.WorkerExited("b", 0, 0, 99, -9), )
    h.pong_all()
    assert h.c.timeline.generation == 1
    h.msg("a", p.WorkerReady("a", 1, 0, 0.02, 0.01, "local"))
    h.msg("s", p.WorkerReady("s", 1, 1, 0.03, 0.05, "replica"))
    h.feed(Received("a", p.Progress("a", 1, 0, 4)), dt=0.5)
    assert not h.named("recovery_complete")
    h.feed(Received("s", p.Progress("s", 1, 1, 4)), dt=0.1)
    (done,) = h.named("recovery_complete")
    assert done["restore_step"] == 3 and done["lost_steps"] == 1 and done["generation"] == 1
    assert done["phases"]["rebuild_s"] == 0.03 and done["phases"]["restore_s"] == 0.05
    assert done["phases"]["total_s"] == pytest.approx(0.6)
    assert "worker 0 (pid 99) killed by SIGKILL" in h.named("node_failed")[0]["cause"]


def test_stale_generation_and_fenced_messages_change_nothing():
    h = formed()
    h.feed(NodeGone("b", "gone"))
    h.pong_all()
    before = copy.deepcopy(h.c.table.nodes)
    h.msg("a", p.Progress("a", 0, 0, 50))  # generation 0 is over
    h.msg("b", p.SnapshotStored("b", 0, 50, 1))  # b is fenced
    h.msg("zz", p.Heartbeat("zz", 1))  # never registered
    assert h.c.table.nodes == before
    assert h.c.members.dropped["stale generation"] == 1
    assert h.c.members.dropped["fenced node"] == 1
    assert h.c.members.dropped["unregistered sender"] == 1


def test_no_spare_left_stops_the_job_naming_the_node():
    h = Harness(spec(spares=0))
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.msg("b", p.WorkerExited("b", 0, 0, 7, 1, "Traceback ..."))
    h.pong_all()
    assert h.finish and h.finish.exit_code == 1
    assert "b (node rank 1" in h.finish.message and "no spare left" in h.finish.message
    assert h.sent_to("a", p.Stop)


def test_a_node_that_says_it_leaves_is_failed_at_once_and_replaced():
    h = formed()
    h.msg("b", p.SnapshotStored("b", 0, 3, 0))
    h.msg("a", p.SnapshotStored("a", 1, 3, 0))
    h.msg("b", p.Leaving("b", "the dprun that ran it (pid 7) died"))
    (failed,) = h.named("node_failed")
    assert failed["node"] == "b" and failed["cause"] == "its agent left the job: the dprun that ran it (pid 7) died"
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"]
    h.msg("b", p.Leaving("b", "again"))  # fenced already: nothing more
    assert len(h.named("node_failed")) == 1


def test_missed_heartbeats_fail_a_frozen_node():
    h = formed()
    for _ in range(12):  # a keeps talking, b is frozen
        h.msg("a", p.Heartbeat("a", 0))
        h.msg("s", p.Heartbeat("s", -1))
        h.feed(Tick(), dt=0.5)
    failed = h.named("node_failed")
    assert [e["node"] for e in failed] == ["b"]
    assert failed[0]["cause"].startswith("no heartbeat")
    h.pong_all()
    for node, rank in (("a", 0), ("s", 1)):
        h.msg(node, p.WorkerReady(node, 1, rank, 0.1, 0.1, "replica"))
        h.msg(node, p.Progress(node, 1, rank, 1))
    (done,) = h.named("recovery_complete")
    assert done["phases"]["detect_s"] > 5.0, "the downtime counts from its last heartbeat, not from the timeout"


def test_peer_error_probes_and_fails_the_node_that_does_not_answer():
    h = formed()
    h.msg("a", p.PeerError("a", 0, 0, "Connection reset by peer"))
    seq = h.c.reconstruction.seq
    assert {s.node_id for s in h.sent if isinstance(s.msg, p.Ping) and s.msg.seq == seq} == {"a", "b", "s"}
    h.msg("a", p.Pong("a", seq))
    h.msg("s", p.Pong("s", seq))
    h.feed(Tick(), dt=1.1)
    assert h.named("node_failed")[0]["node"] == "b"
    assert "probe" in h.named("node_failed")[0]["cause"]
    h.pong_all()
    assert h.c.timeline.generation == 1
    # from the peer's error to the node found: detection (it read 0 s, the probe counted as planning)
    assert h.c.reconstruction.recovery.t_detect - h.c.reconstruction.recovery.t_fail == pytest.approx(1.1)
    assert h.named("reconfigure")[-1]["decide_s"] == 0.0


def test_a_dropped_connection_probes_every_node_and_fails_the_one_that_does_not_answer():
    """A node killed whole (its host up): its kernel closes its connections, and none of its processes can say a
    word. The shell's socket monitor tells of a connection closed (not whose): every node is pinged at once, and
    one not heard from within --probe-timeout is failed, dated from when it was last heard."""
    h = formed()
    h.alive({"a": {}, "b": {}, "s": {}}, dt=0.3)
    h.feed(ConnectionDropped(), dt=0.1)
    seq = h.c.reconstruction.seq
    assert {s.node_id for s in h.sent if isinstance(s.msg, p.Ping) and s.msg.seq == seq} == {"a", "b", "s"}
    h.msg("a", p.Pong("a", seq))
    h.msg("s", p.Pong("s", seq))
    h.feed(Tick(), dt=0.9)
    assert not h.named("node_failed"), "not before --probe-timeout"
    h.feed(Tick(), dt=0.2)
    (failed,) = h.named("node_failed")
    assert failed["node"] == "b" and "a connection to the controller closed" in failed["cause"]
    assert h.c.reconstruction.pending.t_fail == 0.0, "dated from its last word (its heartbeat at 0 s), not from the probe (1.5 s)"


def test_a_dropped_connection_with_every_node_answering_changes_nothing():
    h = formed()
    h.feed(ConnectionDropped(), dt=0.1)  # (a member's dprun that spoke for its dead agent, a status client...)
    h.feed(ConnectionDropped(), dt=0.1)
    h.alive({"a": {}, "b": {}, "s": {}}, dt=1.5)
    assert not h.named("node_failed") and h.c.timeline.generation == 0 and h.c.deadlines.dropped_at is None


def test_a_dropped_connection_during_a_recovery_is_left_to_its_probe():
    h = formed()
    h.feed(NodeGone("b", "agent process exited"))
    h.feed(ConnectionDropped(), dt=0.1)  # (b's own connection, as its processes die)
    assert h.c.deadlines.dropped_at is None


def test_a_peer_error_with_every_node_alive_plans_the_same_layout_again():
    h = formed()
    layout = list(h.c.timeline.layout)
    h.msg("a", p.PeerError("a", 0, 0, "PeerConnectError: could not connect to every rank within 10 s"))
    h.msg("b", p.PeerError("b", 0, 1, "PeerConnectError: could not connect to every rank within 10 s"))
    h.pong_all()  # everyone answers: nobody failed, but both ranks wait for a new generation
    assert h.c.timeline.generation == 0, "not before a worker's exit report had the time to arrive"
    h.feed(Tick(), dt=0.6)
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == layout, "a retry, not a swap: the spare stays a spare"
    assert not h.named("node_failed") and not h.named("spare_promoted")
    (rc,) = h.sent_to("b", p.Reconfigure)[-1:]
    assert rc.generation == 1


def test_a_peer_error_then_the_exit_of_the_worker_behind_it_makes_one_swap_not_a_retry_first():
    h = formed()
    h.msg("a", p.PeerError("a", 0, 0, "Connection reset by peer"))
    h.pong_all()  # b's agent answers: its worker's exit report is a few ms behind
    h.msg("b", p.WorkerExited("b", 0, 0, 9, -9))
    h.pong_all()
    h.feed(Tick(), dt=0.6)
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"]
    assert len(h.named("reconfigure")) == 1


def test_a_peer_error_from_a_replaced_generation_is_dropped():
    h = formed()
    h.msg("a", p.PeerError("a", 0, 0, "boom"))
    h.pong_all()
    h.feed(Tick(), dt=0.6)
    assert h.c.timeline.generation == 1
    h.msg("b", p.PeerError("b", 0, 1, "late news of generation 0"))
    assert h.c.reconstruction.flush is None and h.c.reconstruction.pending is None and h.c.timeline.generation == 1
    assert h.c.members.dropped == {"stale generation": 1}


def test_ranks_that_never_manage_to_connect_end_the_job_with_a_clear_message():
    h = formed()
    for attempt in range(4):
        h.msg("a", p.PeerError("a", h.c.timeline.generation, 0, "PeerConnectError: wait timeout"))
        h.pong_all()
        h.feed(Tick(), dt=0.6)
    assert h.finish is not None and h.finish.exit_code == 1
    assert "could not start" in h.finish.message and "DP_CONNECT_TIMEOUT" in h.finish.message
    assert h.c.timeline.generation == 3


def test_state_lost_when_a_node_and_its_replica_holder_die_together():
    h = formed(spec(nnodes=3, spares=2))
    h.register("c", rank=2)
    h.register("t", spare=True)
    assert h.c.timeline.generation == 0
    h.msg("c", p.SnapshotStored("c", 1, 4, 0))  # rank 1's copy lives on c
    h.msg("b", p.Progress("b", 0, 1, 5))
    h.feed(NodeGone("b", "killed"))
    h.feed(NodeGone("c", "killed"))
    h.pong_all()
    assert h.finish is None and h.c.reconstruction.flush is not None, "before ending, every live node is probed once more"
    h.pong_all()
    assert h.finish and h.finish.exit_code == 1 and "state lost" in h.finish.message
    assert "rerun with --replicas 2" in h.finish.message  # the flag that would have kept it, by name


def test_state_lost_in_a_two_node_job_does_not_advise_more_replicas_than_can_be():
    h = formed(spec(spares=2))  # 2 nodes: each one's only possible holder is the other
    h.register("t", spare=True)
    h.msg("b", p.SnapshotStored("b", 0, 4, 0))  # rank 0's copy lives on b, rank 1's on a
    h.msg("a", p.SnapshotStored("a", 1, 4, 0))
    h.msg("b", p.Progress("b", 0, 1, 5))
    h.feed(NodeGone("a", "killed"))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    h.pong_all()
    assert h.finish and "state lost" in h.finish.message and "--replicas 2" not in h.finish.message
    assert "every node that held a copy failed at once" in h.finish.message


def test_a_copy_reported_after_the_probe_round_still_saves_the_job():
    """Nodes a and b die together, each the holder of the other's rank; c holds second copies, but its reports
    of them left c just after it answered the probe. The first plan finds ranks 0 and 1 with no copy; before
    ending the job the controller probes once more, and c's reports arrive ahead of its second Pong."""
    h = formed(spec(nnodes=3, spares=2))
    h.register("c", rank=2)
    h.register("t", spare=True)
    h.msg("a", p.SnapshotStored("a", 1, 4, 0))
    h.msg("b", p.SnapshotStored("b", 0, 4, 0))
    h.msg("c", p.Progress("c", 0, 2, 5))
    h.feed(NodeGone("a", "killed"))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 0 and h.c.reconstruction.flush is not None
    h.msg("c", p.SnapshotStored("c", 0, 4, 0))
    h.msg("c", p.SnapshotStored("c", 1, 4, 0))
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 1
    restore = {m.node_rank: m for node in ("s", "t") for m in h.sent_to(node, p.Reconfigure)}
    assert {r: m.restore_from for r, m in restore.items()} == {0: {"0": "tcp://c:1"}, 1: {"1": "tcp://c:1"}}
    assert all(m.restore_step == 4 for m in restore.values())


def test_fault_injection_fires_once_on_the_node_holding_that_rank():
    h = formed(spec(faults=(parse_fault("kill-node:1@step=3"),)))
    h.msg("b", p.Progress("b", 0, 1, 2))
    assert not h.sent_to("b", p.Inject)
    h.msg("b", p.Progress("b", 0, 1, 3))
    h.msg("b", p.Progress("b", 0, 1, 4))
    assert h.sent_to("b", p.Inject) == [p.Inject("kill-node", 0)]


def test_faults_naming_the_same_step_fire_together_when_the_first_rank_gets_there():
    h = Harness(spec(nnodes=3, spares=0, faults=(parse_fault("kill-node:1@step=8"), parse_fault("kill-node:2@step=8"))))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    h.msg("a", p.Progress("a", 0, 0, 8))  # node ranks 1 and 2 are slower: both die together all the same
    assert h.sent_to("b", p.Inject) == [p.Inject("kill-node", 0)]
    assert h.sent_to("c", p.Inject) == [p.Inject("kill-node", 0)]


def test_a_fault_that_never_came_due_is_said_skipped_as_the_job_ends():
    """kill-node:1@step=50 in a 3-step job: the job passes, and says that it did without the fault."""
    h = formed(spec(faults=(parse_fault("kill-node:1@step=50"), parse_fault("kill-worker:0@t=3600"))))
    h.msg("a", p.Progress("a", 0, 0, 3))
    h.msg("a", p.WorkerExited("a", 0, 0, 1, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 2, 0))
    assert h.finish and h.finish.exit_code == 0 and not h.sent_to("b", p.Inject)
    skipped = [(e["spec"], e["reason"]) for e in h.named("fault_skipped")]
    assert skipped == [("kill-node:1@step=50", "the job ended before it was due"),
                       ("kill-worker:0@t=3600", "the job ended before it was due")], skipped


def test_job_finishes_when_every_active_worker_exits_zero():
    h = formed()
    h.msg("a", p.WorkerExited("a", 0, 0, 1, 0))
    assert h.finish is None
    h.msg("b", p.WorkerExited("b", 0, 0, 2, 0))
    assert h.finish and h.finish.exit_code == 0
    assert h.sent_to("s", p.Stop), "spares are told to stop too"


def test_ranks_found_unlike_their_data_parallel_peers_are_said_at_once_and_in_the_job_s_last_words():
    h = formed()
    h.msg("b", p.Diverged("b", 0, 1, 5, [3, 4]))
    h.msg("a", p.Diverged("a", 0, 0, 5, [3]))
    h.msg("b", p.Diverged("b", 0, 1, 9, [3]))  # (a worker says it once; a restarted one may again)
    assert [(e["rank"], e["step"], e["blocks"]) for e in h.named("divergence")] == [(1, 5, [3, 4]), (0, 5, [3])]
    h.msg("a", p.WorkerExited("a", 0, 0, 1, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 2, 0))
    assert h.finish.exit_code == 0
    assert "of rank(s) 0, 1 differed from a data parallel peer's (first at step 5)" in h.finish.message
    assert "do not trust a model saved from them" in h.finish.message


@pytest.mark.parametrize("shape, said", [
    (dict(nproc=1), "runs 1 workers, the job needs 2 per node (--nproc-per-node)"),
    (dict(nnodes=3), "was started with --nnodes 3, the job has 2: give every node the same --nnodes"),
    (dict(rdzv_id="other"), "was started for job 'other' (--rdzv-id), this controller runs job 'j1'"),
])
def test_a_node_started_for_another_job_shape_is_refused_and_the_head_says_why(shape, said):
    h = Harness(spec(nproc_per_node=2, job_id="j1"))
    h.register("a", **{"nproc": 2, **shape})
    (stop,) = h.sent_to("a", p.Stop)
    assert stop.exit_code == 2 and said in stop.reason
    assert [e["reason"] for e in h.named("node_refused")] == [stop.reason]
    assert len(h.c.table) == 0 and not h.sent_to("a", p.Welcome)


def test_a_node_told_the_same_job_shape_joins_without_a_word():
    h = Harness(spec(job_id="j1", command=("train.py", "--steps", "40")))
    h.register("a", rank=0, nnodes=2, rdzv_id="j1", script=["train.py", "--steps", "40"])
    h.register("b", rank=1, nnodes=2, rdzv_id="", script=["train.py", "--steps", "40"])  # (no --rdzv-id given)
    h.register("s", spare=True)  # (a bare dpagent: no terms)
    assert h.c.timeline.generation == 0 and not h.named("node_refused") and not h.named("node_warning")


def test_a_node_that_runs_other_arguments_joins_with_a_warning_naming_both_commands():
    h = Harness(spec(command=("train.py", "--steps", "40")))
    h.register("a", rank=0, script=["train.py", "--steps", "40"])
    h.register("b", rank=1, script=["train.py", "--steps", "50"])
    (warning,) = [e["warning"] for e in h.named("node_warning")]
    assert "node b (host h) runs `train.py --steps 50`, the head `train.py --steps 40`" in warning
    assert h.c.table.get("b").role == "active"


def test_a_node_rank_asked_for_twice_is_warned_about_and_the_second_node_stands_by():
    h = Harness(spec())
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.register("b2", rank=1)
    (warning,) = [e["warning"] for e in h.named("node_warning")]
    assert "node b2 (host h) asked for node rank 1, which node b asked for first" in warning
    assert h.c.timeline.generation == 0 and h.c.timeline.layout == ["a", "b"] and h.c.table.get("b2").role == "spare"
    h.feed(NodeGone("b", "agent process exited"), dt=1.0)
    h.register("b3", rank=1)  # once formed, a rank is the controller's to give: a node joins as a spare, unwarned
    assert len(h.named("node_warning")) == 1


def test_restart_mode_restarts_every_worker_up_to_max_restarts():
    h = formed(spec(restart_mode=True, max_restarts=1, spares=2))
    h.register("t", spare=True)
    assert h.sent_to("a", p.Welcome)[0].prespawn is False, "plain scripts cannot wait in dpstate.init()"
    assert h.sent_to("a", p.Reconfigure)[0].restart_workers
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    ra = h.sent_to("a", p.Reconfigure)[-1]
    assert ra.generation == 1 and ra.restart_workers and ra.restore_step == -1
    h.msg("a", p.WorkerReady("a", 1, 0, 0.5, 0.0, "restart"))
    h.msg("s", p.WorkerReady("s", 1, 1, 0.6, 0.0, "restart"))
    (done,) = h.named("recovery_complete")
    assert done["mode"] == "restart"
    h.feed(NodeGone("s", "killed again"))
    h.pong_all()
    assert h.finish and h.finish.exit_code == 1 and "--max-restarts 1" in h.finish.message


def test_restart_mode_dates_a_failure_from_the_first_crash_its_agent_held_back():
    h = formed(spec(restart_mode=True, max_restarts=1))
    h.msg("a", p.PeerError("a", 0, 0, "worker 0 exit code 1"))  # held by its agent: a dead peer may explain it
    h.pong_all()
    assert h.named("peer_error")[0]["held"] and not h.named("node_failed")
    for _ in range(10):  # no Reconfigure came: after its heartbeat timeout the agent reports the exit
        h.alive({"a": {}, "b": {}, "s": {}})
    h.msg("a", p.WorkerExited("a", 0, 0, 99, 1, "ValueError: boom"))
    h.pong_all()
    for node, rank in (("s", 0), ("b", 1)):
        h.msg(node, p.WorkerReady(node, 1, rank, 0.5, 0.0, "restart"))
    (done,) = h.named("recovery_complete")
    assert done["phases"]["detect_s"] == pytest.approx(5.0), "from the crash, not from the exit's report"


def test_two_replicas_survive_a_node_and_its_first_holder_dying_together():
    h = Harness(spec(nnodes=3, spares=2, replicas=2))
    for node, rank in (("a", 0), ("b", 1), ("c", 2)):
        h.register(node, rank=rank)
    h.register("s", spare=True)
    h.register("t", spare=True)
    ra = h.sent_to("a", p.Reconfigure)[0]
    assert (ra.replica_to, ra.replica_also) == ("tcp://b:1", ["tcp://c:1"])
    for rank, holders in ((0, "bc"), (1, "ca"), (2, "ab")):
        for holder in holders:
            h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.feed(NodeGone("b", "killed"))
    h.feed(NodeGone("c", "killed"))
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 1
    restore = {k: v for node in ("s", "t") for k, v in h.sent_to(node, p.Reconfigure)[-1].restore_from.items()}
    assert restore == {"1": "tcp://a:1", "2": "tcp://a:1"}, "both dead ranks come back from a, their second copy"


def test_a_survivor_without_the_local_copy_a_walk_back_reaches_ends_the_job_as_state_lost():
    """A 2-node ring: rank 1's copies (steps 3 and 4 on a) turn out bad one by one, and the plan walks back to
    step 3, which survivor rank 0 (at step 5) no longer holds (its ring keeps 2 steps; its own holder was b).
    Its report (RestoreFailed, source "": its local copy) ends the job as state lost, naming it; it is not
    taken for a connection problem and planned again until the replan limit."""
    h = Harness(spec(nnodes=2, spares=1))
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.register("s", spare=True)
    for step in (3, 4):
        h.msg("a", p.SnapshotStored("a", 1, step, 0))
        h.msg("b", p.SnapshotStored("b", 0, step, 0))
    h.msg("a", p.Progress("a", 0, 0, 5))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    rs = h.sent_to("s", p.Reconfigure)[-1]
    assert (rs.restore_step, rs.restore_from) == (4, {"1": "tcp://a:1"})
    h.msg("s", p.RestoreFailed("s", rs.generation, 1, 4, "tcp://a:1", "checksum mismatch"))
    h.pong_all()
    ra = h.sent_to("a", p.Reconfigure)[-1]
    assert (ra.restore_step, ra.restore_from) == (3, {"0": ""})
    h.msg("a", p.RestoreFailed("a", ra.generation, 0, 3, "", "no local copy of step 3 (holds [4, 5])"))
    h.pong_all()
    h.pong_all()  # the probe before "state lost"
    assert h.finish and h.finish.exit_code == 1
    assert "state lost: ranks [0]" in h.finish.message and "rank 0 step 3 on a (local)" in h.finish.message
    assert h.named("restore_failed")[-1]["source"] == ""


def test_a_corrupt_copy_is_dropped_and_the_next_one_used():
    h = Harness(spec(nnodes=3, spares=1, replicas=2))
    for node, rank in (("a", 0), ("b", 1), ("c", 2)):
        h.register(node, rank=rank)
    h.register("s", spare=True)
    for holder in "ca":
        h.msg(holder, p.SnapshotStored(holder, 1, 4, 0))
    for rank, holders in ((0, "bc"), (2, "ab")):
        for holder in holders:
            h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    rs = h.sent_to("s", p.Reconfigure)[-1]
    assert rs.restore_from == {"1": "tcp://a:1"} and rs.restore_also == {"1": ["tcp://c:1"]}
    h.msg("s", p.RestoreFailed("s", 1, 1, 4, "tcp://a:1", "checksum mismatch"))
    h.pong_all()
    again = h.sent_to("s", p.Reconfigure)[-1]
    assert again.generation == 2 and again.restore_from == {"1": "tcp://c:1"}
    assert h.named("restore_failed")[0]["reason"] == "checksum mismatch"


def _hung_for_12_s(step: int, activity_a: str, activity_b: str) -> Harness:
    """A job that made `step`, then rank 0 (on a) and rank 1 (on b) do these for 12.5 s (--hang-timeout 10)."""
    h = formed(spec(hang_timeout=10.0))
    h.msg("a", p.Progress("a", 0, 0, step))
    for _ in range(25):
        h.alive({"a": {"0": {"rank": 0, "step": step, "activity": activity_a, "age": 0.2}},
                 "b": {"0": {"rank": 1, "step": step, "activity": activity_b, "age": 0.3}}, "s": {}})
    return h


def test_hang_timeout_blames_the_rank_that_is_not_waiting_on_peers():
    h = _hung_for_12_s(3, "collective", "compute")
    (failed,) = h.named("node_failed")
    assert failed["node"] == "b" and "rank 1 stuck in compute" in failed["cause"]


def test_a_hang_of_ranks_that_finished_their_steps_waiting_for_ranks_that_train_on_names_the_step_counts():
    """Rank 0 waits at the final barrier after step 10; rank 1 made step 10 too and waits in a collective of
    step 11 that rank 0 never joins (other --steps). Both wait on a peer: --hang-timeout blamed no one and said
    "check the network"; now the job ends once rank 1's step has stood still for 6 heartbeat intervals."""
    h = formed(spec(hang_timeout=600.0))
    h.msg("a", p.Progress("a", 0, 0, 10))
    for _ in range(8):
        h.alive({"a": {"0": {"rank": 0, "step": 10, "activity": "finishing", "age": 0.2}},
                 "b": {"0": {"rank": 1, "step": 10, "activity": "collective", "age": 0.3}}, "s": {}})
    assert not h.named("node_failed"), "neither rank is stuck on its own"
    assert h.finish and h.now < 5, "at once, not at --hang-timeout"
    assert h.finish.message.startswith("job hung at its end: ranks [0] finished their steps (after step 10) and "
                                       "wait at the end for ranks [1]")
    assert "a different --steps" in h.finish.message


@pytest.mark.parametrize("rank_1", [
    [{"rank": 1, "step": 9, "activity": "compute", "age": 0.3}] * 8,  # slower: still in the last step
    [{"rank": 1, "step": 9, "activity": "collective", "age": 0.3}] * 8,  # ... waiting on its last all-reduce
    [{"rank": 1, "step": 10 + i, "activity": "collective", "age": 0.3} for i in range(8)],  # training on alone
])
def test_ranks_that_reach_the_end_apart_but_move_are_no_hang(rank_1):
    h = formed(spec(hang_timeout=600.0))
    h.msg("a", p.Progress("a", 0, 0, 10))
    for status in rank_1:
        h.alive({"a": {"0": {"rank": 0, "step": 10, "activity": "finishing", "age": 0.2}}, "b": {"0": status}, "s": {}})
    assert h.finish is None


def test_hang_timeout_is_not_armed_before_the_first_step_of_a_generation():
    h = formed(spec(hang_timeout=2.0))
    for _ in range(12):  # importing torch, building the model: no step yet, and that is no hang
        h.alive({"a": {}, "b": {}, "s": {}})
    assert not h.named("node_failed") and h.finish is None


def _rank_1_computes_while_rank_0_waits(h, step: int, on: str = "b", idle: tuple = ("s",)) -> None:
    """Six seconds of heartbeats: rank 0 (on a) waits in a collective, rank 1 (on `on`) computes, after `step`."""
    for _ in range(12):
        h.alive({"a": {"0": {"rank": 0, "step": step, "activity": "collective", "age": 0.1}},
                 on: {"0": {"rank": 1, "step": step, "activity": "compute", "age": 0.2}}, **{n: {} for n in idle}})


def test_a_hang_in_a_generation_s_first_step_is_caught_once_a_rank_waits_on_its_peers():
    """Start-up is no hang; but rank 0 waiting in the first step's collective while rank 1 computes for
    --hang-timeout is (before, the timer waited for a step that never came: the job hung for ever)."""
    h = formed(spec(hang_timeout=5.0))
    _rank_1_computes_while_rank_0_waits(h, step=0)
    (failed,) = h.named("node_failed")
    assert failed["node"] == "b" and "rank 1 stuck in compute after step 0" in failed["cause"]


def test_a_hang_that_follows_its_rank_onto_the_spare_ends_the_job_as_the_script_s():
    h = formed(spec(spares=2, hang_timeout=5.0))
    h.register("s2", spare=True)
    h.msg("a", p.Progress("a", 0, 0, 4))
    _rank_1_computes_while_rank_0_waits(h, step=4, idle=("s", "s2"))
    h.pong_all()
    h.feed(Tick(), dt=0.6)
    assert h.c.timeline.layout == ["a", "s"] and not h.finish
    # the spare restored step 4 and hangs in step 5 again: no step made in generation 1
    _rank_1_computes_while_rank_0_waits(h, step=4, on="s", idle=("s2",))
    assert h.finish and h.finish.exit_code == 1, h.finish
    assert "rank 1 failed on b and again on s, which took its place, the same way after step 4" in h.finish.message
    assert "hangs again at the same step" in h.finish.message and h.c.table.get("s2").role == "spare"


def test_with_snapshots_off_a_node_failure_ends_the_job_at_once_naming_it_and_no_spare_is_spent():
    """Before, the spare was promoted to 'restore step 0', the survivor crashed on it, and the job ended blaming
    the healthy node with 'no spare left: rerun with more --spares'."""
    h = formed(spec(snapshots=False))
    h.msg("a", p.Progress("a", 0, 0, 10))
    h.feed(NodeGone("b", "agent process exited (killed by SIGKILL)"))
    assert h.finish and h.finish.exit_code == 1, h.finish
    assert h.finish.message.startswith("b failed (agent process exited (killed by SIGKILL)) and snapshots are off")
    assert not h.named("spare_promoted") and len(h.named("job_finished")) == 1


def test_hang_with_every_rank_waiting_on_peers_stops_with_a_message():
    h = formed(spec(hang_timeout=5.0))
    h.msg("a", p.Progress("a", 0, 0, 1))
    for _ in range(12):
        h.alive({node: {"0": {"rank": rank, "step": 0, "activity": "collective", "age": 0.1}}
                 for node, rank in (("a", 0), ("b", 1))} | {"s": {}})
    assert h.finish and h.finish.exit_code == 1 and "every rank waits on its peers" in h.finish.message


def test_a_worker_that_does_not_exit_after_training_is_named_then_ends_the_job_at_hang_timeout():
    h = formed(spec(hang_timeout=100.0))
    statuses = finished_but_rank_1_lingers(h)
    while h.now < 29.0:
        h.alive(statuses)
    assert not h.named("waiting_for_exit"), "not at once: a script may do a little after its loop"
    while h.now < 95.0:
        h.alive(statuses)
    notes = h.named("waiting_for_exit")
    assert len(notes) == 3 and notes[0]["workers"] == "rank 1 on b (pid 4242)" and notes[0]["ranks"] == [1]
    assert not h.named("node_failed") and h.finish is None, "no step since is no hang: node a exited 0"
    while h.finish is None and h.now < 110.0:
        h.alive(statuses)
    assert h.finish and h.finish.exit_code == 1 and not h.named("node_failed")
    assert h.finish.message.startswith(
        "training completed (step 40), but rank 1 on b (pid 4242) did not exit within 100 s")


def test_a_finished_job_waits_for_its_workers_without_end_when_hang_timeout_is_off():
    h = formed(spec(hang_timeout=0.0))
    h.msg("a", p.Progress("a", 0, 0, 5))
    for node, rank in (("a", 0), ("b", 1)):
        h.msg(node, p.RankFinished(node, 0, rank, 5))
    while h.now < 700.0:
        h.alive({"a": {}, "b": {}, "s": {}}, dt=5.0)
    assert h.finish is None and len(h.named("waiting_for_exit")) >= 20
    assert h.named("waiting_for_exit")[0]["since"] == "training finished"
    assert h.named("waiting_for_exit")[0]["workers"] == "rank 0 on a, rank 1 on b"
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 0))
    assert h.finish and h.finish.exit_code == 0


def test_in_restart_mode_a_worker_that_exited_0_first_starts_the_notes_and_dprun_waits_as_torchrun():
    h = formed(spec(hang_timeout=100.0, restart_mode=True))
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 0))  # a plain script: no steps, no RankFinished
    while h.now < 400.0:
        h.alive({"a": {}, "b": {}, "s": {}}, dt=5.0)
    notes = h.named("waiting_for_exit")
    assert h.finish is None and len(notes) >= 10 and not h.named("node_failed")
    assert notes[0]["since"] == "a worker exited 0" and notes[0]["workers"] == "rank 1 on b"
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 0))
    assert h.finish and h.finish.exit_code == 0


def two_nodes_no_spare(**kw) -> Harness:
    h = Harness(spec(spares=0, **kw))
    h.register("a", rank=0)
    h.register("b", rank=1)
    return h


def test_out_of_spares_with_wait_policy_resumes_when_a_node_joins():
    h = two_nodes_no_spare(on_spare_exhausted="wait", spare_wait_timeout=60)
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    assert h.finish is None and h.named("waiting_for_spare")
    for _ in range(20):
        h.alive({"a": {}})
    h.register("late")
    assert h.sent_to("late", p.Welcome)[0].role == "spare"
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "late"]


def test_out_of_spares_with_wait_policy_gives_up_after_its_timeout():
    h = two_nodes_no_spare(on_spare_exhausted="wait", spare_wait_timeout=5)
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    for _ in range(12):
        h.alive({"a": {}})
    assert h.finish and h.finish.exit_code == 1 and "no node joined as a spare" in h.finish.message


def test_a_single_node_s_replacement_is_a_spare_that_holds_no_copy_so_a_second_loss_is_survived():
    """One node, two spares: its snapshots live on the first spare. Promoting that holder left the state on
    the new node alone until its first snapshot reached the other spare; its loss then was "state lost"
    (simulator seed 2001984). The other spare is promoted and fetches from the holder, which keeps its copy."""
    h = Harness(spec(nnodes=1, spares=2))
    h.register("a", rank=0)
    h.register("s1", spare=True)
    h.register("s2", spare=True)
    assert h.c.timeline.holders == {0: ["s1"]}
    for step in (1, 2):
        h.msg("s1", p.SnapshotStored("s1", 0, step, 0))
        h.msg("a", p.Progress("a", 0, 0, step, snapshot=True))
    h.feed(NodeGone("a", "killed"))
    h.pong_all()
    (rc,) = h.sent_to("s2", p.Reconfigure)
    assert rc.generation == 1 and rc.restore_step == 2 and rc.restore_from == {"0": "tcp://s1:1"}
    h.feed(NodeGone("s2", "killed"), dt=0.1)  # lost while it restores
    h.pong_all()
    (again,) = h.sent_to("s1", p.Reconfigure)[-1:]
    assert h.finish is None and again.generation == 2 and again.restore_step == 2


def test_a_survivor_whose_holder_died_with_its_last_reports_restores_a_step_its_ring_still_holds():
    """Simulator seed 217749: one node + a spare that holds its snapshots. Snapshots every step; the spare
    dies with its reports of steps 32 and 33 in flight. Rank 0 reported Progress(33) and may be at step 34,
    holding 33 and 34 in its ring of 2 (it captures a step before it reports it). The grid of snapshot steps
    comes from Progress too, so the plan is 33 (its floor); from the replica reports alone it was 31, which
    the ring had dropped, and the job ended as state lost."""
    h = Harness(spec(nnodes=1, spares=1))
    h.register("a", rank=0)
    h.register("s", spare=True)
    for step in range(26, 34):
        if step <= 31:
            h.msg("s", p.SnapshotStored("s", 0, step, 0))
        h.msg("a", p.Progress("a", 0, 0, step, snapshot=True))
    h.feed(NodeGone("s", "killed"))
    h.pong_all()
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert (ra.restore_step, ra.restore_from) == (33, {"0": ""}), ra


def test_snapshots_every_few_steps_a_survivor_whose_reports_died_with_its_holder_restores_a_snapshot_step():
    """Snapshots at steps 0, 5, 10: rank 0's report of step 10 died with b (its holder). Its Progress(11)
    proves its snapshot 10 was acked (step 11's last all-reduce waited for it), so it holds 10 locally, and
    rank 1's copy of 10 lives on a: the plan is 10. A floor from step counts alone (11) names a step no one
    snapshotted: the plan would find no copy of rank 1 at 11 and end the job as state lost."""
    h = formed()
    for step in (0, 5, 10):
        h.msg("a", p.SnapshotStored("a", 1, step, 0))  # rank 1's copies on a
    for step in (0, 5):
        h.msg("b", p.SnapshotStored("b", 0, step, 0))  # rank 0's on b; b's report of step 10 never came
    h.msg("a", p.Progress("a", 0, 0, 11))
    h.msg("b", p.Progress("b", 0, 1, 11))
    h.feed(NodeGone("b", "agent process exited"), dt=1)
    h.pong_all()
    assert h.finish is None, h.finish
    (rs,) = h.sent_to("s", p.Reconfigure)
    assert rs.restore_step == 10 and rs.restore_from == {"1": "tcp://a:1"}
    assert h.sent_to("a", p.Reconfigure)[-1].restore_from == {"0": ""}


def test_bad_copies_walk_the_plan_back_copy_by_copy_past_the_replan_limit():
    """Rank 1 has copies of steps 3 and 4 on a, c and d. Its node dies and four copies in a row turn out bad:
    each report drops one and plans again (more than MAX_REPLANS times: these replans make progress); the
    fifth plan restores step 3 from c. Then the last copies go bad too: state lost, naming them."""
    h = Harness(spec(nnodes=4, spares=1, replicas=3))
    for node, rank in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
        h.register(node, rank=rank)
    h.register("s", spare=True)
    for step in (3, 4):
        for rank, holders in ((0, "bcd"), (1, "acd"), (2, "abd"), (3, "abc")):
            for holder in holders:
                h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    tried = []
    for _ in range(4):
        rs = h.sent_to("s", p.Reconfigure)[-1]
        tried.append((rs.restore_step, rs.restore_from["1"]))
        h.msg("s", p.RestoreFailed("s", rs.generation, 1, rs.restore_step, rs.restore_from["1"], "checksum mismatch"))
        h.pong_all()
        assert h.finish is None, h.finish
    rs = h.sent_to("s", p.Reconfigure)[-1]
    assert tried == [(4, "tcp://a:1"), (4, "tcp://c:1"), (4, "tcp://d:1"), (3, "tcp://a:1")]
    assert (rs.restore_step, rs.restore_from["1"]) == (3, "tcp://c:1")
    for _ in range(2):
        rs = h.sent_to("s", p.Reconfigure)[-1]
        h.msg("s", p.RestoreFailed("s", rs.generation, 1, 3, rs.restore_from["1"], "checksum mismatch"))
        h.pong_all()
    h.pong_all()  # the probe before "state lost"
    assert h.finish and "state lost" in h.finish.message and "rank 1 step 3 on d: checksum mismatch" in h.finish.message


def test_a_plan_goes_down_the_grid_to_the_newest_step_every_rank_has_a_copy_of():
    """Simulator seed 43769, in the ledger: rank 0 failed, its copy of 9 was bad; rank 1's copy of 6 on x was
    bad, and rank 1 (restored earlier in this recovery, so its ring holds only 9) said it has no local copy
    at or before 6. No copy of 6 for rank 1, but both have 3 on x: the plan is 3, not "state lost"."""
    ledger = ReplicaLedger(keep=3)  # three copies per holder, as before the snapshot gate: the walk is tested
    for step in (3, 6, 9):
        ledger.stored(0, step, "x")
        ledger.stored(1, step, "x")
    ledger.discard(0, 9, "x")
    ledger.discard(1, 6, "x")
    plan = ledger.plan([0, 1], failed_ranks={0}, floors={1: 9}, no_local={1: 6})
    assert (plan.step, plan.sources, plan.lost) == (3, {0: "x", 1: "x"}, [])
    ledger.discard(1, 3, "x")  # and with that copy bad too, no step has a copy of both: lost, naming rank 1
    assert ledger.plan([0, 1], failed_ranks={0}, floors={1: 9}, no_local={1: 6}).lost == [1]


def test_spares_are_told_the_snapshot_sizes_to_make_room_for_and_only_when_they_grow():
    """Standby: the largest stored snapshot of each local rank (with headroom), to every spare, when a snapshot
    outgrows it; a spare that registers later hears it after its Welcome; active nodes never do."""
    from dprun.controller.spare_sizing import with_headroom

    h = Harness(spec(nproc_per_node=2))
    h.register("a", rank=0, nproc=2)
    h.register("b", rank=1, nproc=2)
    h.register("s", spare=True, nproc=2)
    assert not h.sent_to("s", p.Standby), "no size is known before the first snapshot"
    h.msg("b", p.SnapshotStored("b", 1, 0, 0, nbytes=1000))  # rank 1: local rank 1 of node 0
    (first,) = h.sent_to("s", p.Standby)
    assert first.snapshot_bytes == [0, with_headroom(1000)]
    h.msg("a", p.SnapshotStored("a", 2, 0, 0, nbytes=50_000_000))  # rank 2: local rank 0 of node 1
    h.msg("a", p.SnapshotStored("a", 3, 0, 0, nbytes=999))
    h.msg("b", p.SnapshotStored("b", 0, 1, 0, nbytes=50_000_100))  # a few bytes more: within the headroom
    sizes = [m.snapshot_bytes for m in h.sent_to("s", p.Standby)]
    assert sizes == [[0, with_headroom(1000)], [with_headroom(50_000_000), with_headroom(1000)]]
    h.register("late", spare=True, nproc=2)
    assert [type(m) for m in (s.msg for s in h.sent if s.node_id == "late")] == [p.Welcome, p.Standby]
    h.msg("a", p.SnapshotStored("a", 3, 1, 0, nbytes=with_headroom(1000) + 1))
    assert h.sent_to("late", p.Standby)[-1].snapshot_bytes[1] == with_headroom(with_headroom(1000) + 1)
    assert len(h.sent_to("s", p.Standby)) == 3 and not h.sent_to("a", p.Standby) + h.sent_to("b", p.Standby)


@pytest.mark.parametrize("nbytes", [0, 1, 1000, (1 << 20) - 1, 1 << 20, 108_123_456, 5 << 30, 80 << 30])
def test_headroom_covers_a_slightly_larger_snapshot_in_whole_mib(nbytes):
    from dprun.controller.spare_sizing import MAX_HEADROOM, ROUND_BYTES, with_headroom

    room = with_headroom(nbytes)
    headroom = min(nbytes // 64, MAX_HEADROOM)
    assert room % ROUND_BYTES == 0 and nbytes + headroom < room <= nbytes + headroom + ROUND_BYTES


def test_state_that_looks_lost_while_a_live_node_restores_it_waits_for_that_restore():
    """Node c dies; spare s1 restores rank 2 from a, the only replica. Then a dies before s1 says it restored:
    rank 2's copy is in s1's hands. The plan waits for s1 (its WorkerReady) instead of ending as state lost, and
    says state lost if s1 only fails to restore (simulator seed 332327) or reports an error before restoring (its
    group for generation 1, with a in it, can no longer form: it takes no copy to the next)."""
    for outcome in ("restored", "failed", "peer error"):
        h = Harness(spec(nnodes=3, spares=2))
        for node, rank in (("a", 0), ("b", 1), ("c", 2)):
            h.register(node, rank=rank)
        h.register("s1", spare=True)
        h.register("s2", spare=True)
        for rank, holder in ((0, "b"), (1, "c"), (2, "a")):
            h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
        h.feed(NodeGone("c", "killed"))
        h.pong_all()
        assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "b", "s1"] and h.c.timeline.unrestored == {2}
        h.feed(NodeGone("a", "killed"))  # the only replica of rank 2 goes too
        h.pong_all()
        h.pong_all()  # the probe before "state lost"
        assert h.finish is None and h.c.timeline.generation == 1, "rank 2 may be restored already: wait for s1"
        (waiting,) = h.named("waiting_for_restore")
        assert waiting["ranks"] == [2] and waiting["nodes"] == ["s1"]
        if outcome == "restored":
            h.msg("s1", p.WorkerReady("s1", 1, 2, 0.01, 0.02, "replica"))
            h.pong_all()
            assert h.finish is None and h.c.timeline.generation == 2 and h.c.timeline.layout == ["s2", "b", "s1"]
            (rc,) = h.sent_to("s1", p.Reconfigure)[-1:]
            assert rc.restore_step == 4 and rc.restore_from == {"2": ""}, "its own restored copy"
        else:
            if outcome == "failed":
                h.msg("s1", p.RestoreFailed("s1", 1, 2, 4, "tcp://a:1", "connection lost"))
            else:
                h.msg("s1", p.PeerError("s1", 1, 2, "DistStoreError: wait timeout after 10000ms"))
            h.pong_all()
            h.pong_all()
            assert h.finish and "state lost" in h.finish.message and "ranks [2]" in h.finish.message
            assert h.now < h.c.spec.restore_wait, "decided when s1 answered, not at the wait's end"


def test_state_lost_for_a_rank_no_live_node_restores_ends_the_job_without_waiting_for_the_others():
    """2 nodes, 2 spares: b dies and s1 is handed rank 1 (its copy on a); a then dies before s1 says it
    restored. Rank 1 may be in s1's hands, but rank 0's only copy died with b and no live node restores it, so
    the job cannot go on whatever s1 says: it ends at once (it once waited restore_wait, 120 s, in silence)."""
    h = formed(spec(spares=2))
    h.register("t", spare=True)
    h.msg("b", p.SnapshotStored("b", 0, 4, 0))
    h.msg("a", p.SnapshotStored("a", 1, 4, 0))
    h.feed(NodeGone("b", "killed"))
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"] and h.c.timeline.unrestored == {1}
    h.feed(NodeGone("a", "killed"))
    h.pong_all()
    h.pong_all()  # the probe before "state lost"
    assert h.finish and "state lost: ranks [0, 1]" in h.finish.message
    assert not h.named("waiting_for_restore") and h.now < 1.0


def test_a_late_copy_that_this_generation_s_copy_superseded_is_forgotten_at_once():
    """b dies with its put of step 5 in flight to a: a's late report of it is taken in (no generation trained
    since). Then the spare restores rank 1 at step 4 and sends it again to a, whose store drops the older
    generation's copies at or past 4 (ReplicaStore.add): the ledger forgets step 5 there too, before generation 1
    trains, so a second failure cannot plan it (simulator seed 78267)."""
    h = formed()
    for step in (2, 4):
        h.msg("a", p.Progress("a", 0, 0, step, snapshot=True))
        h.msg("b", p.Progress("b", 0, 1, step, snapshot=True))
        h.msg("b", p.SnapshotStored("b", 0, step, 0))
        h.msg("a", p.SnapshotStored("a", 1, step, 0))
    h.feed(NodeGone("b", "agent process exited"))
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"]
    h.msg("a", p.SnapshotStored("a", 1, 5, 0))  # late: b's put, in flight when it died
    assert h.c.ledger.holders_of(1, 5) == ["a"], "taken in: the store made room for it"
    h.msg("a", p.SnapshotStored("a", 1, 4, 1))  # the spare's restored step 4, sent again
    assert h.c.ledger.holders_of(1, 5) == [] and h.c.ledger.holders_of(1, 4) == ["a"]
