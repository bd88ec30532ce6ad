"""A Slurm job that lost its controller with the batch script's node: once Slurm has taken that node out of the
job and the nodes left have saved, cancel or requeue the job instead of leaving it allocated, idle, until its
time limit. Pure decisions (JobRecord, next_move) and a thin loop over scontrol and scancel (settle).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from .rendezvous import controller_lost_notice, expand_hostlist

OnControllerLost = Literal["cancel", "requeue"]  # --on-controller-lost: what becomes of the Slurm job

POLL_S = 2.0
SAVE_PATIENCE_S = 360.0  # an agent's save after the controller's loss ends within its save timeout (300 s)
LEADER_PATIENCE_S = 60.0  # how long the other nodes give the first node left to act
SLURMD_TIMEOUT_S = 300.0  # Slurm's default, where `scontrol show config` does not say
PROBE_EVERY_S = 15.0  # how often a node left asks Slurm to run a command on the batch host it still lists


@dataclass(frozen=True)
class JobRecord:
    """What `scontrol show job --oneliner` says of a job, the parts that matter here."""

    state: str  # JobState: RUNNING, COMPLETING, PENDING, ...
    nodes: tuple[str, ...]  # NodeList, expanded: Slurm removes a dead node from a --no-kill job
    batch_host: str  # where the batch script runs (or ran)
    restarts: int  # how often the job was requeued: SLURM_RESTART_COUNT of the run that is on now

    @classmethod
    def parse(cls, text: str) -> JobRecord:
        fields = dict(re.findall(r"(?:^|\s)(JobState|NodeList|BatchHost|Restarts)=(\S*)", text))
        if "JobState" not in fields:
            raise ValueError(f"not a job record: {text[:200]!r}")
        nodes = fields.get("NodeList", "")
        return cls(state=fields["JobState"], nodes=tuple(expand_hostlist(nodes)) if nodes not in ("", "(null)") else (),
                   batch_host=fields.get("BatchHost", ""), restarts=int(fields.get("Restarts") or 0))


@dataclass(frozen=True)
class Orphan:
    """This node of a Slurm step whose controller was lost: the job, the step's nodes and where the nodes left
    mark that they have saved (a folder of the --save-dir, which every node sees)."""

    job_id: str
    restarts: int  # this run's SLURM_RESTART_COUNT: a requeued job's next run is not this one's to act on
    step_nodes: tuple[str, ...]  # the step's nodes by node rank: the first hosted the controller
    node: str  # this node's Slurm name
    save_dir: str = ""

    @property
    def marks(self) -> Path | None:
        return Path(self.save_dir) / f".controller-lost-{self.job_id}.{self.restarts}" if self.save_dir else None

    def mark_saved(self) -> None:
        if self.marks is not None:
            self.marks.mkdir(parents=True, exist_ok=True)
            (self.marks / self.node).touch()

    def saved_nodes(self) -> set[str]:
        """The nodes that have saved; with no --save-dir there is nothing to save, so all of them."""
        if self.marks is None:
            return set(self.step_nodes)
        return {p.name for p in self.marks.iterdir()} if self.marks.is_dir() else set()

    def unmark(self) -> None:
        """Take this node's mark back, and the folder once it is empty (the last node out removes it)."""
        if self.marks is not None:
            (self.marks / self.node).unlink(missing_ok=True)
            try:
                self.marks.rmdir()
            except OSError:
                pass


def next_move(job: JobRecord, orphan: Orphan, saved: set[str], waited: float, slurm_patience: float,
              save_patience: float = SAVE_PATIENCE_S, batch_host_answered: bool = False) -> str:
    """What a node that lost its controller does about its job, `waited` seconds after it saved:

    * "done": the run is not this node's to act on any more (it ended, or another node requeued or cancelled it);
    * "act": the batch script's node is out of the job (dead: nothing is left to end the job), every node of
      the step still in the job has saved (or had `save_patience` to), and this node is the first of them (the
      others act only if it has not for a minute more: one requeue, not one per node);
    * "leave": the batch script's node is still in the job and it answered a command (`batch_host_answered`),
      or `slurm_patience` passed, or it is not the node that hosted the controller: it is alive (the
      controller's dprun alone died), so its batch script goes on once the step ends, and the job is not ours
      to end;
    * "wait": ask again in a moment.
    """
    if job.state != "RUNNING" or job.restarts != orphan.restarts:
        return "done"
    if job.batch_host in job.nodes:
        alive = batch_host_answered or waited >= slurm_patience or job.batch_host != orphan.step_nodes[0]
        return "leave" if alive else "wait"
    left = [n for n in orphan.step_nodes if n in job.nodes]
    if set(left) - saved and waited < save_patience:
        return "wait"
    first = not left or left[0] == orphan.node
    return "act" if first or waited >= save_patience + LEADER_PATIENCE_S else "wait"


