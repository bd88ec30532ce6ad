"""Controller harnesses of a data-parallel job that shrinks (--on-spare-exhausted shrink): three nodes and no spare,
before and after the shrink, for the controller's shrink tests."""

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone

from .controller_harness import Harness, spec


def three_nodes_shrinking(**kw) -> Harness:
    """a, b, c (ranks 0, 1, 2), no spare; each rank's snapshots of steps 0-4 on the next node of the ring."""
    h = Harness(spec(nnodes=3, spares=0, on_spare_exhausted="shrink", **kw))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    for step in range(5):
        for rank, holder in ((0, "b"), (1, "c"), (2, "a")):
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.Progress("a", 0, 0, 5))
    return h


def shrunk_and_training() -> Harness:
    """b lost at step 5 (restore step 4), a trains ranks 0 and 1, c rank 2; both stepped to 6 narrow, their
    snapshots of step 5 held by each other."""
    h = three_nodes_shrinking()
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    trains_narrow(h, {"a": 0, "c": 2})
    return h


def trains_narrow(h: Harness, processes: dict[str, int]) -> None:
    """The narrow generation's processes (node -> own rank, two of them) restored, each one's snapshot of step 5
    held by the other, and both stepped to 6: the shrink's recovery completes."""
    (one, first), (other, second) = processes.items()
    for node, rank in processes.items():
        h.msg(node, p.WorkerReady(node, 1, rank, 0.02, 0.02, "local"))
    h.msg(other, p.SnapshotStored(other, first, 5, 1))
    h.msg(one, p.SnapshotStored(one, second, 5, 1))
    for node, rank in processes.items():
        h.msg(node, p.Progress(node, 1, rank, 6))
    assert h.named("recovery_complete")
