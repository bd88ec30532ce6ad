"""The controller's side of a job's state on disk (dprun.controller.files): a stopping job has the nodes that hold its
newest complete step write it before it ends; a resumed job has them read it back before its first generation."""

from __future__ import annotations

import pytest

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone, Shutdown, Tick
from dprun.monitor.events import describe
from helpers.controller_harness import Harness, formed, spec


def _two_nodes(**kw) -> Harness:
    h = Harness(spec(spares=0, **kw))
    h.register("a", rank=0)
    h.register("b", rank=1)
    return h


def _trained_to_step_4_then_b_died(h: Harness) -> None:
    for step in (2, 4):
        h.msg("a", p.Progress("a", 0, 0, step, snapshot=True))
        h.msg("b", p.Progress("b", 0, 1, step, snapshot=True))
        h.msg("b", p.SnapshotStored("b", 0, step, 0))  # rank 0's replicas are on b ...
        h.msg("a", p.SnapshotStored("a", 1, step, 0))  # ... rank 1's on a
    h.feed(NodeGone("b", "agent process exited"))
    h.pong_all()


def test_a_job_out_of_spares_has_its_newest_step_written_before_it_ends():
    h = _two_nodes(save_dir="/saved")
    _trained_to_step_4_then_b_died(h)
    asked = h.sent_to("a", p.SaveSnapshots)
    assert sorted((m.ranks, m.local) for m in asked) == [([0], True), ([1], False)], asked
    assert {m.directory for m in asked} == {"/saved/step-4"} and {m.step for m in asked} == {4}
    assert h.finish is None and not h.sent_to("a", p.Stop), "the job ends once the files are written"
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))  # a's store wrote rank 1 (whose holder it is) ...
    h.msg("a", p.Heartbeat("a", 0))
    assert h.finish is None
    h.msg("a", p.SnapshotFiles("a", 4, {"0": ""}))  # ... and a's worker its own copy (its holder died)
    assert h.finish and h.finish.exit_code == 1
    assert "no spare left" in h.finish.message and "the state of step 4 is saved in /saved/step-4" in h.finish.message
    assert "--resume-from /saved/step-4" in h.finish.message and h.sent_to("a", p.Stop)
    assert h.finish.saved_in == "/saved/step-4"  # what dprun's shell reads, not the message


def test_a_node_that_does_not_write_in_time_ends_the_job_saying_so():
    h = _two_nodes(save_dir="/saved", files_timeout=30.0)
    _trained_to_step_4_then_b_died(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": "", "0": "rank 0: No space left on device"}))
    assert h.finish is None, "an older step is tried: a file may fail for want of its copy, not of the disk"
    assert sorted((m.ranks, m.local) for m in h.sent_to("a", p.SaveSnapshots) if m.step == 2) == [([0], True),
                                                                                                   ([1], False)]
    h.msg("a", p.SnapshotFiles("a", 2, {"1": "", "0": "rank 0: No space left on device"}))
    assert h.finish and "saving the state of step 4 in /saved/step-4 failed: a: rank 0: No space" in h.finish.message
    assert "saving the state of step 2 in /saved/step-2 failed" in h.finish.message
    assert h.finish.message.endswith("no other step of which every rank has a copy is left to try")
    h2 = _two_nodes(save_dir="/saved", files_timeout=30.0)
    _trained_to_step_4_then_b_died(h2)
    h2.feed(Tick(), dt=31.0)
    assert h2.finish and "a did not answer within 30 s" in h2.finish.message


def test_without_save_dir_or_with_nothing_saved_yet_the_job_ends_at_once():
    h = _two_nodes()
    _trained_to_step_4_then_b_died(h)
    assert h.finish and not h.sent_to("a", p.SaveSnapshots)
    h2 = _two_nodes(save_dir="/saved")
    h2.msg("b", p.WorkerExited("b", 0, 0, 11, -9))  # before any snapshot past step 0
    h2.pong_all()
    assert h2.finish and "no step of which every rank has a copy was left to save" in h2.finish.message


def test_a_resumed_job_reads_its_files_into_its_nodes_stores_then_restores_from_them():
    h = _two_nodes(resume_from="/saved/step-4", resume_step=4)
    # its own ranks', then its peer's, as that node's replica holder
    assert [(m.ranks, m.step) for m in h.sent_to("a", p.LoadSnapshots)] == [([0, 1], 4)]
    assert [(m.ranks, m.step) for m in h.sent_to("b", p.LoadSnapshots)] == [([1, 0], 4)]
    assert not h.sent_to("a", p.Reconfigure), "not before every rank's file is read"
    h.msg("a", p.SnapshotStored("a", 0, 4, 0))
    h.msg("a", p.SnapshotFiles("a", 4, {"0": "", "1": "/saved/step-4/rank-1.dpsnap is corrupt"}))  # (its peer's)
    h.msg("b", p.SnapshotStored("b", 1, 4, 0))
    h.msg("b", p.SnapshotFiles("b", 4, {"1": ""}))  # (without rank 0: a peer's copy is not required)
    (rc,) = h.sent_to("a", p.Reconfigure)
    assert rc.generation == 0 and rc.restore_step == 4 and rc.restore_from == {"0": "tcp://a:1"}
    assert h.c.timeline.max_step == 4 and h.named("job_started")[0]["resumed_from"] == "/saved/step-4"


def _resumed_and_started(h: Harness, held_by_peers: bool) -> None:
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.register("s", spare=True)
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.SnapshotStored(node, rank, 4, 0))
        if held_by_peers:
            h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
        h.msg(node, p.SnapshotFiles(node, 4, {str(rank): ""}))


