"""`srun dprun ...` on a real Slurm cluster on this host (tests/helpers/slurm_cluster.py): the node ranks Slurm
gives, a node killed with its slurmd, what Slurm then does to the job, and scancel's SIGTERM to every process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable

import psutil
import pytest

from conftest import REPO, Processes, free_port
from dpcommon.save_manifest import newest_saved
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, the_save, wait_for
from helpers.slurm_cluster import SlurmCluster, unavailable

pytestmark = pytest.mark.slow  # a real Slurm cluster: minutes, most of them Slurm's own timeouts
STEPS = 300  # at 0.3 s a step under srun: longer than Slurm takes to see a dead node (~14 s), never reached
SBATCH_STEPS = 60  # the second submission trains the rest


@pytest.fixture
def cluster(procs, request):
    """A cluster of 3 nodes, or as many as the test's `nodes` mark says."""
    why = unavailable()
    if why:
        if os.environ.get("DP_TESTS_NEED_SLURM"):  # .ci/run: CI installs Slurm, so a skip there is a failure
            pytest.fail(why)
        pytest.skip(why)
    mark = request.node.get_closest_marker("nodes")
    slurm = SlurmCluster(procs, nodes=mark.args[0] if mark else 3)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


@pytest.mark.timeout(300)
def test_srun_dprun_swaps_a_killed_node_for_its_spare_and_scancel_saves_the_state(cluster, procs, tmp_path):
    """3 nodes, `srun --no-kill dprun --nnodes 2`: SLURM_NODEID is the node rank, n3 waits as the spare. Node n2
    dies whole (slurmd, step daemon, dprun, agent, worker: SIGKILL); the spare takes rank 1 at once. Slurm sees
    the dead node ~14 s later and, with --no-kill, takes it out of the job instead of ending the job. Then
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
    saving = the_save(read_events(events), said())
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


def sbatch_template(cluster: SlurmCluster, folder) -> Callable[[], str]:
    """slurm/train.sbatch, scaled to this cluster (3 nodes, 2 training, the test's small model, the controller's
    port picked free at submission), written to `folder`; returns a function that submits it (job id)."""
    template = (REPO / "slurm" / "train.sbatch").read_text()
    edits = {"--nodes=5": "--nodes=3",
             "dprun --nnodes 4 --nproc-per-node 8": f"{sys.executable} -m dprun --rdzv-endpoint 127.0.0.1:$PORT "
                                                   "--nnodes 2",
             "examples/train_gpt.py --steps 10000": f"{TRAIN} --steps {SBATCH_STEPS} {' '.join(TRAIN_ARGS)} "
                                                    "--step-sleep 0.2"}
    for old, new in edits.items():
        assert old in template, f"slurm/train.sbatch changed: update this test ({old!r})"
        template = template.replace(old, new)
    (folder / "train.sbatch").write_text(template)

    def submit() -> str:
        out = subprocess.run(["sbatch", "--parsable", "-o", str(folder / "%j.out"), str(folder / "train.sbatch")],
                             env={**os.environ, **cluster.env(), "PORT": str(free_port())}, cwd=folder,
                             capture_output=True, text=True, check=True, timeout=30)
        return out.stdout.strip().split(";")[0]
    return submit


def outputs(folder, job: str) -> str:
    """What the template's job printed: its batch script, then each node (the template gives each a file)."""
    files = [folder / f"{job}.out", *sorted(folder.glob(f"deadpool-{job}-node*.out"))]
    return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in files if f.exists())


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> str:
    """params_sha256 of a run of SBATCH_STEPS that nothing interrupted (2 nodes, as the template's job trains),
    run once for the module's template tests, before their cluster starts."""
    procs = Processes()
    try:
        run = dprun(procs, tmp_path_factory.mktemp("unbroken"), "unbroken", "--nnodes", "2", "--spares", "0",
                    steps=SBATCH_STEPS)
    finally:
        procs.kill_all()
    assert run.returncode == 0 and run.summary["final_step"] == SBATCH_STEPS, run.stderr[-3000:]
    return run.summary["params_sha256"]


def assert_ends_like_an_unbroken_run(folder, job: str, unbroken: str) -> None:
    """The summary of the template's job `job` is that of a run of SBATCH_STEPS that nothing interrupted."""
    summary = json.loads((folder / f"summary-{job}.json").read_text())
    assert summary["final_step"] == SBATCH_STEPS and summary["params_sha256"] == unbroken


