"""The snapshot checksum and its per-block digests, torch-free so that replica holders can use them (numpy only).

Workers compute both on every snapshot (dpstate.snapshot.checksum wraps this); holders compare digests to
find the blocks of a peer's snapshot they already hold (dedup) and check a held copy before relabelling it.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

CHECKSUM_BLOCK = 1 << 20  # bytes per block: one digest each
# The digest of a block: its 64-bit words times these fixed odd weights, summed mod 2^64. Any one changed
# word changes it (an odd weight times a non-zero difference below 2^64 is not 0 mod 2^64); so does a swap of
# two words or a +1/-1 pair (which a plain sum misses), unless two weights collide (random 64-bit odd).
_WEIGHTS = np.random.default_rng(0x5EED_D16E).integers(0, 1 << 62, CHECKSUM_BLOCK // 8, dtype=np.int64) * 2 + 1


def checksum_chunks(meta: Any, chunks: Sequence[Any]) -> int:
    """checksum(meta, the chunks joined), without joining them: every chunk but the last must be a whole
    number of CHECKSUM_BLOCKs (as dpagent.protocol.chunk_views cuts them)."""
    crc = zlib.crc32(meta)
    for i, chunk in enumerate(chunks):
        buf = _uint8(chunk)
        if i < len(chunks) - 1 and buf.size % CHECKSUM_BLOCK:
            raise ValueError(f"chunk {i} of {len(chunks)} is {buf.size} bytes, not a multiple of {CHECKSUM_BLOCK}")
        crc = _fold(buf, block_digests(buf), crc)
    return crc


def checksum(meta: Any, data: Any) -> int:
    """32 bits over meta then data (bytes-like): zlib.crc32 over meta, then over the digests of data's whole
    1 MiB blocks (block_digests), then over data's tail. It runs on every snapshot: measured here, 7 ms per
    108 MB against 36-55 ms for zlib.crc32 over the bytes."""
    return checksum_and_digests(meta, data)[0]


def checksum_and_digests(meta: Any, data: Any) -> tuple[int, np.ndarray]:
    """checksum(meta, data) and block_digests(data), in one pass over data."""
    buf = _uint8(data)
    digests = block_digests(buf)
    return _fold(buf, digests, zlib.crc32(meta)), digests


def block_digests(data: Any) -> np.ndarray:
    """One int64 digest per whole CHECKSUM_BLOCK of data (the tail has none): equal digests at the same
    index of two snapshots of the same layout mean (short of a 2^-64 collision) the same bytes."""
    buf = _uint8(data)
    blocks = buf.size // CHECKSUM_BLOCK
    if not blocks:
        return np.zeros(0, dtype=np.int64)
    words = buf[: blocks * CHECKSUM_BLOCK].view(np.int64).reshape(blocks, CHECKSUM_BLOCK // 8)
    # einsum's integer loop, not matmul's: the same sums mod 2^64, in 6-7 ms per 108 MB against 9-11 (measured here)
    return np.einsum("bw,w->b", words, _WEIGHTS)


def _uint8(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)


def _fold(buf: np.ndarray, digests: np.ndarray, crc: int) -> int:
    """crc32 over the digests of buf's whole blocks (block_digests(buf)), then over its tail."""
    if digests.size:
        crc = zlib.crc32(digests, crc)
    return zlib.crc32(buf[digests.size * CHECKSUM_BLOCK :], crc)
