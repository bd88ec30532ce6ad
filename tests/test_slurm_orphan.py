"""A Slurm job orphaned by its controller's node: what each node left decides (pure), and the loop over
scontrol/scancel with Slurm's answers scripted (the real commands run in tests/test_slurm_cluster.py)."""

from __future__ import annotations

import random
import subprocess
import threading

import pytest

from dprun.slurm.orphaned_job import (LEADER_PATIENCE_S, PROBE_EVERY_S, SAVE_PATIENCE_S, JobRecord, Orphan, next_move,
                                      settle, slurm_patience)

RECORD = ("JobId=5 JobName=train.sbatch UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901755 Nice=0 "
          "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
          "Reboot=0 ExitCode=0:0 RunTime=00:00:31 TimeLimit=UNLIMITED ReqNodeList=(null) ExcNodeList=(null) "
          "NodeList=n[2-3] BatchHost=n1 NumNodes=2 NumCPUs=4 WorkDir=/home/a b Comment=NodeList=n1")


def record(state="RUNNING", nodes="n[2-3]", batch="n1", restarts=0) -> JobRecord:
    return JobRecord.parse(RECORD.replace("JobState=RUNNING", f"JobState={state}")
                           .replace("NodeList=n[2-3]", f"NodeList={nodes}").replace("BatchHost=n1", f"BatchHost={batch}")
                           .replace("Restarts=0", f"Restarts={restarts}"))


def test_a_job_record_is_read_from_scontrols_one_line_form():
    job = JobRecord.parse(RECORD)
    assert job == JobRecord(state="RUNNING", nodes=("n2", "n3"), batch_host="n1", restarts=0)
    assert record(nodes="(null)").nodes == ()  # a pending job has none
    with pytest.raises(ValueError, match="not a job record"):
        JobRecord.parse("slurm_load_jobs error: Invalid job id specified")


STEP = Orphan("5", 0, ("n1", "n2", "n3"), "n2")


@pytest.mark.parametrize("job, saved, waited, move", [
    (record(nodes="n[1-3]"), {"n2", "n3"}, 10.0, "wait"),  # Slurm has not yet seen the batch host die
    (record(nodes="n[1-3]"), {"n2", "n3"}, 700.0, "leave"),  # it never does: the node is alive, its script goes on
    (record(nodes="n[1-3]", batch="n3"), {"n2"}, 1.0, "leave"),  # the batch script is on a node that did not die
    (record(), {"n2", "n3"}, 1.0, "act"),  # the batch host is out of the job and each node left has saved
    (record(nodes="n[2-4]"), {"n2", "n3"}, 1.0, "act"),  # (n4 is in the job, not in the step: it has nothing)
    (record(), {"n2"}, 10.0, "wait"),  # n3 is still writing its files
    (record(), {"n2"}, 400.0, "act"),  # ... for longer than any save may take
    (record(nodes="n2"), {"n2"}, 1.0, "act"),  # n3 died too: Slurm took it out of the job
    (record(state="COMPLETING"), {"n2", "n3"}, 1.0, "done"),  # another node cancelled or requeued it
    (record(restarts=1), {"n2", "n3"}, 1.0, "done"),  # requeued, and running again: the new run is not ours
    (record(state="PENDING", nodes="(null)", restarts=1), set(), 1.0, "done"),
])
def test_next_move(job, saved, waited, move):
    assert next_move(job, STEP, saved, waited, slurm_patience=600.0) == move


def test_a_batch_host_that_runs_a_command_is_alive_and_left_to_its_script_at_once():
    """The controller's dprun died but its node lives (Slurm still lists it): a command Slurm ran there proves it,
    ~2 x SlurmdTimeout sooner than waiting for Slurm to take a dead node out."""
    assert next_move(record(nodes="n[1-3]"), STEP, {"n2"}, 2.0, slurm_patience=600.0, batch_host_answered=True) == "leave"


