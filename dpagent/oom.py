"""Whether the kernel's OOM killer ended a worker that died of SIGKILL: the out-of-memory kills its memory cgroup
counted (cgroup v2: memory.events, v1: memory.oom_control), each kill claimed by one worker's exit.

A SIGKILL alone says nothing of who sent it (an operator's kill -9, the OOM killer, Slurm past KillWait); the
cgroup's count does, where the host exposes it. Where it does not, nothing is claimed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_COUNT = re.compile(r"^oom_kill\s+(\d+)$", re.MULTILINE)


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
    """The OOM kills in this process's memory cgroup (where its workers run) since it started, each claimed
    once: `claim()` when a worker died of SIGKILL says whether an uncounted kill explains it."""

    def __init__(self, path: Path | None = None):
        self.path = counter_file() if path is None else path
        self._claimed = read_count(self.path)

    @property
    def readable(self) -> bool:
        return self._claimed is not None

    def claim(self) -> bool:
        count = read_count(self.path)
        if count is None or self._claimed is None or count <= self._claimed:
            return False
        self._claimed += 1
        return True
