"""A training script's own failures, in real dprun jobs: an error that follows its rank onto the spare that
replaced the node ends the job saying it is the script's, with spares left unspent, and is named even when the
process crashes as it exits on it, or is killed by the kernel's OOM killer at the same step again; a one-off
error is recovered from; a rank that leaves the loop early is named as such, not as a finished run, and one
that never exits after it ends the job at --hang-timeout; a bug that strikes every rank at once still leaves
the state of the step before it, with --save-dir, to go on from once fixed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cgroups import in_cgroup, memory_cgroup
from helpers.cli import in_process
from helpers.e2e import read_events

pytestmark = pytest.mark.slow

SCRIPT = """
import atexit, os, sys, time, torch, dpstate
mode = os.environ["BUG"]
torch.manual_seed(0)
width = 1024 if mode == "drift" else 8  # drift: state of several checksum blocks (1 MiB each), to compare
model = torch.nn.Linear(width, width)
opt = dpstate.AdamW(model.parameters(), lr=1e-3)
job = dpstate.init()
ddp = job.data_parallel(model)
if mode != "untracked":
    job.track(model=model, optimizer=opt)
if mode == "unwrapped":  # a loop without `with step:`: a peer's failure is an exception like any other
    for step in job.steps(40):
        if job.rank == 1:  # rank 0 waits for it in each step's all-reduce: where node 1's death reaches it
            time.sleep(0.05)  # (a failure heard between collectives is recovered at the step's end, loop or not)
        loss = ddp(torch.randn(4, width)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.exit(0)
hog = bytearray if mode == "oom" and job.rank == 1 else None  # its appetite at step 5, on every node it runs on
if mode == "crash" and job.rank == 1:  # what libstdc++ does when a native thread dies as the interpreter exits
    atexit.register(lambda: (print("terminate called without an active exception", file=sys.stderr), os.abort()))
for step in job.steps(12):
    with step:
        if step.number == 5 and hog is not None:
            hog(int(os.environ["OOM_BYTES"]))
        if step.number == 5 and mode == "hang" and job.rank == 1:
            time.sleep(600)  # waits for what never comes, on every node it runs on
        if step.number == 5 and (job.rank == 1 or mode == "every") and (
                mode not in ("fixed", "converged", "linger", "oom", "twice", "drift")) and (
                mode in ("always", "every", "crash") or job.generation == 0):
            raise ValueError("bad batch at step 5")
        loss = ddp(torch.randn(4, width)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step.number == 5 and mode == "drift" and job.rank == 1:  # (after the step, as a snapshot's capture
            with torch.no_grad():  # may overlap the next one's start) one rank's copy only: DDP averages the
                model.weight.add_(1.0)  # gradients, never the parameters
        step.log(loss=loss.item())
    if mode == "leave" and step.number == 5 and job.rank == 1:
        break  # a rank that stops early on its own: its peers cannot go on
    if mode == "converged" and step.number == 5:
        break  # every rank stops early: a clean end at step 5
if mode == "twice":
    for step in job.steps(20):  # a warm-up loop of 12 first: a second loop after the job's end is refused
        with step:
            pass
if mode == "linger" and job.rank == 1:
    time.sleep(600)  # its work after the loop never ends (a teardown that hangs)
"""


def _run(procs, tmp_path, mode: str, *options: str, cgroup: Path | None = None,
         env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The job, all of it in `cgroup` if given."""
    script = tmp_path / "bug.py"
    script.write_text(SCRIPT)
    events = tmp_path / f"{mode}.events.jsonl"
    command = [sys.executable, "-m", "dprun", "--nnodes", "2", "--no-tui", "--events-file", events, *options, script]
    proc = procs.popen(in_cgroup(cgroup, command) if cgroup else command, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={"BUG": mode, **(env or {})})
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), read_events(events)


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


def test_an_error_that_follows_its_rank_to_the_spare_ends_the_job_with_spares_left(procs, tmp_path):
    run, events = _run(procs, tmp_path, "always", "--spares", "2")
    assert run.returncode == 1, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert "rank 1 failed on" in finished["message"] and "a spare cannot fix it" in finished["message"]
    assert "ValueError: bad batch at step 5" in finished["message"] and "after step 4" in finished["message"]
    assert len(_named(events, "spare_promoted")) == 1, "the second spare is not spent on the script's bug"
    assert 'raise ValueError("bad batch at step 5")' in run.stderr, "the failure report shows the traceback"


def test_a_hang_that_follows_its_rank_onto_the_spare_is_caught_in_the_first_step_and_ends_the_job(procs, tmp_path):
    """Rank 1 hangs in step 5 wherever it runs. On the spare, step 5 is the first step of the new generation:
    before, the hang timer waited for a step there and the job hung for ever; now the rank that computes while its
    peer waits is failed again, and the same hang at the same step ends the job as the script's."""
    run, events = _run(procs, tmp_path, "hang", "--spares", "2", "--hang-timeout", "3")
    assert run.returncode == 1, run.stderr[-3000:]
    causes = [e["cause"] for e in _named(events, "node_failed")]
    assert len(causes) == 2 and all("rank 1 stuck in compute after step 4" in c for c in causes), causes
    (finished,) = _named(events, "job_finished")
    assert re.search(r"rank 1 failed on node1 and again on node[23], which took its place", finished["message"]), \
        finished  # (whichever spare registered first)
    assert "hangs again at the same step" in finished["message"] and len(_named(events, "spare_promoted")) == 1
    # each hung worker, still running after its node was told to stop, said where it was before its SIGTERM
    line = next(i for i, text in enumerate(SCRIPT.split("\n"), 1) if "waits for what never comes" in text)
    assert run.stderr.count(f'bug.py", line {line} in <module>') >= 2, run.stderr[-5000:]


def test_a_script_that_tracks_nothing_is_not_recovered_into_a_silently_diverged_model(procs, tmp_path):
    """Without job.track() a snapshot holds no training state: the spare that took node1's rank started from its
    initial parameters and the job ended 0, its ranks' models differing. Now the spare's restore says why it
    cannot be done, and the job ends with that error (the same on the second spare: the script's)."""
    run, events = _run(procs, tmp_path, "untracked", "--spares", "2", "--inject", "kill-node:1@step=3")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "no model or optimizer is tracked (job.track(model=..., optimizer=...))" in run.stderr, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert "rank 1 cannot be restored to step" in finished["message"], finished


def test_a_worker_that_crashes_while_exiting_on_its_error_is_named_by_it_and_spares_are_not_spent_on_it(
        procs, tmp_path):
    """A process may abort after the traceback, while it exits (a native thread taking the interpreter's lock
    back: "terminate called without an active exception"; seen once in CI): the node's failure names the
    script's error, and the same crash on the spare that took the rank counts as the same error."""
    run, events = _run(procs, tmp_path, "crash", "--spares", "2")
    assert run.returncode == 1, run.stderr[-3000:]
    (failed, *_) = _named(events, "node_failed")
    assert ("killed by SIGABRT: [rank1]: ValueError: bad batch at step 5 (then: terminate called without an active "
            "exception)" in failed["cause"]), failed
    (finished,) = _named(events, "job_finished")
    assert "rank 1 failed on" in finished["message"] and "a spare cannot fix it" in finished["message"], finished
    assert len(_named(events, "spare_promoted")) == 1, "the second spare is not spent on the script's bug"


def test_the_oom_killer_is_named_and_striking_the_spare_at_the_same_step_ends_the_job_as_the_scripts(tmp_path,
                                                                                                     procs):
    """The whole job in a memory cgroup of 2 GiB: rank 1 asks for 3 GiB at step 5, on whichever node trains it.
    Its agent tells the OOM killer's SIGKILL from a kill -9 by the cgroup's count of OOM kills; the same on the
    spare that took rank 1 over is the script's appetite: the job ends so, with the second spare unspent."""
    with memory_cgroup(2 << 30) as cgroup:  # (what the job left in it is killed as it goes)
        run, events = _run(procs, tmp_path, "oom", "--spares", "2", cgroup=cgroup, env={"OOM_BYTES": str(3 << 30)})
    assert run.returncode == 1, run.stderr[-3000:]
    (failed, *_) = _named(events, "node_failed")
    assert "killed by the kernel's OOM killer: out of memory" in failed["cause"], failed
    (finished,) = _named(events, "job_finished")
    assert "rank 1 failed on" in finished["message"] and "a spare cannot fix" in finished["message"], finished
    assert "(killed by the kernel's OOM killer: out of memory): the training script needs more memory" in \
        finished["message"], finished
    assert len(_named(events, "spare_promoted")) == 1, "the second spare is not spent on the script's appetite"


def test_a_one_off_error_is_recovered_from(procs, tmp_path):
    run, events = _run(procs, tmp_path, "once", "--spares", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_named(events, "recovery_complete")) == 1
    assert _named(events, "job_finished")[0]["exit_code"] == 0
    said = re.search(r"dprun: done in .*; goodput (\d+)%", run.stdout)
    assert said, run.stdout[-1500:]
    # (`dprun report` by dprun.cli.main in this process: test_cli shows that a process says the same)
    code, report, err = in_process(["report", "--json", tmp_path / "once.events.jsonl"], tmp_path)
    assert code == 0, err
    # the same job the same way: from dprun's launch, the final barrier no step (the report said 25 % vs 41 %)
    assert abs(json.loads(report)["goodput"] * 100 - int(said[1])) <= 2, (said[0], report[:300])


def test_a_rank_that_leaves_the_loop_early_is_named_not_taken_for_a_finished_run(procs, tmp_path):
    run, events = _run(procs, tmp_path, "leave", "--spares", "1")
    assert run.returncode == 1, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert "rank 1 exited (exit code 0) after step" in finished["message"], finished
    assert "training completed" not in finished["message"]


def test_every_rank_leaving_the_loop_early_ends_cleanly_at_the_step_it_left_after(procs, tmp_path):
    run, events = _run(procs, tmp_path, "converged", "--spares", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert finished["exit_code"] == 0 and not _named(events, "node_failed")
    assert re.search(r"dprun: done in \S+, step 5\b", run.stdout), run.stdout[-1500:]  # not one short


def test_a_second_steps_loop_after_one_that_ran_to_its_end_is_refused_at_once_not_left_to_hang(procs, tmp_path):
    run, events = _run(procs, tmp_path, "twice", "--spares", "1", "--hang-timeout", "60")
    assert run.returncode == 1, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert "job.steps() called again after a loop that ran to its end (step 12): call job.steps(total) once" in \
        finished["message"] and "the same way after step 12" in finished["message"], finished
    assert "did not exit within" not in finished["message"]


def test_a_worker_that_never_exits_after_training_ends_the_job_at_hang_timeout_blaming_no_node(procs, tmp_path):
    run, events = _run(procs, tmp_path, "linger", "--spares", "0", "--hang-timeout", "4")
    assert run.returncode == 1, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    named = re.match(r"training completed \(step 12\), but rank 1 on \S+ \(pid (\d+)\) did not exit within 4 s",
                     finished["message"])
    assert named, finished["message"]
    assert not _named(events, "node_failed"), "no node failed: rank 0 exited 0, rank 1 finished its steps"
    assert "killed by SIGKILL (by its agent, as it stops)" in run.stdout + run.stderr
    assert f"worker 0 started (pid {named[1]})" in run.stdout + run.stderr, "the pid of the worker that lingered"


def test_a_bug_on_every_rank_saves_the_step_before_it_and_the_fixed_script_goes_on_from_there(procs, tmp_path):
    """Each node's worker raises at step 5; each node's replica store holds the other's rank. The node fenced
    first keeps its store (its agent is fine), so the save has a copy of every rank although no worker lives."""
    run, events = _run(procs, tmp_path, "every", "--spares", "0", "--save-dir", "saved")
    assert run.returncode == 1, run.stderr[-3000:]
    (saving,) = _named(events, "saving_state")
    (finished,) = _named(events, "job_finished")
    assert "ValueError: bad batch at step 5" in finished["message"]
    assert f"the state of step {saving['step']} is saved in" in finished["message"], finished["message"]
    assert 1 <= saving["step"] <= 4
    resumed, events = _run(procs, tmp_path, "fixed", "--spares", "0", "--resume-from", saving["folder"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert min(e["step"] for e in _named(events, "progress")) == saving["step"] + 1
    assert _named(events, "job_finished")[0]["exit_code"] == 0


def test_a_rank_whose_parameters_drift_from_its_peers_is_named_as_it_happens_and_in_the_job_s_last_words(
        procs, tmp_path):
    """Rank 1 changes its own copy of the weights at step 5 (as a faulty GPU or a rank-dependent bug would). Each
    node's replica store compares the other's data parallel snapshot with its own node's: the difference was
    printed on the worker's stderr only, and the job ended 0 as if nothing were wrong. Now the controller hears
    it (protocol.Diverged): an event at once, and the job's last line names the ranks and the step."""
    run, events = _run(procs, tmp_path, "drift", "--spares", "0", "--snapshot-check", "full")
    assert run.returncode == 0, run.stderr[-3000:]
    found = _named(events, "divergence")
    assert {e["rank"] for e in found} == {0, 1} and {e["step"] for e in found} == {5}, found  # (either side's view)
    (finished,) = _named(events, "job_finished")
    assert "of rank(s) 0, 1 differed from a data parallel peer's (first at step 5)" in finished["message"], finished
    assert "differed from a data parallel peer's (first at step 5)" in run.stdout


def test_a_peer_s_failure_that_ends_a_script_without_with_step_says_what_would_have_recovered_it(procs, tmp_path):
    """A loop that forgets `with step:`: when node 1 dies, rank 0's collective error escapes the loop and ends
    its process like any bug. It still does (dpstate cannot resume a loop the script left), but after the
    traceback it says that this error is one dpstate recovers from inside `with step:`, and how to write it."""
    run, events = _run(procs, tmp_path, "unwrapped", "--spares", "1", "--inject", "kill-node:1@step=3")
    assert run.returncode == 1, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert "rank 0: this error is a peer's failure (or the job reconfiguring), which dpstate recovers from only " \
           "inside a step's `with step:` block" in said, said[-3000:]
