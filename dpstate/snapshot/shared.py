"""A snapshot buffer that this node's agent can map read-only: anonymous shared memory (a memfd) whose first
page counts the writes to it, so that a holder referencing its bytes can tell when they changed.

The agent opens it as /proc/<pid>/fd/<fd> (dpagent.dedup), checks the inode, and keeps peers' identical
blocks by reference; the memory goes away with the last process that maps it (nothing in /dev/shm).
With CUDA the buffer is page-locked (cudaHostRegister), so that the side stream's device-to-host copy into it
runs asynchronously, as into torch's own pinned memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import weakref

import numpy as np
import torch

HEADER_BYTES = mmap.PAGESIZE  # the write counter; the data starts page-aligned after it
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python 3.11's mmap lacks the name


def supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, as torch's own pin_memory helper asks
_page_lock_works: bool | None = None


class PageLockError(RuntimeError):
    """CUDA refused to page-lock a snapshot buffer."""


def can_page_lock() -> bool:
    """Whether CUDA page-locks a shared buffer here (tried once on one page, then remembered)."""
    global _page_lock_works
    if _page_lock_works is None:
        try:
            SharedBuffer(mmap.PAGESIZE, page_locked=True)  # registered, then unregistered once dropped
            _page_lock_works = True
        except Exception:  # noqa: BLE001 (no CUDA runtime: torch raises AssertionError; a refusal: PageLockError)
            _page_lock_works = False
    return _page_lock_works


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class SharedBuffer:
    """`nbytes` of host memory in a memfd (tensor: a uint8 view of them) and its write counter; page-locked for
    CUDA if asked (PageLockError when CUDA refuses; it is unregistered before the memory is unmapped)."""

    def __init__(self, nbytes: int, page_locked: bool = False):
        self.fd = os.memfd_create("dpstate-snapshot", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, HEADER_BYTES + nbytes)
        self._map = mmap.mmap(self.fd, HEADER_BYTES + nbytes)
        self.inode = os.fstat(self.fd).st_ino
        self._counter = np.frombuffer(self._map, dtype=np.uint64, count=1)
        self.tensor = (torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
                       if nbytes else torch.empty(0, dtype=torch.uint8))
        self.page_locked = False
        if page_locked and nbytes:
            address = self.tensor.data_ptr()  # page-aligned: the data starts a page into the mapping
            err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))
            if err:
                raise PageLockError(f"cudaHostRegister refused {nbytes} bytes of snapshot buffer (cudaError {err})")
            # before the mapping goes: finalizers run before the object's attributes (the mmap) are released
            weakref.finalize(self, _unregister, address)
            self.page_locked = True

    @property
    def writes(self) -> int:
        return int(self._counter[0])

    def populate(self) -> None:
        """Fault every page in now, writable (memory for a restore, made while a spare idles): the kernel does it
        in one call where it can, else the data is zeroed, which faults it in too. OSError when the memory is
        not there (ENOMEM): a write would have been killed by SIGBUS instead."""
        if self.page_locked or not len(self.tensor):
            return  # page-locking made it resident
        try:
            self._map.madvise(MADV_POPULATE_WRITE, HEADER_BYTES, len(self.tensor))
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14 does not know the advice
                raise
            self.tensor.zero_()

    def begin_write(self) -> int:
        """Count a write about to start (a reader that saw an older count no longer trusts the bytes)."""
        self._counter[0] += np.uint64(1)
        return self.writes
