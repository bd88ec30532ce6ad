"""The disk tier in real dprun jobs: background saves (--save-every) while training goes on; a job whose every
process is killed at once goes on from them; a damaged newest step is passed over for the one before; a
failure that takes a rank's every copy in memory is restored from disk; a full disk is said once. Each ends
with the parameters of the run that never failed."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys

import psutil
import pytest

from conftest import REPO, Processes
from dpcommon.save_manifest import complete_steps
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
STEPS = 30
NODES = ["--nnodes", "3", "--nproc-per-node", "1"]


@pytest.fixture(scope="module")
def reference(unbroken) -> str:
    """params_sha256 of the run that never failed and never saved (conftest's session-wide run of 3 nodes:
    test_e2e_faults's too)."""
    return unbroken(3, STEPS).summary["params_sha256"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reference):
    """A --save-dir that a whole run saved steps 10, 20 and 30 into, in the background; its run ended equal."""
    tmp = tmp_path_factory.mktemp("saved")
    procs = Processes()
    try:
        run = dprun(procs, tmp, "saves", *NODES, "--spares", "0", "--save-dir", tmp / "saved", "--save-every", "10",
                    "--save-keep", "3", steps=STEPS)
    finally:
        procs.kill_all()
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary["params_sha256"] == reference, "background saves changed the training"
    assert [e["step"] for e in run.named("state_saved")] == [10, 20, 30]
    usable, _ = complete_steps(tmp / "saved", 3)
    assert [s.step for s in usable] == [30, 20, 10]
    assert "the newest step safe on disk is step 30" in run.named("job_finished")[0]["message"]
    return tmp / "saved"


def _kill_everything(proc: subprocess.Popen) -> int:
    """SIGKILL to dprun and every process under it, one right after the other: the power cut of a whole job."""
    victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    return len(victims)


def test_every_process_killed_at_once_goes_on_from_the_background_saves(procs, tmp_path, reference):
    # (said in every assertion's message) 9+ steps before the end: progress events come at most once a second
    # (PROGRESS_EVERY_S), up to 5 of these 0.2 s steps apart, and the last one is the job's end
    kill_at = random.randint(13, STEPS - 9)
    events, folder = tmp_path / "killed.events.jsonl", tmp_path / "saved"
    proc = procs.dprun(*NODES, "--spares", "0", "--no-tui", "--save-dir", folder, "--save-every", "10",
                       "--events-file", events, TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.2",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    progress = lambda: max([e["step"] for e in read_events(events) if e["event"] == "progress"], default=0)  # noqa: E731
    wait_for(lambda: progress() >= kill_at or proc.poll() is not None, 120, f"step {kill_at}")
    assert proc.poll() is None, f"the job ended before step {kill_at}"
    assert _kill_everything(proc) >= 7, "dprun, 3 agents, 3 workers"
    proc.wait(timeout=10)
    saved_steps = [e["step"] for e in read_events(events) if e["event"] == "state_saved"]
    assert saved_steps and saved_steps[0] == 10, (kill_at, saved_steps)
    newest = complete_steps(folder, 3)[0][0].step
    run = dprun(procs, tmp_path, "resumed", *NODES, "--spares", "0", "--resume-from", folder, steps=STEPS)
    assert run.returncode == 0, (kill_at, run.stderr[-3000:])
    (started,) = run.named("job_started")
    # the newest complete step on disk: the one the events named last, or a newer one whose state_saved event
    # the kill beat to the events file (workers run ahead of the progress events dprun writes)
    assert started["step"] == newest >= max(saved_steps) >= 10, (kill_at, started, saved_steps, newest)
    assert run.summary["params_sha256"] == reference, f"killed at step {kill_at}: the resumed run diverged"


def _damage(step_folder, how: str) -> None:
    victim = step_folder / "rank-1.dpsnap"
    if how == "truncated":
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        data = bytearray(victim.read_bytes())
        data[-1000] ^= 0x10
        victim.write_bytes(bytes(data))
    else:
        for part in step_folder.glob("manifest.*.json"):
            part.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped", "no-manifest"])
def test_a_damaged_newest_step_is_found_by_verify_and_a_resume_goes_on_from_the_one_before(procs, tmp_path, saved,
                                                                                          reference, how):
    folder = tmp_path / "saved"
    shutil.copytree(saved, folder)
    _damage(folder / "step-30", how)
    verify = subprocess.run([sys.executable, "-m", "dprun", "ckpt", "verify", str(folder / "step-30")],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert verify.returncode != 0, verify.stdout + verify.stderr
    said = verify.stdout + verify.stderr
    assert ("manifest" in said) if how == "no-manifest" else ("rank-1.dpsnap" in said), said
    run = dprun(procs, tmp_path, "resumed", *NODES, "--spares", "0", "--resume-from", folder, steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    (started,) = run.named("job_started")
    assert started["step"] == 20 and started["resumed_from"].endswith("step-20"), started
    if how == "flipped":  # the manifest names it whole: the bytes read say otherwise
        (fallback,) = run.named("resume_fallback")
        assert "rank-1.dpsnap is corrupt" in fallback["why"] and fallback["next_step"] == 20, fallback
    else:  # found before the job starts
        assert "passing over step-30" in run.stderr, run.stderr[-3000:]
    assert run.summary["params_sha256"] == reference


def test_two_adjacent_nodes_killed_together_are_restored_from_disk(procs, tmp_path, reference):
    """--replicas 1: node 1's snapshots live on node 2 alone; both die at once. Every rank goes back to the
    newest step saved (within 5 steps) and the job completes, instead of ending 'state lost'."""
    run = dprun(procs, tmp_path, "pair", *NODES, "--spares", "2", "--replicas", "1", "--save-dir",
                tmp_path / "saved", "--save-every", "5", "--inject", "kill-node:1@step=12",
                "--inject", "kill-node:2@step=12", steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    (restoring,) = run.named("restoring_from_disk")
    assert restoring["ranks"] == [1] and restoring["step"] in (5, 10), restoring
    (done,) = run.named("recovery_complete")
    assert done["from_disk"].endswith(f"step-{restoring['step']}") and done["restore_step"] == restoring["step"]
    assert done["lost_steps"] == restoring["lost_steps"] > 0
    assert run.summary["params_sha256"] == reference


def test_background_saves_on_a_full_disk_are_said_once_and_training_finishes(procs, tmp_path, full_disk, unbroken):
    """Every background save fails with ENOSPC: the job says so once (not per step), trains on and ends
    bitwise as the failure-free run, saying that no step was saved whole."""
    reference = unbroken(2, STEPS).summary["params_sha256"]
    run = dprun(procs, tmp_path, "full", "--nnodes", "2", "--spares", "0", "--save-dir", full_disk / "saved",
                "--save-every", "5", steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = run.named("save_failed")
    assert len(failed) >= 3 and all("No space left on device" in e["why"] for e in failed), failed
    # (a save still being written when the next is due is said too, in words of its own)
    said = re.findall(r"the background save of step \d+ in \S+ failed \(training goes on\)", run.stdout)
    assert len(said) == 1, run.stdout[-3000:]
    assert "no step was saved whole on disk" in run.named("job_finished")[0]["message"]
    assert run.summary["params_sha256"] == reference
