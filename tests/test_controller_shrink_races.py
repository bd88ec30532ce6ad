"""--on-spare-exhausted shrink in the controller, where a width change meets what the workers did meanwhile: a grow
whose restore step the workers trained past, a node lost before a grown one restored (the simulator's seeds)."""

import pytest

from dpcommon import protocol as p
from dprun.controller.nodes import GROW_SETUP_WAIT_S
from dprun.controller.state_machine import NodeGone, Tick
from helpers.controller_harness import Harness, spec
from helpers.controller_shrinking import shrunk_and_training

pytestmark = pytest.mark.timeout(30)


def grow_planned_at_step_5() -> Harness:
    """shrunk_and_training, then d joins: the grow goes back to step 5 (rank 0's newest copy the controller
    knows of, rank 0's snapshots holding rank 1 that d takes back)."""
    h = shrunk_and_training()
    h.join_set_up("d")
    h.pong_all()
    assert h.c.timeline.generation == 2 and h.sent_to("d", p.Reconfigure)[-1].restore_step == 5
    return h


def test_a_grow_whose_restore_step_the_workers_trained_past_goes_to_their_newer_step():
    """Nothing stops a narrow job that trains while its grow is planned: a and c made steps 6 and 7 (their copies
    reported late) and no longer hold step 5, so every restore fails. The copies of 6 and 7 still hold the job's
    newest state (no generation trained since): the grow is planned again from step 7, not 'state lost'."""
    h = grow_planned_at_step_5()
    for step in (6, 7):
        h.msg("c", p.SnapshotStored("c", 0, step, 1))
        h.msg("a", p.SnapshotStored("a", 2, step, 1))
    h.msg("a", p.RestoreFailed("a", 2, 0, 5, "", "no local copy"))
    h.msg("a", p.PeerError("a", 2, 0, "snapshot of rank 0 at step 5 not found"))
    h.msg("c", p.RestoreFailed("c", 2, 2, 5, "", "no local copy"))
    h.msg("d", p.RestoreFailed("d", 2, 0, 5, "tcp://c:1", "not held"))
    for _ in range(3):  # (the probe answered, the plan waits a heartbeat for exits in flight)
        h.pong_all()
        h.feed(Tick(), dt=0.3)
    assert h.finish is None, h.finish
    assert h.c.timeline.generation == 3 and h.c.timeline.layout == ["a", "d", "c"]
    (rd,) = h.sent_to("d", p.Reconfigure)[-1:]
    assert rd.restore_step == 7 and rd.adopt_from == {"1": 0} and rd.restore_from["0"] == "tcp://c:1"
    assert h.sent_to("a", p.Reconfigure)[-1].restore_from["0"] in ("", "tcp://c:1")


def test_a_generation_that_trained_drops_the_copies_of_the_timeline_it_abandoned():
    h = grow_planned_at_step_5()
    h.msg("c", p.SnapshotStored("c", 0, 6, 1))  # (a late copy: a trained step 6 before the grow reached it)
    assert h.c.ledger.newest_live(0) == 6
    for node, rank in (("a", 0), ("d", 1), ("c", 2)):
        h.msg(node, p.WorkerReady(node, 2, rank, 0.02, 0.02, "local"))
    h.msg("a", p.Progress("a", 2, 0, 6))
    assert h.c.ledger.holders_of(0, 6) == [] and h.c.ledger.newest_ever[0] == 5


