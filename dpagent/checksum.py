"""The snapshot checksum, torch-free so that replica holders can check a copy they hold (numpy only).

Workers compute it on every snapshot (dpstate.snapshot.checksum wraps this); a holder asked to keep a copy
it already holds (PutSnapshot held=True) checks it first, so a corrupted copy is replaced, not kept.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

CHECKSUM_BLOCK = 1 << 20  # bytes summed per block


def checksum_chunks(meta: Any, chunks: Sequence[Any]) -> int:
    """checksum(meta, the chunks joined), without joining them: every chunk but the last must be a whole
    number of CHECKSUM_BLOCKs (as dpagent.protocol.chunk_views cuts them)."""
    crc = zlib.crc32(meta)
    for i, chunk in enumerate(chunks):
        buf = _uint8(chunk)
        if i < len(chunks) - 1 and buf.size % CHECKSUM_BLOCK:
            raise ValueError(f"chunk {i} of {len(chunks)} is {buf.size} bytes, not a multiple of {CHECKSUM_BLOCK}")
        crc = _fold(buf, crc)
    return crc


def checksum(meta: Any, data: Any) -> int:
    """32 bits over meta then data (bytes-like): zlib.crc32 over meta, then over the wrapping 64-bit sums of
    data's 1 MiB blocks, then over data's tail.

    Any changed byte changes its block's sum (a word changes by a non-zero multiple of a power of 256 below
    2^64) and the crc32 of the sums places it; what it misses that a crc32 of all the bytes would catch is a
    change that keeps a block's sum, e.g. two words swapped. It runs on every snapshot: measured here, 8 ms
    per 108 MB against 42-55 ms for zlib.crc32 over the bytes."""
    return _fold(_uint8(data), zlib.crc32(meta))


def _uint8(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)


def _fold(buf: np.ndarray, crc: int) -> int:
    """crc32 over the sums of buf's whole blocks, then over its tail."""
    blocks = buf.size // CHECKSUM_BLOCK
    if blocks:
        sums = buf[: blocks * CHECKSUM_BLOCK].view(np.int64).reshape(blocks, CHECKSUM_BLOCK // 8).sum(axis=1)
        crc = zlib.crc32(sums, crc)
    return zlib.crc32(buf[blocks * CHECKSUM_BLOCK :], crc)
