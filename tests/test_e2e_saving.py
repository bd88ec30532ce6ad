"""A job's state outlives the job, in real dprun jobs: one that stops (out of spares, or told to by SIGTERM)
writes its newest complete step with --save-dir (as do the nodes that outlive the controller's, and the agents of a
dprun killed by SIGKILL), and a job started
with --resume-from that folder goes on from it to the very parameters of a run that never stopped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import gone
from dpcommon.save_manifest import complete_steps
from dprun.slurm.rendezvous import controller_lost_notice
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, read_events, the_save, wait_for
from helpers.multi_node import multi_node_job

pytestmark = pytest.mark.slow
STEPS = 30


@pytest.fixture
def sha(unbroken) -> str:
    """The parameters of the run that never stopped (conftest's session-wide run: test_e2e_faults's too)."""
    return unbroken(2, STEPS).summary["params_sha256"]


def _resumed(procs, tmp_path, folder: str, sha: str, *options: str, name: str = "resume"):
    """`dprun --nnodes 2 --resume-from FOLDER` (OPTIONS, or no spare), which must go on from the saved step and end
    with the parameters of the run that never stopped."""
    options = options or ("--spares", "0")
    run = dprun(procs, tmp_path, name, "--nnodes", "2", *options, "--resume-from", folder, steps=STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
    (started,) = run.named("job_started")
    first = min(e["step"] for e in run.named("progress"))
    assert first > started["step"] > 0, "it went on from the saved step, not from the start"
    assert run.summary["final_step"] == STEPS
    assert run.summary["params_sha256"] == sha, "the resumed run diverged from the one that never stopped"
    return run


def test_a_job_out_of_spares_saves_its_state_and_a_resumed_job_ends_where_an_unbroken_one_does(procs, tmp_path, sha):
    """The resumed job loses a node as it starts, and still ends so: the one resumed job shows both."""
    saved = tmp_path / "saved"
    run = dprun(procs, tmp_path, "stop", "--nnodes", "2", "--spares", "0", "--save-dir", saved,
                "--inject", "kill-node:1@step=12", steps=STEPS)
    assert run.returncode == 1, run.stderr[-3000:]
    (saving,) = run.named("saving_state")
    (finished,) = run.named("job_finished")
    assert "no spare left" in finished["message"] and f"is saved in {saving['folder']}" in finished["message"]
    assert [s.step for s in complete_steps(saved, 2)[0]] == [saving["step"]], "one step, every rank's file"
    fewer = saving["step"] - 2  # a typo in --steps, or the save of a longer run: nothing to train, and it says so
    short = dprun(procs, tmp_path, "short", "--nnodes", "2", "--spares", "0", "--resume-from", saving["folder"],
                  steps=fewer)
    assert short.returncode == 0, short.stderr[-3000:]
    assert {e["step"] for e in short.named("progress")} <= {saving["step"]}, "no step trained"
    # the resumed job, whose node 1 is lost as training starts, before a snapshot of its own could reach node 0:
    # node 0 read its file too (as its replica holder), and the spare is restored from that copy; before, the job
    # ended "state lost"
    lost = _resumed(procs, tmp_path, saving["folder"], sha, "--spares", "1", "--inject", "kill-node:1@t=0",
                    name="lost")
    (recovered,) = lost.named("recovery_complete")
    assert recovered["restore_step"] >= saving["step"] and lost.summary["params_sha256"] == sha
    assert f"goes on from step {saving['step']}, past the {fewer} steps asked for" in short.stderr, short.stderr


def _one_node_signalled_at(procs, tmp_path, save_dir: Path, sig: int, step: int) -> tuple[int, str, str, list]:
    """A long 1-node job with --save-dir, sent `sig` once past `step`: (its exit code, stdout, stderr, events)."""
    events = tmp_path / "sig.events.jsonl"
    proc = procs.dprun("--nnodes", "1", "--no-tui", "--save-dir", save_dir, "--events-file", events,
                       TRAIN, "--steps", "400", *TRAIN_ARGS, "--step-sleep", "0.05",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= step for e in read_events(events)), 90,
             f"step {step}")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err, read_events(events)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT], ids=["SIGHUP", "SIGQUIT"])
def test_a_closed_session_s_sighup_or_a_sigquit_stops_the_job_in_order_as_sigterm_does(procs, tmp_path, sig):
    """torchrun's four stop signals: SIGHUP (the ssh session or terminal closed) and SIGQUIT too save the state
    and end with 128 + N and the job's message. Before, dprun died of them at once: no message, no
    job_finished, and its agents left alone to take the controller for lost."""
    code, _, err, events = _one_node_signalled_at(procs, tmp_path, tmp_path / "saved", sig, step=5)
    assert code == 128 + sig, err[-3000:]
    assert f"dprun received {sig.name}; stopping every node" in err, err[-3000:]
    assert the_save(events, err[-3000:])["step"] >= 5


def test_sigterm_with_a_full_disk_ends_at_once_saying_so(procs, tmp_path, full_disk):
    """Before, the save was tried again for every newer step the workers made after the SIGTERM (each refused by
    the disk but taken for 'trained past'): thousands of lines a second, then a wait for the files' deadline."""
    code, out, err, events = _one_node_signalled_at(procs, tmp_path, full_disk / "saved", signal.SIGTERM, step=8)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert len([e for e in events if e["event"] == "saving_state"]) == 1, out[-3000:]
    assert re.search(r"saving the state of step \d+ in \S+ failed: node0: cannot write rank 0's file: \[Errno 28\] "
                     "No space left on device", err), err[-3000:]
    assert len(out) < 20_000 and "Traceback" not in err


