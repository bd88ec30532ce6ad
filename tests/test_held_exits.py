"""Restart mode's held exits (dpagent.restart.HeldExits), alone: a crash waits for its deadline, a restart drops
what it held and makes the replaced workers' exits no news, each once."""

from __future__ import annotations

import pytest

from dpcommon import protocol as p
from dpagent.restart import HeldExits

pytestmark = pytest.mark.timeout(30)


def exited(local_rank: int) -> p.WorkerExited:
    return p.WorkerExited("n0", 1, local_rank, 100 + local_rank, 1)


def test_a_held_exit_stands_once_its_deadline_passes_in_deadline_order():
    held = HeldExits()
    held.hold(exited(0), until=5.0)
    held.hold(exited(1), until=6.0)
    assert held.next_deadline() == 5.0 and held.due(4.9) == []
    assert held.due(6.0) == [exited(0), exited(1)] and held.next_deadline() is None


def test_a_restart_drops_what_was_held_and_its_replaced_workers_exits_are_no_news_once():
    held = HeldExits()
    held.hold(exited(0), until=5.0)
    held.retire([100, 101])
    assert held.due(10.0) == []
    assert held.retired_exit(100) and not held.retired_exit(100) and not held.retired_exit(999)