def run_slurm(args: list[str]) -> str:
    """A Slurm command's standard output; CalledProcessError / OSError / TimeoutExpired if it fails."""
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=30).stdout


def read_job(job_id: str, run: Callable[[list[str]], str] = run_slurm) -> JobRecord:
    """The job's record as scontrol says it; OSError / SubprocessError / ValueError where that fails."""
    return JobRecord.parse(run(["scontrol", "show", "job", "--oneliner", job_id]))


def batch_host_answers(job: JobRecord, job_id: str, run: Callable[[list[str]], str] = run_slurm) -> bool:
    """Whether Slurm runs `true` on the job's batch host (a step beside this one, `srun --overlap`): proof that
    the node lives, where Slurm's own view of a dead node comes ~2 x SlurmdTimeout late. A dead node's launch
    fails or hangs (run's timeout); either way: False."""
    try:
        run(["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={job.batch_host}", "--nodes=1", "--ntasks=1",
             "--quiet", "true"])
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def slurm_patience(run: Callable[[list[str]], str] = run_slurm) -> float:
    """How long Slurm may take to take a dead node out of a job: a node is down SlurmdTimeout after its last
    answer, and Slurm asks nodes in rounds (measured: ~25 s with SlurmdTimeout=5)."""
    try:
        match = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", run(["scontrol", "show", "config"]), re.MULTILINE)
    except (OSError, subprocess.SubprocessError):
        match = None
    return 2 * (float(match.group(1)) if match else SLURMD_TIMEOUT_S) + 120.0


def settle(orphan: Orphan, mode: OnControllerLost, halted: threading.Event, run: Callable[[list[str]], str] = run_slurm,
           clock=time.monotonic, patience: float | None = None) -> str:
    """Mark this node saved, wait until next_move says what to do with the job, and do it (`mode`: cancel or
    requeue). Returns the line to print ("" when another node or Slurm ended the run, or `halted` was set: a
    signal)."""
    orphan.mark_saved()
    try:
        patience = slurm_patience(run) if patience is None else patience
        start = clock()
        probed = -PROBE_EVERY_S
        while not halted.is_set():
            try:
                job = read_job(orphan.job_id, run)
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                return (f"dprun: cannot ask Slurm about job {orphan.job_id} ({_why(exc)}). "
                        f"{controller_lost_notice(orphan.job_id)}")
            waited, answered = clock() - start, False
            kept = job.batch_host in job.nodes and job.batch_host == orphan.step_nodes[0]  # dead, or alive?
            if kept and waited - probed >= PROBE_EVERY_S:
                probed, answered = waited, batch_host_answers(job, orphan.job_id, run)
            move = next_move(job, orphan, orphan.saved_nodes(), waited, patience, batch_host_answered=answered)
            if move == "done":
                return ""
            if move == "leave":
                return controller_lost_notice(orphan.job_id)
            if move == "act":
                return _end(job, orphan, mode, run)
            halted.wait(POLL_S)
        return ""
    finally:
        orphan.unmark()


def _end(job: JobRecord, orphan: Orphan, mode: str, run: Callable[[list[str]], str]) -> str:
    job_id = orphan.job_id
    lost = (f"dprun: job {job_id} lost its controller with node {job.batch_host}, where its batch script ran, "
            f"and Slurm took that node out of the job: ")
    resume = f"--resume-from {orphan.save_dir}" if orphan.save_dir else "--resume-from the --save-dir"
    refused = ""
    if mode == "requeue":
        try:
            run(["scontrol", "requeue", job_id])
            return lost + f"requeued it (scontrol requeue {job_id}); Slurm runs its batch script again, which goes " \
                          f"on from the newest step every rank saved with {resume}"
        except (OSError, subprocess.SubprocessError) as exc:
            if _moved_on(orphan, run):  # another node requeued it first: not ours to cancel
                return ""
            refused = f"Slurm refused to requeue it ({_why(exc)}), so "
    try:
        run(["scancel", job_id])
    except (OSError, subprocess.SubprocessError) as exc:
        return lost + f"{refused}cancelling it failed too ({_why(exc)}): `scancel {job_id}` by hand"
    return lost + f"{refused}cancelled it (scancel {job_id}) so its nodes go back; submit again with {resume}"


def _moved_on(orphan: Orphan, run: Callable[[list[str]], str]) -> bool:
    """Whether the job is no longer this run (ended, requeued), as far as Slurm says."""
    try:
        job = read_job(orphan.job_id, run)
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return job.state != "RUNNING" or job.restarts != orphan.restarts


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        said = (exc.stderr or "").strip().splitlines()
        return said[-1] if said else f"exit {exc.returncode}"
    return str(exc) or type(exc).__name__
