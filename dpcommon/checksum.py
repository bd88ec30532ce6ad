"""The snapshot checksum and its per-block digests, torch-free so that replica holders can use them (numpy only).

Workers compute both on every snapshot (dpstate.snapshot.packing.checksum wraps this); holders compare digests to
find the blocks of a peer's snapshot they already hold (dedup) and check a held copy before relabelling it.
A snapshot's CheckPlan (in its meta) may leave most of its data parallel blocks undigested: see CheckPlan.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

CHECKSUM_BLOCK = 1 << 20  # bytes per block: one digest each
# The digest of a block: its 64-bit words times these fixed odd weights, summed mod 2^64. Any one changed
# word changes it (an odd weight times a non-zero difference below 2^64 is not 0 mod 2^64); so does a swap of
# two words or a +1/-1 pair (which a plain sum misses), unless two weights collide (random 64-bit odd).
_WEIGHTS = np.random.default_rng(0x5EED_D16E).integers(0, 1 << 62, CHECKSUM_BLOCK // 8, dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class CheckPlan:
    """Which whole blocks of a snapshot's data are digested. Its first `shared_blocks` blocks hold what every
    data parallel rank has bitwise alike after a step (parameters and their optimizer state, laid out as the
    fingerprint `shared_key` says); of those, one in `every` is digested (block i where i % every == phase,
    the phase following the step) and the rest are trusted: their digest is 0 in the checksum. Every block
    after them is digested. Without a plan, every block is. A rank whose shared blocks differ from its peers'
    is caught within about `every` snapshots (see dpagent.dedup.decide)."""

    shared_blocks: int
    shared_key: int
    every: int
    phase: int

    @classmethod
    def for_step(cls, shared_blocks: int, shared_key: int, every: int, step: int) -> CheckPlan:
        """The plan of a snapshot of `step`: every data parallel rank's snapshot of that step checks the same
        blocks; the phase is a hash of the step, so that intervals (every 2nd step...) still visit every phase."""
        return cls(shared_blocks, shared_key, every, _mix(step) % every)

    @classmethod
    def from_json(cls, doc: Any) -> CheckPlan | None:
        """A plan from its JSON form (None: none, every block checked). ValueError when malformed."""
        if doc is None or doc == {}:
            return None
        try:
            plan = cls(**{name: doc[name] for name in ("shared_blocks", "shared_key", "every", "phase")})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed check plan {str(doc)[:120]}: {exc}") from None
        fields = (plan.shared_blocks, plan.shared_key, plan.every, plan.phase)
        if (not all(isinstance(v, int) and not isinstance(v, bool) for v in fields) or plan.shared_blocks < 0
                or plan.every < 1 or not 0 <= plan.phase < plan.every):
            raise ValueError(f"malformed check plan {str(doc)[:120]}")
        return plan

    @classmethod
    def from_meta(cls, meta: Any) -> CheckPlan | None:
        """The plan a snapshot's meta (dpstate.snapshot.packing's JSON) carries at its top level; None when it has none
        or is not JSON at all. ValueError when the plan is malformed."""
        raw = bytes(meta)
        if b'"checks"' not in raw:
            return None
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        return cls.from_json(doc.get("checks")) if isinstance(doc, dict) else None

    def as_json(self) -> dict:
        return asdict(self)

    def unchecked(self, nblocks: int) -> np.ndarray:
        """A boolean per whole block: True where this plan leaves the block undigested (trusted)."""
        out = np.zeros(nblocks, dtype=bool)
        shared = min(self.shared_blocks, nblocks)
        out[:shared] = True
        out[self.phase : shared : self.every] = False
        return out


def _mix(step: int) -> int:
    """splitmix64's finalizer: consecutive or evenly spaced steps get unrelated phases."""
    z = (step + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


_FROM_META = object()


def checksum_chunks(meta: Any, chunks: Sequence[Any]) -> int:
    """checksum(meta, the chunks joined), without joining them: every chunk but the last must be a whole
    number of CHECKSUM_BLOCKs (as dpcommon.protocol.chunk_views cuts them)."""
    crc = zlib.crc32(meta)
    plan = CheckPlan.from_meta(meta)
    first = 0  # index of the chunk's first block in the whole data
    for i, chunk in enumerate(chunks):
        buf = _uint8(chunk)
        if i < len(chunks) - 1 and buf.size % CHECKSUM_BLOCK:
            raise ValueError(f"chunk {i} of {len(chunks)} is {buf.size} bytes, not a multiple of {CHECKSUM_BLOCK}")
        crc = _fold(buf, block_digests(buf, plan, first), crc)
        first += buf.size // CHECKSUM_BLOCK
    return crc


def checksums_both(meta: Any, chunks: Sequence[Any]) -> tuple[int, int]:
    """(checksum_chunks(meta, chunks), the same with every block digested whatever the meta's plan says), from
    one pass over the bytes: a snapshot file's "checksum" and "check" (dpcommon.snapshot_files)."""
    plan = CheckPlan.from_meta(meta)
    planned = every = zlib.crc32(meta)
    first = 0
    for i, chunk in enumerate(chunks):
        buf = _uint8(chunk)
        if i < len(chunks) - 1 and buf.size % CHECKSUM_BLOCK:
            raise ValueError(f"chunk {i} of {len(chunks)} is {buf.size} bytes, not a multiple of {CHECKSUM_BLOCK}")
        digests = block_digests(buf)
        every = _fold(buf, digests, every)
        if plan is not None and digests.size:
            digests = np.where(plan.unchecked(first + digests.size)[first:], 0, digests)
        planned = _fold(buf, digests, planned)
        first += digests.size
    return planned, every


def checksum(meta: Any, data: Any, plan: Any = _FROM_META) -> int:
    """32 bits over meta then data (bytes-like): zlib.crc32 over meta, then over the digests of data's whole
    1 MiB blocks (block_digests; 0 for a block the plan leaves unchecked), then over data's tail. The plan is
    the meta's (CheckPlan.from_meta) unless given. It runs on every snapshot: measured here, 7 ms per 108 MB
    with every block digested, against 36-55 ms for zlib.crc32 over the bytes."""
    return checksum_and_digests(meta, data, plan)[0]


def checksum_and_digests(meta: Any, data: Any, plan: Any = _FROM_META) -> tuple[int, np.ndarray]:
    """checksum(meta, data, plan) and block_digests(data, plan), in one pass over data."""
    if plan is _FROM_META:
        plan = CheckPlan.from_meta(meta)
    buf = _uint8(data)
    digests = block_digests(buf, plan)
    return _fold(buf, digests, zlib.crc32(meta)), digests


def block_digests(data: Any, plan: CheckPlan | None = None, first: int = 0) -> np.ndarray:
    """One int64 digest per whole CHECKSUM_BLOCK of data (the tail has none), 0 for a block the plan leaves
    unchecked (`first`: the index of data's first block in the snapshot's data): equal digests at the same
    index of two snapshots of the same layout mean (short of a 2^-64 collision) the same bytes."""
    buf = _uint8(data)
    blocks = buf.size // CHECKSUM_BLOCK
    if not blocks:
        return np.zeros(0, dtype=np.int64)
    words = buf[: blocks * CHECKSUM_BLOCK].view(np.int64).reshape(blocks, CHECKSUM_BLOCK // 8)
    if plan is None:
        # einsum's integer loop, not matmul's: the same sums mod 2^64, in 6-7 ms per 108 MB against 9-11 (measured here)
        return np.einsum("bw,w->b", words, _WEIGHTS)
    digests = np.zeros(blocks, dtype=np.int64)
    checked = np.flatnonzero(~plan.unchecked(first + blocks)[first:])
    for start, stop in _runs(checked):  # a run at a time: no copy of the blocks (a fancy index would copy)
        digests[start:stop] = np.einsum("bw,w->b", words[start:stop], _WEIGHTS)
    return digests


def _runs(indexes: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive values in a sorted index array."""
    if not indexes.size:
        return []
    breaks = np.flatnonzero(np.diff(indexes) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [indexes.size]))
    return [(int(indexes[a]), int(indexes[b - 1]) + 1) for a, b in zip(starts, stops)]


def _uint8(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)


def _fold(buf: np.ndarray, digests: np.ndarray, crc: int) -> int:
    """crc32 over the digests of buf's whole blocks (block_digests(buf)), then over its tail."""
    if digests.size:
        crc = zlib.crc32(digests.data, crc)  # (.data: the array's memoryview, a Buffer to the stubs on 3.11)
    return zlib.crc32(buf[digests.size * CHECKSUM_BLOCK :].data, crc)


MIN_RANGE_BLOCKS = 16  # 16 MiB: a range's hand-off to a thread costs ~20 us, its digests ~2 ms
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def digest_threads() -> int:
    """Threads that digest a snapshot's blocks while it is copied (DP_CHECKSUM_THREADS; default half the cores,
    at most 4; 0: inline, after the copy). numpy's einsum releases the GIL: they run in parallel."""
    value = os.environ.get("DP_CHECKSUM_THREADS", "")
    if value.strip().isdigit():
        return int(value)
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _pool(threads: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="dp-digest")
        return _POOLS[threads]


class BlockDigester:
    """block_digests of a buffer that is still being written in order (a capture's copy): each range of whole
    blocks that became final (ready()) is digested on `threads` threads meanwhile; digests() waits for the last.
    The result equals block_digests(data, plan): the checksum is the same, only sooner."""

    def __init__(self, data: Any, plan: CheckPlan | None, threads: int):
        self.buf = _uint8(data)
        self.plan = plan
        self.blocks = self.buf.size // CHECKSUM_BLOCK
        self.out = np.zeros(self.blocks, dtype=np.int64)
        self.threads = threads
        self.done_to = 0  # blocks below this are digested or on their way
        self.futures: list[Future] = []

    def ready(self, upto: int, wait: Callable[[], Any] | None = None) -> None:
        """The buffer's first `upto` bytes are final (once `wait()` returns, for a device copy in flight)."""
        end = min(upto // CHECKSUM_BLOCK, self.blocks)
        if end - self.done_to < MIN_RANGE_BLOCKS and end < self.blocks:
            return
        start, self.done_to = self.done_to, end
        if end <= start:
            return
        if self.threads <= 0:
            self._digest(start, end, wait)
            return
        step = max(MIN_RANGE_BLOCKS, -(-(end - start) // self.threads))
        for a in range(start, end, step):
            self.futures.append(_pool(self.threads).submit(self._digest, a, min(end, a + step), wait))

    def _digest(self, start: int, stop: int, wait: Callable[[], Any] | None) -> None:
        if wait is not None:
            wait()
        part = self.buf[start * CHECKSUM_BLOCK : stop * CHECKSUM_BLOCK]
        self.out[start:stop] = block_digests(part, self.plan, first=start)

    def digests(self) -> np.ndarray:
        self.ready(self.buf.size)
        for future in self.futures:
            future.result()  # (raises what a digest raised)
        self.futures = []
        return self.out

    def checksum(self, meta: Any) -> tuple[int, np.ndarray]:
        """checksum_and_digests(meta, data, plan), the digests this digester made."""
        digests = self.digests()
        return _fold(self.buf, digests, zlib.crc32(meta)), digests

