"""Where a worker's snapshot time goes: SnapshotStats (per phase) and per-thread CPU from /proc.

With DP_SNAPSHOT_PROFILE=PATH each rank writes its stats as JSON at exit (benchmarks/overhead.py reads them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from dpcommon.thread_cpu import thread_cpu_times


@dataclass
class SnapshotStats:
    """Where snapshot time goes in this worker (seconds summed over snapshots). The background thread's:
    meta (flatten + layout + the skeleton written as JSON), copy (tensors into the host buffer), crc (checksum),
    send (PutSnapshot handed to ZeroMQ until every SnapshotAck: the socket writes, the holder's receive, verify
    and store). The main thread's: wait (blocked at the snapshot gate on the previous snapshot)."""

    captures: int = 0
    bytes: int = 0
    landed_bytes: int = 0  # of those, what an optimizer step had written in place already (not copied)
    meta_s: float = 0.0
    copy_s: float = 0.0
    crc_s: float = 0.0
    meta_cpu_s: float = 0.0  # the same three phases in the thread's CPU time (wall counts waits for a core)
    copy_cpu_s: float = 0.0
    crc_cpu_s: float = 0.0
    capture_s: float = 0.0
    # each capture's CPU (ms), the last MAX_SAMPLES: a median is the steady cost, the sums above also hold
    # the first capture into each new buffer, which faults its pages in (~0.2 s per 108 MB here)
    capture_cpu_ms: list = field(default_factory=list)
    sends: int = 0
    send_s: float = 0.0
    waits: int = 0
    wait_s: float = 0.0
    fetches: int = 0
    fetch_s: float = 0.0  # request until the whole snapshot is received
    fetch_verify_s: float = 0.0
    relabels: int = 0  # restored snapshots a replica store already held: kept there, not sent again
    relabel_refused: int = 0  # ... it no longer held them: sent whole after all
    offers: int = 0  # snapshots offered to a holder by block digests (dedup) ...
    blocks_sent: int = 0  # ... and the blocks it asked for (the rest its node held already)
    streamed: int = 0  # snapshots sent whole whose parts went to a holder during their capture

    def as_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        out["threads_cpu_s"] = thread_cpu_times()
        return out


MAX_SAMPLES = 4096


class PhaseClock:
    """Times consecutive phases of one thread: lap(name) adds the wall and this thread's CPU seconds since the
    last lap to stats.<name>_s and stats.<name>_cpu_s."""

    def __init__(self, stats: SnapshotStats):
        self.stats = stats
        self.start = self._wall = time.perf_counter()
        self._cpu = self._cpu0 = time.thread_time()

    def lap(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        for key, spent in ((f"{phase}_s", wall - self._wall), (f"{phase}_cpu_s", cpu - self._cpu)):
            setattr(self.stats, key, getattr(self.stats, key) + spent)
        self._wall, self._cpu = wall, cpu

    def finish(self) -> float:
        """Record this capture's CPU milliseconds (stats.capture_cpu_ms); return its wall seconds."""
        samples = self.stats.capture_cpu_ms
        samples.append(round((time.thread_time() - self._cpu0) * 1000, 3))
        del samples[:-MAX_SAMPLES]
        return time.perf_counter() - self.start


def write_profile(rep: Any) -> None:
    """At exit, with DP_SNAPSHOT_PROFILE=PATH: this rank's SnapshotStats as JSON in PATH.rank<R>.<pid>.json."""
    path = os.environ.get("DP_SNAPSHOT_PROFILE")
    if not path:
        return
    data = {"rank": rep.rank, "pid": os.getpid(), "policy": rep.policy.state_dict(), **rep.stats.as_dict()}
    try:
        with open(f"{path}.rank{rep.rank}.{os.getpid()}.json", "w") as f:
            json.dump(data, f)
    except OSError as exc:
        print(f"dpstate: cannot write the snapshot profile: {exc}", file=sys.stderr)
