"""The snapshot checksum, torch-free so that replica holders can check a copy they hold (numpy only).

Workers compute it on every snapshot (dpstate.snapshot.checksum wraps this); a holder asked to keep a copy
it already holds (PutSnapshot held=True) checks it first, so a corrupted copy is replaced, not kept.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

CHECKSUM_BLOCK = 1 << 20  # bytes summed per block


def checksum(meta: Any, data: Any) -> int:
    """32 bits over meta then data (bytes-like): zlib.crc32 over meta, then over the wrapping 64-bit sums of
    data's 1 MiB blocks, then over data's tail.

    Any changed byte changes its block's sum (a word changes by a non-zero multiple of a power of 256 below
    2^64) and the crc32 of the sums places it; what it misses that a crc32 of all the bytes would catch is a
    change that keeps a block's sum, e.g. two words swapped. It runs on every snapshot: measured here, 8 ms
    per 108 MB against 42-55 ms for zlib.crc32 over the bytes."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    blocks = buf.size // CHECKSUM_BLOCK
    crc = zlib.crc32(meta)
    if blocks:
        sums = buf[: blocks * CHECKSUM_BLOCK].view(np.int64).reshape(blocks, CHECKSUM_BLOCK // 8).sum(axis=1)
        crc = zlib.crc32(sums, crc)
    return zlib.crc32(buf[blocks * CHECKSUM_BLOCK :], crc)