def test_only_the_first_node_left_acts_unless_it_does_not():
    """One requeue, not one per node: measured, a second `scontrol requeue` while the first one's run is
    completing is refused ("Job is pending execution"), and once it runs again it would requeue the new run."""
    n3 = Orphan("5", 0, ("n1", "n2", "n3"), "n3")
    assert next_move(record(), n3, {"n2", "n3"}, 1.0, slurm_patience=600.0) == "wait"
    assert next_move(record(), n3, {"n2", "n3"}, SAVE_PATIENCE_S + LEADER_PATIENCE_S, slurm_patience=600.0) == "act"
    assert next_move(record(nodes="n3"), n3, {"n3"}, 1.0, slurm_patience=600.0) == "act"  # n2 died as well


def test_nodes_mark_their_save_in_the_save_dir_and_the_last_one_out_removes_the_marks(tmp_path):
    nodes = [Orphan("5", 1, ("n1", "n2", "n3"), name, str(tmp_path)) for name in ("n2", "n3")]
    assert nodes[0].saved_nodes() == set()
    for node in nodes:
        node.mark_saved()
    assert nodes[0].saved_nodes() == {"n2", "n3"} and nodes[0].marks.name == ".controller-lost-5.1"
    nodes[0].unmark()
    assert nodes[1].saved_nodes() == {"n3"}
    nodes[1].unmark()
    assert list(tmp_path.iterdir()) == []
    assert Orphan("5", 0, ("n1", "n2"), "n2").saved_nodes() == {"n1", "n2"}  # no --save-dir: nothing to wait for


class Slurm:
    """Slurm's answers to the commands settle() runs, in order; records each command."""

    def __init__(self, *jobs: str, refuse: tuple[str, ...] = ()):
        self.jobs, self.refuse, self.commands = list(jobs), refuse, []

    def __call__(self, args: list[str]) -> str:
        self.commands.append(" ".join(args))
        if args[0] in self.refuse or " ".join(args[:2]) in self.refuse:
            raise subprocess.CalledProcessError(1, args, "", f"{args[0]}: error: Access/permission denied\n")
        if args[:3] == ["scontrol", "show", "job"]:
            return self.jobs.pop(0) if len(self.jobs) > 1 else self.jobs[0]
        if args[:3] == ["scontrol", "show", "config"]:
            return "MessageTimeout          = 10 sec\nSlurmdTimeout           = 5 sec\n"
        return ""


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 2.0
        return self.now


def settle_with(slurm: Slurm, save_dir, mode: str = "cancel", patience=None) -> str:
    """As node n2 of n1-n3, with n3 already marked as saved."""
    Orphan("5", 0, STEP.step_nodes, "n3", str(save_dir)).mark_saved()
    orphan = Orphan("5", 0, STEP.step_nodes, "n2", str(save_dir))
    return settle(orphan, mode, threading.Event(), run=slurm, clock=Clock(), patience=patience)


def test_the_job_is_cancelled_once_slurm_took_the_batch_host_out(monkeypatch, tmp_path):
    monkeypatch.setattr("dprun.slurm.orphaned_job.POLL_S", 0.0)
    slurm = Slurm(RECORD.replace("NodeList=n[2-3]", "NodeList=n[1-3]"), RECORD, refuse=("srun",))  # dead, not seen
    said = settle_with(slurm, tmp_path)
    assert slurm.commands[-1] == "scancel 5" and sum(c.startswith("scontrol show job") for c in slurm.commands) == 2
    assert "lost its controller with node n1" in said and f"submit again with --resume-from {tmp_path}" in said
    assert [p.name for p in tmp_path.rglob("*")] == [".controller-lost-5.0", "n3"]  # n2's mark is taken back


def test_requeue_and_its_fallback_when_slurm_refuses(tmp_path):
    requeued = Slurm(RECORD)
    assert "requeued it (scontrol requeue 5)" in settle_with(requeued, tmp_path, "requeue", patience=60.0)
    assert requeued.commands[-1] == "scontrol requeue 5"
    refused = Slurm(RECORD, refuse=("scontrol requeue",))
    said = settle_with(refused, tmp_path, "requeue", patience=60.0)
    assert refused.commands[-3:] == ["scontrol requeue 5", "scontrol show job --oneliner 5", "scancel 5"]
    assert "Slurm refused to requeue it (scontrol: error: Access/permission denied), so cancelled it" in said
    requeued_by_n3 = RECORD.replace("JobState=RUNNING", "JobState=PENDING").replace("Restarts=0", "Restarts=1")
    raced = Slurm(RECORD, requeued_by_n3, refuse=("scontrol requeue",))
    assert settle_with(raced, tmp_path, "requeue", patience=60.0) == ""  # another node requeued it first
    assert not any(c.startswith("scancel") for c in raced.commands)
    nothing = Slurm(RECORD, refuse=("scontrol requeue", "scancel"))
    assert "`scancel 5` by hand" in settle_with(nothing, tmp_path, "requeue", patience=60.0)


