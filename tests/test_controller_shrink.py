"""--on-spare-exhausted shrink in the controller: a node lost with no spare left leaves the layout, the least busy
survivors take its ranks, each from the snapshots that hold it, and the job ends when every process finished."""

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone
from dprun.controller.narrowing import Width
from helpers.controller_shrinking import shrunk_and_training, three_nodes_shrinking


def test_a_lost_node_s_rank_goes_to_a_survivor_which_restores_it_from_its_replica():
    h = three_nodes_shrinking()
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 1
    assert h.c.timeline.layout == ["a", "c"] and h.c.timeline.width.assignment == ((0, 1), (2,))
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert (ra.node_rank, ra.nnodes, ra.world_size, ra.restore_step) == (0, 2, 2, 4)
    assert ra.carry == [[0, 1], [2]] and ra.adopt_from == {"1": 1}
    assert ra.restore_from == {"0": "", "1": "tcp://c:1"}, "rank 0's replicas died with b; rank 1's are on c"
    (rc,) = h.sent_to("c", p.Reconfigure)[-1:]
    assert (rc.node_rank, rc.carry, rc.adopt_from) == (1, [[0, 1], [2]], {})
    (shrunk,) = h.named("job_shrunk")
    assert shrunk == {"event": "job_shrunk", "generation": 1, "nodes": ["b"], "processes": 2, "ranks": 3,
                      "slowdown": 2, "carried": {"0": [1]}}
    assert not h.named("spare_promoted")

    h.msg("a", p.WorkerReady("a", 1, 0, 0.02, 0.03, "local"))
    h.msg("c", p.WorkerReady("c", 1, 2, 0.02, 0.01, "local"))
    h.msg("a", p.Progress("a", 1, 0, 5))
    h.msg("c", p.Progress("c", 1, 2, 5))
    assert h.named("recovery_complete"), "two processes stepping past the restore step complete it"
    for node, rank in (("a", 0), ("c", 2)):
        h.msg(node, p.RankFinished(node, 1, rank, 30))
        h.msg(node, p.WorkerExited(node, 1, 0, 10, 0))
    assert h.finish is not None and h.finish.exit_code == 0
    assert h.finish.message.startswith("all 3 ranks finished (trained by 2 processes: the job shrank)")


def test_a_failure_before_the_narrow_job_trained_takes_the_adopted_rank_from_its_old_snapshots():
    """a dies while it restores rank 1: c takes ranks 0 and 1, rank 1 still from the copies of b's snapshots
    (a's own snapshots hold it only from the first step it trains narrow), rank 0 from its copy on c."""
    h = three_nodes_shrinking()
    h.msg("c", p.SnapshotStored("c", 0, 4, 0))  # rank 0's step 4 also on c
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    h.feed(NodeGone("a", "killed"), dt=1)
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 2 and h.c.timeline.layout == ["c"]
    assert h.c.timeline.width.assignment == ((2, 0, 1),)
    (rc,) = h.sent_to("c", p.Reconfigure)[-1:]
    assert rc.restore_step == 4 and rc.adopt_from == {"0": 0, "1": 1}
    assert rc.restore_from == {"2": "", "0": "tcp://c:1", "1": "tcp://c:1"}


def test_a_node_that_joins_a_narrow_job_takes_its_rank_back_from_the_carrier_s_snapshot():
    h = shrunk_and_training()
    h.join_set_up("d")
    h.pong_all()
    assert h.finish is None and h.c.timeline.generation == 2
    assert h.c.timeline.layout == ["a", "d", "c"], "in the order of their ranks: rank r on process r again"
    assert h.c.timeline.width.assignment == ((0,), (1,), (2,))
    (rd,) = h.sent_to("d", p.Reconfigure)
    assert (rd.node_rank, rd.nnodes, rd.world_size, rd.restore_step, rd.carry) == (1, 3, 3, 5, [])
    assert rd.adopt_from == {"1": 0} and rd.restore_from["0"] == "tcp://c:1", "rank 1 is in rank 0's snapshots"
    (ra,) = h.sent_to("a", p.Reconfigure)[-1:]
    assert ra.adopt_from == {} and ra.carry == []
    (grew,) = h.named("job_grew")
    assert grew == {"event": "job_grew", "generation": 2, "nodes": ["d"], "processes": 3, "ranks": 3, "slowdown": 1}
    assert h.c.timeline.holder_key(1, 6) == 0, "until the grown generation trains, rank 1's newer state is in rank 0's"
    for node, rank in (("a", 0), ("d", 1), ("c", 2)):
        h.msg(node, p.WorkerReady(node, 2, rank, 0.02, 0.02, "replica"))
    h.msg("d", p.Progress("d", 2, 1, 6))
    assert h.c.timeline.holder_key(1, 5) == 0 and h.c.timeline.holder_key(1, 6) == 1


def test_a_job_whose_ranks_are_out_of_order_tells_its_workers_even_at_full_width():
    h = three_nodes_shrinking()
    h.feed(NodeGone("a", "killed"), dt=1)  # rank 0 goes to b's process: ((1, 0), (2,))
    h.pong_all()
    assert h.c.timeline.width.assignment == ((1, 0), (2,))
    h.c.timeline.width = Width(((1,), (2,), (0,)))  # (a layout that no grow makes, but a worker must follow)
    sends = h.c.timeline.reconfigures(h.c.spec, h.c.table, h.c.ledger, 4, {}, "test")
    assert {s.msg.carry == [[1], [2], [0]] for s in sends} == {True}
