"""The simulator's invariants of a job that shrinks and grows (--on-spare-exhausted shrink): each logical rank trained
once per generation, its state continuous across reshapes, a grow only onto a live spare, full width in order.
"""

from __future__ import annotations

from dpcommon import protocol as p
from dprun.controller.nodes import SPARE


class InvariantViolation(AssertionError):
    pass


def restored_parts(node_id: str, carry: tuple, adopt: dict[int, int], fetched: dict[int, dict], step: int
                   ) -> dict[int, int]:
    """Invariant 13: a worker restoring `step` takes each logical rank it carries from the snapshot of step the plan
    names for it (Reconfigure.adopt_from; else its own, or, its own rank adopted, that one's), and that snapshot
    holds the rank's state at that very step: no rank's training state skips or repeats a step across a shrink or
    a grow. Returns the parts restored (logical rank -> step)."""
    own = carry[0]
    base = adopt.get(own, own)
    for rank in carry:
        key = adopt.get(rank, base)
        if fetched[key].get(rank) != step:
            raise InvariantViolation(f"invariant 13: {node_id} restores logical rank {rank} at step {step} from the "
                                     f"snapshot of rank {key}, which holds {fetched[key]} (rank: step)")
    return dict.fromkeys(carry, step)



class WidthChecks:
    """Per-event checks of the width (a part of invariants.Checker)."""

    def __init__(self) -> None:
        self.shrunk = False  # the job shrank (a grow comes only after one)
        self.ever_active: set[str] = set()  # nodes of a layout before the current generation's
        self.layout_seen, self.last_layout = -1, set[str]()  # the generation whose layout is last_layout

    def layout(self, timeline) -> None:
        """After each input: the nodes of every layout before the current generation's."""
        if timeline.generation != self.layout_seen:
            self.ever_active |= self.last_layout
            self.layout_seen, self.last_layout = timeline.generation, set(timeline.layout)

    def reconfigure(self, world, node_id: str, msg: p.Reconfigure) -> None:
        """Invariant 14: a generation's carry gives every logical rank 0..W-1 to exactly one process, and
        world_size counts those processes over nnodes nodes; at full width (never narrow, or grown back) it is in
        order and says nothing (rank r on process r); what a node adopts is a rank one of its processes trains."""
        W, nproc = world.spec.world_size, world.spec.nproc_per_node
        carry = msg.carry or [[r] for r in range(msg.world_size)]
        trained = sorted(r for ranks in carry for r in ranks)
        if trained != list(range(W)) or len(carry) != msg.world_size or msg.world_size != msg.nnodes * nproc:
            raise InvariantViolation(f"invariant 14: generation {msg.generation} to {node_id}: carry {msg.carry}, "
                                     f"world_size {msg.world_size}, nnodes {msg.nnodes}: not each of {W} ranks once")
        if msg.world_size == W and msg.carry and any(ranks != [r] for r, ranks in enumerate(msg.carry)):
            raise InvariantViolation(f"invariant 14: generation {msg.generation} is at full width out of order: "
                                     f"{msg.carry}")
        mine = {r for p in range(msg.node_rank * nproc, (msg.node_rank + 1) * nproc) for r in carry[p]}
        if not {int(r) for r in msg.adopt_from} <= mine:
            raise InvariantViolation(f"invariant 14: {node_id} told to adopt {msg.adopt_from}, its processes "
                                     f"train {sorted(mine)}")

    def reshaped(self, world, event: dict) -> None:
        """Invariant 15: a job shrinks only with --on-spare-exhausted shrink and no spare left to promote; it
        grows only onto spares that registered and live (never a node it had before), back from narrow."""
        c = world.controller
        if c.spec.on_spare_exhausted != "shrink":
            raise InvariantViolation(f"invariant 15: {event['event']} with --on-spare-exhausted "
                                     f"{c.spec.on_spare_exhausted}")
        if event["event"] == "job_shrunk":
            if spares := [n.node_id for n in c.table.with_role(SPARE)]:
                raise InvariantViolation(f"invariant 15: shrank without {event['nodes']} while spares {spares} wait")
            self.shrunk = True
            return
        if not self.shrunk:
            raise InvariantViolation(f"invariant 15: grew onto {event['nodes']}, never having shrunk")
        for node_id in event["nodes"]:
            node = world.nodes.get(node_id)
            if node is None or not node.alive or node_id in self.ever_active:
                raise InvariantViolation(f"invariant 15: grew onto {node_id}, not a live spare (alive: "
                                         f"{node is not None and node.alive}, in a layout before: "
                                         f"{node_id in self.ever_active})")
