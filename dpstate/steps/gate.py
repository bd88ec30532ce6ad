"""The snapshot gate: what a rank waits for before the last collective of a step, so that no optimizer step
overwrites a snapshot that a restore may still need (DESIGN.md; the Job calls it, docs/sequences.md step 2).

Every gate waits until the newest snapshot is captured (its tensors may change after it). Deferring (on a
GPU; DP_SNAPSHOT_DEFER_ACKS), its acks are waited for at the next snapshot step: only then does a capture
reuse the buffer of the snapshot before it. Otherwise, and always where an optimizer step lands in the
snapshot buffers (dpstate.snapshot.landing: it reuses one), every step's gate waits for them.
"""

from __future__ import annotations

import os
import time

import torch

from dpstate.replication.replicator import Replicator

STALL_STEPS, STALL_SHARE = 16, 0.10  # warn once when waiting for acks took over 10 % of 16 steps' time


def defers_acks(lands: bool, device: torch.device) -> bool:
    """Whether gates wait for acks at snapshot steps only: never where an optimizer step writes the snapshot
    buffers (`lands`, dpstate.snapshot.landing); on a GPU, whose host cores the replication does not take from the
    training; on the CPU only with DP_SNAPSHOT_DEFER_ACKS=1 (there a replication spilling past the step after a
    snapshot slows the steps auto compares it with: docs/performance.md). Alike on every rank of a job."""
    if lands:
        return False
    wanted = os.environ.get("DP_SNAPSHOT_DEFER_ACKS", "").strip().lower()
    return wanted in ("1", "on", "true", "yes") if wanted else device.type == "cuda"


def stall_message(share: float, interval: str) -> str:
    """What rank 0 says once when a fixed interval's snapshots stall training (SnapshotGate.stalled_share)."""
    return (f"dpstate: training waited for snapshots' replication {share:.0%} of the time over the last "
            f"{STALL_STEPS} steps (snapshots {interval}); --snapshot-interval auto takes the smallest interval "
            "that keeps it under 1 %")


class SnapshotGate:
    """Counts what the gate waited for and when, for one Replicator; pure bookkeeping besides the waits.

    `defers` is set once the step loop knows its optimizers (Job.steps()): True where none lands its step in
    a snapshot buffer. Every rank then waits for acks at the same steps (the snapshot steps, which the policy
    gives alike everywhere), so passing the collective after such a gate means every rank's previous snapshot is
    held, which is what the capture about to reuse its predecessor's buffer needs."""

    def __init__(self, replicator: Replicator):
        self.replicator = replicator
        self.defers = False
        self.step: int | None = None  # the step in progress; between steps every gate waits for acks
        self.acked = 0  # the replicator's submission count that the gate last waited to be acked
        self.ack_wait_s = 0.0  # seconds spent waiting for acks, in all (auto measures steps without them)
        self._lag_seq = 0  # the newest snapshot's submission count, until its lag is known ...
        self._lag_gate_at: float | None = None  # ... and when the first gate after it came
        self._recent: list[tuple[float, float]] = []  # (seconds waited for acks, step seconds) of the newest steps
        self._waited_before = 0.0  # ack_wait_s at the end of the step before
        self.stall_warned = False

    @property
    def pending(self) -> bool:
        """Whether a snapshot was submitted that this gate has not seen acked."""
        return self.acked < self.replicator.submitted

    def acks_due(self) -> bool:
        """Whether this step's gate waits for acks: every step's where optimizer steps land, else only a
        snapshot step's (and any gate between steps: the final barrier, a recovery)."""
        return not self.defers or self.step is None or self.replicator.policy.wants(self.step)

    def wait(self) -> None:
        """Pass the gate: wait (abortably) for the captures, and for the acks where they are due."""
        submitted = self.replicator.submitted
        if self.acked >= submitted:
            return
        if self._lag_seq == submitted and self._lag_gate_at is None:
            self._lag_gate_at = time.perf_counter()
        if not self.acks_due():
            self.replicator.wait_captured()
            return
        started = time.perf_counter()
        try:
            self.replicator.wait_acked()
        finally:
            self.ack_wait_s += time.perf_counter() - started
        self.acked = submitted

    def stalled_share(self, step_s: float) -> float | None:
        """After each step (its wall time): once, the share of the newest STALL_STEPS steps' time spent waiting
        for acks when it exceeds STALL_SHARE (snapshots whose replication is slower than the steps between
        them, at a fixed interval); None otherwise and ever after."""
        waited, self._waited_before = self.ack_wait_s - self._waited_before, self.ack_wait_s
        self._recent = (self._recent + [(waited, step_s)])[-STALL_STEPS:]
        if self.stall_warned or len(self._recent) < STALL_STEPS:
            return None
        share = sum(w for w, _ in self._recent) / max(sum(s for _, s in self._recent), 1e-9)
        if share <= STALL_SHARE:
            return None
        self.stall_warned = True
        return share

    def forget_waits(self) -> None:
        """After a failed step and its recovery: what the gate waited meanwhile (acks that a dead or frozen peer
        never sent, a recovery's gates) was the failure's, not the replication's, so no step is charged with it;
        the steps counted start anew."""
        self._waited_before = self.ack_wait_s
        self._recent = []

    def step_clock(self, policy) -> float:
        """The clock an auto policy measures this step's end by (SnapshotPolicy.after_step), after handing it the
        newest lag if known: where the gate defers, the time spent waiting for acks is left out (lag models it)."""
        lag = self.lag()
        if lag is not None:
            policy.record_lag(lag)
        return time.perf_counter() - (self.ack_wait_s if self.defers else 0.0)

    def submitted(self) -> None:
        """A snapshot was just submitted: measure how long after the next gate its acks come (deferring)."""
        self._lag_seq, self._lag_gate_at = self.replicator.submitted, None

    def lag(self) -> float | None:
        """Once known, and only once: seconds from the first gate after the newest snapshot to its last ack
        (negative: acked before that gate), which at a snapshot step of its own the gate would have waited."""
        if not self.defers or not self._lag_seq or self._lag_gate_at is None:
            return None
        acked_at = self.replicator.acked_at(self._lag_seq)
        if acked_at is None:
            return None
        self._lag_seq = 0
        return acked_at - self._lag_gate_at
