"""Deadlines: what the controller does as time passes: forming times out, heartbeats and probes go unanswered,
no spare comes for a waiting recovery, no rank steps for --hang-timeout, a finished worker does not exit.

A part of the Controller state machine (it inherits this), kept apart so each file reads in one sitting.
"""

from __future__ import annotations

from dpagent import protocol as p

from .hang_evidence import Placed
from .nodes import ACTIVE, FAILED, SPARE
from .phase import Phase
from .repeats import HUNG

FORMING_NOTE_EVERY_S = 15.0  # nodes still missing after this long, and as often again: "waiting_for_nodes"
EXIT_NOTE_EVERY_S = 30.0  # workers not exited this long after training finished, and as often: "waiting_for_exit"


class Deadlines:
    """The timer half of dprun.controller.Controller (its state lives there): `_tick` runs on every Tick."""

    def _tick(self, now: float) -> None:
        if self.phase is Phase.FORMING:
            if now - self.started_at >= self.spec.rdzv_timeout:
                if len(self.table.with_role(ACTIVE)) >= self.spec.nnodes:
                    self._maybe_form(now)
                else:
                    self._finish(1, f"only {len(self.table.with_role(ACTIVE))} of {self.spec.nnodes} nodes "
                                    f"registered within {self.spec.rdzv_timeout:g} s; start the missing nodes "
                                    "or lower --nnodes")
                    return
            elif now >= self.forming_note_at:  # the first generation waits: say for whom, until when
                self.forming_note_at = now + FORMING_NOTE_EVERY_S
                self._publish("waiting_for_nodes", active=self.table.count(ACTIVE), nnodes=self.spec.nnodes,
                              spares=self.table.count(SPARE), spares_wanted=self.spec.spares,
                              timeout_s=round(self.spec.rdzv_timeout - (now - self.started_at)))
        for node in self.table.nodes.values():
            silent = now - node.last_heard
            if silent > self.spec.heartbeat_timeout and (node.role != FAILED or node.keeps_store):
                self._node_failed(node.node_id, f"no heartbeat for {silent:.1f} s", now, since=node.last_heard)
        if self.dropped_at is not None and now >= self.dropped_at + self.spec.probe_timeout:
            self._dropped_probe_over(now)
        if self.flush is not None and now >= self.flush.deadline:
            for node_id in sorted(self.flush.waiting):
                self._node_failed(node_id, f"no answer to a probe within {self.spec.probe_timeout:g} s", now)
            if self.flush is not None:
                self.flush.waiting.clear()
        self._check_waits(now)
        self._ping_due(now)
        self._fire_faults(now)
        self._save_if_due(now)

    def _connection_dropped(self, now: float) -> None:
        """A connection to the controller closed: probe every node now (a Ping), and fail those not heard from
        within --probe-timeout (`_dropped_probe_over`). While training runs: in a recovery every node is probed
        anyway, and a fenced node's agent closes its own connection as it exits."""
        if self.phase is not Phase.TRAINING or self.flush is not None or self.dropped_at is not None:
            return
        self.dropped_at = now
        self.next_ping = now
        self._ping_due(now)

    def _dropped_probe_over(self, now: float) -> None:
        since, self.dropped_at = self.dropped_at, None
        for node in self.table.live():
            if node.last_heard < since:
                self._node_failed(node.node_id, f"a connection to the controller closed and it did not answer a "
                                                f"probe within {self.spec.probe_timeout:g} s", now,
                                  since=node.last_heard)

    def _paused(self, seconds: float, now: float) -> None:
        """The controller itself did not run for `seconds`: no node is blamed for that silence, nor a rank for
        not stepping; every deadline moves on by as much. Near --heartbeat-timeout its nodes take the controller
        for lost (they leave, saving what they hold with --save-dir): a job that then ends says why."""
        for node in self.table.nodes.values():
            node.last_heard = min(now, node.last_heard + seconds)
        self.last_progress_at = min(now, self.last_progress_at + seconds)
        if self.all_finished_at is not None:  # nor a worker for not exiting after training finished
            self.all_finished_at = min(now, self.all_finished_at + seconds)
        for work in (self.flush, self.files):
            if work is not None:
                work.deadline += seconds
        rec = self.pending
        if rec is not None and rec.waiting_since is not None:
            rec.waiting_since = min(now, rec.waiting_since + seconds)
        if rec is not None and rec.restoring_until is not None:
            rec.restoring_until += seconds
        # a node's silence clock started at its last Ping, up to a heartbeat interval before the pause
        nodes_left = seconds >= self.spec.heartbeat_timeout - self.spec.heartbeat_interval
        if nodes_left:
            self.paused = (now, seconds)
        self._publish("controller_paused", seconds=round(seconds, 2), nodes_left=nodes_left)

    def _ping_due(self, now: float) -> None:
        """Every heartbeat interval, a Ping to every live node (its Pong proves it alive; its agent, which
        leaves when the controller falls silent, hears from it)."""
        if now >= self.next_ping:
            self.next_ping = now + self.spec.heartbeat_interval
            self.seq += 1
            for node in self.table.live():
                self._send(node.node_id, p.Ping(seq=self.seq))

    def _check_waits(self, now: float) -> None:
        rec = self.pending
        if (rec is not None and rec.waiting_since is None and rec.restoring_until is not None
                and now >= rec.restoring_until and self.flush is None):
            self._start_flush(now)  # the restore it waited for did not come: decide (state lost)
            return
        if rec is not None and rec.waiting_since is not None and self.flush is None:
            if now - rec.waiting_since > self.spec.spare_wait_timeout:
                self._finish(1, f"no node joined as a spare within {self.spec.spare_wait_timeout:g} s after "
                                f"{', '.join(rec.failed)} failed; start nodes with --rdzv-endpoint to rejoin")
            return
        if self.all_finished_at is not None:
            if rec is None and self.flush is None:
                self._waiting_for_exit(now)
        elif rec is None and self.flush is None and not self.spec.restart_mode \
                and self.hangs.stuck_apart(self._statuses(), now):
            self._finish(1, f"job hung at its end: {self.hangs.finished_apart(self._statuses())}")
        elif (self.spec.hang_timeout > 0 and rec is None and self.flush is None and not self.spec.restart_mode
                and now - self.last_progress_at > self.spec.hang_timeout
                and (self.stepped or self.hangs.waits_on_peers(self._statuses()))):
            self._hung(now)

    def _statuses(self) -> list[p.WorkerSummary]:
        """The training nodes' worker statuses, as their heartbeats said."""
        return [status for node_id in self.layout for status in self.table.nodes[node_id].workers.values()]

    def _waiting_for_exit(self, now: float) -> None:
        """Every rank finished job.steps() (in restart mode: a worker exited 0), and some workers have not exited
        yet (what a script does after its loop, a final save, say): said every EXIT_NOTE_EVERY_S; past
        --hang-timeout the job ends with exit 1 (not in restart mode, where dprun waits as torchrun does)."""
        running = [(node_rank * self.spec.nproc_per_node + local, node_id)
                   for node_rank, node_id in enumerate(self.layout) for local in range(self.spec.nproc_per_node)
                   if local not in self.table.nodes[node_id].exited_ok]
        waited = now - self.all_finished_at
        names = ", ".join(f"rank {rank} on {node_id}{self._pid_of(node_id, rank)}" for rank, node_id in running)
        timeout = 0.0 if self.spec.restart_mode else self.spec.hang_timeout
        if timeout > 0 and waited > timeout:
            self._finish(1, f"training completed (step {max(self.finished_ranks.values())}), but {names} did not "
                            f"exit within {self.spec.hang_timeout:g} s of it (--hang-timeout); stopped: what the "
                            "script does after job.steps() (a final save?) may not have completed")
        elif waited >= (self.exit_notes + 1) * EXIT_NOTE_EVERY_S:
            self.exit_notes += 1
            self._publish("waiting_for_exit", ranks=[rank for rank, _ in running], workers=names,
                          since="a worker exited 0" if self.spec.restart_mode else "training finished",
                          waited_s=round(waited), timeout_s=timeout)

    def _pid_of(self, node_id: str, rank: int) -> str:
        """" (pid N)" for a rank's worker as its node's last heartbeat told it, or "" where it did not."""
        status = self.table.nodes[node_id].workers.get(str(rank % self.spec.nproc_per_node))
        return f" (pid {status.pid})" if status is not None and status.pid else ""

    def _hung(self, now: float) -> None:
        """No rank stepped for hang_timeout: blame the ranks that are not waiting on their peers."""
        stalled = now - self.last_progress_at
        self.last_progress_at = now
        placed = [Placed(node_id, node_rank * self.spec.nproc_per_node + local,
                         self.table.nodes[node_id].workers.get(str(local)))
                  for node_rank, node_id in enumerate(self.layout) for local in range(self.spec.nproc_per_node)]
        culprits = self.hangs.culprits(placed, self.max_step)
        if not culprits:
            self._finish(1, f"job hung: no step for {stalled:.0f} s and every rank waits on its peers; "
                            + (self.hangs.finished_apart(self._statuses())
                               or "check the network, or raise --hang-timeout"))
            return
        same = None
        for node_id, (why, rank, step) in culprits.items():
            self._node_failed(node_id, f"{why}: no progress for {stalled:.0f} s (--hang-timeout)", now)
            same = same or self.repeats.seen(1, HUNG, node_id, rank, step)  # hung again where the rank went
        if same is not None and not self.finished:
            self._finish(1, same)

