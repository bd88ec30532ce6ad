"""Shared by the benchmarks: run a job as a process tree, watch its memory and CPU, read its timings, tabulate.

Every run gets its own session (process group) and temporary folder; whatever is left of the tree is killed
when the run ends, also on Ctrl-C or an exception. Nothing here imports torch (the benchmark drivers stay light).
A run that fails is said with its cause and left out of every figure (Failures); the benchmark then exits 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil

from dpcommon.thread_cpu import thread_cpu_times

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_gpt.py"

# The benchmark model: 9.0 M parameters, AdamW -> 108 MB of parameters + optimizer state per node (2 nodes).
BIG_MODEL = ["--n-layer", "5", "--n-embd", "384", "--n-head", "6", "--block-size", "128", "--batch-size", "8",
             "--max-bytes", "1000000"]
# --quick: 0.8 M parameters (10 MB of state), a step of a few tens of ms
SMALL_MODEL = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64", "--batch-size", "8",
               "--max-bytes", "300000"]

_LIVE: set[int] = set()  # process-group leaders of runs in flight (killed on exit)


def _kill_group(pid: int) -> None:
    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in tree:
        try:
            child.resume()
            child.kill()
        except psutil.Error:
            pass


_SCRATCH: list[Path] = []  # TMPDIR of every run (short: agents' ipc paths live there), removed on exit


def _scratch() -> Path:
    """One temporary folder that the runs use as TMPDIR: what a killed dprun, agent or torchrun leaves in it
    (run folders, torchelastic_*) goes when the benchmark ends."""
    if not _SCRATCH:
        _SCRATCH.append(Path(tempfile.mkdtemp(prefix="dpb-")))
    return _SCRATCH[0]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process a benchmark starts: unbuffered, TMPDIR in the scratch folder, then `env`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(_scratch()), **(env or {})}


def _cleanup_all(*_args) -> None:
    for pid in list(_LIVE):
        _kill_group(pid)
    _LIVE.clear()
    for path in _SCRATCH:
        shutil.rmtree(path, ignore_errors=True)
    _SCRATCH.clear()


def install_cleanup() -> None:
    """Kill every run still in flight when the benchmark exits or is interrupted."""
    import atexit

    atexit.register(_cleanup_all)

    def on_signal(signum, _frame):
        _cleanup_all()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def role_of(cmdline: Sequence[str]) -> str:
    text = " ".join(cmdline)
    if "dpagent" in text:
        return "agent"
    if "train_gpt" in text or "bench_worker" in text:
        return "worker"
    if "torchrun" in text or "torch.distributed.run" in text:
        return "torchrun"
    if "dprun" in text:
        return "dprun"
    return "other"


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (Linux /proc)."""
    return thread_cpu_times(pid)


@dataclass
class ProcInfo:
    pid: int
    role: str
    peak_rss: int = 0  # bytes (VmHWM)
    cpu: dict[str, float] = field(default_factory=dict)  # per thread name, last sample