def test_a_node_that_has_not_saved_is_waited_for(monkeypatch, tmp_path):
    monkeypatch.setattr("dprun.slurm.orphaned_job.POLL_S", 0.0)
    orphan = Orphan("5", 0, STEP.step_nodes, "n2", str(tmp_path))
    slurm = Slurm(RECORD)
    said = settle(orphan, "cancel", threading.Event(), run=slurm, clock=Clock(), patience=60.0)
    assert "cancelled it" in said  # n3 never marked: after SAVE_PATIENCE_S
    assert sum(c.startswith("scontrol show job") for c in slurm.commands) == SAVE_PATIENCE_S / 2


def test_a_live_batch_host_that_answers_is_left_to_end_the_job_at_the_first_poll(tmp_path):
    alive = Slurm(RECORD.replace("NodeList=n[2-3]", "NodeList=n[1-3]"))
    assert "`scancel 5`, then submit again" in settle_with(alive, tmp_path)
    assert alive.commands[-2:] == ["scontrol show job --oneliner 5",
                                   "srun --jobid=5 --overlap --nodelist=n1 --nodes=1 --ntasks=1 --quiet true"]


def test_a_batch_host_that_does_not_answer_is_waited_for_and_slurms_timeout_sets_the_patience(monkeypatch, tmp_path):
    """Where no command runs on it (dead, though Slurm has not seen it yet; or a site without `srun --overlap`),
    the node left asks again every PROBE_EVERY_S and leaves once Slurm would have taken a dead node out."""
    monkeypatch.setattr("dprun.slurm.orphaned_job.POLL_S", 0.0)
    silent = Slurm(RECORD.replace("NodeList=n[2-3]", "NodeList=n[1-3]"), refuse=("srun",))
    assert "`scancel 5`, then submit again" in settle_with(silent, tmp_path)
    assert slurm_patience(silent) == 2 * 5 + 120  # SlurmdTimeout = 5 sec
    assert not any(c.startswith(("scancel", "scontrol requeue")) for c in silent.commands)
    waits = sum(c.startswith("scontrol show job") for c in silent.commands)
    assert 130 / 2 <= waits <= 130 / 2 + 2  # asked every poll until the patience ran out
    probes = sum(c.startswith("srun") for c in silent.commands)
    assert 130 / PROBE_EVERY_S <= probes <= 130 / PROBE_EVERY_S + 2


def test_without_scontrol_it_says_so_and_what_to_do():
    def missing(args):
        raise FileNotFoundError(2, "No such file or directory", args[0])

    said = settle(STEP, "cancel", threading.Event(), run=missing, patience=10.0)
    assert said.startswith("dprun: cannot ask Slurm about job 5 (") and "`scancel 5`" in said
    assert slurm_patience(missing) == 2 * 300 + 120  # Slurm's default SlurmdTimeout


def test_a_signal_ends_the_wait():
    halted = threading.Event()
    halted.set()
    slurm = Slurm(RECORD)
    assert settle(STEP, "cancel", halted, run=slurm, patience=10.0) == "" and slurm.commands == []


POLL = 2.0  # as dprun.slurm.orphaned_job.POLL_S


