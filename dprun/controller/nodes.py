"""The controller's table of nodes: who registered, in which role, at which node rank, when last heard.

Pure data with a few queries; the controller decides, this only records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Role(enum.StrEnum):
    """A node's role. Transitions: SPARE -> ACTIVE (promoted into a failed node's ranks, or placed as the first
    generation forms); ACTIVE -> SPARE (demoted: its data-parallel replica left a sharded job's mesh as the job
    shrank); ACTIVE or SPARE -> FAILED (fenced: its later messages are refused). FAILED is final: a
    node that comes back registers afresh under a new id. (Strings on the wire and in events: "active"...)"""

    ACTIVE = "active"
    SPARE = "spare"
    FAILED = "failed"


ACTIVE, SPARE, FAILED = Role.ACTIVE, Role.SPARE, Role.FAILED


GROW_SETUP_WAIT_S = 3.0  # the longest a narrow job waits for a joining node's workers to say they are set up

@dataclass
class Node:
    node_id: str
    host: str
    pid: int
    nproc: int
    replica_endpoint: str
    role: Role
    registered_at: float
    last_heard: float
    node_rank: int = -1  # in the current layout; -1 for spares and nodes not yet placed
    want_rank: int = -1
    cause: str = ""  # why it failed
    raised: bool = False  # ... a worker exited with an error (exit code > 0): not a signal, not silence
    keeps_store: bool = False  # failed (fenced), but its replica store stays (dprun.controller.files.keeps_store)
    exited_ok: set = field(default_factory=set)  # local ranks whose worker exited 0
    last_step: int = -1  # newest step any of its ranks reported (any generation)
    workers: dict = field(default_factory=dict)  # str(local rank) -> status from its latest Heartbeat

    def set_up(self, now: float) -> bool:
        """A grow takes it: its workers said they are set up, or it registered GROW_SETUP_WAIT_S ago (one whose
        workers start slower, or never say, then costs the survivors only the rest of its start)."""
        return self.initialized or now - self.registered_at >= GROW_SETUP_WAIT_S

    @property
    def initialized(self) -> bool:
        """Each of its workers said, in its latest heartbeat, that it waits set up (idle): a spare that a grow
        takes at once (one still importing torch or building its model would hold the others up meanwhile)."""
        return len(self.workers) >= self.nproc and all(getattr(status, "activity", None) == "idle"
                                                        for status in self.workers.values())


class NodeTable:
    """Nodes by id, in registration order (spares are promoted first come, first served), indexed by role."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._by_role: dict[Role, dict[str, None]] = {role: {} for role in Role}  # ordered sets

    def add(self, node: Node) -> None:
        self.nodes[node.node_id] = node
        self._by_role[node.role][node.node_id] = None

    def set_role(self, node: Node, role: Role) -> None:
        del self._by_role[node.role][node.node_id]
        node.role = role
        self._by_role[role][node.node_id] = None

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def with_role(self, role: Role) -> list[Node]:
        return [self.nodes[n] for n in self._by_role[role]]

    def count(self, role: Role) -> int:
        return len(self._by_role[role])

    def all_in_role(self, node_ids: set[str], role: Role) -> bool:
        """Has every one of `node_ids` this role? (a set comparison: cheap for thousands of nodes)"""
        return self._by_role[role].keys() >= node_ids

    def first_layout(self, nnodes: int) -> list[str]:
        """The first generation's node ids by node rank, once `nnodes` nodes are active: node-rank hints honoured,
        the gaps filled in registration order."""
        layout: list[str | None] = [None] * nnodes
        rest = []
        for node in self.with_role(Role.ACTIVE):
            if 0 <= node.want_rank < nnodes and layout[node.want_rank] is None:
                layout[node.want_rank] = node.node_id
            else:
                rest.append(node.node_id)
        return [slot if slot is not None else rest.pop(0) for slot in layout]

    def live(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.role != FAILED]

    def __len__(self) -> int:
        return len(self.nodes)
