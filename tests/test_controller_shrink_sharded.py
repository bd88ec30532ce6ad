"""--on-spare-exhausted shrink of a sharded job (FSDP2 over dp, with tp) in the controller: the lost node's whole
data-parallel replica leaves the mesh, the survivors of every tensor-parallel place carry its ranks, and the job
grows back to the full mesh once enough nodes joined; a mesh that cannot shrink says so and falls back."""

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone
from helpers.controller_harness import Harness, spec
from helpers.controller_shrinking import trains_narrow

MESH = "dp=2 x tp=2"


def four_nodes(mesh: str = MESH, **kw) -> Harness:
    """a, b, c, d (ranks 0-3 of `mesh`), no spare; each rank's snapshots of steps 0-4 on the next node."""
    h = Harness(spec(nnodes=4, spares=0, on_spare_exhausted="shrink", **kw))
    for rank, node in enumerate("abcd"):
        h.register(node, rank=rank)
    for step in range(5):
        for rank, holder in enumerate("bcda"):
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.WorkerReady("a", 0, 0, 0.1, 0.1, "", mesh=mesh))
    h.msg("a", p.Progress("a", 0, 0, 5))
    return h


def test_a_lost_node_takes_its_replica_out_and_each_tp_place_carries_its_ranks():
    h = four_nodes()
    h.feed(NodeGone("b", "killed"), dt=1)  # rank 1 (dp 0, tp 1): replica dp 0 (ranks 0 and 1) is lost
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 1
    # rank 0's only copy is a's own (its replica died with b): a goes on, for tp 0; d (rank 3) for tp 1
    assert h.c.timeline.layout == ["a", "d"] and h.c.timeline.width.assignment == ((0, 2), (3, 1))
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert (ra.node_rank, ra.nnodes, ra.world_size, ra.restore_step) == (0, 2, 2, 4)
    assert ra.carry == [[0, 2], [3, 1]] and ra.adopt_from == {"2": 2}
    assert ra.restore_from == {"0": "", "2": "tcp://d:1"}
    (rd,) = h.sent_to("d", p.Reconfigure)[-1:]
    assert rd.adopt_from == {"1": 1} and rd.restore_from == {"3": "tcp://a:1", "1": "tcp://c:1"}, "b's on c"
    (demote,) = h.sent_to("c", p.Demote)
    assert "left the mesh" in demote.reason and not h.sent_to("c", p.Stop)
    assert not h.sent_to("c", p.Reconfigure)[1:], "c is out of the new generation"
    assert h.c.table.nodes["c"].role == "spare" and h.c.table.nodes["c"].node_rank == -1, "c waits as a spare"
    (shrunk,) = h.named("job_shrunk")
    assert (shrunk["nodes"], shrunk["demoted"], shrunk["processes"], shrunk["ranks"]) == (["b", "c"], ["c"], 2, 4)

    h.msg("a", p.WorkerReady("a", 1, 0, 0.02, 0.03, "local"))
    h.msg("d", p.WorkerReady("d", 1, 3, 0.02, 0.01, "local"))
    for node, rank in (("a", 0), ("d", 3)):
        h.msg(node, p.Progress(node, 1, rank, 6))
    assert h.named("recovery_complete")
    for node, rank in (("a", 0), ("d", 3)):
        h.msg(node, p.RankFinished(node, 1, rank, 30))
        h.msg(node, p.WorkerExited(node, 1, 0, 10, 0))
    assert h.finish is not None and h.finish.exit_code == 0
    assert h.finish.message.startswith("all 4 ranks finished (trained by 2 processes: the job shrank)")
    assert h.sent_to("c", p.Stop)[-1].exit_code == 0, "the spare is stopped at the end, as any"


def test_the_narrow_mesh_grows_back_whole_with_the_demoted_node_and_one_that_joins():
    h = four_nodes()
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    trains_narrow(h, {"a": 0, "d": 3})
    h.msg("c", p.Heartbeat("c", -1, {"0": {"activity": "idle"}}))  # c's spare workers are set up
    h.pong_all()
    assert h.c.timeline.generation == 1 and not h.named("job_grew"), "one node cannot bring a replica of two back"
    h.join_set_up("e")
    h.pong_all()
    assert h.c.timeline.generation == 2
    assert h.c.timeline.layout == ["a", "c", "e", "d"] and h.c.timeline.width.assignment == ((0,), (1,), (2,), (3,))
    (rc,) = h.sent_to("c", p.Reconfigure)[-1:]
    (re,) = h.sent_to("e", p.Reconfigure)
    assert (rc.node_rank, rc.world_size, rc.carry, rc.adopt_from) == (1, 4, [], {"1": 3})
    assert (re.node_rank, re.adopt_from) == (2, {"2": 0})
    assert rc.restore_from["3"] == "tcp://a:1" and re.restore_from["0"] == "tcp://d:1"
    assert h.named("job_grew")[0]["processes"] == 4


def test_a_mesh_that_cannot_shrink_says_why_and_fails():
    h = four_nodes(mesh="pp=2 x dp=2")
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    assert h.finish is not None and h.finish.exit_code == 1
    why = "its mesh (pp=2 x dp=2) has pipeline-parallel or replicated (HSDP) dims"
    assert f"the job could not shrink: {why}" in h.finish.message
    (refused,) = h.named("shrink_refused")
    assert refused["reason"].startswith(why) and refused["fallback"] == "fail"


def test_a_mesh_that_cannot_shrink_waits_for_a_spare_when_the_fallback_is_wait():
    h = four_nodes(mesh="dp=1 x tp=4", shrink_fallback="wait")
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 0
    assert [e["fallback"] for e in h.named("shrink_refused")] == ["wait"] and h.named("waiting_for_spare")
    h.register("e", spare=True)
    h.pong_all()
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "e", "c", "d"], "a hot swap"
    assert len(h.named("shrink_refused")) == 1, "said once"