def test_a_grown_node_lost_before_it_restored_takes_its_rank_from_the_carrier_s_newest_snapshot():
    """d dies before it restored rank 1: rank 1's state is still in rank 0's snapshots (its own copies are
    from before the shrink, of step 4), so it is bounded by those, not by its own old copies: the job shrinks
    again from step 5 rather than saying rank 1 lost."""
    h = grow_planned_at_step_5()
    h.feed(NodeGone("d", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None, h.finish
    assert h.c.timeline.generation == 3 and h.c.timeline.layout == ["a", "c"]
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert ra.restore_step == 5 and ra.adopt_from == {} and ra.carry == [[0, 1], [2]]


def test_a_rank_lost_before_its_step_0_snapshot_reached_a_replica_is_not_carried_by_another_process():
    """b dies before any of its snapshots was stored: rank 1's state before training is nowhere but in a process
    started as rank 1 (its RNG is the script's own), so the job does not shrink (no generation that would fetch
    it from no store, planned again and again): it says why, and ends as --shrink-fallback fail says."""
    h = Harness(spec(nnodes=3, spares=0, on_spare_exhausted="shrink"))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    for rank, holder in ((0, "b"), (2, "a")):
        h.msg(holder, p.SnapshotStored(holder, rank, 0, 0))
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    (refused,) = h.named("shrink_refused")
    assert "ranks [1] were lost before their state at step 0 reached a replica" in refused["reason"]
    assert not h.named("job_shrunk") and h.c.timeline.generation == 0
    assert h.finish is not None and h.finish.exit_code == 1 and "could not shrink" in h.finish.message


def test_a_rank_whose_old_copies_are_lost_comes_back_from_the_carrier_s_snapshot_taken_anew():
    """4 nodes, 2 replicas. b (rank 1) dies: a carries rank 1, taken in from its copy on c, and replicates its
    snapshot of the restore step anew, with rank 1 in it, to c and d. c dies before the narrow job trained:
    rank 1's own copies died with it, but a's snapshot of step 4 taken anew on d holds it (as does a's local one):
    the job shrinks again from step 4, a restoring its own snapshot from d, not 'state lost'."""
    h = Harness(spec(nnodes=4, spares=0, replicas=2, on_spare_exhausted="shrink"))
    for rank, node in enumerate("abcd"):
        h.register(node, rank=rank)
    for step in range(5):
        for rank, holder in ((0, "b"), (0, "c"), (1, "c"), (2, "d"), (3, "a")):
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.Progress("a", 0, 0, 5))
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    assert h.c.timeline.width.assignment == ((0, 1), (2,), (3,))
    assert h.sent_to("a", p.Reconfigure)[-1].adopt_from == {"1": 1}
    h.msg("a", p.WorkerReady("a", 1, 0, 0.02, 0.02, "local"))
    h.msg("d", p.SnapshotStored("d", 0, 4, 1))  # (a's snapshot of step 4 taken anew, with rank 1's part)
    h.feed(NodeGone("c", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None, h.finish
    assert h.c.timeline.generation == 2 and h.c.timeline.width.assignment == ((0, 1), (3, 2))
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert ra.restore_step == 4 and ra.adopt_from == {} and ra.restore_from["0"] == "tcp://d:1"
    (rd,) = h.sent_to("d", p.Reconfigure)[-1:]
    assert rd.adopt_from == {"2": 2} and rd.restore_from["2"] == "tcp://d:1"


def test_a_copy_of_the_restore_step_from_before_it_was_taken_anew_is_not_planned_for_the_ranks_taken_in():
    h = Harness(spec(nnodes=3, spares=0, on_spare_exhausted="shrink"))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    for step in range(5):
        for rank, holder in ((0, "b"), (1, "c"), (2, "a")):
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    timeline, ledger = h.c.timeline, h.c.ledger
    h.msg("c", p.SnapshotStored("c", 0, 4, 0))  # (a late copy of a's from before: without rank 1)
    assert timeline.copies(ledger, 0, 4, {0: 0, 1: 0}) == [] and timeline.copies(ledger, 0, 4, {0: 0}) == ["c"]
    h.msg("c", p.SnapshotStored("c", 0, 4, 1))  # taken anew
    assert timeline.copies(ledger, 0, 4, {0: 0, 1: 0}) == ["c"]


def test_a_grow_whose_reconfigure_comes_after_the_narrow_job_finished_ends_the_job_done():
    """d joins as the narrow job makes its last step: a and c pass the final barrier and exit 0 before the grow's
    Reconfigure reaches them, so its generation can never start; training is complete: the job ends 0."""
    h = grow_planned_at_step_5()
    for node, rank in (("a", 0), ("c", 2)):
        h.msg(node, p.RankFinished(node, 1, rank, 30))
    for node in "ac":
        h.msg(node, p.WorkerExited(node, 1, 0, 10, 0))
    assert h.finish is not None and h.finish.exit_code == 0, h.finish
    assert h.finish.message.startswith("all 3 ranks finished (trained narrow to the end: the job ended before d")


def test_a_node_that_joins_as_the_narrow_job_finishes_does_not_make_it_fail():
    """d registers while the probe of its grow is out, and the narrow job finishes meanwhile: the grow is dropped
    and the job ends 0 once its workers exited (not 'exited after training completed')."""
    h = shrunk_and_training()
    h.join_set_up("d")
    for node, rank in (("a", 0), ("c", 2)):
        h.msg(node, p.RankFinished(node, 1, rank, 30))
    h.msg("a", p.WorkerExited("a", 1, 0, 10, 0))
    h.pong_all()
    h.feed(Tick(), dt=0.6)
    assert not h.named("job_grew") and h.finish is None
    h.join_set_up("e")  # (nor does one that joins once training is over)
    h.pong_all()
    assert not h.named("job_grew") and h.c.timeline.generation == 1
    h.msg("c", p.WorkerExited("c", 1, 0, 10, 0))
    assert h.finish is not None and h.finish.exit_code == 0, h.finish


def test_a_narrow_job_grows_onto_a_node_once_its_workers_are_set_up_not_when_it_registers():
    """d registers while its worker still imports torch and builds its model: the narrow job trains on (the
    survivors would wait for d's worker in the new generation); the grow comes with the heartbeat that says d's
    worker waits set up."""
    h = shrunk_and_training()
    h.register("d", spare=True)
    h.pong_all()
    h.msg("d", p.Heartbeat("d", -1, {}))  # (its agent's first heartbeats: no worker status yet)
    h.pong_all()
    assert h.c.timeline.generation == 1 and not h.named("job_grew") and not h.sent_to("d", p.Reconfigure)
    h.msg("d", p.Heartbeat("d", -1, {"0": {"activity": "idle"}}))
    h.pong_all()
    assert h.c.timeline.generation == 2 and h.named("job_grew") and h.sent_to("d", p.Reconfigure)


def test_a_recovery_that_needs_a_spare_takes_one_not_set_up_yet_but_grows_onto_none():
    """Two nodes join, neither set up, and a carrier dies: the one a lost node's ranks need is taken at once (a
    hot swap waits for nobody else's readiness); the other is left for a grow once it is set up."""
    h = shrunk_and_training()
    h.register("d", spare=True)
    h.register("e", spare=True)
    h.feed(NodeGone("c", "killed"), dt=1)
    h.pong_all()
    assert h.c.timeline.generation == 2 and "d" in h.c.timeline.layout and "e" not in h.c.timeline.layout
    assert not h.named("job_grew")


def test_a_recovery_does_not_grow_where_the_carriers_snapshots_died_with_the_node_lost():
    """c dies; d (not set up yet) takes its place, e (set up) could take rank 1 back from a, but a's snapshots
    were on c: the new node could not read them, so the recovery goes on without the grow (a restores its own
    copy), where planning it would have said rank 0 lost."""
    h = shrunk_and_training()
    h.feed(NodeGone("c", "killed"), dt=1)
    h.register("d", spare=True)
    h.join_set_up("e")
    h.pong_all()
    assert h.finish is None, h.finish
    assert h.c.timeline.generation == 2 and h.c.timeline.layout == ["a", "d"] and not h.named("job_grew")
    assert h.sent_to("a", p.Reconfigure)[-1].restore_from["0"] == ""


def test_a_grow_not_trained_yet_is_undone_where_its_new_node_cannot_reach_the_carrier_s_snapshot():
    """d took rank 1 back (its state in rank 0's snapshot of step 5, held on c), then c dies before the grown job
    trained: rank 0's snapshot is now only a's local copy, out of d's reach. The grow is undone (d leaves, its
    store kept) and a carries every rank, as the job that trained last had it plus c's rank."""
    h = grow_planned_at_step_5()
    h.feed(NodeGone("c", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None, h.finish
    (undone,) = h.named("grow_undone")
    assert undone["nodes"] == ["d"] and h.c.table.nodes["d"].keeps_store
    assert h.sent_to("d", p.Stop)[-1].keep_store
    assert h.c.timeline.generation == 3 and h.c.timeline.layout == ["a"]
    assert h.c.timeline.width.assignment == ((0, 1, 2),)
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert ra.restore_step == 5 and ra.adopt_from == {"2": 2} and ra.restore_from["2"] == "tcp://a:1"


def test_a_grow_waits_for_a_joining_node_s_workers_only_so_long():
    """d's worker never says it is set up (a slow start): the narrow job grows onto it GROW_SETUP_WAIT_S after
    it registered, the survivors waiting only for the rest of its start."""
    h = shrunk_and_training()
    h.register("d", spare=True)
    h.pong_all()
    h.feed(Tick(), dt=GROW_SETUP_WAIT_S / 2)
    h.pong_all()
    assert h.c.timeline.generation == 1
    h.feed(Tick(), dt=GROW_SETUP_WAIT_S / 2)
    h.pong_all()
    assert h.c.timeline.generation == 2 and h.named("job_grew")


def test_a_node_lost_while_a_grow_is_planned_is_recovered_even_where_the_grow_cannot_be():
    """d and e join set up (a grow onto d is being planned) when c dies, with a's snapshots, which e would have
    read to take rank 1 back: the recovery promotes d into c's place and leaves the grow for later."""
    h = shrunk_and_training()
    h.join_set_up("d")
    h.join_set_up("e")
    assert h.c.reconstruction.pending is not None and h.c.reconstruction.pending.why.startswith("a node joined")
    h.feed(NodeGone("c", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None, h.finish
    assert h.c.timeline.generation == 2 and h.c.timeline.layout == ["a", "d"] and not h.named("job_grew")
    assert h.c.reconstruction.recovery is not None


def test_a_process_that_went_back_to_a_failed_grow_s_step_is_planned_from_it():
    """The grow went back to step 5; a restored it (letting its newer snapshots go) while c had trained on to 6,
    so the grow fails and is planned again from 6, which a no longer holds. a holds step 5, which it was told to
    restore since the job last trained: the plan goes back to 5 rather than say rank 0 lost."""
    h = grow_planned_at_step_5()
    h.msg("a", p.SnapshotStored("a", 2, 6, 1))  # (c's step 6, reported late)
    h.msg("c", p.SnapshotStored("c", 0, 6, 1))  # (and a's, its only copy on c)
    h.msg("c", p.RestoreFailed("c", 2, 2, 5, "", "no local copy"))
    for _ in range(3):
        h.pong_all()
        h.feed(Tick(), dt=0.3)
    assert h.c.timeline.generation == 3 and h.sent_to("a", p.Reconfigure)[-1].restore_step == 6
    h.feed(NodeGone("c", "killed"), dt=0.1)  # (a's copy of 6 goes with it)
    h.msg("a", p.RestoreFailed("a", 3, 0, 6, "", "no local copy"))
    for _ in range(4):
        h.pong_all()
        h.feed(Tick(), dt=0.3)
    assert h.finish is None, h.finish
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert ra.restore_step == 5 and ra.restore_from["0"] == ""