def simulate(seed: int) -> tuple[list[tuple[float, str]], dict[str, tuple[float, str]], dict]:
    """One random schedule of the nodes left after the batch host n1 died, each asking next_move every 2 s
    from its save on, against a Slurm that applies an act at once: (the acts as (time, node), each node's last
    move, the schedule)."""
    rng = random.Random(seed)
    nodes = tuple(f"n{i}" for i in range(1, rng.randint(2, 7)))
    slurm_patience_s = rng.choice([130.0, 720.0])
    # n1 taken out in time, too late for the others' patience, or never (it is alive: its dprun alone died)
    removed = {"n1": rng.choice([rng.uniform(5, 0.9 * slurm_patience_s), rng.uniform(1.1, 2) * slurm_patience_s,
                                 float("inf")])}
    died = {n: rng.choice([float("inf")] * 3 + [rng.uniform(0, 600)]) for n in nodes[1:]}
    removed.update({n: died[n] + rng.uniform(5, 60) for n in nodes[1:]})
    saved = {n: rng.choice([rng.uniform(0, 30)] * 4 + [rng.uniform(0, 400), float("inf")]) for n in nodes[1:]}
    phase = {n: rng.uniform(0, POLL) for n in nodes[1:]}
    probes_work = rng.random() < 0.5  # `srun --overlap` runs a command on a live batch host (not at every site)
    acts, last, restarts, t = [], {}, 0, 0.0
    while t < 3000 and len(last) < len(nodes) - 1:
        for node in nodes[1:]:
            if node in last or t >= died[node] or t < saved[node] or (t - saved[node] - phase[node]) % POLL >= 0.5:
                continue
            job = JobRecord("RUNNING" if restarts == 0 else "PENDING", tuple(n for n in nodes if t < removed[n]),
                            "n1", restarts)
            marks = {n for n in nodes[1:] if saved[n] <= t}
            answered = probes_work and removed["n1"] == float("inf")  # a dead node never answers
            move = next_move(job, Orphan("5", 0, nodes, node), marks, t - saved[node], slurm_patience_s,
                             batch_host_answered=answered)
            if move == "act":
                acts.append((t, node))
                restarts += 1
            if move != "wait":
                last[node] = (t, move)
        t += 0.5
    return acts, last, dict(nodes=nodes, removed=removed, died=died, saved=saved, patience=slurm_patience_s,
                            probes_work=probes_work)


@pytest.mark.slow  # 2,000 schedules: ~40 s on a busy host
@pytest.mark.timeout(60)
def test_in_random_schedules_one_node_ends_an_orphaned_job_once_and_every_node_finishes():
    """2,000 schedules: nodes saving early, late or never, dying before or after the batch host is taken out,
    Slurm keeping the batch host (alive) or not. The job is ended exactly once iff Slurm took the batch host
    out within the patience (twice SlurmdTimeout + 2 minutes) while some node of the step was left to act, never
    before every live node saved or had SAVE_PATIENCE_S; a node that keeps running ends its wait in bounded
    time, with "leave" where Slurm keeps the batch host: at its first poll where a command ran there."""
    for seed in range(2000):
        acts, last, s = simulate(seed)
        live = [n for n in s["nodes"][1:] if s["died"][n] == float("inf") and s["saved"][n] < float("inf")]
        why = f"seed {seed}: {s}, acts {acts}, moves {last}"
        assert len(acts) <= 1, why
        for node in live:
            assert node in last, why  # it stopped waiting
            assert last[node][0] - s["saved"][node] <= max(s["patience"], SAVE_PATIENCE_S + LEADER_PATIENCE_S,
                                                           s["removed"]["n1"] + 10) + POLL + 1, why
        if s["removed"]["n1"] == float("inf"):
            assert not acts and all(last[n][1] == "leave" for n in live), why
            if s["probes_work"]:  # it answered: every node leaves at its first poll, not after the patience
                assert all(last[n][0] - s["saved"][n] <= POLL + 0.5 for n in live), why
            continue
        if live and s["removed"]["n1"] < s["patience"]:
            assert acts, why  # someone ended it
        if acts:
            t, node = acts[0]
            in_job = [n for n in s["nodes"][1:] if t < s["removed"][n]]
            assert t >= s["removed"]["n1"], why
            waited = t - s["saved"][node]
            assert all(s["saved"][n] <= t for n in in_job) or waited >= SAVE_PATIENCE_S, why
            assert node == in_job[0] or waited >= SAVE_PATIENCE_S + LEADER_PATIENCE_S, why
