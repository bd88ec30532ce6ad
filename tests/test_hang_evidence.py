"""The controller's hang evidence (dprun.controller.hang_evidence), alone: which ranks wait on their peers, which are
stuck, and ranks left apart by different step counts, from workers' statuses as heartbeats carry them."""

from __future__ import annotations

import pytest

from dpcommon import protocol as p
from dprun.controller.hang_evidence import HangEvidence, Placed

pytestmark = pytest.mark.timeout(30)


def status(rank: int, activity: str, step: int, age: float = 0.1) -> p.WorkerSummary:
    return p.WorkerSummary(activity, rank=rank, step=step, age=age)


def test_a_rank_in_a_collective_waits_on_its_peers_unless_its_status_is_stale():
    hangs = HangEvidence(heartbeat_interval=0.5, now=0.0)
    assert hangs.waits_on_peers([status(0, "training", 3), status(1, "collective", 3)])
    assert not hangs.waits_on_peers([status(0, "training", 3), status(1, "collective", 3, age=5.0)])


def test_ranks_at_a_later_generations_rendezvous_wait_on_the_one_that_never_came():
    """A worker stopped or stuck as a recovery began never reaches the new generation's rendezvous, where the others
    wait for it: no step is made, and before, no hang clock ran either (the job hung for ever). At the first
    generation's rendezvous, processes may still be starting: no hang."""
    hangs = HangEvidence(heartbeat_interval=0.5, now=0.0)
    waiting = [status(0, "recovering", 7), status(1, "rendezvous", 7), status(2, "rendezvous", 7)]
    assert hangs.waits_on_peers(waiting, started=True)
    assert not hangs.waits_on_peers(waiting, started=False)
    placed = [Placed(f"node{s.rank}", s.rank, s) for s in waiting]
    assert hangs.culprits(placed, newest_step=7) == {"node0": ("rank 0 stuck in recovering after step 7", 0, 7)}


def test_the_culprits_are_the_nodes_whose_ranks_do_not_wait_on_peers():
    hangs = HangEvidence(heartbeat_interval=0.5, now=0.0)
    placed = [Placed("a", 0, status(0, "collective", 7)), Placed("b", 1, status(1, "training", 7)),
              Placed("c", 2, None), Placed("d", 3, status(3, "snapshot", 7, age=9.0))]
    assert hangs.culprits(placed, newest_step=8) == {
        "b": ("rank 1 stuck in training after step 7", 1, 7),
        "c": ("rank 2 stopped responding", 2, 8),
        "d": ("rank 3 stopped responding", 3, 7)}


def test_ranks_left_apart_by_different_step_counts_are_named_once_they_stay_so():
    hangs = HangEvidence(heartbeat_interval=0.5, now=0.0)
    apart = [status(0, "finishing", 10), status(1, "collective", 10)]
    assert not hangs.stuck_apart(apart, now=1.0)  # (first seen: the clock starts)
    assert not hangs.stuck_apart(apart, now=3.9)
    assert hangs.stuck_apart(apart, now=4.0)  # 6 heartbeat intervals on
    assert hangs.finished_apart(apart).startswith("ranks [0] finished their steps (after step 10) and wait at the "
                                                  "end for ranks [1], which train on")
    moved = [status(0, "finishing", 10), status(1, "collective", 11)]
    assert not hangs.stuck_apart(moved, now=5.0)  # it stepped: the clock starts again
