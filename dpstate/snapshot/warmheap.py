"""A spare's worker faults in heap memory for its first step while it idles (training on the CPU): the C library
then keeps what is freed, so the activations, gradients and buckets of the step after a promotion reuse it.

Measured here (examples/train_gpt.py, 108 MB of state, batch 2 x 128): the first step of a fresh process took
0.28 s (median of 5) against 0.21 s with 200 MB of heap faulted in first, and 0.20 s for the steps after it;
on this VM a fresh page costs ~1 us, and a first step allocates ~100-200 MB it has never touched.
"""

from __future__ import annotations

import ctypes
import os
import sys

import psutil
import torch

from dpcommon import protocol as P

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)
HEAP_BELOW = 1 << 30  # blocks smaller than this come from the heap, not from mmap (which returns them on free)
KEEP = (1 << 31) - 1  # never give freed heap back to the system
HEAP_PER_STATE = 2  # heap faulted in per byte of the rank's snapshot (the first step's activations, grads, buckets)


def heap_bytes(snapshot_bytes: int, local_workers: int) -> int:
    """How much heap a spare faults in for a rank whose snapshot is `snapshot_bytes`: DP_SPARE_HEAP_BYTES if set
    (0: none), else HEAP_PER_STATE times the snapshot, at most a quarter of the memory available per worker on
    the host: its node's `local_workers`, or every node's where a standalone job runs several on one host
    (DP_TOTAL_LOCAL_WORKERS, set by dprun)."""
    configured = os.environ.get("DP_SPARE_HEAP_BYTES", "").strip()
    if configured:
        return max(0, int(float(configured)))
    sharing = max(local_workers, int(os.environ.get("DP_TOTAL_LOCAL_WORKERS") or 0), 1)
    return min(HEAP_PER_STATE * max(snapshot_bytes, 0), psutil.virtual_memory().available // 4 // sharing)


def warm_heap(nbytes: int) -> bool:
    """Make the C library keep freed memory in the heap and fault in `nbytes` of it now (in the calling thread's
    arena: call it from the thread that will train). False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if not (mallopt(M_MMAP_THRESHOLD, HEAP_BELOW) and mallopt(M_TRIM_THRESHOLD, KEEP)):
        return False
    if nbytes > 0:
        block = torch.empty(nbytes, dtype=torch.uint8)
        block.fill_(0)  # every page touched: faulted in now, kept after the free
        del block
    return True


def heap_rss(pid: int | str = "self") -> int:
    """Bytes of process `pid`'s C heap ([heap] in its smaps) that are faulted in; 0 if it has none or is gone."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            lines = f.read().splitlines()
    except OSError:  # it exited, or no /proc
        return 0
    for i, line in enumerate(lines):
        if line.endswith("[heap]"):
            return next((int(x.split()[1]) * 1024 for x in lines[i + 1:] if x.startswith("Rss:")), 0)
    return 0


def warm_while_idle(control, local_rank: int, local_workers: int) -> None:
    """A spare's main thread before it waits for its promotion: on each Standby that names a larger snapshot for
    its local rank (the first comes before the optimizer has state), fault in heap_bytes() of it. Returns when a
    Reconfigure or Stop comes."""
    standby: P.Standby | None = None
    warmed = 0
    while (standby := control.wait_standby(standby)) is not None:
        sizes = standby.snapshot_bytes
        nbytes = heap_bytes(sizes[local_rank] if local_rank < len(sizes) else 0, local_workers)
        if nbytes > warmed and warm_heap(nbytes):
            warmed = nbytes
            sys.stderr.write(f"dpstate: spare worker {local_rank} faulted in {nbytes / 1e6:.0f} MB of heap for its "
                             f"first step while idle (heap {heap_rss() / 1e6:.0f} MB)\n")  # one write: the standby
            # thread prints beside it
            sys.stderr.flush()
