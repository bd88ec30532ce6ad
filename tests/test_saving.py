"""The controller's side of a job's state on disk (dprun.files): a stopping job has the nodes that hold its newest
complete step write it before it ends; a resumed job has them read it back before its first generation."""

from __future__ import annotations

from dpagent import protocol as p
from dprun.controller import Shutdown, Tick
from test_controller import Harness, spec


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
    h.msg("b", p.WorkerExited("b", 0, 0, 11, -9))
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


def test_a_node_that_does_not_write_in_time_ends_the_job_saying_so():
    h = _two_nodes(save_dir="/saved", files_timeout=30.0)
    _trained_to_step_4_then_b_died(h)
    h.msg("a", p.SnapshotFiles("a", 4, {"1": "", "0": "rank 0: No space left on device"}))
    assert h.finish and "saving the state of step 4 in /saved/step-4 failed: a: rank 0: No space" in h.finish.message
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
    assert [(m.ranks, m.step) for m in h.sent_to("a", p.LoadSnapshots)] == [([0], 4)]
    assert [(m.ranks, m.step) for m in h.sent_to("b", p.LoadSnapshots)] == [([1], 4)]
    assert not h.sent_to("a", p.Reconfigure), "not before every rank's file is read"
    for node, rank in (("a", 0), ("b", 1)):
        h.msg(node, p.SnapshotStored(node, rank, 4, 0))
        h.msg(node, p.SnapshotFiles(node, 4, {str(rank): ""}))
    (rc,) = h.sent_to("a", p.Reconfigure)
    assert rc.generation == 0 and rc.restore_step == 4 and rc.restore_from == {"0": "tcp://a:1"}
    assert h.c.max_step == 4 and h.named("job_started")[0]["resumed_from"] == "/saved/step-4"


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
