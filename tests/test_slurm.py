"""Slurm mode: the rendezvous that `srun dprun ...` derives from Slurm's environment."""

from __future__ import annotations

from dprun.slurm import BASE_PORT, expand_hostlist, from_environment


def test_expand_hostlist_handles_ranges_padding_and_plain_names():
    assert expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert expand_hostlist("node[008-010]") == ["node008", "node009", "node010"]
    assert expand_hostlist("single") == ["single"]


def test_every_node_of_a_step_agrees_on_the_controller_and_takes_its_node_id_as_rank():
    jobs = [from_environment({"SLURM_JOB_ID": "4242", "SLURM_NODEID": str(i), "SLURM_STEP_NODELIST": "n[1-3]"})
            for i in range(3)]
    assert {j.rdzv_endpoint for j in jobs} == {f"n1:{BASE_PORT + 4242}"}
    assert [j.node_rank for j in jobs] == [0, 1, 2]
    assert jobs[0].nodes == 3 and jobs[0].job_id == "slurm-4242"


def test_outside_slurm_nothing_is_derived():
    assert from_environment({}) is None
    assert from_environment({"SLURM_JOB_ID": "1"}) is None