def machine_busy_s() -> float:
    """CPU seconds this machine has been busy (all CPUs, /proc/stat: everything but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class RunResult:
    name: str
    returncode: int
    wall_s: float
    folder: Path
    output: str
    procs: dict[int, ProcInfo]
    t_start: float  # Unix time the command was started
    machine_busy_s: float = 0.0  # CPU seconds the whole machine was busy during the run
    timed_out: bool = False  # killed at run()'s timeout (returncode -9)

    @property
    def own_cpu_s(self) -> float:
        return sum(sum(p.cpu.values()) for p in self.procs.values())

    @property
    def others_cpu_share(self) -> float:
        """Fraction of the machine's CPUs that other processes (other jobs on a shared box) used during the run."""
        if self.wall_s <= 0:
            return 0.0
        return max(0.0, (self.machine_busy_s - self.own_cpu_s) / (self.wall_s * (os.cpu_count() or 1)))

    def peak_rss_by_role(self) -> dict[str, int]:
        peaks: dict[str, int] = {}
        for p in self.procs.values():
            peaks[p.role] = max(peaks.get(p.role, 0), p.peak_rss)
        return peaks

    def cpu_by_role_thread(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for p in self.procs.values():
            role = out.setdefault(p.role, {})
            for name, sec in p.cpu.items():
                role[name] = role.get(name, 0.0) + sec
        return out

    def timings(self, name: str = "timings.jsonl") -> list[dict]:
        return read_jsonl(self.folder / name)

    def json_file(self, name: str) -> Any:
        path = self.folder / name
        return json.loads(path.read_text()) if path.exists() else None

    def events(self, name: str = "events.jsonl") -> list[dict]:
        return self.timings(name)


def run(name: str, cmd: Sequence[str], *, folder: Path, env: dict[str, str] | None = None, timeout: float = 600,
        sample_s: float = 0.25, quiet: bool = True) -> RunResult:
    """Run `cmd` in `folder` in its own session; sample peak RSS and per-thread CPU of every descendant."""
    full_env = child_env(env)
    log = open(folder / "output.log", "wb")
    busy0 = machine_busy_s()
    t_start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(map(str, cmd)), cwd=folder, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    _LIVE.add(proc.pid)
    procs: dict[int, ProcInfo] = {}
    stop = threading.Event()

    def sample() -> None:
        while True:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    info = procs.get(p.pid)
                    if info is None:
                        info = procs[p.pid] = ProcInfo(p.pid, role_of(p.cmdline()))
                    info.peak_rss = max(info.peak_rss, _status_kb(p.pid, "VmHWM:") * 1024)
                    cpu = thread_cpu(p.pid)
                    if cpu:
                        info.cpu = cpu
                except psutil.Error:
                    continue
            if stop.wait(sample_s):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timed_out = False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code, timed_out = -9, True
        print(f"  {name}: timed out after {timeout:.0f} s", file=sys.stderr)
    finally:
        wall = time.perf_counter() - t0
        busy = machine_busy_s() - busy0
        stop.set()
        sampler.join(5)
        _kill_group(proc.pid)
        _LIVE.discard(proc.pid)
        log.close()
    output = (folder / "output.log").read_text(errors="replace")
    if code != 0 and not quiet:
        print(output[-3000:], file=sys.stderr)
    return RunResult(name, code, wall, folder, output, procs, t_start, busy, timed_out)


class Workdir:
    """A temporary folder per benchmark (removed at the end unless --keep)."""

    def __init__(self, prefix: str, keep: bool = False):
        self.path = Path(tempfile.mkdtemp(prefix=f"dpbench-{prefix}-"))
        self.keep = keep
        self._n = 0

    def new(self, name: str) -> Path:
        self._n += 1
        path = self.path / f"{self._n:02d}-{name}"
        path.mkdir()
        return path

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ failures


def tail(text: str, lines: int = 25) -> str:
    """The last `lines` non-empty lines of a run's output: where its error is."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def file_tail(path: Path, lines: int = 25) -> str:
    try:
        return tail(path.read_text(errors="replace"), lines)
    except OSError:
        return ""


def exit_cause(returncode: int) -> str:
    """`exit code 1`, or `killed by SIGKILL` for a negative return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Failures:
    """The runs of a benchmark that failed. A failed run measured nothing: a 0, a NaN or a default in its place
    reads as a result (a goodput of 0.0 was once all a failed run said). So each is said when it fails (which
    run, why: the exception, or the exit code and the tail of its output), its folder is kept, it gets no figure
    in the JSON or the tables, and main() ends with `return failures.exit_code()`: the list again, and 1."""

    def __init__(self, benchmark: str, work: Workdir | None = None):
        self.benchmark = benchmark
        self.work = work
        self.runs: list[dict] = []

    def __bool__(self) -> bool:
        return bool(self.runs)

    def add(self, run: str, cause: str, output: str = "", folder: Path | None = None) -> None:
        """Record that `run` failed because of `cause`; `output`: the tail of what it printed, shown with it."""
        entry: dict = {"run": run, "cause": cause}
        if output:
            entry["output_tail"] = output
        if folder is not None and self.work is not None:
            self.work.keep = True  # its logs are the rest of the story
            entry["folder"] = str(folder)
        self.runs.append(entry)
        print(f"  {run}: FAILED: {cause}" + (f" (kept: {folder})" if "folder" in entry else ""), file=sys.stderr)
        if output:
            print("    | " + output.replace("\n", "\n    | "), file=sys.stderr)
        sys.stderr.flush()

    def check(self, res: RunResult) -> bool:
        """True when `res` succeeded; else record its failure (timeout or exit code, tail of its output)."""
        if res.returncode == 0 and not res.timed_out:
            return True
        cause = "timed out" if res.timed_out else exit_cause(res.returncode)
        self.add(res.name, f"{cause} after {res.wall_s:.0f} s", tail(res.output), res.folder)
        return False

    def as_json(self) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "output_tail"} for r in self.runs]

    def exit_code(self) -> int:
        """0 when every run succeeded; else list the failures (after the tables, where they are read) and 1."""
        if not self.runs:
            return 0
        print(f"\n{self.benchmark}: {len(self.runs)} run(s) FAILED and have no figures above:", file=sys.stderr)
        for r in self.runs:
            print(f"  {r['run']}: {r['cause']}", file=sys.stderr)
        return 1


# ------------------------------------------------------------------------------------------------ numbers


def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def spread(values: Iterable[float]) -> tuple[float, float] | None:
    vals = [v for v in values if v is not None]
    return (min(vals), max(vals)) if vals else None


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, none where it does not exist. Text after the last newline is a record
    its writer has not finished (read while the run goes on): left for the next read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def step_times(timings: list[dict]) -> dict[int, float]:
    """step -> Unix time it ended (rank 0), the newest occurrence of each step (after a rollback)."""
    out: dict[int, float] = {}
    for rec in timings:
        if "step" in rec and "event" not in rec:
            out[rec["step"]] = rec["t"]
    return out


def window_rate(timings: list[dict], lo: int, hi: int) -> float | None:
    """Steps per second between the end of step lo and the end of step hi."""
    ends = step_times(timings)
    if lo not in ends or hi not in ends or hi <= lo:
        return None
    return (hi - lo) / (ends[hi] - ends[lo])


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def machine() -> dict:
    vm = psutil.virtual_memory()
    return {"cpus": os.cpu_count(), "memory_gib": round(vm.total / 2**30, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2), "python": sys.version.split()[0]}


def mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.0f}"


# ------------------------------------------------------------------------------------------------ multi-node jobs


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: Sequence[Any], folder: Path, env: dict[str, str] | None, log_name: str) -> subprocess.Popen:
    """One process of a job that a benchmark drives itself (a dprun node, say): its own session, its output in
    FOLDER/LOG_NAME, killed with the rest when the benchmark ends (stop() sooner)."""
    with open(folder / log_name, "ab") as log:
        proc = subprocess.Popen(list(map(str, cmd)), cwd=folder, env=child_env(env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE.add(proc.pid)
    return proc


def stop(procs: Iterable[subprocess.Popen], folder: Path | None = None) -> None:
    """Kill what is left of processes start() began; with `folder`, also any process whose command line names
    it (a node's agent or worker that outlived its dprun)."""
    for proc in procs:
        _kill_group(proc.pid)
        _LIVE.discard(proc.pid)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    if folder is None:
        return
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and str(folder) in " ".join(p.info["cmdline"] or []):
                p.kill()
        except psutil.Error:
            pass