def test_a_resumed_job_that_loses_a_node_before_its_first_snapshot_is_restored_from_the_files_its_peer_read():
    h = Harness(spec(spares=1, resume_from="/saved/step-4", resume_step=4))
    _resumed_and_started(h, held_by_peers=True)
    h.feed(NodeGone("b", "agent process exited"))
    for _ in range(3):
        h.pong_all()
    assert h.finish is None
    (rc,) = [m for m in h.sent_to("s", p.Reconfigure) if m.generation == 1]
    assert rc.restore_step == 4 and rc.restore_from == {"1": "tcp://a:1"}


def test_a_resumed_job_that_loses_a_node_before_its_state_is_on_a_peer_is_restored_from_its_folder_again():
    """Its files are a step safe on disk: every rank goes back to it (each node reads them again) rather than the
    job ending 'state lost' (before the disk tier, it ended naming the folder to go on from)."""
    h = Harness(spec(spares=1, resume_from="/saved/step-4", resume_step=4))
    _resumed_and_started(h, held_by_peers=False)  # lost before its holder had read its files
    h.feed(NodeGone("b", "agent process exited"))
    for _ in range(3):
        h.pong_all()
    assert h.finish is None
    (restoring,) = h.named("restoring_from_disk")
    assert restoring["ranks"] == [1] and restoring["folder"] == "/saved/step-4"
    (load,) = h.sent_to("s", p.LoadSnapshots)
    assert (load.directory, load.step, load.generation) == ("/saved/step-4", 4, 1) and 1 in load.ranks
    h.msg("a", p.SnapshotFiles("a", 4, {"0": ""}))
    h.msg("s", p.SnapshotFiles("s", 4, {"1": ""}))
    (rc,) = [m for m in h.sent_to("s", p.Reconfigure) if m.generation == 1]
    assert rc.restore_step == 4 and rc.restore_from == {"1": "tcp://s:1"}, "from its own store's copy"


def test_a_restore_from_disk_whose_files_cannot_be_read_ends_the_job_saying_both():
    h = Harness(spec(spares=1, resume_from="/saved/step-4", resume_step=4))
    _resumed_and_started(h, held_by_peers=False)
    h.feed(NodeGone("b", "agent process exited"))
    for _ in range(3):
        h.pong_all()
    h.msg("a", p.SnapshotFiles("a", 4, {"0": ""}))
    h.msg("s", p.SnapshotFiles("s", 4, {"1": "/saved/step-4/rank-1.dpsnap: No such file or directory"}))
    assert h.finish and h.finish.exit_code == 1 and "state lost" in h.finish.message
    assert "restoring every rank from /saved/step-4 failed: s: /saved/step-4/rank-1.dpsnap" in h.finish.message


def test_a_resume_whose_file_cannot_be_read_stops_before_training():
    h = _two_nodes(resume_from="/saved/step-4", resume_step=4)
    h.msg("a", p.SnapshotFiles("a", 4, {"0": "/saved/step-4/rank-0.dpsnap is corrupt"}))
    h.msg("b", p.SnapshotFiles("b", 4, {"1": ""}))
    assert h.finish and h.finish.exit_code == 1 and "cannot resume from /saved/step-4" in h.finish.message
    assert "rank-0.dpsnap is corrupt" in h.finish.message and not h.sent_to("a", p.Reconfigure)


