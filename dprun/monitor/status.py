"""`dprun status`: the head publishes its dashboard model on a ZeroMQ PUB socket; this attaches to it read-only.

The head also leaves a small file per running job in a per-user directory, so a local `dprun status` needs no endpoint.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import zmq

from .events import user_json

PUBLISH_HWM = 4


def state_dir() -> Path:
    """Where running jobs leave their status endpoint (DPRUN_STATE_DIR overrides it)."""
    return Path(os.environ.get("DPRUN_STATE_DIR") or Path(tempfile.gettempdir()) / f"dprun-{os.getuid()}")


class StatusFeed:
    """The head's side: one PUB socket; each model goes out as one JSON frame (late joiners get the next one)."""

    def __init__(self, host: str, port: int = 0):
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, PUBLISH_HWM)
        self.sock.setsockopt(zmq.LINGER, 500)
        try:
            if port == 0:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise OSError(f"cannot listen on {host}:{port} for `dprun status` ({exc.strerror}); "
                          "pick another --status-port") from None
        self.endpoint = f"{host}:{port}"
        self.record: Path | None = None

    def publish(self, model: dict) -> None:
        try:
            self.sock.send(json.dumps(model, default=str).encode(), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # nobody listening fast enough: they get the next one

    def register(self, job_id: str, command: list[str]) -> None:
        """Leave <state dir>/<job id>.json so that `dprun status` on this machine finds the job."""
        folder = state_dir()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = folder / f"{job_id}.json"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"job_id": job_id, "endpoint": self.endpoint, "pid": os.getpid(),
                                       "started": time.time(), "command": command}))
            tmp.replace(path)
            self.record = path
        except OSError:
            self.record = None  # status still works with --endpoint

    def close(self) -> None:
        if self.record is not None:
            self.record.unlink(missing_ok=True)
        self.sock.close()


def running_jobs() -> list[dict]:
    """Jobs on this machine whose head process is alive (stale records are removed)."""
    jobs = []
    for path in sorted(state_dir().glob("*.json")):
        try:
            info = json.loads(path.read_text())
            started = info.get("started")
            alive = (_alive_as_recorded(int(info["pid"]), float(started)) if started is not None
                     else _alive_dprun(int(info["pid"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not alive:
            path.unlink(missing_ok=True)
            continue
        jobs.append(info)
    return jobs


def _alive_as_recorded(pid: int, started: float) -> bool:
    """The process that wrote a record at `started` still runs: not merely its pid, since reused by a process
    (or a thread: os.kill(tid, 0) succeeds) created after the record, as after a kill -9 of dprun."""
    try:
        return psutil.pid_exists(pid) and psutil.Process(pid).create_time() <= started + 1.0
    except psutil.Error:
        return False


def _alive_dprun(pid: int) -> bool:
    """For a record without "started" (another version's, or written by hand): its pid is a live process (not a
    thread: psutil tells them apart on Linux) whose command line names dprun."""
    try:
        return psutil.pid_exists(pid) and "dprun" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def find_endpoint(endpoint: str | None) -> str:
    """The endpoint to attach to, or ValueError with a one-line reason."""
    if endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad --endpoint {endpoint!r}: expected HOST:PORT (dprun prints it when a job starts)")
        return endpoint
    jobs = running_jobs()
    if not jobs:
        raise ValueError(f"no running job found on this machine (looked in {state_dir()}); "
                         "give --endpoint HOST:PORT as printed by the job's dprun")
    if len(jobs) > 1:
        names = ", ".join(f"{j['job_id']} ({j['endpoint']})" for j in jobs)
        raise ValueError(f"{len(jobs)} jobs are running here: {names}; pick one with --endpoint")
    return jobs[0]["endpoint"]


def models(endpoint: str, timeout: float) -> Iterator[dict | None]:
    """Yields each model as it arrives, or None every 0.25 s without one; stops after `timeout` s of silence."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.CONFLATE, 1)  # only the newest model matters
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{endpoint}")
    last = time.monotonic()
    try:
        while time.monotonic() - last < timeout:
            if sock.poll(250):
                try:
                    model = json.loads(sock.recv())
                except ValueError:
                    continue
                last = time.monotonic()
                yield model
            else:
                yield None
    finally:
        sock.close(0)


def attach(endpoint: str, once: bool, as_json: bool, timeout: float) -> int:
    """The `dprun status` command: 0 when the job answered, 1 when nothing did."""
    from rich.console import Console

    from .dashboard import LiveDashboard, render

    console = Console()
    live = console.is_terminal and not once and not as_json
    latest: dict | None = None
    if not live:
        for model in models(endpoint, timeout):
            if model is not None:
                if as_json:
                    print(user_json(model))
                else:
                    console.print(render(model, console.width, 10_000))
                return 0
        print(f"dprun status: no job answered at {endpoint} within {timeout:g} s", file=sys.stderr)
        return 1
    finished_at = None
    try:
        with LiveDashboard(lambda: latest, console=console):
            for model in models(endpoint, timeout):
                if model is not None:
                    latest = model
                    if model.get("finished") and finished_at is None:
                        finished_at = time.monotonic()
                if finished_at is not None and time.monotonic() - finished_at > 1.0:
                    return 0
    except KeyboardInterrupt:
        return 0
    if latest is None:
        print(f"dprun status: no job answered at {endpoint} within {timeout:g} s", file=sys.stderr)
        return 1
    print(f"dprun status: the job at {endpoint} stopped publishing (ended or unreachable)", file=sys.stderr)
    return 1