@pytest.mark.timeout(420)  # (with the module's unbroken run, on first use)
def test_the_sbatch_template_saves_at_its_signal_and_a_second_submission_resumes(cluster, tmp_path, unbroken):
    """The SIGTERM that the template's `--signal=TERM@300` sends before the time limit (here at once, by
    `scancel --signal=TERM`, which signals the steps the same way) saves the newest step; the same script
    submitted again resumes from it and finishes, bitwise where an unbroken run ends."""
    submit = sbatch_template(cluster, tmp_path)
    env = dict(os.environ, **cluster.env())

    def events(job: str) -> list[dict]:
        return read_events(tmp_path / f"events-{job}.jsonl")

    first = submit()
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in events(first)) or not cluster.jobs(),
             120, "step 5")
    subprocess.run(["scancel", "--signal=TERM", first], env=env, check=True, timeout=30)
    wait_for(lambda: not cluster.jobs(), 120, "the first job to end")
    saving = the_save(events(first))
    assert saving["folder"] == str(tmp_path / "deadpool-saved" / f"step-{saving['step']}")
    second = submit()
    wait_for(lambda: not cluster.jobs(), 240, "the second job to end")
    (started,) = [e for e in events(second) if e["event"] == "job_started"]
    (finished,) = [e for e in events(second) if e["event"] == "job_finished"]
    assert started["step"] == saving["step"] and finished["exit_code"] == 0, outputs(tmp_path, second)
    assert_ends_like_an_unbroken_run(tmp_path, second, unbroken)


@pytest.mark.nodes(4)
@pytest.mark.timeout(420)
def test_when_the_first_node_dies_the_nodes_left_save_and_requeue_the_job_which_resumes(cluster, tmp_path,
                                                                                         unbroken):
    """The template's first node dies whole: the controller and the batch script with it. The nodes left save
    what they hold; once Slurm has taken the dead node out of the job they requeue it (without that, Slurm keeps
    a --no-kill job allocated, idle, until its time limit), and Slurm runs the script again on n2-n4, which
    resumes from the save and finishes bitwise where an unbroken run ends."""
    submit = sbatch_template(cluster, tmp_path)
    job = submit()
    events = lambda: read_events(tmp_path / f"events-{job}.jsonl")  # noqa: E731 (both runs append to it)
    said = lambda: f"{outputs(tmp_path, job)}\n{cluster.log('slurmctld')}"  # noqa: E731
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 5 for e in events()) or not cluster.jobs(),
             120, "step 5")
    assert cluster.jobs() == [job], said()
    cluster.kill_node("n1")  # the batch host, and node rank 0: the controller
    try:
        wait_for(lambda: len([e for e in events() if e["event"] == "job_started"]) == 2 or not cluster.jobs(), 240,
                 "the job requeued and started again")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{said()}") from None
    first_run, second_run = [e for e in events() if e["event"] == "job_started"]
    assert first_run.get("step", 0) == 0 and second_run.get("step", 0) > 0, said()  # it went on from the save
    try:
        wait_for(lambda: not cluster.jobs(), 240, "the requeued job to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{said()}") from None
    (finished,) = [e for e in events() if e["event"] == "job_finished"]
    assert finished["exit_code"] == 0, said()
    assert "requeued it (scontrol requeue" in said()
    assert_ends_like_an_unbroken_run(tmp_path, job, unbroken)


@pytest.mark.timeout(300)
def test_when_the_controllers_dprun_alone_dies_the_nodes_left_save_and_leave_the_job_to_its_script(cluster, tmp_path):
    """kill -9 of the first node's dprun alone: its node lives, and the batch script with it. Every agent saves
    what it holds and exits 3; the nodes left find that Slurm still runs a command on the batch host, so they
    leave the job to its script at once, neither cancelling nor requeueing it, instead of waiting twice
    SlurmdTimeout + 2 minutes (130 s here) for Slurm to take a dead node out. The script's srun fails, and
    the job ends with the state saved."""
    submit = sbatch_template(cluster, tmp_path)
    job = submit()
    events = lambda: read_events(tmp_path / f"events-{job}.jsonl")  # noqa: E731
    said = lambda: f"{outputs(tmp_path, job)}\n{cluster.log('slurmctld')}"  # noqa: E731
    progress = lambda: max([e["step"] for e in events() if e["event"] == "progress"], default=0)  # noqa: E731
    wait_for(lambda: progress() >= 5 or not cluster.jobs(), 120, "step 5")
    assert cluster.jobs() == [job], said()
    (controller,) = [p for p in cluster.node_processes("n1") if _is_dprun(p) and p.environ()["SLURM_NODEID"] == "0"]
    reached = progress()
    controller.kill()
    killed = time.monotonic()
    try:
        wait_for(lambda: not cluster.jobs(), 100, "the job to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{said()}") from None
    assert time.monotonic() - killed < 60, said()  # the heartbeat timeout (5 s), the saves and one probe
    assert "the job cannot go on without its controller" in said()
    assert "requeued it" not in said() and "cancelled it" not in said()
    assert len([e for e in events() if e["event"] == "job_started"]) == 1, said()
    assert newest_saved(tmp_path / "deadpool-saved", 2)[1] >= reached, said()
