"""Whether the kernel's OOM killer ended a worker that died of SIGKILL: the out-of-memory kills its memory cgroup
counted (cgroup v2: memory.events, v1: memory.oom_control), each kill claimed by one worker's exit.

A SIGKILL alone says nothing of who sent it (an operator's kill -9, the OOM killer, Slurm past KillWait); the
cgroup's count does, where the host exposes it. Where it does not, nothing is claimed.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from pathlib import Path

_COUNT = re.compile(r"^oom_kill\s+(\d+)$", re.MULTILINE)
RECENT_S = 5.0  # a kill counted longer than this before a process was seen dead is not what killed it
SAMPLE_EVERY_S = 1.0


def counter_file(pid: int | None = None, proc: str = "/proc") -> Path | None:
    """The file where the memory cgroup of `pid` (this process by default) counts OOM kills, or None where
    there is none to read (no memory controller, or a cgroup this mount namespace does not show).

    v1: the `memory` line of /proc/PID/cgroup, under the cgroup mount with the memory option:
    memory.oom_control (counted in the victim's own cgroup). v2: the "0::" line, under the cgroup2 mount:
    memory.events (counted in the victim's cgroup and every one above it). A mount may show a subtree only
    (a container's): its root, from /proc/PID/mountinfo, is taken off the cgroup's path."""
    pid = pid or os.getpid()
    try:
        cgroups = Path(proc, str(pid), "cgroup").read_text().splitlines()
        mounts = Path(proc, str(pid), "mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths = {}  # controller ("" for v2) -> the cgroup's path
    for line in cgroups:
        fields = line.split(":", 2)
        if len(fields) == 3:
            for controller in fields[1].split(",") if fields[1] else [""]:
                paths[controller] = fields[2]
    candidates = []
    for line in mounts:
        before, _, after = line.partition(" - ")
        mount, kind = before.split(" "), after.split(" ")
        if len(mount) < 5 or len(kind) < 3:
            continue
        root, mountpoint = mount[3], mount[4]
        if kind[0] == "cgroup" and "memory" in kind[2].split(",") and "memory" in paths:
            candidates.append((root, mountpoint, paths["memory"], "memory.oom_control"))
        elif kind[0] == "cgroup2" and "" in paths:
            candidates.append((root, mountpoint, paths[""], "memory.events"))
    for root, mountpoint, path, name in candidates:
        inside = os.path.relpath(path, root)
        if not inside.startswith(".."):
            file = Path(mountpoint, inside, name)
            if file.is_file():
                return file
    return None


def read_count(path: Path | None) -> int | None:
    """The OOM kills counted in `path` so far (None where it cannot be read)."""
    if path is None:
        return None
    try:
        match = _COUNT.search(path.read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


class OomKills:
    """The OOM kills that this process's memory cgroup (where its workers run) counts, each claimed once by a
    process that died of SIGKILL: `claim(now)` says whether a kill counted in the last RECENT_S explains it.
    Others may share the cgroup (a standalone job's agents do): a kill older than that is not this death's, so
    the count is sampled (`sample(now)`, at least every SAMPLE_EVERY_S) to know when each kill came. Safe to
    call from several threads."""

    def __init__(self, path: Path | None = None, now: float | None = None):
        self.path = counter_file() if path is None else path
        now = time.monotonic() if now is None else now
        count = read_count(self.path)
        self._upto = count  # kills accounted for: claimed, or counted too long before a death to explain it
        self._samples = collections.deque([(now, count)] if count is not None else [])  # (time, count), oldest 1st
        self._lock = threading.Lock()

    @property
    def readable(self) -> bool:
        return self._upto is not None

    def sample(self, now: float) -> None:
        with self._lock:
            if self._upto is not None and now - self._samples[-1][0] >= SAMPLE_EVERY_S:
                if (count := read_count(self.path)) is not None:
                    self._samples.append((now, count))
            self._expire(now)

    def claim(self, now: float) -> bool:
        with self._lock:
            self._expire(now)
            count = read_count(self.path)
            if count is None or self._upto is None or count <= self._upto:
                return False
            self._upto += 1
            return True

    def _expire(self, now: float) -> None:
        """The kills counted by the newest sample older than RECENT_S came too long ago to explain a death now."""
        while len(self._samples) > 1 and self._samples[1][0] <= now - RECENT_S:
            self._samples.popleft()
        if self._samples and self._samples[0][0] <= now - RECENT_S:
            assert self._upto is not None  # samples are only taken while the count is readable
            self._upto = max(self._upto, self._samples[0][1])
