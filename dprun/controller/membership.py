"""Membership: the nodes of a job as the controller admits them (Welcome, or refused), screens what they send
(dropped, and counted by reason, where it is not for this job's generation), and fences them.

A part that the controller composes: it owns the count of messages dropped; it is handed the spec, the node table,
the ledger, the spare sizing and the outbox. Who joined, and a fenced node's loss, the controller acts on.
"""

from __future__ import annotations

from typing import Any

from dpcommon import protocol as p

from . import admission
from .vocabulary import JobSpec, Outbox, out_of_range
from .ledger import ReplicaLedger
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable, Role
from .spare_sizing import SpareSizing
from .timeline import Timeline

# what a node says of its workers stands in any generation: how they are, how they ended, that they finished
ANY_GENERATION = (p.Heartbeat, p.WorkerExited, p.RankFinished, p.Diverged)


class Membership:
    def __init__(self, spec: JobSpec, table: NodeTable, ledger: ReplicaLedger, sizing: SpareSizing, out: Outbox):
        self.spec, self.table, self.ledger, self.sizing, self.out = spec, table, ledger, sizing, out
        self.dropped: dict[str, int] = {}  # reason -> messages dropped for it

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def register(self, sender: str, msg: p.Register, now: float, forming: bool) -> Node | None:
        """A Register: the node admitted, welcomed (None: refused, or one already known answered again)."""
        if msg.node_id != sender:
            self.drop("node_id does not match the sender")
            return None
        known = self.table.get(sender)
        if known is not None:
            if known.role == FAILED:
                self.out.send(sender, p.Stop(reason=f"node {sender} was fenced: {known.cause}", exit_code=1))
            else:  # a re-sent Register (reconnect): answer again
                known.last_heard = now
                self._welcome(known)
            return None
        if (why := admission.refusal(self.spec, msg)) is not None:
            self.out.send(sender, p.Stop(reason=why, exit_code=2))
            self.out.publish("node_refused", node=sender, host=msg.host, reason=why)
            return None
        claimed = [(n.node_id, n.want_rank) for n in self.table.nodes.values() if n.role != FAILED] if forming else []
        for warning in admission.warnings(self.spec, msg, claimed):  # (once formed, a rank goes where room is)
            self.out.publish("node_warning", node=sender, warning=warning)
        actives = self.table.count(ACTIVE)
        role = ACTIVE if forming and not msg.want_spare and actives < self.spec.nnodes else SPARE
        node = Node(
            node_id=sender, host=msg.host, pid=msg.pid, nproc=msg.nproc, replica_endpoint=msg.replica_endpoint,
            role=role, registered_at=now, last_heard=now, want_rank=msg.node_rank,
        )
        self.table.add(node)
        self._welcome(node)
        self.out.publish("node_joined", node=sender, host=msg.host, role=role, pid=msg.pid)
        return node

    def _welcome(self, node: Node) -> None:
        spec = self.spec
        self.out.send(node.node_id, p.Welcome(
            node_id=node.node_id, role="active" if node.role == ACTIVE else "spare", job_id=spec.job_id,
            heartbeat_interval=spec.heartbeat_interval, heartbeat_timeout=spec.heartbeat_timeout,
            prespawn=not spec.restart_mode, save_dir=spec.save_dir, world_size=spec.world_size,
        ))
        standby = self.sizing.message()
        if node.role == SPARE and standby is not None:
            self.out.send(node.node_id, standby)

    def sender(self, sender: str, msg: Any, now: float, timeline: Timeline) -> Node | None:
        """The live node that sent `msg`, heard now, if the message is one to handle (else it is dropped: from no
        node of this job, a fenced one (told to stop again), a rank it does not have, or a replaced generation)."""
        node = self.table.get(sender)
        if node is None:
            self.drop("unregistered sender")
            return None
        if node.role == FAILED:
            self.drop("fenced node")
            if isinstance(msg, (p.Heartbeat, p.Pong)):
                self.out.send(sender, p.Stop(reason=f"node {sender} was fenced: {node.cause}", exit_code=1))
            return None
        node.last_heard = now
        if getattr(msg, "node_id", sender) != sender:
            self.drop("node_id does not match the sender")
            return None
        if (why := out_of_range(msg, self.spec.nproc_per_node, self.spec.world_size)) is not None:
            self.drop(why)  # a buggy agent's: no rank of this job
            if self.dropped[why] == 1:  # said once per reason: never normal, but never to flood the log either
                self.out.publish("message_refused", node=sender, kind=type(msg).__name__, reason=why)
            return None
        generation = getattr(msg, "generation", None)
        if generation is not None and generation != timeline.generation \
                and not isinstance(msg, ANY_GENERATION) and not timeline.late_copy(msg):
            self.drop("stale generation")
            return None
        return node

    def fenced(self, node: Node, was: Role, cause: str, keep: bool) -> None:
        """`node` (which was `was`) is fenced for `cause`: its agent told to stop, keeping its store if `keep`
        (for a save), else the copies it held are gone."""
        node.cause = cause
        if not keep:
            self.ledger.holder_lost(node.node_id)
        self.out.send(node.node_id, p.Stop(reason=f"node {node.node_id} was fenced: {cause}", exit_code=1,
                                           keep_store=keep))
        self.out.publish("node_failed", node=node.node_id, node_rank=node.node_rank if was == ACTIVE else None,
                         role=was, cause=cause)

    def snapshot_sized(self, rank: int, nbytes: int) -> None:
        """A rank's snapshot size: the spares are told what to make room for, when it grows."""
        if self.sizing.stored(rank, nbytes):
            for spare in self.table.with_role(SPARE):
                self.out.send(spare.node_id, self.sizing.message())

    def worker_exit_said(self, node: Node, msg: p.WorkerExited, rank: int) -> None:
        """A live node's worker ended with an error or a signal: said as an event (the job's failure summary,
        `dprun report`) before what comes of it."""
        if msg.exitcode == 0 or node.role == FAILED:
            return
        self.out.publish("worker_exited", node=node.node_id, local_rank=msg.local_rank,
                         rank=rank if rank != p.NO_RANK else None, pid=msg.pid,
                         exitcode=msg.exitcode, cause=p.describe_end(msg.exitcode, msg.detail, msg.oom_killed),
                         tail=msg.stderr_tail, log=msg.log_path)