def test_sigterm_saves_from_the_stores_which_need_no_worker_of_theirs():
    h = _two_nodes(save_dir="/saved")
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.feed(Shutdown(143, "dprun received SIGTERM; stopping every node"))
    assert [(m.ranks, m.local) for m in h.sent_to("a", p.SaveSnapshots)] == [([1], False)]
    assert [(m.ranks, m.local) for m in h.sent_to("b", p.SaveSnapshots)] == [([0], False)]
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 1, "KeyboardInterrupt"))  # its store still writes rank 1
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    assert h.finish is None
    h.msg("b", p.SnapshotFiles("b", 4, {"0": ""}))
    assert h.finish and h.finish.exit_code == 143 and "the state of step 4 is saved" in h.finish.message


def test_a_worker_lost_while_it_writes_its_own_copy_fails_the_save_saying_so():
    h = _two_nodes(save_dir="/saved")
    _trained_to_step_4_then_b_died(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    h.msg("a", p.WorkerExited("a", 0, 0, 10, -9))  # it was to write rank 0, whose holder died
    assert h.finish and "saving the state of step 4 in /saved/step-4 failed: a: its worker 0 killed by SIGKILL" \
        in h.finish.message
    assert h.finish.saved_in == ""


def _sigterm_at_step_4(h: Harness) -> None:
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.feed(Shutdown(143, "dprun received SIGTERM; stopping every node"))


def test_a_damaged_copy_in_a_store_is_saved_from_the_rank_s_own_worker_instead():
    h = _two_nodes(save_dir="/saved")
    _sigterm_at_step_4(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 4, {"0": "rank 0 step 4 is damaged here (checksum mismatch)"}))
    assert h.finish is None, "a second source is asked before the save is given up"
    (retry,) = [m for m in h.sent_to("a", p.SaveSnapshots) if m.ranks == [0]]
    assert retry.local and retry.step == 4 and retry.directory == "/saved/step-4"
    assert h.named("save_retried")[0]["why"].startswith("b: rank 0 step 4 is damaged")
    assert "writing it from its worker on a instead" in describe(h.named("save_retried")[0])
    h.msg("a", p.SnapshotFiles("a", 4, {"0": ""}))
    assert h.finish and h.finish.exit_code == 143 and "the state of step 4 is saved" in h.finish.message


def test_a_store_lost_while_it_writes_has_its_ranks_saved_elsewhere_until_none_is_left():
    h = _two_nodes(save_dir="/saved")
    _sigterm_at_step_4(h)
    h.feed(NodeGone("b", "agent process exited"))
    assert [m.ranks for m in h.sent_to("a", p.SaveSnapshots) if m.local] == [[0]], "rank 0 from its own worker"
    assert h.finish is None
    h.msg("a", p.WorkerExited("a", 0, 0, 10, -9))  # ... which dies too: rank 0 has no copy left to write
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    assert h.finish and "saving the state of step 4 in /saved/step-4 failed: a: its worker 0 killed by SIGKILL" \
        in h.finish.message


