"""The controller's fault-firing part (dprun.controller.fault_firing), driven alone: it is handed the job's progress and
layout and returns the actions; a freeze is remembered for the wake-node that follows it."""

from __future__ import annotations

import typing

import pytest

from dpcommon import protocol as p
from dprun.controller.vocabulary import Publish, Send, WakeNode
from dprun.controller.fault_firing import FaultFiring, JobNow
from dprun.controller.faults import KINDS, FaultPlan, parse_fault

pytestmark = pytest.mark.timeout(30)


def firing(*specs: str) -> FaultFiring:
    return FaultFiring(FaultPlan([parse_fault(spec) for spec in specs]))


def job(step: int, trained_s: float = 0.0) -> JobNow:
    return JobNow(steps={0: step, 1: step}, trained_s=trained_s, layout=["a", "b"], spares=["s1", "s2"])


def test_a_kill_fires_once_when_its_step_comes_and_is_timed():
    faults = firing("kill-node:1@step=3")
    assert faults.fire(10.0, job(2)) == []
    actions = faults.fire(11.0, job(3))
    assert actions[0] == Send("b", p.Inject(kind="kill-node", local_rank=0))
    assert isinstance(actions[1], Publish) and actions[1].event["event"] == "fault_injected"
    assert faults.injected_at == {"b": 11.0} and faults.fire(12.0, job(4)) == []


def test_a_wake_goes_to_the_node_frozen_at_that_rank_as_an_action_for_the_launcher():
    faults = firing("freeze-node:0@step=2", "wake-node:0@t=5")
    faults.fire(1.0, job(2, trained_s=1.0))
    assert faults.frozen_at == {0: "a"}
    (wake, said) = faults.fire(6.0, job(2, trained_s=5.0))
    assert wake == WakeNode("a", "wake-node:0@t=5") and said.event["kind"] == "wake-node"
    assert "a" in faults.injected_at and faults.injected_at["a"] == 1.0  # (the wake is no failure's start)


def test_a_spare_target_counts_spares_in_promotion_order_and_a_missing_one_is_said():
    faults = firing("kill-spare:1@step=1", "kill-node:5@step=1")
    kill, said, missing = faults.fire(1.0, job(1))
    assert kill == Send("s2", p.Inject(kind="kill-spare", local_rank=0)) and said.event["node"] == "s2"
    assert missing.event == {"event": "fault_skipped", "spec": "kill-node:5@step=1", "reason": "no such node"}


def test_faults_that_never_fired_are_said_as_the_job_ends():
    faults = firing("kill-node:1@step=99")
    (skipped,) = faults.never_fired()
    assert skipped.event["event"] == "fault_skipped" and faults.plan.pending == []


def test_every_fault_kind_on_the_wire_has_its_wording_and_parses():
    kinds = typing.get_args(p.FaultKind)
    assert set(KINDS) == set(kinds)
    assert [parse_fault(f"{kind}:1@step=3").kind for kind in kinds] == list(kinds)
    codec = p.Codec("t")
    with pytest.raises(p.ProtocolError, match="Inject.kind"):
        codec.decode(codec.encode(p.Inject(kind="no-such-fault")))  # type: ignore[arg-type]
