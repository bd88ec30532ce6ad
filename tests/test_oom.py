"""dpagent.oom: the agent tells the kernel's OOM killer from any other SIGKILL by its memory cgroup's count of OOM
kills, on cgroup v1 and v2 and inside a container that sees a subtree only; checked against a real OOM kill in
a memory cgroup of the test's own where the host allows one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpagent.oom import RECENT_S, OomKills, counter_file, read_count
from helpers.cgroups import counter_in, in_cgroup, memory_cgroup

pytestmark = pytest.mark.timeout(60)

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 {root} {mount}/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / {mount}/unified rw,relatime - cgroup2 cgroup2 rw
"""


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc.parent


def test_the_v1_memory_hierarchy_is_read_where_the_process_is_and_a_container_mount_shows_its_own_subtree(
        tmp_path):
    mount = tmp_path / "fs"
    counter = mount / "memory" / "job" / "step" / "memory.oom_control"
    counter.parent.mkdir(parents=True)
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    cgroups = "9:name=systemd:/\n4:memory:/job/step\n1:cpu,cpuacct:/\n0::/\n"
    proc = fake_proc(tmp_path, cgroups, V1_MOUNTS.format(root="/", mount=mount))
    assert counter_file(42, str(proc)) == counter and read_count(counter) == 3
    # a container's mount of /job as its cgroup root: the path it shows is the host's
    inner = tmp_path / "inner"
    (inner / "memory" / "step").mkdir(parents=True)
    (inner / "memory" / "step" / "memory.oom_control").write_text("oom_kill 0\n")
    (tmp_path / "proc" / "42" / "mountinfo").write_text(V1_MOUNTS.format(root="/job", mount=inner))
    assert counter_file(42, str(proc)) == inner / "memory" / "step" / "memory.oom_control"


def test_v2_reads_memory_events_and_a_cgroup_out_of_sight_or_a_bad_file_gives_nothing(tmp_path):
    mount = tmp_path / "fs"
    events = mount / "user.slice" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    mounts = f"25 1 0:22 / {mount} rw - cgroup2 cgroup2 rw,nsdelegate\n"
    proc = fake_proc(tmp_path, "0::/user.slice\n", mounts)
    assert counter_file(42, str(proc)) == events and read_count(events) == 2
    (tmp_path / "proc" / "42" / "cgroup").write_text("0::/elsewhere\nnot a cgroup line\n")
    assert counter_file(42, str(proc)) is None, "no such cgroup under this mount: nothing to read"
    assert counter_file(43, str(proc)) is None, "no such process"
    events.write_text("garbage\n")
    assert read_count(events) is None and read_count(None) is None


def test_each_oom_kill_is_claimed_once_and_only_by_a_death_soon_after_it(tmp_path):
    """Others share the cgroup (a standalone job's agents): a kill counted more than RECENT_S before a death
    was some other process's."""
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill 5\n")
    kills = OomKills(counter, now=100.0)
    assert kills.readable and not kills.claim(100.5), "kills before it started are not its workers'"
    counter.write_text("oom_kill 7\n")
    assert kills.claim(101.0) and kills.claim(101.0) and not kills.claim(101.0)
    kills.sample(102.0)
    counter.write_text("oom_kill 8\n")  # counted between 102 and 103.5
    kills.sample(103.5)
    assert kills.claim(103.5 + RECENT_S - 0.1), "a death seen soon after the kill"
    counter.write_text("oom_kill 9\n")  # counted between 103.5 and 110
    kills.sample(110.0)
    kills.sample(111.0)
    assert not kills.claim(110.0 + RECENT_S), "another process's kill, counted over RECENT_S before this death"
    assert not OomKills(tmp_path / "absent").claim(0.0)


@pytest.mark.slow  # starts python processes
def test_a_real_oom_kill_in_a_limited_cgroup_is_claimed_and_a_plain_sigkill_is_not():
    with memory_cgroup(200 << 20) as cgroup:
        kills = OomKills(counter_in(cgroup))
        hog = subprocess.run(in_cgroup(cgroup, [sys.executable, "-c", "b = bytearray(600 << 20)"]), timeout=30)
        assert hog.returncode == -signal.SIGKILL
        assert kills.claim(time.monotonic()) and not kills.claim(time.monotonic())
        sleeper = subprocess.Popen(in_cgroup(cgroup, [sys.executable, "-c", "import time; time.sleep(60)"]))
        sleeper.kill()
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not kills.claim(time.monotonic()), "a kill -9 is no OOM kill"
