"""--on-spare-exhausted shrink, end to end: a data-parallel job that loses a node with no spare left goes on with
the survivors training the lost node's ranks, and ends bit for bit as the run that never failed."""

from __future__ import annotations

import json

import pytest

from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, wait_for
from helpers.multi_node import multi_node_job

STEPS = 30


@pytest.mark.slow  # a 3-node job and its failure-free reference: about a minute
@pytest.mark.timeout(300)
def test_a_job_out_of_spares_shrinks_and_ends_bitwise_as_the_full_width_run(procs, tmp_path, unbroken):
    reference = unbroken(3, STEPS).summary["params_sha256"]
    run = dprun(procs, tmp_path, "shrink", "--nnodes", "3", "--spares", "0", "--on-spare-exhausted", "shrink",
                "--inject", "kill-node:1@step=10", steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    (shrunk,) = run.named("job_shrunk")
    assert (shrunk["nodes"], shrunk["processes"], shrunk["ranks"], shrunk["carried"]) == (
        [run.named("node_failed")[0]["node"]], 2, 3, {"0": [1]}), shrunk
    assert run.named("recovery_complete")
    assert "all 3 ranks finished (trained by 2 processes: the job shrank)" in run.named("job_finished")[0]["message"]
    assert run.summary["final_step"] == STEPS and run.summary["params_sha256"] == reference


@pytest.mark.slow  # a 3-node job, then a fourth node: about a minute
@pytest.mark.timeout(300)
def test_a_shrunk_job_grows_back_when_a_node_joins_and_ends_bitwise_as_the_full_width_run(procs, tmp_path, unbroken):
    reference = unbroken(3, STEPS).summary["params_sha256"]
    script = [TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", 0.3, "--summary", tmp_path / "summary.json"]
    job = multi_node_job(procs, tmp_path, "--nnodes", "3", "--spares", "0", "--on-spare-exhausted", "shrink",
                         script=script, secret="shrink-tests-secret")
    victim = job.start("--node-rank", "1")
    job.start("--node-rank", "2")
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in read_events(job.events)),
             timeout=120, what="training to pass step 5")
    victim.kill()
    wait_for(lambda: any(e["event"] == "job_shrunk" for e in read_events(job.events)), timeout=60,
             what="the job to shrink")
    job.start()  # a node joins the narrow job: it registers as a spare and the job grows onto it
    out, err = job.head.communicate(timeout=180)
    assert job.head.returncode == 0, err[-3000:]
    events = read_events(job.events)
    (shrunk,) = [e for e in events if e["event"] == "job_shrunk"]
    (grew,) = [e for e in events if e["event"] == "job_grew"]
    assert (shrunk["processes"], grew["processes"], grew["ranks"]) == (2, 3, 3)
    assert json.loads((tmp_path / "summary.json").read_text())["params_sha256"] == reference
