"""Fault injection as the controller fires it: each --inject spec that is due goes to its target node as an
Inject message (wake-node: a WakeNode action, for the launcher of the node frozen at that rank), and an event.

A part of the Controller state machine (it inherits this); dprun.faults parses the specs and says when each is due.
"""

from __future__ import annotations

from dpagent import protocol as p

from .controller_io import WakeNode
from .nodes import ACTIVE, SPARE
from .phase import Phase


class FaultInjection:
    """The fault-firing part of dprun.controller.Controller (its state lives there: faults, injected_at, frozen_at)."""

    def _fire_faults(self, now: float, recovering: bool = False) -> None:
        if self.phase is Phase.FORMING or not self.faults.pending:
            return
        steps = {node.node_rank: node.last_step for node in self.table.with_role(ACTIVE)}
        for spec in self.faults.due(steps, now - (self.training_since or now), recovering):
            node_id = self._fault_target(spec)
            if node_id is None:
                self._publish("fault_skipped", spec=str(spec), reason="no such node")
                continue
            if spec.kind == "freeze-node":
                self.frozen_at[spec.node_rank] = node_id
            if spec.kind != "wake-node":
                self.injected_at[node_id] = now
            if spec.kind == "wake-node":  # (a frozen node's agent cannot act: its launcher must)
                self._out.append(WakeNode(node_id, str(spec)))
            else:
                self._send(node_id, p.Inject(kind=spec.kind, local_rank=spec.local_rank))
            self._publish("fault_injected", node=node_id, node_rank=spec.node_rank, kind=spec.kind, spec=str(spec))

    def _fault_target(self, spec) -> str | None:
        if spec.on_spare:
            spares = self.table.with_role(SPARE)
            return spares[spec.node_rank].node_id if spec.node_rank < len(spares) else None
        if spec.kind == "wake-node":
            return self.frozen_at.get(spec.node_rank)
        return self.layout[spec.node_rank] if spec.node_rank < len(self.layout) else None
