"""The snapshot gate (dpstate.steps.gate) with a real Replicator: where optimizer steps do not land in the snapshot
buffers it waits for a snapshot's capture at every step and for its acks only at the next snapshot step, so a
replication slower than a step overlaps the steps between snapshots; a holder that never answers shows which."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from dpstate.steps.abort import Aborted, AbortSignal
from dpstate.steps.gate import STALL_STEPS, SnapshotGate, defers_acks
from dpstate.steps.interval import SnapshotPolicy
from helpers.replication import replicator, state

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_holder():
    """A replica endpoint that takes every message and never answers (a holder too slow to ack)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


def gate_over(endpoint: str, interval: int, defers: bool, abort: AbortSignal | None = None):
    rep = replicator(abort=abort)
    rep.policy = SnapshotPolicy(str(interval))
    rep.configure(0, endpoint, 1)
    gate = SnapshotGate(rep)
    gate.defers = defers
    return rep, gate


def assert_blocks(gate: SnapshotGate, abort: AbortSignal) -> None:
    """gate.wait(), in a thread once the snapshot is captured, is still waiting (for acks) half a second later;
    the abort then ends it with Aborted."""
    raised: list = []

    def run():
        try:
            gate.wait()
        except Aborted as exc:
            raised.append(exc)

    gate.replicator.wait_captured(timeout=10)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive(), f"the gate of step {gate.step} passed without the previous snapshot's acks"
    abort.trigger("test over")
    thread.join(10)
    assert not thread.is_alive() and raised and gate.pending


def test_a_deferring_gate_waits_for_the_capture_only_until_the_next_snapshot_step(silent_holder):
    abort = AbortSignal()
    _, _, tracked = state()
    rep, gate = gate_over(silent_holder, interval=5, defers=True, abort=abort)
    rep.submit(5, tracked.capture(5))
    gate.submitted()
    for step in (6, 7, 8, 9):  # not snapshot steps: captured is enough, though no ack will ever come
        gate.step = step
        assert not gate.acks_due()
        gate.wait()  # returns: the tensors were copied (the checksum may still be running)
        assert gate.pending and rep.acked_at(rep.submitted) is None
    gate.step = 10  # the next snapshot step: its capture will reuse a buffer, so step 5 must be held first
    assert gate.acks_due()
    assert_blocks(gate, abort)


@pytest.mark.parametrize("defers, step", [(False, 6), (True, None)], ids=["landing-next-step", "between-steps"])
def test_a_gate_waits_for_every_ack_where_optimizers_land_and_between_steps(silent_holder, defers, step):
    """Landing writes the older buffer at step 6: its gate waits there. Between steps (the final barrier, a
    recovery) every gate waits, deferring or not."""
    abort = AbortSignal()
    _, _, tracked = state()
    rep, gate = gate_over(silent_holder, interval=5, defers=defers, abort=abort)
    rep.submit(5, tracked.capture(5))
    gate.step = step
    assert gate.acks_due()
    assert_blocks(gate, abort)


def test_the_lag_is_measured_from_the_first_gate_after_a_snapshot_to_its_ack(replica):
    _, _, tracked = state()
    rep, gate = gate_over(replica.replica_endpoint, interval=4, defers=True)
    rep.submit(4, tracked.capture(4))
    gate.submitted()
    assert gate.lag() is None  # no gate yet
    gate.step = 5
    gate.wait()
    replica.wait(lambda: rep.acked_at(rep.submitted) is not None, 10, "the ack")
    lag = gate.lag()
    assert lag is not None and -1.0 < lag < 10.0
    assert gate.lag() is None  # once
    gate.step = 8
    gate.wait()  # a snapshot step: waits for the ack (already here) and counts it
    assert not gate.pending and gate.ack_wait_s >= 0.0


def test_waiting_for_acks_over_a_tenth_of_the_time_is_said_once():
    gate = SnapshotGate(replicator())
    for _ in range(STALL_STEPS):  # 5 ms of 100 ms steps: fine
        gate.ack_wait_s += 0.005
        assert gate.stalled_share(0.1) is None
    shares = []
    for _ in range(2 * STALL_STEPS):  # now 60 ms of each 100 ms step (a replication slower than a step)
        gate.ack_wait_s += 0.06
        shares.append(gate.stalled_share(0.1))
    said = [s for s in shares if s is not None]
    assert len(said) == 1 and 0.10 < said[0] <= 0.6 and gate.stall_warned


def test_what_a_gate_waited_in_a_failed_step_and_its_recovery_is_not_charged_to_the_next_step():
    """A frozen peer never acks: the gate waits ~5 s until its failure is detected, then the recovery's gates
    wait too. The step after the recovery took 0.1 s: it must not read as waiting 5,000 % of the time (it did:
    "2116 % of the time", said as the last words of a worker killed later)."""
    gate = SnapshotGate(replicator())
    for _ in range(STALL_STEPS):
        gate.ack_wait_s += 0.005
        assert gate.stalled_share(0.1) is None
    gate.ack_wait_s += 5.0  # the failed step's gate, then the recovery's
    gate.forget_waits()
    for _ in range(STALL_STEPS):
        gate.ack_wait_s += 0.005
        assert gate.stalled_share(0.1) is None
    assert not gate.stall_warned


@pytest.mark.parametrize("lands, device, env, defers", [
    (True, "cuda", "1", False),  # landing writes the older buffer at the next step: never deferred
    (False, "cuda", "", True), (False, "cpu", "", False), (False, "cpu", "1", True), (False, "cuda", "0", False),
])
def test_acks_are_deferred_on_a_gpu_or_when_asked_and_never_where_steps_land(monkeypatch, lands, device, env, defers):
    monkeypatch.setenv("DP_SNAPSHOT_DEFER_ACKS", env)
    assert defers_acks(lands, torch.device(device)) is defers
