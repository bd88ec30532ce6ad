"""CPU seconds per thread of a process, read from /proc: where a worker's or an agent's time goes, for the
snapshot profile (dpstate.replication.profile) and the benchmarks' drivers, which must not import torch."""

from __future__ import annotations

import os
import threading


def thread_cpu_times(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) per thread of a process, summed by thread name (Linux /proc; {} elsewhere).
    Python threads are named by their threading name, others (ZeroMQ's I/O thread, Gloo's) by the OS's."""
    names = {}
    if pid == "self":
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), comm)
        out[name] = round(out.get(name, 0.0) + cpu, 3)
    return out
