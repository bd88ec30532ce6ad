"""A memory cgroup of the tests' own, with a limit, to run processes in until the kernel's OOM killer ends one;
skips the test where this host does not let it make one (no memory controller, a read-only cgroup mount)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from dpagent.oom import counter_file


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A child of this process's memory cgroup that holds at most `limit_bytes` (no swap); afterwards every
    process still in it is killed and it is removed."""
    counter = counter_file()
    if counter is None:
        pytest.skip("no memory cgroup to read OOM kills from on this host")
    child = counter.parent / f"dptest-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc.strerror})")
    try:
        limits = (["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"] if counter.name == "memory.oom_control"
                  else ["memory.max", "memory.swap.max"])
        try:
            (child / limits[0]).write_text(str(limit_bytes))
            if (child / limits[1]).exists():  # no swapping instead of the OOM kill
                (child / limits[1]).write_text(str(limit_bytes) if limits[1].startswith("memory.memsw") else "0")
        except OSError as exc:
            pytest.skip(f"cannot limit a memory cgroup here ({exc.strerror})")
        yield child
    finally:
        deadline = time.monotonic() + 30
        while (left := (child / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
            for pid in left:  # only the test's own processes are in it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)  # a killed process leaves its cgroup once reaped (by its parent, or init)
        child.rmdir()


def in_cgroup(cgroup: Path, command: list[str]) -> list[str]:
    """`command`, run in `cgroup` (it and everything it starts)."""
    return ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *map(str, command)]


def counter_in(cgroup: Path) -> Path:
    """Where `cgroup` counts its OOM kills (dpagent.oom.read_count reads it)."""
    return next(cgroup / name for name in ("memory.oom_control", "memory.events") if (cgroup / name).exists())