def test_a_store_that_falls_silent_while_it_writes_is_given_up_at_the_heartbeat_timeout_not_the_files_one():
    """As when Slurm ends a step: a node's agent killed during the save sends nothing more; the save goes on
    without it after --heartbeat-timeout (5 s here) instead of waiting for the files' 600 s."""
    h = _two_nodes(save_dir="/saved")
    _sigterm_at_step_4(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    for _ in range(2):
        h.feed(Tick(), dt=2.0)
        h.msg("a", p.Heartbeat("a", 0))
    assert not [m for m in h.sent_to("a", p.SaveSnapshots) if m.local], "b is silent for 4 s only"
    h.feed(Tick(), dt=2.0)
    (retry,) = [m for m in h.sent_to("a", p.SaveSnapshots) if m.local]
    assert retry.ranks == [0] and h.named("save_retried")[0]["why"] == "b failed: no heartbeat for 6.0 s"
    h.msg("a", p.SnapshotFiles("a", 4, {"0": ""}))
    assert h.finish and h.finish.exit_code == 143 and "the state of step 4 is saved" in h.finish.message


def test_two_replicas_give_a_failed_store_s_rank_a_second_store_before_its_worker():
    h = Harness(spec(spares=0, nnodes=3, replicas=2, save_dir="/saved"))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    for rank, node in enumerate("abc"):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        for holder in "abc":
            if holder != node:
                h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.feed(Shutdown(143, "dprun received SIGTERM; stopping every node"))
    first = {node: [m.ranks for m in h.sent_to(node, p.SaveSnapshots)] for node in "abc"}
    asked_of = {rank: node for node, lists in first.items() for ranks in lists for rank in ranks}
    failing = asked_of[0]
    h.feed(NodeGone(failing, "killed"))
    retried = [(node, m.ranks, m.local) for node in "abc" if node != failing
               for m in h.sent_to(node, p.SaveSnapshots) if [r for r in m.ranks if asked_of[r] == failing]
               and m.ranks not in first[node]]
    assert retried and all(not local for _, _, local in retried), retried
    for node in "abc":
        if node != failing:
            for m in h.sent_to(node, p.SaveSnapshots):
                h.msg(node, p.SnapshotFiles(node, 4, {str(r): "" for r in m.ranks}))
    assert h.finish and "the state of step 4 is saved" in h.finish.message, h.finish


def test_a_stopping_job_saves_the_newest_step_its_stores_hold_rather_than_ask_its_workers():
    """Step 6 of rank 1 is only in its worker (its store has not acked it yet), step 4 of both is in the stores:
    a stopping job's workers are often dying (scancel signals them too), so step 4 is saved, by the stores."""
    h = _two_nodes(save_dir="/saved")
    for step in (4, 6):
        for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
            h.msg(node, p.Progress(node, 0, rank, step, snapshot=True))
            if (rank, step) != (1, 6):
                h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.feed(Shutdown(143, "dprun received SIGTERM; stopping every node"))
    asked = [(node, m.ranks, m.step, m.local) for node in "ab" for m in h.sent_to(node, p.SaveSnapshots)]
    assert asked == [("a", [1], 4, False), ("b", [0], 4, False)], asked


def test_a_node_fenced_for_its_worker_s_error_keeps_its_store_for_the_save():
    """b's worker raises (its agent is fine): b is fenced, its workers stopped, but its store (rank 0's copies)
    stays; with no spare the job ends and rank 0 is saved from b's store, not asked of a's worker."""
    h = _two_nodes(save_dir="/saved")
    for step in (2, 4):
        for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
            h.msg(node, p.Progress(node, 0, rank, step, snapshot=True))
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, "ValueError: bad batch"))
    (fenced,) = h.sent_to("b", p.Stop)
    assert fenced.keep_store and fenced.exit_code == 1
    h.msg("b", p.Heartbeat("b", 0))
    assert h.sent_to("b", p.Stop) == [fenced], "a kept node's heartbeat is not answered with another Stop"
    h.pong_all()
    asked = [(node, m.ranks, m.step, m.local) for node in "ab" for m in h.sent_to(node, p.SaveSnapshots)]
    assert asked == [("a", [1], 4, False), ("b", [0], 4, False)], asked
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 4, {"0": ""}))
    assert h.finish and "the state of step 4 is saved" in h.finish.message
    assert [m.keep_store for m in h.sent_to("b", p.Stop)] == [True, False], "the job's end stops it for good"


@pytest.mark.parametrize("save_dir", [None, "/saved"])
def test_a_node_fenced_for_its_worker_s_exit_keeps_its_store_until_it_was_replaced(save_dir):
    """Its copies serve the recovery's restores, with or without --save-dir; in restart mode (every worker
    restarted, nothing restored from stores) it stops at once."""
    h = formed(spec(restart_mode=True))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, "ValueError"))
    assert [m.keep_store for m in h.sent_to("b", p.Stop)] == [False]
    h = formed(spec(save_dir=save_dir))
    h.msg("a", p.SnapshotStored("a", 1, 3, 0))
    h.msg("b", p.SnapshotStored("b", 0, 3, 0))
    h.msg("a", p.Progress("a", 0, 0, 4))
    h.msg("b", p.Progress("b", 0, 1, 4))
    h.msg("b", p.WorkerExited("b", 0, 0, 99, -9))
    h.pong_all()
    assert h.c.timeline.generation == 1 and [m.keep_store for m in h.sent_to("b", p.Stop)] == [True]
    h.msg("a", p.WorkerReady("a", 1, 0, 0.02, 0.01, "local"))
    h.msg("s", p.WorkerReady("s", 1, 1, 0.03, 0.05, "replica"))
    h.msg("a", p.Progress("a", 1, 0, 4))
    h.msg("s", p.Progress("s", 1, 1, 4))
    assert h.named("recovery_complete")
    assert [m.keep_store for m in h.sent_to("b", p.Stop)] == [True, False]
    assert "b" not in {holder for by_holder in h.c.ledger.held.values() for holder in by_holder}


