"""`srun dprun ...` on a real Slurm cluster on this host (tests/slurm_cluster.py): the node ranks Slurm gives,
a node killed with its slurmd, what Slurm then does to the job, and scancel's SIGTERM to every process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from conftest import free_port
from dpagent.snapshot_files import newest_saved
from e2e import TRAIN, TRAIN_ARGS, dprun, read_events, wait_for
from slurm_cluster import SlurmCluster, unavailable

STEPS = 300  # at 0.3 s a step under srun: longer than Slurm takes to see a dead node (~25 s), never reached


@pytest.fixture
def cluster(procs):
    why = unavailable()
    if why:
        if os.environ.get("DP_TESTS_NEED_SLURM"):  # .ci/run: CI installs Slurm, so a skip there is a failure
            pytest.fail(why)
        pytest.skip(why)
    slurm = SlurmCluster(procs)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


@pytest.mark.timeout(300)
def test_srun_dprun_swaps_a_killed_node_for_its_spare_and_scancel_saves_the_state(cluster, procs, tmp_path):
    """3 nodes, `srun --no-kill dprun --nnodes 2`: SLURM_NODEID is the node rank, n3 waits as the spare. Node n2
    dies whole (slurmd, step daemon, dprun, agent, worker: SIGKILL); the spare takes rank 1 at once. Slurm sees
    the dead node ~25 s later and, with --no-kill, takes it out of the job instead of ending the job. Then
    scancel: Slurm's SIGTERM to every process; the job saves its newest step, which resumes bitwise."""
    events, saved, out = tmp_path / "events.jsonl", tmp_path / "saved", tmp_path / "srun.out"
    with open(out, "w") as output:
        srun = procs.popen(
            ["srun", "--nodes=3", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0",
             sys.executable, "-m", "dprun", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nnodes", "2",
             "--save-dir", str(saved), "--events-file", str(events), TRAIN, "--steps", str(STEPS), *TRAIN_ARGS,
             "--step-sleep", "0.3"],
            env={**cluster.env(), "DP_JOB_TOKEN": "slurm-test-secret"}, cwd=tmp_path, stdout=output,
            stderr=subprocess.STDOUT)
    said = lambda: f"{out.read_text()[-3000:]}\n{cluster.log('slurmctld')}"  # noqa: E731
    progress = lambda: max([e["step"] for e in read_events(events) if e["event"] == "progress"], default=0)  # noqa: E731
    wait_for(lambda: progress() >= 5 or srun.poll() is not None, 120, "step 5")
    assert srun.poll() is None, said()
    (job,) = cluster.jobs()

    (launcher,) = [p for p in cluster.node_processes("n2") if _is_dprun(p)]  # node rank 1: SLURM_NODEID 1
    cluster.kill_node("n2")
    wait_for(lambda: any(e["event"] == "recovery_complete" for e in read_events(events)), 60, "the hot swap")
    (failed,) = [e for e in read_events(events) if e["event"] == "node_failed"]
    assert failed["node"] == f"{socket.gethostname()}-{launcher.pid}" and failed["node_rank"] == 1, failed
    (promoted,) = [e for e in read_events(events) if e["event"] == "spare_promoted"]
    assert promoted["node_rank"] == 1

    wait_for(lambda: cluster.state("n2").startswith("down"), 120, "Slurm to mark n2 down")
    swapped_at = progress()
    wait_for(lambda: progress() >= swapped_at + 3 or srun.poll() is not None, 60, "training after Slurm's verdict")
    assert srun.poll() is None, f"Slurm ended the job for its dead node\n{said()}"

    cluster.scancel(job)
    srun.wait(timeout=120)
    (saving,) = [e for e in read_events(events) if e["event"] == "saving_state"]
    (finished,) = [e for e in read_events(events) if e["event"] == "job_finished"]
    assert f"is saved in {saving['folder']}" in finished["message"], (finished, said())
    assert newest_saved(saved, 2)[1] == saving["step"] > swapped_at

    resumed = dprun(procs, tmp_path, "resumed", "--nnodes", "2", "--spares", "0", "--resume-from", saved,
                    steps=STEPS)
    unbroken = dprun(procs, tmp_path, "unbroken", "--nnodes", "2", "--spares", "0", steps=STEPS)
    assert resumed.returncode == 0 == unbroken.returncode, resumed.stderr[-3000:] + unbroken.stderr[-3000:]
    assert resumed.summary["params_sha256"] == unbroken.summary["params_sha256"]


def _is_dprun(p: psutil.Process) -> bool:
    try:
        return p.cmdline()[1:3] == ["-m", "dprun"]
    except psutil.Error:
        return False
