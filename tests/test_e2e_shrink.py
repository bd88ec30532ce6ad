"""--on-spare-exhausted shrink, end to end: a data-parallel job that loses a node with no spare left goes on with
the survivors training the lost node's ranks, and ends bit for bit as the run that never failed."""

from __future__ import annotations

import pytest

from helpers.e2e import dprun

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