def test_a_kept_node_that_falls_silent_loses_its_copies():
    h = _two_nodes(save_dir="/saved", on_spare_exhausted="wait")  # (the job does not end at once)
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, "ValueError"))
    h.pong_all()
    assert h.c.ledger.holders_of(0, 4) == ["b"], "a kept store's copies count (for a restore, for a save)"
    h.alive({"a": {}}, dt=3.0)
    h.alive({"a": {}}, dt=3.0)  # b silent for 6 s (timeout 5)
    assert h.c.ledger.holders_of(0, 4) == [] and not h.c.table.get("b").keeps_store


def test_a_kept_node_whose_agent_leaves_loses_its_copies_at_once():
    h = _two_nodes(save_dir="/saved", on_spare_exhausted="wait")
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, "ValueError"))
    h.pong_all()
    assert h.c.ledger.holders_of(0, 4) == ["b"] and h.c.table.get("b").keeps_store
    h.msg("b", p.Leaving("b", "received SIGTERM; the controller did not stop the job"))  # not its heartbeat timeout
    assert h.c.ledger.holders_of(0, 4) == [] and not h.c.table.get("b").keeps_store


def test_a_save_whose_copies_turn_out_damaged_goes_down_to_an_older_step_every_rank_has():
    """Rank 0's step-4 copy is damaged and its worker died with its node: nothing else holds rank 0's step 4,
    but every rank's step 2 is still in a store: that is saved, the message saying why not step 4."""
    h = _two_nodes(save_dir="/saved")
    for step in (2, 4):
        for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
            h.msg(node, p.Progress(node, 0, rank, step, snapshot=True))
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.WorkerExited("a", 0, 0, 11, -9))  # a fenced, its store (rank 1's copies) kept; no spare
    h.pong_all()
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 4, {"0": "rank 0 step 4 is damaged here"}))
    assert h.finish is None
    asked = [(node, m.ranks, m.local) for node in "ab" for m in h.sent_to(node, p.SaveSnapshots) if m.step == 2]
    assert asked == [("a", [1], False), ("b", [0], False)], asked
    h.msg("a", p.SnapshotFiles("a", 2, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 2, {"0": ""}))
    assert h.finish and "saving the state of step 4 in /saved/step-4 failed: b: rank 0 step 4 is damaged" \
        in h.finish.message
    assert "the state of step 2 is saved in /saved/step-2 (go on from it" in h.finish.message


def test_a_save_whose_copies_the_workers_trained_past_saves_the_newer_step_instead():
    """A first SIGTERM leaves the workers training while the controller picks the step: by the time the stores
    look, they hold only newer copies (reported before their answers). The rank's worker moved past it too, so
    no worker is asked for that step; the newest step every rank now has is saved instead (the nodes asked
    stopped their workers), not an older one that is just as gone."""
    h = _two_nodes(save_dir="/saved")
    _sigterm_at_step_4(h)
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        for step in (6, 8):
            h.msg(node, p.Progress(node, 0, rank, step, snapshot=True))
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.SnapshotFiles("a", 4, {"1": "rank 1 step 4 is not held here (held: [8])"}))
    h.msg("b", p.SnapshotFiles("b", 4, {"0": "rank 0 step 4 is not held here (held: [8])"}))
    assert not h.named("save_retried"), "no worker is asked for a step it trained past"
    assert h.finish is None
    asked = [(node, m.ranks, m.local) for node in "ab" for m in h.sent_to(node, p.SaveSnapshots) if m.step == 8]
    assert asked == [("a", [1], False), ("b", [0], False)], asked
    h.msg("a", p.SnapshotFiles("a", 8, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 8, {"0": ""}))
    assert h.finish and h.finish.message == ("dprun received SIGTERM; stopping every node; saving the state of step "
                                             "4 in /saved/step-4 failed: the workers trained on past it (ranks [0, "
                                             "1]); the state of step 8 is saved in /saved/step-8 (go on from it: "
                                             "dprun ... --resume-from /saved/step-8)"), h.finish


def _both_workers_lost(job) -> Harness:
    """Spares s and t; a's and b's workers die one after the other (b's, then a's before the spare said it
    restored rank 1), each node holding the other's only copy of step 4."""
    h = formed(job)
    h.register("t", spare=True)
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 4, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 4, 0))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, -9))
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout[1] in ("s", "t")
    h.msg("a", p.WorkerExited("a", 1, 0, 12, -9))
    h.pong_all()
    h.pong_all()
    return h


