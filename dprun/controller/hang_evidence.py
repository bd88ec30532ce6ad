"""Hang evidence: what the workers' statuses (as their agents' heartbeats carry them) say of a job that does not
step: which ranks wait on their peers, which are stuck elsewhere, and ranks that finished apart from others.

A part that the controller composes: it owns the one thing it remembers (since when ranks have waited apart), and
is handed the statuses, placed in the layout, and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpcommon.control_messages import WorkerSummary

WAITING_ON_PEERS = ("collective", "snapshot", "finishing", "rendezvous")  # activities that wait on other ranks
APART_FOR = 6  # heartbeat intervals that ranks stuck past others' last step must stay so (HangEvidence.stuck_apart)


@dataclass(frozen=True)
class Placed:
    """A rank of the layout with its worker's latest status (None: its node's heartbeat named none)."""

    node_id: str
    rank: int
    status: WorkerSummary | None


class HangEvidence:
    def __init__(self, heartbeat_interval: float, now: float):
        # a status older than this (as its node's heartbeat says) is of a worker that stopped responding
        self.stale_after = max(3 * heartbeat_interval, 2.0)
        self.apart_for = APART_FOR * heartbeat_interval
        self._apart: tuple[float, dict[int, int]] = (now, {})  # since when these ranks wait past the others' step

    def _fresh(self, status: WorkerSummary) -> bool:
        return status.age <= self.stale_after

    def waits_on_peers(self, statuses: list[WorkerSummary], started: bool = False) -> bool:
        """Before a generation's first step, start-up (the script's own, a restore) is no hang; but once a rank
        waits in a collective for its peers, that first step has begun, and one that hangs in it is caught as in
        any other step (a hang that follows its rank onto the spare would hang the job for ever). Once the job
        `started` (a later generation, whose processes all ran before it), so is a rank that waits at the
        generation's rendezvous for one that never comes (a worker stopped or stuck as a recovery began)."""
        waiting = ("collective", "finishing", "rendezvous") if started else ("collective", "finishing")
        return any(s.activity in waiting and self._fresh(s) for s in statuses)

    def stuck_apart(self, statuses: list[WorkerSummary], now: float) -> bool:
        """Ranks past their last step wait at the final barrier while others made that step too, and wait in a
        collective of the next one that the finished ranks will never join: given different step counts. True
        once those others' steps have not moved for APART_FOR heartbeat intervals (statuses lag by one)."""
        finishing = [s.step for s in statuses if s.activity == "finishing"]
        beyond = {s.rank: s.step for s in statuses if s.activity == "collective" and self._fresh(s)}
        beyond = {rank: step for rank, step in beyond.items() if finishing and step >= max(finishing)}
        if not beyond or beyond != self._apart[1]:
            self._apart = (now, beyond)
            return False
        return now - self._apart[0] >= self.apart_for

    @staticmethod
    def finished_apart(statuses: list[WorkerSummary]) -> str:
        """Why every rank waits, where some left the training loop and wait at its final barrier while others
        train on: they were given different step counts ("": not so)."""
        done = [s for s in statuses if s.activity == "finishing"]
        training = [s for s in statuses if s.activity != "finishing"]
        if not done or not training:
            return ""
        return (f"ranks {_ranks(done)} finished their steps (after step {max(s.step for s in done)}) and "
                f"wait at the end for ranks {_ranks(training)}, which train on: give every node's script the same "
                "arguments (a different --steps, or a loop condition that differs between ranks)")

    def culprits(self, placed: list[Placed], newest_step: int) -> dict[str, tuple[str, int, int]]:
        """No rank stepped for --hang-timeout: the nodes whose ranks are not waiting on their peers, each with
        (why, its first such rank, the step that rank made)."""
        found: dict[str, tuple[str, int, int]] = {}
        for rank in placed:
            status = rank.status
            step = status.step if status is not None else newest_step
            if status is None or not self._fresh(status):
                found.setdefault(rank.node_id, (f"rank {rank.rank} stopped responding", rank.rank, step))
            elif status.activity not in WAITING_ON_PEERS:
                found.setdefault(rank.node_id, (f"rank {rank.rank} stuck in {status.activity} after step {step}",
                                                rank.rank, step))
        return found


def _ranks(statuses: list[WorkerSummary]) -> list[int]:
    return sorted(status.rank for status in statuses)
