"""Shared test fixtures: free ports, process-tree cleanup and leftover checks for multi-process tests. Shared
code that is not a fixture is in tests/helpers/ (imported as `helpers.<module>`); tests/data/ holds scripts that
tests run by path."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# The processes that tests start run on the CPU with Gloo, as on CI, also on a machine with GPUs: several ranks
# of one host would otherwise all take cuda:0, which NCCL refuses. This process keeps its own view: CUDA is
# initialised here first (the driver reads the variable once) and torch caches the device count after that.
# tests/test_cuda_gpu.py runs the CUDA path in-process, and gives the dprun it starts HOST_CUDA_DEVICES back.
import torch  # noqa: E402

if torch.cuda.is_available():
    torch.cuda.init()
HOST_CUDA_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Tests start their own jobs (and tests/helpers/slurm_cluster.py its own Slurm): under srun or sbatch, the processes
# they start must not take the allocation's SLURM_* variables for theirs.
for _name in [n for n in os.environ if n.startswith("SLURM_")]:
    del os.environ[_name]


@pytest.fixture
def replica(tmp_path):
    """A real replica store (dpagent's ReplicaServer behind fake agents) for a Replicator to send to."""
    from helpers.fake_agents import FakeAgents

    agents = FakeAgents(tmp_path, [])
    yield agents
    agents.close()


@pytest.fixture
def holder(tmp_path):
    """A replica holder whose node runs this process (its 'local worker'): fake agents whose replica store maps
    this process's shared snapshot buffers, as an agent maps its workers'."""
    from helpers.fake_agents import FakeAgents

    agents = FakeAgents(tmp_path, [], local_pids=lambda: [os.getpid()])
    yield agents
    agents.close()


@pytest.fixture
def peer_node(tmp_path):
    """The peer's own node's agent: it runs no worker of this process, so it takes no local snapshot in."""
    from helpers.fake_agents import FakeAgents

    agents = FakeAgents(tmp_path, [])
    yield agents
    agents.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_shmem(pid: int | str = "self") -> int:
    """Bytes of shared memory (memfds, /dev/shm) that process `pid` has faulted in (RssShmem)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("RssShmem:")).split()[1]) * 1024


class Processes:
    """Starts commands in their own session and kills every descendant at teardown.

    Each gets TMPDIR (and dprun's status records) in a folder of its own, removed by kill_all(): a dprun or
    agent killed by SIGKILL cannot remove its run folder itself."""

    def __init__(self):
        self.started: list[subprocess.Popen] = []
        self.adopted: list[psutil.Process] = []  # their descendants that may outlive them (see adopt)
        self.scratch = Path(tempfile.mkdtemp(prefix="dptest-"))

    def popen(self, args, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        self.scratch.mkdir(exist_ok=True)  # again, if kill_all() ran in between
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.scratch),
                   DPRUN_STATE_DIR=str(self.scratch / "dprun-state"))
        env.update(kwargs.pop("env", {}) or {})
        proc = subprocess.Popen(args, env=env, **kwargs)
        self.started.append(proc)
        return proc

    def dprun(self, *args, **kwargs) -> subprocess.Popen:
        return self.popen([sys.executable, "-m", "dprun", *map(str, args)], **kwargs)

    def adopt(self, processes) -> None:
        """Descendants to kill at teardown even once they are orphans (a test that kills their parent first)."""
        self.adopted.extend(processes)

    def kill_all(self):
        orphans = [*self.adopted]
        for p in self.adopted:
            try:
                orphans += p.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in orphans:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in self.started:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for child in tree:
                try:
                    child.resume()
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)


def gone(pid: int) -> bool:
    """Whether a process has ended: exited, or a zombie its (perhaps stopped) parent has not reaped."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _our_descendants() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def procs():
    """Start processes through this; all of them and their descendants are gone after the test."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    tracker = Processes()
    try:
        yield tracker
    finally:
        tracker.kill_all()
    # descendants started in new sessions still count as our children while the parent lives
    leftovers = _our_descendants()
    for p in leftovers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not leftovers, f"processes left behind: {[p.pid for p in leftovers]}"
    assert shm_after <= shm_before, f"/dev/shm segments left behind: {sorted(shm_after - shm_before)}"


@pytest.fixture
def port():
    return free_port()


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory):
    """unbroken(nnodes, steps) -> helpers.e2e.Run: examples/train_gpt.py (with helpers/e2e.py's TRAIN_ARGS) for
    `steps` steps on `nnodes` nodes, no spare, nothing failing: the run that a recovered or resumed run of that
    shape must end bit for bit equal to. Each shape runs once per session, on first use, for every test file that
    asks."""
    from helpers.e2e import dprun

    runs = {}

    def run(nnodes: int, steps: int):
        if (nnodes, steps) not in runs:
            procs = Processes()
            try:
                ref = dprun(procs, tmp_path_factory.mktemp(f"unbroken{nnodes}x{steps}"), "unbroken", "--nnodes",
                            nnodes, "--spares", "0", steps=steps)
            finally:
                procs.kill_all()
            assert ref.returncode == 0, ref.stderr[-3000:]
            assert ref.summary["final_step"] == steps and not ref.named("node_failed"), ref.stderr[-3000:]
            runs[nnodes, steps] = ref
        return runs[nnodes, steps]

    return run


@pytest.fixture(scope="session")
def saved_3d(tmp_path_factory):
    """helpers.mesh_jobs.saved_3d_job, run once per session on first use: an 8-rank job that
    test_e2e_parallel's recovery and test_ckpt_export's DCP export both read (each checks what it needs)."""
    from helpers.mesh_jobs import saved_3d_job

    procs = Processes()
    try:
        return saved_3d_job(procs, tmp_path_factory.mktemp("saved3d"))
    finally:
        procs.kill_all()


@pytest.fixture
def store():
    """A TCPStore master on a free loopback port, for workers that build process groups over it."""
    import datetime

    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    yield master
    del master


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs: room for the save's folders, none for a file of state (skipped where mounting is not
    allowed); unmounted after the test."""
    folder = tmp_path / "full"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], check=False)
