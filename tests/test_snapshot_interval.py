"""--snapshot-interval N | auto | off: the policy (which steps are snapshotted, the auto decision, its place in
every snapshot), the dprun flag, and real recoveries with an interval."""

from __future__ import annotations

import json
import random
import re
import statistics

import pytest
import torch

from dpcommon import protocol as P
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.steps.interval import POLICY_NAME, SnapshotPolicy, interquartile_mean, interquartile_mean_error
from dpstate.replication.replicator import Replicator
from helpers.cli import in_process
from helpers.e2e import dprun
from helpers.fake_agents import TOKEN

# ----------------------------------------------------------------------------- the policy (pure)


@pytest.mark.parametrize("spec, mode, interval, budget", [
    ("1", "fixed", 1, 0.01), (" 7 ", "fixed", 7, 0.01), ("off", "off", 0, 0.01), ("auto", "auto", 1, 0.01),
    ("auto:0.05", "auto", 1, 0.05), ("AUTO:2%", "auto", 1, 0.02), (None, "fixed", 1, 0.01),
])
def test_parse(spec, mode, interval, budget):
    p = SnapshotPolicy(spec)
    assert (p.mode, p.interval, p.budget) == (mode, interval, pytest.approx(budget))
    assert p.enabled == (mode != "off")


@pytest.mark.parametrize("spec", ["0x", "-3", "auto:1.5", "auto:0", "sometimes"])
def test_parse_refuses(spec):
    with pytest.raises(ValueError):
        SnapshotPolicy(spec)


def test_fixed_interval_snapshots_step_zero_and_every_multiple():
    p = SnapshotPolicy("5")
    assert [s for s in range(0, 21) if p.wants(s)] == [0, 5, 10, 15, 20]
    assert p.max_lost_steps == 6  # N + 1: a peer may finish one more step while the newest is in flight
    assert not any(p.after_step(s, float(s)) for s in range(1, 30))  # never decides
    off = SnapshotPolicy("off")
    assert not any(off.wants(s) for s in range(0, 10)) and off.max_lost_steps == 0


def run_auto(p: SnapshotPolicy, cost: float, steps: range, noise: float = 0.0, t0: float = 0.0, seed: int = 0):
    """Feed the policy step times: 1 s, plus `cost` after a snapshotted step; returns (step, interval) decisions."""
    rnd = random.Random(seed)
    t, decisions = t0, []
    for s in steps:
        t += (1.0 + (cost if p.wants(s - 1) else 0.0)) * (1 + rnd.uniform(-noise, noise))
        if p.after_step(s, t):
            decisions.append((s, p.decide_from(p.local_measurements(), s)))  # one rank: its own are agreed
    return decisions


def test_auto_measures_alternating_steps_then_picks_the_smallest_interval_under_budget():
    p = SnapshotPolicy("auto", warmup=2, pairs=3)
    p.after_step(1, 0.0)
    # steps 1-2 warm up (snapshotted), 3..8 alternate, the decision comes at the end of step 9
    assert [p.wants(s) for s in range(1, 9)] == [True, True, True, False, True, False, True, False]
    p = SnapshotPolicy("auto", warmup=2, pairs=3)
    decisions = run_auto(p, cost=0.2, steps=range(1, 12))
    assert decisions[0] == (9, 20)  # 20 % per snapshot, 1 % budget -> every 20 steps
    assert p.decided and p.cost == pytest.approx(0.2) and p.max_lost_steps == 21
    assert [s for s in range(10, 61) if p.wants(s)] == [20, 40, 60]
    cheap = SnapshotPolicy("auto:0.5", warmup=1, pairs=2)
    assert run_auto(cheap, cost=0.2, steps=range(1, 8))[0][1] == 1  # cheaper than the budget: every step


