"""A real Slurm cluster on this host, for tests: munged, slurmctld and one slurmd per node, all on loopback
with their files in one temp folder (as ../shared/DESIGN.md describes); stop() kills it and its jobs' processes.

Needs root (slurmd starts the jobs' tasks as their user) and Debian's slurmctld, slurmd, slurm-client and munge.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil

from conftest import free_port
from helpers.e2e import wait_for

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel")


def unavailable() -> str | None:
    """Why a cluster cannot run here, or None."""
    missing = [p for p in PROGRAMS if not shutil.which(p)]
    if missing:
        return f"no {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge (as .ci/run does)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


class SlurmCluster:
    """Nodes n1..nN of partition `debug`, each a slurmd on 127.0.0.1 with a port of its own. Start with start(),
    run commands with env(); kill_node() is a node failure (its slurmd, its step daemons and their tasks)."""

    def __init__(self, procs, nodes: int = 3):
        self.procs = procs  # conftest.Processes: starts the daemons, kills what is left at teardown
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.root = Path(tempfile.mkdtemp(prefix="dpslurm-"))  # short: unix socket paths end up under it
        self.conf = self.root / "slurm.conf"
        self.slurmd: dict[str, subprocess.Popen] = {}

    def env(self) -> dict[str, str]:
        """For Slurm's commands, and through them the jobs' tasks: this cluster, and the test's scratch folder
        for their temporary files and dprun's status records (as conftest.Processes gives its commands)."""
        return {"SLURM_CONF": str(self.conf), "TMPDIR": str(self.procs.scratch),
                "DPRUN_STATE_DIR": str(self.procs.scratch / "dprun-state")}

    def start(self, timeout: float = 60) -> None:
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        self._daemon("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                                f"--socket={self.root}/munge.sock", f"--pid-file={self.root}/munged.pid",
                                f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munged.seed"])
        self._wait(lambda: (self.root / "munge.sock").exists(), timeout, "munged's socket")
        self._write_conf()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            self.start_node(node)
        self._wait(lambda: all(self.state(n) == "idle" for n in self.nodes), timeout, "every node idle")

    def start_node(self, node: str) -> None:
        self.slurmd[node] = self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node])

    def state(self, node: str) -> str:
        """sinfo's short state of a node: idle, alloc, mix, down*, ..."""
        out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], env=dict(os.environ, **self.env()),
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=dict(os.environ, **self.env()), capture_output=True,
                             text=True, timeout=30)
        return out.stdout.split()

    def scancel(self, job: str) -> None:
        subprocess.run(["scancel", job], env=dict(os.environ, **self.env()), check=True, timeout=30)

    def node_processes(self, node: str) -> list[psutil.Process]:
        """The node's slurmd, its step daemons (slurmstepd: found by their socket in the node's spool folder)
        and every process they started."""
        return [psutil.Process(self.slurmd[node].pid), *self._step_daemons(f"{self.root}/spool-{node}/")]

    def kill_node(self, node: str) -> list[psutil.Process]:
        """A node failure: SIGKILL to its slurmd, its step daemons and all their tasks, at once."""
        victims = self.node_processes(node)
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return victims

    def stop(self) -> None:
        """Kill every process of the cluster and of its jobs (the step daemons are not the daemons' children:
        they are found by their sockets, and the tasks by SLURM_CONF in their environment)."""
        ours = self._step_daemons(f"{self.root}/")
        for p in psutil.process_iter():
            try:
                if p.environ().get("SLURM_CONF") == str(self.conf):
                    ours += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        for p in ours:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(ours, timeout=10)
        self.procs.kill_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self, name: str) -> str:
        """The last lines a daemon wrote (slurmctld, slurmd-n1, munged, ...), for assertion messages."""
        path = self.root / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else f"(no {path})"

    @staticmethod
    def _step_daemons(folder: str) -> list[psutil.Process]:
        """The slurmstepd processes with a socket under `folder` (a node's spool folder, or the cluster's), and
        every process they started."""
        found = []
        for p in psutil.process_iter(["name"]):
            try:
                if p.info["name"].startswith("slurmstepd") and any(
                        str(c.laddr).startswith(folder) for c in p.net_connections("unix")):
                    found += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        return found

    def _daemon(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.root / f"{name}.out", "ab") as out:
            return self.procs.popen(args, env=self.env(), cwd=self.root, stdout=out, stderr=subprocess.STDOUT)

    def _wait(self, condition, timeout: float, what: str) -> None:
        try:
            wait_for(condition, timeout, f"{what} (Slurm test cluster)", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log('slurmctld')}") from None

    def _write_conf(self) -> None:
        host, root = socket.gethostname(), self.root
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 "
                          f"State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=dptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
ReturnToService=2
# Slurm's own timeouts, which the tests wait on, short: a killed node is set DOWN and taken out of its job
# ~SlurmdTimeout + 2 x MessageTimeout after it dies (measured ~14 s; 25 s with MessageTimeout's default 10); a
# requeued job may start again cred_expire (AuthInfo, above) after the requeue (its default 120 s: the
# credentials the nodes revoked for its last run have expired by then), and the main scheduler looks at pending
# jobs every sched_interval seconds (default 60), which an eligible requeued job waited for too.
SlurmdTimeout=5
MessageTimeout=5
SchedulerParameters=sched_interval=2
KillWait=30
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        (root / "state").mkdir()
