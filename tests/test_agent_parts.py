"""The agent's parts alone, handed fakes for what they read and reach (no sockets, no processes): how stop
signals count, how a signal and the controller's own stop decide a shutdown and its phases, and what restart
mode holds back."""

from __future__ import annotations

import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass

import pytest

from dpcommon import protocol as p
from dpagent.agent_config import AgentConfig
from dpagent.liveness import Liveness
from dpagent.placement import Placement
from dpcommon.replica_store import ReplicaStore
from dpagent.restart import RestartMode
from dpagent.shutdown import STACKS_S, ShutdownSequence, StopPhase
from dpagent.stop_signals import StopSignals

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeWorker:
    local_rank: int


class FakeWorkers:
    """What a ShutdownSequence asks of a WorkerGroup: its live workers, and the signals sent to them."""

    def __init__(self, nproc: int) -> None:
        self.live = [FakeWorker(r) for r in range(nproc)]
        self.sent: list[int | str] = []

    def ask_for_stacks(self) -> None:
        self.sent.append("stacks")

    def thaw(self, local_ranks=None) -> None:
        pass

    def alive(self) -> list[FakeWorker]:
        return list(self.live)

    def greeted(self) -> list[FakeWorker]:
        return list(self.live)

    def paused(self):
        return nullcontext()

    def signal_all(self, sig: int) -> None:
        self.sent.append(sig)


def config() -> AgentConfig:
    return AgentConfig("tcp://c:1", "n0", "token", ["true"], nproc=2, stop_grace=3.0, term_grace=2.0)


def welcome(**kw) -> p.Welcome:
    return p.Welcome("n0", "active", "job", 0.5, 4.0, **kw)


def sequence(signals: StopSignals, place: Placement):
    workers, to_workers, to_controller = FakeWorkers(2), [], []
    seq = ShutdownSequence(config(), workers, to_workers.append, to_controller.append, ReplicaStore(), place,
                           signals)
    return seq, workers, to_workers, to_controller


def test_a_stop_signal_its_launcher_passed_on_and_the_same_one_from_outside_count_once():
    signals = StopSignals(watch_launcher=False)
    signals._on_launcher_stop(0, None)
    signals._on_signal(signal.SIGTERM, None)  # Slurm's, to every process of the step
    assert (signals.count, signals.name) == (1, "SIGTERM")
    signals._on_signal(signal.SIGINT, None)
    assert (signals.count, signals.name) == (2, "SIGINT")


def test_a_first_signal_waits_for_the_controller_then_the_node_stops_alone_and_says_it_leaves():
    signals, place = StopSignals(watch_launcher=False), Placement(2, "active", welcome=welcome())
    seq, workers, to_workers, to_controller = sequence(signals, place)
    signals._on_signal(signal.SIGTERM, None)
    now = time.monotonic()
    seq.stop_signalled(now, Liveness(0.5, 4.0, now))
    assert seq.shutdown is None and seq.stop_wait == now + 4.0 and not to_controller
    seq.stop_signalled(now + 4.0, Liveness(0.5, 4.0, now))
    assert to_controller == [p.Leaving("n0", "received SIGTERM; the controller did not stop the job")]
    assert seq.shutdown is not None and seq.shutdown.phase is StopPhase.STOP and seq.shutdown.code == 128 + 15
    assert to_workers == [p.Stop("received SIGTERM; the controller did not stop the job", 128 + 15)]
    assert seq.greeting() == to_workers[0], "a worker that says hello now is told to stop too"


def test_a_first_signal_does_not_stop_a_node_whose_job_the_controller_stops():
    signals, place = StopSignals(watch_launcher=False), Placement(2, "active", welcome=welcome())
    seq, _, _, to_controller = sequence(signals, place)
    signals._on_signal(signal.SIGTERM, None)
    now = time.monotonic()
    seq.stop_signalled(now, Liveness(0.5, 4.0, now))
    seq.job_stopping = True  # its SaveSnapshots came: the controller's Stop follows
    seq.stop_signalled(now + 10.0, Liveness(0.5, 4.0, now))
    assert seq.shutdown is None and not to_controller


def test_a_stop_asks_for_stacks_then_goes_to_sigterm_then_sigkill_at_its_graces_and_exits_once_the_workers_are_gone():
    signals, place = StopSignals(watch_launcher=False), Placement(2, "active", welcome=welcome())
    seq, workers, _, _ = sequence(signals, place)
    seq.begin(0, "stop from controller: done", StopPhase.STOP, p.Stop("done"))
    assert seq.shutdown is not None and seq.exiting()
    stop_deadline = seq.shutdown.deadline
    seq.advance(stop_deadline - 0.1)
    assert seq.shutdown.phase is StopPhase.STOP and workers.sent == []
    seq.advance(stop_deadline)
    assert seq.shutdown.phase is StopPhase.STACKS and workers.sent == ["stacks"], "where they are stuck, said first"
    seq.advance(seq.shutdown.deadline)
    assert seq.shutdown.phase is StopPhase.TERM and workers.sent == ["stacks", signal.SIGTERM]
    assert seq.shutdown.deadline == stop_deadline + STACKS_S + 2.0, "the term grace"
    seq.advance(seq.shutdown.deadline)
    assert seq.shutdown.phase is StopPhase.KILL and workers.sent == ["stacks", signal.SIGTERM, signal.SIGKILL]
    assert seq.exit_code is None
    workers.live.clear()
    seq.advance(seq.shutdown.deadline - 1.0)
    assert seq.exit_code == 0


def test_a_stop_that_keeps_the_store_retires_the_node_until_the_end_comes():
    signals, place = StopSignals(watch_launcher=False), Placement(2, "active", welcome=welcome())
    seq, workers, _, _ = sequence(signals, place)
    seq.begin(0, "stop from controller: spare", StopPhase.STOP, p.Stop("spare", keep_store=True))
    assert not seq.exiting()
    workers.live.clear()
    seq.advance(time.monotonic())
    assert seq.retired and seq.shutdown is None and seq.exit_code is None


def test_the_controller_lost_without_a_save_dir_kills_the_workers_and_exits_3():
    signals, place = StopSignals(watch_launcher=False), Placement(2, "active", welcome=welcome())
    seq, workers, _, _ = sequence(signals, place)
    seq.lose_controller("silent")
    assert seq.shutdown is not None and seq.shutdown.phase is StopPhase.KILL and workers.sent == [signal.SIGKILL]
    workers.live.clear()
    seq.advance(time.monotonic())
    assert seq.exit_code == 3


def test_restart_mode_holds_a_crash_that_a_peer_may_have_caused_and_reports_it_once_its_deadline_passes():
    place = Placement(2, "active", generation=1, welcome=welcome(prespawn=False), restart_mode=True,
                      latest=p.Reconfigure(1, 1, 2, 2, 4, -1, "h:1", "", restart_workers=True))
    sent: list = []
    restart = RestartMode(config(), None, sent.append, place)  # (no worker link: no restart here)
    crash = p.WorkerExited("n0", 1, 1, 123, 1)
    assert restart.hold_exit(crash)
    assert sent == [p.PeerError("n0", 1, 3, "worker 1 exit code 1")]
    restart.release_held(time.monotonic() + 3.0)
    assert len(sent) == 1
    restart.release_held(time.monotonic() + 4.1)
    assert sent[1:] == [crash]
    assert not restart.hold_exit(p.WorkerExited("n0", 1, 0, 124, 0)), "a clean exit is news at once"
    assert not restart.hold_exit(p.WorkerExited("n0", 1, 0, 125, -9)), "so is a SIGKILL from outside"
