"""Fault injection as the controller fires it: each --inject spec that is due becomes an Inject message to its
target node (wake-node: a WakeNode action for the launcher of the node frozen at that rank) and an event.

A part that the controller composes: it owns the specs still to fire and what it fired (when each node was hit,
which node froze at which node rank); the controller hands it the job's progress and layout when it asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpcommon import protocol as p

from .vocabulary import Publish, Send, WakeNode
from .faults import FaultPlan, FaultSpec


@dataclass(frozen=True)
class JobNow:
    """What firing needs of the job: each node rank's newest step, the seconds trained, and who holds which
    place (node ids by node rank; spares in promotion order)."""

    steps: dict[int, int]
    trained_s: float
    layout: list[str]
    spares: list[str]


@dataclass
class FaultFiring:
    plan: FaultPlan
    injected_at: dict[str, float] = field(default_factory=dict)  # node id -> when a fault was fired at it
    frozen_at: dict[int, str] = field(default_factory=dict)  # node rank -> the node frozen there (for wake-node)

    def fire(self, now: float, job: JobNow, recovering: bool = False) -> list[Send | WakeNode | Publish]:
        """The actions of every spec now due (recovering: those due "during recovery" too)."""
        actions: list[Send | WakeNode | Publish] = []
        for spec in self.plan.due(job.steps, job.trained_s, recovering):
            node_id = self._target(spec, job)
            if node_id is None:
                actions.append(Publish({"event": "fault_skipped", "spec": str(spec), "reason": "no such node"}))
                continue
            if spec.kind == "freeze-node":
                self.frozen_at[spec.node_rank] = node_id
            if spec.kind == "wake-node":  # (a frozen node's agent cannot act: its launcher must)
                actions.append(WakeNode(node_id, str(spec)))
            else:
                self.injected_at[node_id] = now
                actions.append(Send(node_id, p.Inject(kind=spec.kind, local_rank=spec.local_rank)))
            actions.append(Publish({"event": "fault_injected", "node": node_id, "node_rank": spec.node_rank,
                                    "kind": spec.kind, "spec": str(spec)}))
        return actions

    def never_fired(self) -> list[Publish]:
        """The job ends: a rehearsal whose fault never fired must not pass for one survived."""
        skipped = [Publish({"event": "fault_skipped", "spec": str(spec), "reason": "the job ended before it was due"})
                   for spec in self.plan.pending]
        self.plan.pending.clear()
        return skipped

    def _target(self, spec: FaultSpec, job: JobNow) -> str | None:
        if spec.on_spare:
            return job.spares[spec.node_rank] if spec.node_rank < len(job.spares) else None
        if spec.kind == "wake-node":
            return self.frozen_at.get(spec.node_rank)
        return job.layout[spec.node_rank] if spec.node_rank < len(job.layout) else None
