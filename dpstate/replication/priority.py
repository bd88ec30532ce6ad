"""Scheduling priority of the snapshot threads (the replication thread and its ZeroMQ I/O thread):
as training's by default, lower with DP_SNAPSHOT_NICE=N.
"""

from __future__ import annotations

import os

# A lower priority for the snapshot threads does not make their work smaller: where training keeps every core
# busy, the step waits for it at the snapshot gate anyway. Seen on a 2-core host shared with other
# jobs at nice 10: a 5 MB capture took 150 ms of wall time for 10 ms of CPU (other processes went first)
# while training waited. So by default they run as training does; DP_SNAPSHOT_NICE=N to try otherwise.
SNAPSHOT_NICE = int(os.environ.get("DP_SNAPSHOT_NICE", "0"))


def lower_priority(tid: int) -> None:
    """Lower the scheduling priority of one thread (Linux: nice is per thread) by DP_SNAPSHOT_NICE (default 0:
    as training); used for the replication thread and the snapshot context's ZeroMQ I/O thread."""
    if SNAPSHOT_NICE <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + SNAPSHOT_NICE))
    except OSError:
        pass


def lower_io_threads(before: set[str]) -> None:
    """Renice the ZeroMQ I/O threads that appeared since `before` (the tids of this process's tasks)."""
    try:
        for tid in set(os.listdir("/proc/self/task")) - before:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    lower_priority(int(tid))
    except OSError:
        pass
