"""The controller's state as the operator sees it: a frozen view that the controller publishes (Controller.view),
so that the dashboard, the status feed and `dprun status` read no controller internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .nodes import ACTIVE, Node, Role
from .phase import Phase
from .timeline import Timeline

if TYPE_CHECKING:
    from .state_machine import Controller


@dataclass(frozen=True)
class NodeView:
    host: str
    pid: int
    role: Role
    node_rank: int
    age: float  # seconds since it was last heard
    cause: str  # why it failed
    last_step: int  # the newest step any of its ranks reported
    room: int  # bytes its workers reserved for snapshots (a spare's, while idle)
    holder: str = ""  # an active node: the nodes holding its replicas, "+"-joined
    replicated: int | None = None  # ... and the newest step of which they hold every one of its ranks


@dataclass(frozen=True)
class WidthView:
    """The job's data-parallel width (dprun.controller.narrowing.Width): narrower than asked after a shrink."""

    processes: int  # processes training now
    ranks: int  # logical data-parallel ranks (the world size asked for)
    slowdown: int  # ranks the busiest process trains per step: a step takes about this many times as long

    @property
    def narrow(self) -> bool:
        return self.processes < self.ranks


@dataclass(frozen=True)
class ControllerView:
    job_id: str
    nproc_per_node: int
    world_size: int
    generation: int
    phase: Phase
    nodes: Mapping[str, NodeView]
    restore_point: int | None  # the newest step every rank could go back to from the replicas, if any
    width: WidthView | None = None  # None until the first generation formed


def view_of(controller: Controller, now: float) -> ControllerView:
    """`controller` (a dprun.controller.state_machine.Controller) as a ControllerView at `now` (its monotonic clock)."""
    spec, timeline = controller.spec, controller.timeline
    layout = timeline.layout
    nproc = spec.nproc_per_node
    held = controller.ledger.held
    nodes = {node_id: _node_view(node, timeline, held, now)
             for node_id, node in controller.table.nodes.items()}
    restore_point = None
    if held and layout and not spec.restart_mode:
        newest = [max((s for steps in held.get(rank, {}).values() for s in steps), default=-1)
                  for rank in range(len(layout) * nproc)]
        restore_point = min(newest) if min(newest) >= 0 else None
    width = timeline.width
    return ControllerView(job_id=spec.job_id, nproc_per_node=nproc, world_size=spec.world_size,
                          generation=timeline.generation, phase=controller.phase, nodes=nodes,
                          restore_point=restore_point,
                          width=WidthView(width.processes, width.logical_world, width.slowdown)
                          if width.assignment else None)


def _node_view(node: Node, timeline: Timeline, held: dict, now: float) -> NodeView:
    holder, replicated = "", None
    rank, layout = node.node_rank, timeline.layout
    if node.role == ACTIVE and 0 <= rank < len(layout) and layout[rank] == node.node_id:
        holding = timeline.holders.get(rank, [])
        newest = [max([s for h in holding for s in held.get(r, {}).get(h, [])] or [-1])
                  for r in timeline.ranks_of(rank)]
        holder, replicated = "+".join(holding), (min(newest) if min(newest) >= 0 else None)
    return NodeView(host=node.host, pid=node.pid, role=node.role, node_rank=node.node_rank,
                    age=round(max(0.0, now - node.last_heard), 3), cause=node.cause, last_step=node.last_step,
                    room=sum(status.room for status in node.workers.values()), holder=holder, replicated=replicated)
