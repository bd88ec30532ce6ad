"""Inside a Slurm allocation (`srun dprun ...`): the rendezvous settings that Slurm's environment implies.

The first node of the step hosts the controller; SLURM_NODEID is the node rank; nodes past --nnodes are
spares. Pure functions over the environment, so they are tested without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE_PORT = 10000  # the controller's port: BASE_PORT + job id mod 20000, the same on every node of the job;
# 10000-29999 stays below Linux's ephemeral ports (32768-60999), which outgoing connections take at random


@dataclass(frozen=True)
class SlurmJob:
    rdzv_endpoint: str
    node_rank: int
    slurm_id: str  # SLURM_JOB_ID, for scontrol and scancel
    step_nodes: tuple[str, ...]  # by node rank: the first hosts the controller
    restarts: int = 0  # SLURM_RESTART_COUNT: how often Slurm requeued the job before this run

    @property
    def nodes(self) -> int:
        return len(self.step_nodes)

    @property
    def job_id(self) -> str:
        """The rendezvous id."""
        return f"slurm-{self.slurm_id}"


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, e.g. "n[1-3,7],gpu01" -> ["n1", "n2", "n3", "n7", "gpu01"]."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            for n in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


def from_environment(env: dict[str, str]) -> SlurmJob | None:
    """The job's rendezvous inside an `srun` step, or None outside one: a batch script or an `salloc` shell
    has SLURM_NODEID too, but runs on one node only, so dprun stays standalone there (see outside_step).
    ValueError for a step that runs more than one dprun on a node."""
    nodelist = env.get("SLURM_STEP_NODELIST")
    if not (env.get("SLURM_JOB_ID") and env.get("SLURM_NODEID") and nodelist):
        return None
    hosts = expand_hostlist(nodelist)
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and int(tasks) != len(hosts):
        raise ValueError(f"the Slurm step runs {tasks} tasks on {len(hosts)} node(s), but dprun runs once per node: "
                         f"srun --ntasks-per-node=1 dprun ... (its workers come from --nproc-per-node)")
    port = BASE_PORT + int(env["SLURM_JOB_ID"]) % 20000
    return SlurmJob(rdzv_endpoint=f"{hosts[0]}:{port}", node_rank=int(env["SLURM_NODEID"]),
                    slurm_id=env["SLURM_JOB_ID"], step_nodes=tuple(hosts),
                    restarts=int(env.get("SLURM_RESTART_COUNT") or 0))


def outside_step(env: dict[str, str]) -> str | None:
    """A notice for dprun started in a Slurm job of several nodes but not by `srun` (its batch script, an
    `salloc` shell): it runs on this node only."""
    nodes = env.get("SLURM_JOB_NUM_NODES", "")
    if env.get("SLURM_STEP_NODELIST") or not env.get("SLURM_JOB_ID") or not nodes.isdigit() or int(nodes) < 2:
        return None
    return (f"dprun: Slurm job {env['SLURM_JOB_ID']} has {nodes} nodes but this dprun was not started by srun: it "
            f"runs on this node only; use `srun --ntasks-per-node=1 dprun ...` for all of them")


def controller_lost_notice(job_id: str) -> str:
    """What a node's dprun says under Slurm once its agent saved what it held and exited for the controller's
    loss: measured on Slurm 22.05, a job with --no-kill whose first node (the controller's, and the batch
    script's) died stays RUNNING on the nodes left, idle, until its time limit."""
    return (f"dprun: the job cannot go on without its controller; if Slurm keeps job {job_id} allocated (with "
            f"--no-kill it does when the batch script's node died), `scancel {job_id}`, then submit again: "
            f"--resume-from the --save-dir goes on from the newest step every rank saved")
