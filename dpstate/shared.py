"""A snapshot buffer that this node's agent can map read-only: anonymous shared memory (a memfd) whose first
page counts the writes to it, so that a holder referencing its bytes can tell when they changed.

The agent opens it as /proc/<pid>/fd/<fd> (dpagent.dedup), checks the inode, and keeps peers' identical
blocks by reference; the memory goes away with the last process that maps it (nothing in /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np
import torch

HEADER_BYTES = mmap.PAGESIZE  # the write counter; the data starts page-aligned after it


def supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedBuffer:
    """`nbytes` of host memory in a memfd (tensor: a uint8 view of them) and its write counter."""

    def __init__(self, nbytes: int):
        self.fd = os.memfd_create("dpstate-snapshot", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, HEADER_BYTES + nbytes)
        self._map = mmap.mmap(self.fd, HEADER_BYTES + nbytes)
        self.inode = os.fstat(self.fd).st_ino
        self._counter = np.frombuffer(self._map, dtype=np.uint64, count=1)
        self.tensor = (torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
                       if nbytes else torch.empty(0, dtype=torch.uint8))

    @property
    def writes(self) -> int:
        return int(self._counter[0])

    def begin_write(self) -> int:
        """Count a write about to start (a reader that saw an older count no longer trusts the bytes)."""
        self._counter[0] += np.uint64(1)
        return self.writes