def test_a_copy_found_damaged_is_saved_from_the_rank_s_own_worker_instead(procs, tmp_path, sha):
    """Node 1's store holds rank 0's copies; bit rot strikes them all at step 12, then SIGTERM: the save of step
    10 finds rank 0's copy damaged and has rank 0's worker write its own; the resumed run ends bitwise alike."""
    events = tmp_path / "rot.events.jsonl"
    proc = procs.dprun("--nnodes", "2", "--spares", "0", "--no-tui", "--save-dir", tmp_path / "saved",
                       "--snapshot-interval", "5", "--inject", "corrupt-replicas:1@step=12", "--events-file", events,
                       TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.3",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "fault_injected" for e in read_events(events)), 90, "the injected fault")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    (saving,) = [e for e in read_events(events) if e["event"] == "saving_state"]
    (retried,) = [e for e in read_events(events) if e["event"] == "save_retried"]
    assert saving["step"] == 10 and (retried["rank"], retried["local"]) == (0, True), retried
    assert "damaged" in retried["why"] or "corrupt" in retried["why"], retried
    _resumed(procs, tmp_path, saving["folder"], sha)


def test_sigterm_saves_the_state_before_the_job_stops_and_a_node_that_falls_silent_during_the_save_is_given_up(
        procs, tmp_path, sha):
    """As Slurm's time limit or scancel would: the job stops with 128 + 15, its state saved on the way. Node 1
    (whose store holds rank 0's copies) freezes whole just as the job gets SIGTERM: the save asks it for rank 0's
    file, hears nothing for the heartbeat timeout (5 s), gives it up and has rank 0's own worker write it instead;
    before, the save waited for the files' deadline (600 s), past Slurm's SIGKILL. The resumed run ends bitwise
    alike."""
    events = tmp_path / "silent.events.jsonl"
    proc = procs.dprun("--nnodes", "2", "--spares", "0", "--no-tui", "--save-dir", tmp_path / "saved",
                       "--events-file", events, TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    (started,) = [e for e in read_events(events) if e["event"] == "job_started"]
    (node1,) = [e for e in read_events(events) if e["event"] == "node_joined" and e["node"] == started["layout"][1]]
    os.killpg(node1["pid"], signal.SIGSTOP)  # its agent and worker (each node is a process group of its own)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "dprun: job stopped: dprun received SIGTERM" in err, err[-3000:]
    (saving,) = [e for e in read_events(events) if e["event"] == "saving_state"]
    assert the_save(read_events(events), err[-3000:]) == saving
    # "progress" names the furthest rank's step; the save is the newest step every rank's snapshot holds
    assert 7 <= saving["step"] < STEPS
    (retried,) = [e for e in read_events(events) if e["event"] == "save_retried"]
    assert (retried["rank"], retried["local"]) == (0, True), retried
    assert f"{node1['node']} failed: no heartbeat for" in retried["why"], retried
    (finished,) = [e for e in read_events(events) if e["event"] == "job_finished"]
    assert f"is saved in {saving['folder']}" in finished["message"], finished
    _resumed(procs, tmp_path, saving["folder"], sha)


def test_resume_from_a_folder_that_is_not_a_saved_step_is_refused_in_one_line(procs, tmp_path):
    proc = procs.dprun("--nnodes", "2", "--resume-from", tmp_path / "nowhere", TRAIN, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [f"dprun: --resume-from: {tmp_path / 'nowhere'} is not a folder of saved "
                                        "steps (give a --save-dir, or one of its step-S folders)"]


def test_save_dir_for_a_script_without_dpstate_is_refused_in_one_line(procs, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('a plain script')\n")
    proc = procs.dprun("--nnodes", "2", "--save-dir", tmp_path / "saved", script, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "--save-dir needs a script that uses dpstate" in err


def test_nodes_that_lose_the_controller_write_their_copies_and_the_job_resumes_from_them(procs, tmp_path, sha):
    """The first node (the controller's) dies with its agent and worker: node 1's agent, silent controller
    past the heartbeat timeout, writes the copy of rank 0 it holds and has its worker write rank 1's own, then
    exits 3; `--resume-from` the --save-dir picks the newest step every rank has and ends bitwise alike. In a
    Slurm job but not an srun step its last line says to scancel the job (in a step, dprun.slurm.orphaned_job ends it:
    tests/test_slurm_cluster.py)."""
    saved = tmp_path / "saved"
    script = [TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1"]
    job = multi_node_job(procs, tmp_path, "--nnodes", "2", "--spares", "0", "--heartbeat-interval", "0.25",
                         "--heartbeat-timeout", "2", script=script, secret="lost-controller-secret",
                         events="lost.events.jsonl", head_options=("--save-dir", saved), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    head, events = job.head, job.events
    other = job.start("--node-rank", "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env={"SLURM_JOB_ID": "77"})  # a Slurm job, no srun step
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    procs.adopt(psutil.Process(head.pid).children(recursive=True))
    head.kill()  # the controller's process (its agent saves too, and may write a file before node 1 does)
    _, err = other.communicate(timeout=90)
    assert other.returncode == 3, err[-3000:]
    assert "controller lost: nothing from" in err and "rank 1 (own) step" in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == controller_lost_notice("77"), "the last line says what to do on Slurm"
    _assert_a_step_complete(saved)
    (saved / f"step-{STEPS + 1}").mkdir()  # as a save that failed before a file was written leaves it
    run = _resumed(procs, tmp_path, str(saved), sha)
    lines = run.stderr.splitlines()
    (said,) = [line for line in lines if line.startswith("dprun: resuming from")]
    assert re.fullmatch(rf"dprun: resuming from {re.escape(str(saved))}/step-\d+ \(the newest complete step\)", said), said
    assert any(line.startswith(f"dprun: passing over step-{STEPS + 1}: ") for line in lines), run.stderr[-3000:]


def test_a_standalone_dprun_killed_by_sigkill_leaves_its_agents_to_save_the_state(procs, tmp_path, sha):
    """kill -9 of a standalone dprun (the controller, the store and every agent's parent): each agent gets its
    parent-death signal, writes the copies it holds and has its workers write theirs to --save-dir at once
    (no heartbeat timeout waited for), and exits 3; the spare, holding nothing, exits too. The last one out
    removes the run folder that dprun could not."""
    saved, events = tmp_path / "saved", tmp_path / "killed.events.jsonl"
    run = procs.dprun("--nnodes", "2", "--spares", "1", "--no-tui", "--save-dir", saved, "--events-file", events,
                      TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    agents = psutil.Process(run.pid).children()
    procs.adopt(agents)
    assert len(agents) == 3, agents
    (run_dir,) = {Path(a.cmdline()[a.cmdline().index("--run-dir") + 1]).parent for a in agents}  # dprun-XXXX
    run.kill()
    _, err = run.communicate(timeout=90)  # the agents write to its stderr: it ends when they do
    assert not psutil.wait_procs(agents, timeout=10)[1], "an agent outlived its save"
    left = sorted(run_dir.rglob("*")) if run_dir.exists() else []
    assert not run_dir.exists(), f"the last agent out removes the run folder (left: {left})\n{err[-3000:]}"
    lost = [line for line in err.splitlines() if "controller lost: the dprun that ran it" in line]
    assert sorted(line.split("]")[0] for line in lost) == ["[dpagent node0", "[dpagent node1", "[dpagent node2"], err
    assert "rank 0 (own) step" in err and "rank 1 (own) step" in err, err[-3000:]
    assert f"[dpagent node2] controller lost: this node held no snapshot to write to {saved}" in err, err[-3000:]
    # the agents killed their workers after the save: said as such, not with a worker's last line before it
    ends = re.findall(r"\[dpagent node\d\] worker 0 \(pid \d+\) exited: killed by SIGKILL(.*)", err)
    assert ends and set(ends) == {" (by its agent, as it stops)"}, err[-3000:]
    _assert_a_step_complete(saved)
    _resumed(procs, tmp_path, str(saved), sha)


def test_a_dprun_stopped_past_the_heartbeat_timeout_ends_saying_so_and_its_nodes_saved(procs, tmp_path, sha):
    """SIGSTOP to a standalone dprun (as Ctrl-Z would) for longer than --heartbeat-timeout: its agents take the
    controller for lost, write what they hold to --save-dir and exit 3. Continued, dprun ends with exit 1
    saying that it was the one that did not run (not "no spare left" alone), and where the state is; the
    resumed job ends where one that never stopped does."""
    saved, events = tmp_path / "saved", tmp_path / "stopped.events.jsonl"
    run = procs.dprun("--nnodes", "2", "--spares", "1", "--no-tui", "--heartbeat-timeout", "2", "--save-dir", saved,
                      "--events-file", events, TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1",
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    agents = psutil.Process(run.pid).children()
    procs.adopt(agents)
    run.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:  # each agent ends (a zombie: its parent is stopped) once it has saved; dprun stays stopped past the timeout
        wait_for(lambda: all(gone(a.pid) for a in agents) and time.monotonic() - stopped > 2.5, 60,
                 "the agents to give the controller up")
    finally:
        run.send_signal(signal.SIGCONT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 1, err[-3000:]
    assert "dprun: job failed: dprun itself did not run for" in err and "to take the controller for lost" in err, \
        err[-3000:]
    assert f"go on with --resume-from {saved}" in err.splitlines()[-1], err[-3000:]
    _assert_a_step_complete(saved)
    _resumed(procs, tmp_path, str(saved), sha)


def _assert_a_step_complete(saved) -> None:
    """Some step folder holds every rank's file at the size its manifest parts name (a node's own newer step may
    lack the other's: the resume picks the newest complete one)."""
    usable, _ = complete_steps(saved, 2)
    assert usable, f"no step has every rank's file: {[(f.name, sorted(g.name for g in f.iterdir())) for f in saved.iterdir()]}"


def test_a_member_signalled_by_its_dprun_then_by_slurm_counts_one_stop_and_serves_the_save(procs, tmp_path):
    """Slurm signals every process of a step in no set order: a member's dprun may pass its SIGTERM on to its
    agent before the agent's own comes. The two are one request, not the second that stops a node at once: the
    member trains on while the controller has not stopped the job, then serves its save."""
    saved = tmp_path / "saved"
    script = [TRAIN, "--steps", 3000, *TRAIN_ARGS, "--step-sleep", "0.1"]
    job = multi_node_job(procs, tmp_path, "--nnodes", "2", "--spares", "0",
                         "--heartbeat-timeout", "10",  # (a member waits this long for the controller's stop)
                         script=script, secret="relayed-stop-secret", events="relay.events.jsonl",
                         head_options=("--save-dir", saved))
    head, events = job.head, job.events
    with open(tmp_path / "member.err", "w") as err_file:
        member = job.start("--node-rank", "1", stderr=err_file)
    member_err = (tmp_path / "member.err").read_text

    def progress() -> int:
        return max([e["step"] for e in read_events(events) if e["event"] == "progress"], default=0)

    wait_for(lambda: progress() >= 8, 90, "step 8")
    (agent,) = psutil.Process(member.pid).children()
    procs.adopt([agent, *agent.children(recursive=True)])

    member.send_signal(signal.SIGTERM)  # its dprun passes it on first ...
    wait_for(lambda: "received SIGTERM: waiting up to" in member_err(), 10, "the member's agent to take it")
    agent.send_signal(signal.SIGTERM)  # ... then Slurm's own to the agent
    signalled_at = progress()
    wait_for(lambda: progress() >= signalled_at + 5, 8, f"training on past step {signalled_at}\n{member_err()}")

    everyone = [psutil.Process(head.pid)]
    everyone += everyone[0].children(recursive=True)
    procs.adopt(everyone)
    for p in everyone:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, err = head.communicate(timeout=90)
    assert member.wait(timeout=90) == 128 + signal.SIGTERM, member_err()[-3000:]
    saving = the_save(read_events(events), err[-3000:] + member_err()[-3000:])
    said = member_err()
    assert f"saved snapshots of step {saving['step']} in {saving['folder']}" in said, said[-3000:]
    assert "] received SIGTERM; " not in said, f"the member's agent stopped at once\n{said[-3000:]}"


def test_sigterm_to_every_process_of_a_multinode_job_saves_its_state(procs, tmp_path, sha):
    """As Slurm ends a step (its time limit, scancel): every process of every node, dprun, agents and workers,
    gets SIGTERM at once. The job still saves its newest complete step before it stops, and resumes from it."""
    saved = tmp_path / "saved"
    script = [TRAIN, "--steps", STEPS, *TRAIN_ARGS, "--step-sleep", "0.1"]
    job = multi_node_job(procs, tmp_path, "--nnodes", "2", "--spares", "0", script=script,
                         secret="sigterm-everyone-secret", events="slurm.events.jsonl",
                         head_options=("--save-dir", saved))
    head, events = job.head, job.events
    other = job.start("--node-rank", "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= 8 for e in read_events(events)), 90, "step 8")
    everyone = [psutil.Process(p.pid) for p in (head, other)]
    everyone += [child for p in everyone for child in p.children(recursive=True)]
    procs.adopt(everyone)
    for p in everyone:  # (a process may already be stopping for the controller's Stop: the save can be that quick)
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, err = head.communicate(timeout=90)
    _, other_err = other.communicate(timeout=90)
    assert head.returncode == 128 + signal.SIGTERM, err[-3000:]
    saving = the_save(read_events(events), err[-3000:] + other_err[-3000:])
    # (progress names the furthest rank's step; the save, the newest step every rank's snapshot holds: one less
    # at times)
    assert 7 <= saving["step"] < STEPS
    for said in (err, other_err):  # each agent served the save (whether its own SIGTERM came before it or after)
        assert f"saved snapshots of step {saving['step']} in {saving['folder']}" in said, said[-3000:]
        assert "the controller did not stop the job" not in said, said[-3000:]
    # each worker waited for its agent: none died of its SIGTERM
    assert not [e for e in read_events(events) if e["event"] == "worker_exited" and e["exitcode"] < 0]
    _resumed(procs, tmp_path, saving["folder"], sha)