def test_auto_estimate_holds_when_other_jobs_slow_the_host_down_now_and_then():
    """Adjacent steps are compared: a host whose speed changes (another job starts or ends) between them
    moves single pairs, not the median of the pairs."""
    estimates = []
    for seed in range(60):
        rnd = random.Random(seed)
        p, t, level = SnapshotPolicy("auto"), 0.0, 1.0
        for s in range(1, 40):
            if rnd.random() < 0.15:
                level = rnd.choice([1.0, 1.5, 2.5])
            t += (1.0 + (0.25 if p.wants(s - 1) else 0.0)) * level * rnd.uniform(0.95, 1.05)
            if p.after_step(s, t):
                estimates.append(p.local_cost())
                break
    estimates.sort()
    assert 0.2 < estimates[len(estimates) // 2] < 0.3
    assert estimates[len(estimates) // 10] > 0.12 and estimates[-len(estimates) // 10] < 0.4


def test_interquartile_mean_drops_a_quarter_at_each_end_and_its_error_matches_the_spread_of_many_samples():
    assert interquartile_mean([1000.0, 0.0, 6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == pytest.approx(3.5)
    assert interquartile_mean([2.0, 7.0]) == pytest.approx(4.5)  # fewer than 4: all of them
    rnd = random.Random(7)
    samples = [[rnd.gauss(0.0, 1.0) for _ in range(16)] for _ in range(2000)]
    observed = statistics.stdev(interquartile_mean(x) for x in samples)
    predicted = statistics.median(interquartile_mean_error(x) for x in samples)
    assert observed == pytest.approx(predicted, rel=0.2), (observed, predicted)


def test_auto_keeps_the_budget_on_a_host_whose_steps_vary_more_than_a_snapshot_costs():
    """This host's steps vary by ~4 % (sd) at random, and a snapshot costs ~3 % of one: single pairs say
    little. Choosing the interval for the cost's upper bound keeps the budget in most runs (the median of 8
    pairs alone kept it in about 6 runs in 10), at a few more steps between snapshots."""
    kept, intervals = 0, []
    for seed in range(300):
        rnd, p, t = random.Random(seed), SnapshotPolicy("auto"), 0.0
        for s in range(1, 60):
            t += 1.0 + (0.03 if p.wants(s - 1) else 0.0) + rnd.gauss(0.0, 0.04)
            if p.after_step(s, t):
                intervals.append(p.decide_from(p.local_measurements(), s))
                kept += 0.03 / p.interval <= p.budget + 1e-9
                break
    assert len(intervals) == 300
    assert kept >= 0.9 * 300, kept
    assert 3 <= statistics.median(intervals) <= 6, sorted(intervals)


def test_auto_interval_shrinks_to_young_daly_once_failures_come_often():
    p = SnapshotPolicy("auto")  # budget 1 %
    assert p.decide(1.0, step=20, elapsed_s=300.0, step_s=0.6) == 100  # no failure yet: the budget's interval
    p.generation = 5  # five recoveries in 300 s: one every 60 s
    n = p.decide(1.0, step=21, elapsed_s=300.0, step_s=0.6)
    assert n == round((2 * 1.0 * 60 / 0.6) ** 0.5) == 14 and p.mtbf_s == 60
    assert "bounded by the failures so far" in p.describe()
    p.generation = 1  # rare failures: the budget's interval is the smaller one
    assert p.decide(0.05, step=22, elapsed_s=36000.0, step_s=0.6) == 5


def test_a_deferring_gate_lets_auto_overlap_a_replication_slower_than_a_step():
    """The H100's 4 GB: a snapshot acked 40 steps after the next gate. Gates that wait at the next step pay
    those 40 steps per snapshot (interval 4,000 and more); gates that wait at the next snapshot step overlap
    them with the steps between (dpstate.steps.gate), so 41 steps keep a contention of 0.2 % of a step in budget."""
    blocking = SnapshotPolicy("auto")
    assert blocking.decide(40.002, step=36, step_s=0.067, lag_steps=40.0) == 4001  # the lag is in its cost
    assert blocking.lag_steps == 0.0 and blocking.max_lost_steps == 4002
    deferring = SnapshotPolicy("auto")
    deferring.defers = True
    assert deferring.decide(0.002, step=36, step_s=0.067, lag_steps=40.0) == 41
    assert (0.002 + 1.0) / 40 > 0.01 >= 0.002 / 41  # 40 would wait a step for each snapshot: over budget
    assert deferring.max_lost_steps == 82 and "acked 40.0 step(s) after the next gate" in deferring.describe()
    assert deferring.decide(0.05, step=40, lag_steps=0.0) == 5  # fast replication: the cost alone, as before
    assert deferring.decide(0.05, step=44, lag_steps=0.5) == 5  # acked within the step after: no stall at 5
    assert deferring.decide(0.005, step=48, lag_steps=3.0) == 4  # (0.005 + 0) / 4 within budget; 3 waits 1
    deferring.generation = 5  # failures every 60 s: Young/Daly says 2 steps, but not below the lag + 1
    assert deferring.decide(0.002, step=52, elapsed_s=300.0, step_s=0.067, lag_steps=40.0) == 41
    restored = SnapshotPolicy("auto")
    restored.load_state_dict(deferring.state_dict())
    assert restored.lag_steps == 40.0


def test_lags_are_measured_in_steps_from_the_newest_few():
    p = SnapshotPolicy("auto", warmup=1, pairs=2)
    p.defers = True
    run_auto(p, cost=0.1, steps=range(1, 7))  # steps of ~1 s
    for seconds in (2.0, 3.0, -0.5, 2.5):
        p.record_lag(seconds)
    assert p.local_measurements()[4] == pytest.approx(2.25, rel=0.1)
    for _ in range(20):
        p.record_lag(-0.1)  # acked before the gate: no lag
    assert p.local_measurements()[4] == 0.0


def test_fixed_intervals_lose_twice_the_interval_at_most_where_the_gate_defers():
    p = SnapshotPolicy("5")
    assert p.max_lost_steps == 6
    p.defers = True
    assert p.max_lost_steps == 10
    assert SnapshotPolicy("1").max_lost_steps == 2


def test_auto_decides_again_at_the_first_step_after_a_recovery():
    p = SnapshotPolicy("auto", warmup=1, pairs=2)
    run_auto(p, cost=0.1, steps=range(1, 7))
    saved = p.state_dict()
    spare = SnapshotPolicy("auto", warmup=1, pairs=2)
    spare.load_state_dict(saved)  # restored at step 5, now in generation 1
    assert spare.after_step(6, 100.0, generation=1)  # decided in generation 0: decide again, on every rank
    cost, bound, elapsed, step_s, lag = spare.local_measurements()
    assert cost == pytest.approx(0.1) and bound == pytest.approx(0.1) and step_s == pytest.approx(1.0, rel=0.1)
    assert lag == 0.0  # its gates wait at the next step: no lag measured
    spare.decide_from([cost, bound, 50.0, step_s, lag], 6)
    assert spare.decided_generation == 1 and spare.interval == min(10, round((2 * 0.1 * 50 / step_s) ** 0.5))
    assert not spare.after_step(7, 101.0, generation=1)


def test_auto_keeps_measuring_and_follows_a_changed_cost():
    p = SnapshotPolicy("auto", warmup=2, pairs=3, refresh=2)
    first = run_auto(p, cost=0.3, steps=range(1, 120), noise=0.01)
    assert first[0][1] in range(25, 36)
    later = run_auto(p, cost=0.05, steps=range(120, 400), noise=0.01, t0=1000.0, seed=1)
    assert later and later[-1][1] in range(4, 8), later


def test_auto_at_interval_one_leaves_out_a_step_now_and_then_so_a_low_first_estimate_is_corrected():
    """A first estimate that came out under the budget (a noisy host) fixed the interval at 1, where no step
    without a snapshot was left to compare with: now one step in PROBE_EVERY is left out and measured."""
    p = SnapshotPolicy("auto", warmup=2, pairs=3, refresh=2)
    assert run_auto(p, cost=0.001, steps=range(1, 12))[0][1] == 1  # measured as cheap: every step
    assert p.probing and p.max_lost_steps == 3  # a failure just after a left-out step costs 3
    assert [s for s in range(12, 60) if not p.wants(s)] == [15, 31, 47]  # PROBE_EVERY = 16
    later = run_auto(p, cost=0.05, steps=range(12, 200), noise=0.01, t0=100.0, seed=2)  # the real cost
    assert later and later[-1][1] in range(4, 7), later  # 5 % per snapshot, 1 % budget
    assert not p.probing and p.max_lost_steps == later[-1][1] + 1
    assert [s for s in range(200, 212) if p.wants(s)] == [s for s in range(200, 212) if s % p.interval == 0]


def test_auto_decision_travels_in_the_state_and_a_rollback_before_it_measures_again():
    p = SnapshotPolicy("auto", warmup=1, pairs=2)
    run_auto(p, cost=0.1, steps=range(1, 7))
    assert p.decided and p.interval == 10
    saved = p.state_dict()
    fresh = SnapshotPolicy("auto", warmup=1, pairs=2)  # a promoted spare
    fresh.load_state_dict(saved)
    assert fresh.decided and fresh.interval == 10 and fresh.wants(20) and not fresh.wants(21)
    before = SnapshotPolicy("auto", warmup=1, pairs=2).state_dict()  # a snapshot from before the decision
    p.load_state_dict(before)
    assert not p.decided and p.wants(50)  # measuring again, from the step after the restore
    assert run_auto(p, cost=0.1, steps=range(41, 47))[0] == (46, 10)


def test_auto_policy_is_tracked_so_snapshots_carry_it(monkeypatch):
    from dpstate.snapshot.state import Tracked

    p = SnapshotPolicy("auto")
    tracked = Tracked()
    tracked.add(**{POLICY_NAME: p})
    meta, data = S.pack(tracked.capture(3))
    tree = S.unpack(meta, data)
    assert tree["state"][POLICY_NAME]["mode"] == "auto"


def test_replicator_takes_no_snapshot_when_off(monkeypatch):
    monkeypatch.setenv("DP_SNAPSHOT_INTERVAL", "off")
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    rep.submit(0, {"step": 0, "x": torch.ones(4)})
    rep.wait_acked(timeout=5)
    assert rep.local_steps() == [] and rep.stats.captures == 0


# ----------------------------------------------------------------------------- the dprun flag


@pytest.mark.parametrize("value", ["0", "-1", "auto:3", "often"])
def test_dprun_refuses_a_bad_interval(tmp_path, value):
    """(dprun.cli.main in this process: test_cli shows that `python -m dprun` says the same)"""
    script = tmp_path / "x.py"
    script.write_text("print('hi')\n")
    code, _, err = in_process(["--snapshot-interval", value, script], tmp_path)
    assert code == 2 and "--snapshot-interval" in err, err


# ----------------------------------------------------------------------------- real recoveries


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_interval_five_and_auto_recover_to_a_snapshot_step_bitwise(procs, tmp_path, unbroken):
    """A node killed after step 13: with an interval of 5 the job rolls back to step 10 (at most N + 1 lost);
    with auto every rank agrees on the interval (the decision is in the restored snapshots). Same result.
    Without landing (DP_SNAPSHOT_LANDING=0: the optimizer steps in place, as on CUDA) and with
    DP_SNAPSHOT_DEFER_ACKS=1 (CUDA's default) the gates wait for acks at snapshot steps only: the restore goes
    to step 10, or 5 if 10 were still in flight (2N lost at most). (30 steps: conftest's failure-free run of
    that shape serves test_e2e_faults and test_e2e_saving too.)"""
    clean = unbroken(2, 30)
    five = dprun(procs, tmp_path, "five", "--nnodes", "2", "--spares", "1", "--snapshot-interval", "5",
                 "--inject", "kill-node:1@step=13", steps=30)
    assert five.returncode == 0, five.stderr[-3000:]
    (done,) = five.named("recovery_complete")
    assert done["restore_step"] == 10 and done["lost_steps"] <= 6
    assert five.summary["params_sha256"] == clean.summary["params_sha256"]
    deferred = dprun(procs, tmp_path, "deferred", "--nnodes", "2", "--spares", "1", "--snapshot-interval", "5",
                     "--inject", "kill-node:1@step=13", steps=30, env={"DP_SNAPSHOT_LANDING": "0", "DP_SNAPSHOT_DEFER_ACKS": "1"})
    assert deferred.returncode == 0, deferred.stderr[-3000:]
    (done,) = deferred.named("recovery_complete")
    assert done["restore_step"] in (5, 10) and done["lost_steps"] <= 10
    assert deferred.summary["params_sha256"] == clean.summary["params_sha256"]
    auto = dprun(procs, tmp_path, "auto", "--nnodes", "2", "--spares", "1", "--snapshot-interval", "auto:0.5",
                 "--inject", "kill-node:1@step=13", steps=30, env={"DP_SNAPSHOT_AUTO_STEPS": "1,2"})
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "dpstate: snapshot interval auto" in auto.stderr
    assert auto.summary["params_sha256"] == clean.summary["params_sha256"]
    (done,) = auto.named("recovery_complete")
    decided = re.search(r"-> every (\d+) step", auto.stderr)
    assert decided, auto.stderr[-2000:]
    interval = int(decided.group(1))
    assert done["restore_step"] % interval == 0 and done["restore_step"] >= 13 - interval - 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_off_takes_no_snapshot_and_a_failure_says_why_it_cannot_recover(procs, tmp_path):
    ok = dprun(procs, tmp_path, "off", "--nnodes", "2", "--snapshot-interval", "off", steps=10,
               env={"DP_SNAPSHOT_PROFILE": str(tmp_path / "profile")})
    assert ok.returncode == 0 and ok.summary["final_step"] == 10, ok.stderr[-3000:]
    profiles = [json.loads(f.read_text()) for f in tmp_path.glob("profile.rank*.json")]
    assert len(profiles) == 2 and all(p["captures"] == 0 and p["sends"] == 0 for p in profiles)
    bad = dprun(procs, tmp_path, "offkill", "--nnodes", "2", "--spares", "1", "--snapshot-interval", "off",
                "--inject", "kill-node:1@step=5", steps=20)
    assert bad.returncode == 1 and "snapshots are off" in bad.stdout + bad.stderr
