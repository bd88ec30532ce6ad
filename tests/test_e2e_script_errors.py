"""A training script's own failures, in real dprun jobs: an error that follows its rank onto the spare that
replaced the node ends the job saying it is the script's, with spares left unspent; a one-off error is
recovered from; a rank that leaves the loop early is named as such, not as a finished run."""

from __future__ import annotations

import subprocess

import pytest

from e2e import read_events

pytestmark = pytest.mark.slow

SCRIPT = """
import os, torch, dpstate
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = dpstate.AdamW(model.parameters(), lr=1e-3)
job = dpstate.init()
ddp = job.data_parallel(model)
job.track(model=model, optimizer=opt)
mode = os.environ["BUG"]
for step in job.steps(12):
    with step:
        if step.number == 5 and job.rank == 1 and (mode == "always" or job.generation == 0):
            raise ValueError("bad batch at step 5")
        loss = ddp(torch.randn(4, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step.log(loss=loss.item())
    if mode == "leave" and step.number == 5 and job.rank == 1:
        break  # a rank that stops early on its own: its peers cannot go on
"""


def _run(procs, tmp_path, mode: str, *options: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    script = tmp_path / "bug.py"
    script.write_text(SCRIPT)
    events = tmp_path / "events.jsonl"
    proc = procs.dprun("--nnodes", "2", "--no-tui", "--events-file", events, *options, script,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                       env={"BUG": mode})
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


def test_a_one_off_error_is_recovered_from(procs, tmp_path):
    run, events = _run(procs, tmp_path, "once", "--spares", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_named(events, "recovery_complete")) == 1
    assert _named(events, "job_finished")[0]["exit_code"] == 0


def test_a_rank_that_leaves_the_loop_early_is_named_not_taken_for_a_finished_run(procs, tmp_path):
    run, events = _run(procs, tmp_path, "leave", "--spares", "1")
    assert run.returncode == 1, run.stderr[-3000:]
    (finished,) = _named(events, "job_finished")
    assert "rank 1 exited (exit code 0) after step" in finished["message"], finished
    assert "training completed" not in finished["message"]
