"""Changes of the job's width (--on-spare-exhausted shrink): where a lost node's ranks go when no spare is left,
which nodes leave with it, and how a narrow job grows back as nodes join. A part of the reconstruction. Pure.
"""

from __future__ import annotations

from dpcommon import protocol as p
from dpcommon.mesh_dims import MeshDims

from .ledger import NEWEST, ReplicaLedger
from .narrowing import Narrowing, Width
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable
from .timeline import Timeline
from .vocabulary import JobSpec, Outbox, Recovery


class Reshaping:
    """Handed the job's spec, node table, ledger, timeline and outbox; owns no state of its own."""

    def __init__(self, spec: JobSpec, table: NodeTable, ledger: ReplicaLedger, timeline: Timeline, out: Outbox):
        self.spec, self.table, self.ledger, self.timeline, self.out = spec, table, ledger, timeline, out

    def narrowing(self, failed_slots: list[int], spares: int) -> Narrowing | str:
        """The job without the failed nodes that no spare takes (a sharded job's: without all of them, its spares
        kept to grow it back whole), or why it cannot go on so."""
        mesh, nproc = self.timeline.mesh, self.spec.nproc_per_node
        found = self.timeline.without_nodes(failed_slots if mesh else failed_slots[spares:],
                                            MeshDims.described(mesh) if mesh else None, self.anchored())
        if isinstance(found, str):
            return found
        # a rank whose state before training is in no snapshot (its process was lost before its step-0 snapshot
        # was replicated) comes back only in a process started as that rank: its RNG is the script's own
        moved = [r for i in found.leaving for process in range(i * nproc, (i + 1) * nproc)
                 for r in self.timeline.width.assignment[process]]
        unheld = sorted(r for r in moved if self.timeline.holder_key(r, NEWEST) not in self.ledger.newest_ever)
        if unheld:
            return (f"ranks {unheld} were lost before their state at step 0 reached a replica: no other process "
                    "can take them over (their RNG before training is their own process's)")
        return found

    def waits_for_spares(self) -> bool:
        """With no spare left (and no shrink), the survivors wait for a node to join rather than end the job."""
        spec = self.spec
        return spec.on_spare_exhausted == "wait" or (spec.on_spare_exhausted == "shrink"
                                                      and spec.shrink_fallback == "wait")

    def growth(self, spares: list[Node], now: float) -> list[Node]:
        """The spares that a narrow job grows onto: as many whole nodes as its carried ranks fill (a sharded
        job's: all it lacks, or none), of those whose workers are set up (Node.set_up: the survivors would wait
        for the others' in the new generation)."""
        if self.spec.on_spare_exhausted != "shrink":
            return []
        spares = [spare for spare in spares if spare.set_up(now)]
        width = self.timeline.width
        wanted = (width.logical_world - width.processes) // self.spec.nproc_per_node
        if self.timeline.mesh and len(spares) < wanted:
            return []
        return spares[:wanted]

    def anchored(self) -> frozenset[int]:
        """The ranks of live processes with no copy on any live replica (their holders died): a sharded job's
        shrink keeps those processes, whose own snapshots are then their only state."""
        return frozenset(rank for rank in self.timeline.keys() if self.ledger.newest_live(rank) is None)

    def shrink(self, rec: Recovery, shrink: Narrowing, now: float) -> None:
        """The nodes of shrink.leaving leave the layout; the ranks their processes trained go to the others. A
        sharded job's nodes that leave alive (the lost replica's others) wait as spares, their stores serving."""
        timeline, narrower = self.timeline, shrink.width
        rec.shrunk = [timeline.layout[i] for i in shrink.leaving]
        demoted = [node_id for node_id in rec.shrunk if self.table.nodes[node_id].role == ACTIVE]
        for node_id in demoted:
            self._demote(self.table.nodes[node_id], now)
        timeline.reshaped(narrower, [timeline.layout[i] for i in shrink.nodes], self.table)
        self.out.publish("job_shrunk", generation=timeline.generation + 1, nodes=rec.shrunk,
                         processes=narrower.processes, ranks=narrower.logical_world, slowdown=narrower.slowdown,
                         carried={str(ranks[0]): list(ranks[1:]) for ranks in narrower.assignment if len(ranks) > 1},
                         **({"demoted": demoted} if demoted else {}))

    def _demote(self, node: Node, now: float) -> None:
        """A live node leaves the layout with its lost replica and waits as a spare: its agent replaces its workers
        by spare ones (p.Demote), which a grow or a hot swap takes once they say they are set up."""
        self.table.set_role(node, SPARE)
        node.node_rank, node.workers, node.registered_at = -1, {}, now
        node.exited_ok.clear()
        self.out.send(node.node_id, p.Demote(reason="its data-parallel replica left the mesh as the job shrank"))

    def undo_grow(self, rec: Recovery) -> bool:
        """A grow that has not trained yet, whose plan now finds state lost (the carriers' snapshots died with
        their replica holders, their local copies out of the new nodes' reach): its nodes leave (their stores
        kept) and each process carries again the ranks its snapshots hold. False where there is none to undo."""
        timeline = self.timeline
        if timeline.trained_generation >= timeline.generation:
            return False
        grown = [i for i, node_id in enumerate(timeline.layout) if self.table.nodes[node_id].role == ACTIVE
                 and all(timeline.holder_key(key, NEWEST) != key for key in timeline.ranks_of(i))]
        kept = [i for i in range(len(timeline.layout)) if i not in grown]
        keys = [key for i in kept for key in timeline.ranks_of(i)]
        held = {r: timeline.holder_key(r, NEWEST) for r in timeline.held_in}
        assignment = tuple((key, *sorted(r for r, k in held.items() if k == key and r != key)) for key in keys)
        if not grown or sum(map(len, assignment)) != len(held):
            return False
        rec.undone = [timeline.layout[i] for i in grown]
        for node_id in rec.undone:
            node = self.table.nodes[node_id]
            self._retire(node, "joined as the job grew, which it had not trained in when that grow was undone")
        timeline.reshaped(Width(assignment), [timeline.layout[i] for i in kept], self.table)
        self.out.publish("grow_undone", generation=timeline.generation + 1, nodes=rec.undone,
                         processes=len(assignment), ranks=len(held),
                         slowdown=max(len(ranks) for ranks in assignment))
        return True

    def _retire(self, node: Node, cause: str) -> None:
        """A live node leaves the layout: its workers stop, its store keeps the copies it holds for the others (as
        a fenced node's does for a save: dprun.controller.files releases it)."""
        node.cause = cause
        node.keeps_store = True
        self.table.set_role(node, FAILED)
        self.out.send(node.node_id, p.Stop(reason=f"node {node.node_id} {node.cause}", keep_store=True))

    def grow(self, rec: Recovery, spares: list[Node]) -> None:
        """The spares join the layout; their processes take back ranks that others trained. The nodes are put in
        the order of their processes' own ranks, so that a job grown back to full width is in order again (rank
        r on process r: DataParallel's own reduction, no ranks to tell the workers)."""
        timeline, nproc = self.timeline, self.spec.nproc_per_node
        width = timeline.width
        if len(spares) * nproc == width.logical_world - width.processes:
            # back to full width: every node in the slot of its own ranks (a sharded job's mesh needs it), the
            # spares in the slots left
            wider = Width.full(width.logical_world)
            slots = {timeline.ranks_of(i)[0] // nproc: node_id for i, node_id in enumerate(timeline.layout)}
            joining = iter(spare.node_id for spare in spares)
            layout = [slots[i] if i in slots else next(joining) for i in range(width.logical_world // nproc)]
        else:
            grown = width.grow(len(spares) * nproc).assignment
            nodes = [*timeline.layout, *(spare.node_id for spare in spares)]
            order = sorted(range(len(nodes)), key=lambda i: grown[i * nproc][0])
            wider = Width(tuple(grown[i * nproc + local] for i in order for local in range(nproc)))
            layout = [nodes[i] for i in order]
        for spare in spares:
            self.table.set_role(spare, ACTIVE)
            rec.promoted[layout.index(spare.node_id)] = spare.node_id
        timeline.reshaped(wider, layout, self.table)
        self.out.publish("job_grew", generation=timeline.generation + 1, nodes=[s.node_id for s in spares],
                         processes=wider.processes, ranks=wider.logical_world, slowdown=wider.slowdown)

