"""Host memory for snapshots: malloc settings for a replica holder (received snapshots reuse freed memory
instead of fresh pages), and huge-page buffers for the big blocks that are new (huge_page_buffer).

ZeroMQ allocates each received message; glibc serves any block over 32 MB with a fresh mmap, so every 100 MB
snapshot costs ~27,000 page faults and zeroing, then an munmap when it is dropped. Measured on this project's
2-core test host (108 MB messages): the receiving process spent 110 ms of CPU per message by default, 50 ms with
these settings. The price: memory the agent freed stays with it (its steady state is the snapshots it holds).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

log = logging.getLogger("dpagent")

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # from glibc's malloc.h
NEVER_TRIM = 2**31 - 1  # mallopt's value is a C int: a larger Python int is masked (1 << 62 became 0: trim always)


def reuse_freed_memory() -> bool:
    """Serve big blocks from the heap (no mmap), keep freed memory (no trim), one arena; glibc only.

    Call before the big allocations start; child processes started with exec are not affected. False where
    the C library has no mallopt (musl, macOS): nothing changes there."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    mallopt(M_ARENA_MAX, 1)  # ZeroMQ's I/O thread allocates in the same (reused) heap
    if not ok:
        log.debug("mallopt refused; big snapshots are received into fresh pages")
    return ok


def huge_page_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of private anonymous memory, advised to be backed by transparent huge pages (Linux; elsewhere
    plain pages). Memory new to a process costs a page fault per page on its first write: with 2 MB pages
    instead of 4 KB, writing a fresh GB took 0.08 s against 0.25 s on this project's test host (THP in its
    usual "madvise" mode; Python's default mmap is shared memory, which that mode leaves at 4 KB)."""
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out or disabled: plain pages
            pass
    return buf
