"""Slurm mode: the rendezvous that `srun dprun ...` derives from Slurm's environment."""

from __future__ import annotations

import pytest

from dprun.slurm.rendezvous import BASE_PORT, expand_hostlist, from_environment, outside_step


def test_expand_hostlist_handles_ranges_padding_and_plain_names():
    assert expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert expand_hostlist("node[008-010]") == ["node008", "node009", "node010"]
    assert expand_hostlist("single") == ["single"]


def test_every_node_of_a_step_agrees_on_the_controller_and_takes_its_node_id_as_rank():
    jobs = [from_environment({"SLURM_JOB_ID": "4242", "SLURM_NODEID": str(i), "SLURM_STEP_NODELIST": "n[1-3]"})
            for i in range(3)]
    assert {j.rdzv_endpoint for j in jobs} == {f"n1:{BASE_PORT + 4242}"}
    assert [j.node_rank for j in jobs] == [0, 1, 2]
    assert jobs[0].nodes == 3 and jobs[0].job_id == "slurm-4242" and jobs[0].slurm_id == "4242"
    assert jobs[1].step_nodes == ("n1", "n2", "n3") and jobs[1].restarts == 0
    requeued = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[4-5]", "SLURM_RESTART_COUNT": "2"}
    assert from_environment(requeued).restarts == 2  # (a requeued job's run: its nodes do not act on the next)
    ports = {int(from_environment({**env, "SLURM_JOB_ID": str(job)}).rdzv_endpoint.rpartition(":")[2])
             for env in [{"SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1"}] for job in range(0, 100_000, 7)}
    assert min(ports) >= 1024 and max(ports) < 32768  # never one of Linux's ephemeral ports, which any connection takes


def test_outside_slurm_nothing_is_derived():
    assert from_environment({}) is None
    assert from_environment({"SLURM_JOB_ID": "1"}) is None


def test_a_batch_script_or_salloc_shell_is_not_a_step_and_dprun_says_it_runs_on_one_node():
    """sbatch's script has SLURM_NODEID=0 and the job's node list but no step: taking it for node 0 of the
    job would wait for nodes that no dprun runs on."""
    batch = {"SLURM_JOB_ID": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    assert from_environment(batch) is None
    assert "this dprun was not started by srun: it runs on this node only" in outside_step(batch)
    assert outside_step({**batch, "SLURM_JOB_NUM_NODES": "1"}) is None  # a one-node job: nothing to say
    assert outside_step({"SLURM_JOB_ID": "2", "SLURM_STEP_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "2"}) is None
    assert outside_step({}) is None


def test_a_step_with_several_tasks_per_node_is_refused():
    step = {"SLURM_JOB_ID": "3", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "4"}
    with pytest.raises(ValueError, match="dprun runs once per node: srun --ntasks-per-node=1"):
        from_environment(step)
    assert from_environment({**step, "SLURM_STEP_NUM_TASKS": "2"}).nodes == 2
