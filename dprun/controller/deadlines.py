"""Deadlines: the controller's clocks: forming times out, pings fall due, a dropped connection's probe ends, the
controller's own pause moves every deadline on, and no rank steps for --hang-timeout.

A part that the controller composes: it owns those clocks and answers, on each Tick, what has fallen due; it is
handed the spec, the node table, the timeline, the hang evidence and the outbox. What falls due (a node to fail,
the job to end) the controller carries out.
"""

from __future__ import annotations

from typing import Iterator

from dpcommon import protocol as p

from .vocabulary import JobSpec, Outbox
from .hang_evidence import HangEvidence, Placed
from .nodes import ACTIVE, FAILED, SPARE, NodeTable
from .timeline import Timeline

FORMING_NOTE_EVERY_S = 15.0  # nodes still missing after this long, and as often again: "waiting_for_nodes"


class Deadlines:
    def __init__(self, spec: JobSpec, table: NodeTable, timeline: Timeline, hangs: HangEvidence, out: Outbox,
                 now: float):
        self.spec, self.table, self.timeline, self.hangs, self.out = spec, table, timeline, hangs, out
        self.started_at = now
        self.forming_note_at = now + FORMING_NOTE_EVERY_S  # while nodes are missing, say so this often
        self.next_ping = now
        self.dropped_at: float | None = None  # a connection closed then: nodes not heard since are probed
        self.paused: tuple[float, float] | None = None  # (when, seconds) the controller last stopped running

    def forming(self, now: float) -> bool | str:
        """The first generation forms: True once the rendezvous time is over with every node active (form it
        now), the job's end message if it is over without, else False (and, every so often, who is missing)."""
        spec = self.spec
        if now - self.started_at >= spec.rdzv_timeout:
            actives = self.table.count(ACTIVE)
            if actives >= spec.nnodes:
                return True
            return (f"only {actives} of {spec.nnodes} nodes registered within {spec.rdzv_timeout:g} s; start the "
                    "missing nodes or lower --nnodes")
        if now >= self.forming_note_at:  # the first generation waits: say for whom, until when
            self.forming_note_at = now + FORMING_NOTE_EVERY_S
            self.out.publish("waiting_for_nodes", active=self.table.count(ACTIVE), nnodes=spec.nnodes,
                             spares=self.table.count(SPARE), spares_wanted=spec.spares,
                             timeout_s=round(spec.rdzv_timeout - (now - self.started_at)))
        return False

    def overdue(self, now: float) -> Iterator[tuple[str, str, float]]:
        """The nodes to fail now, as (node id, cause, last heard), each looked at once the one before it was
        failed: those silent for the heartbeat timeout (a fenced one whose store stays too), then, once a closed
        connection's probe is over, the live nodes not heard from since it closed."""
        for node in self.table.nodes.values():
            silent = now - node.last_heard
            if silent > self.spec.heartbeat_timeout and (node.role != FAILED or node.keeps_store):
                yield node.node_id, f"no heartbeat for {silent:.1f} s", node.last_heard
        if (since := self.dropped_probe_over(now)) is not None:
            for node in self.table.live():
                if node.last_heard < since:
                    yield (node.node_id, f"a connection to the controller closed and it did not answer a probe "
                                         f"within {self.spec.probe_timeout:g} s", node.last_heard)

    def ping_due(self, now: float) -> bool:
        """Every heartbeat interval, a Ping to every live node (its Pong proves it alive; its agent, which
        leaves when the controller falls silent, hears from it)."""
        if now < self.next_ping:
            return False
        self.next_ping = now + self.spec.heartbeat_interval
        return True

    def connection_dropped(self, now: float) -> bool:
        """A connection to the controller closed: True to probe every node now (not while one probe is out)."""
        if self.dropped_at is not None:
            return False
        self.dropped_at = now
        self.next_ping = now
        return True

    def dropped_probe_over(self, now: float) -> float | None:
        """When the connection closed, once its probe's time is over: the nodes not heard since then are lost."""
        if self.dropped_at is None or now < self.dropped_at + self.spec.probe_timeout:
            return None
        since, self.dropped_at = self.dropped_at, None
        return since

    def pause(self, seconds: float, now: float) -> bool:
        """The controller did not run for `seconds`: no node is blamed for that silence, nor a rank for not
        stepping. True if it was long enough for its nodes to take the controller for lost."""
        for node in self.table.nodes.values():
            node.last_heard = min(now, node.last_heard + seconds)
        self.timeline.last_progress_at = min(now, self.timeline.last_progress_at + seconds)
        # a node's silence clock started at its last Ping, up to a heartbeat interval before the pause
        nodes_left = seconds >= self.spec.heartbeat_timeout - self.spec.heartbeat_interval
        if nodes_left:
            self.paused = (now, seconds)
        return nodes_left

    def paused_lately(self, now: float) -> float | None:
        """How long dprun itself did not run, if lately, for long enough that its nodes may have taken it for
        lost: a job that ends now ends for that, not for what its nodes then did (None: not so)."""
        if self.paused is not None and now - self.paused[0] <= 2 * self.spec.heartbeat_timeout:
            return self.paused[1]
        return None

    def pause_said(self, message: str, now: float) -> str:
        """A job that ends with an error just after dprun itself did not run long enough for its nodes to take it
        for lost ends for that: said first."""
        paused = self.paused_lately(now)
        if paused is None:
            return message
        cause = (f"dprun itself did not run for {paused:.1f} s (stopped with SIGSTOP or Ctrl-Z, its "
                 f"machine paused, or starved of CPU), long enough for its nodes (--heartbeat-timeout "
                 f"{self.spec.heartbeat_timeout:g} s) to take the controller for lost and leave")
        if self.spec.save_dir:
            cause += f", each writing the copies it held to {self.spec.save_dir}"
        return message if message.startswith(cause) else f"{cause}; then: {message}"

    def statuses(self) -> list[p.WorkerSummary]:
        """The training nodes' worker statuses, as their heartbeats said."""
        return [status for node_id in self.timeline.layout for status in self.table.nodes[node_id].workers.values()]

    def hung_at_end(self, now: float) -> str | None:
        """Ranks that finished their steps wait at the end for others that train on (dprun.controller.hang_evidence):
        the job's end message, once they have for long enough."""
        if not self.hangs.stuck_apart(self.statuses(), now):
            return None
        return f"job hung at its end: {self.hangs.finished_apart(self.statuses())}"

    def all_waiting(self, stalled: float) -> str:
        """The end message of a hang in which every rank waits on its peers."""
        return (f"job hung: no step for {stalled:.0f} s and every rank waits on its peers; "
                + (self.hangs.finished_apart(self.statuses()) or "check the network, or raise --hang-timeout"))

    def hang_due(self, now: float) -> bool:
        """No rank stepped for --hang-timeout (once a step was made, or ranks wait on their peers: at a later
        generation's rendezvous too)."""
        started = self.timeline.generation > 0
        return (self.spec.hang_timeout > 0 and now - self.timeline.last_progress_at > self.spec.hang_timeout
                and (self.timeline.stepped or self.hangs.waits_on_peers(self.statuses(), started)))

    def hung(self, now: float) -> tuple[float, dict[str, tuple[str, int, int]]]:
        """The hang found: for how long no rank stepped, and the nodes whose ranks are not waiting on their
        peers (dprun.controller.hang_evidence). Its clock starts again."""
        stalled = now - self.timeline.last_progress_at
        self.timeline.last_progress_at = now
        placed = [Placed(node_id, rank, self.table.nodes[node_id].workers.get(str(local)))
                  for rank, node_id, local in self.timeline.placed()]
        return stalled, self.hangs.culprits(placed, self.timeline.max_step)