def test_the_stores_fenced_nodes_keep_serve_the_recovery_when_they_hold_the_only_copies():
    """a's and b's workers die one after the other, each node holding the other's only copy: with --save-dir
    their stores stay, and the plan restores from them rather than say "state lost"."""
    h = _both_workers_lost(spec(spares=2, save_dir="/saved"))
    assert h.finish is None and h.c.timeline.generation == 2 and set(h.c.timeline.layout) == {"s", "t"}
    plans = {m.node_rank: m for node in ("s", "t") for m in h.sent_to(node, p.Reconfigure) if m.generation == 2}
    assert plans[0].restore_from == {"0": "tcp://b:1"} and plans[1].restore_from == {"1": "tcp://a:1"}
    assert [m.keep_store for m in h.sent_to("a", p.Stop)] == [True], "kept until this recovery completes"


def test_a_kept_store_lost_while_a_rank_restores_from_it_has_the_plan_made_again_at_once():
    """As above, then b's agent dies too, before rank 0 (restoring from b's store) said it restored: the plan is
    made again at once (the fetch from a dead store would wait out its timeout), and with b's copy gone the job
    says rank 0's state is lost, once rank 0's node has not said it restored it in --restore-wait (the copy may
    have been fetched before b died) (simulator seed 13863: before, no plan was made again at all)."""
    h = _both_workers_lost(spec(spares=2, save_dir="/saved", restore_wait=3.0))
    assert h.c.timeline.generation == 2 and h.finish is None
    rank0_on = h.c.timeline.layout[0]
    h.msg(h.c.timeline.layout[1], p.WorkerReady(h.c.timeline.layout[1], 2, 1, 0.01, 0.02, "replica"))  # rank 1 restored from a
    h.feed(NodeGone("b", "agent process exited (killed by SIGKILL)"))
    assert h.c.reconstruction.flush is not None, "every node probed at once for a new plan, not left to the fetch's timeout"
    h.pong_all()
    h.pong_all()
    (waiting,) = h.named("waiting_for_restore")
    assert waiting["ranks"] == [0] and waiting["nodes"] == [rank0_on]
    while h.finish is None and h.now < 10.0:
        h.alive({node: {} for node in ("s", "t")})
    assert h.finish and h.finish.exit_code == 1 and "state lost: ranks [0]" in h.finish.message, h.finish


def test_a_full_disk_ends_the_save_at_the_first_step_tried_even_where_the_workers_trained_on():
    """The disk refused the file (full, read-only): no other step would fit, so none is tried, even where the
    workers trained past the step asked meanwhile (before, each newer copy was tried in turn as 'trained past',
    thousands of times a second on a job that kept training after its SIGTERM, the message growing each time).
    The rank's own worker is still asked (another node may see another disk)."""
    h = _two_nodes(save_dir="/saved")
    _sigterm_at_step_4(h)
    for node, rank, holder in (("a", 0, "b"), ("b", 1, "a")):
        h.msg(node, p.Progress(node, 0, rank, 6, snapshot=True))
        h.msg(holder, p.SnapshotStored(holder, rank, 6, 0))
    full = "cannot write rank 1's file: [Errno 28] No space left on device: '/saved/step-4/rank-1.dpsnap.tmp'"
    h.msg("a", p.SnapshotFiles("a", 4, {"1": full}))
    h.msg("b", p.SnapshotFiles("b", 4, {"0": ""}))
    (retry,) = [m for m in h.sent_to("b", p.SaveSnapshots) if m.ranks == [1] and m.local]
    assert retry.step == 4 and h.finish is None
    h.msg("b", p.SnapshotFiles("b", 4, {"1": full}))
    assert h.finish and h.finish.exit_code == 143, h.finish
    assert h.finish.message.endswith(f"saving the state of step 4 in /saved/step-4 failed: b: {full}"), h.finish
    assert not [m for node in "ab" for m in h.sent_to(node, p.SaveSnapshots) if m.step != 4], "no other step tried"


def test_a_worker_that_finishes_before_it_writes_its_own_copy_is_not_waited_for():
    """A worker asked to write its own copy that exits 0 first (its script had finished) never answers: the
    save goes on without it at once, not at the files' deadline (600 s)."""
    h = _two_nodes(save_dir="/saved")
    _trained_to_step_4_then_b_died(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": ""}))
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 0))  # it was to write rank 0, whose holder died
    assert h.finish and ("saving the state of step 4 in /saved/step-4 failed: a: its worker 0 exit code 0 before "
                         "it wrote its file") in h.finish.message, h.finish
