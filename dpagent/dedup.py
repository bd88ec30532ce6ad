"""Dedup for a replica holder: its own node's snapshots, mapped read-only from the workers' shared buffers,
and the offers of peers' snapshots, held by reference to the identical blocks of those (data parallel state).

Data parallel ranks hold the same parameters and optimizer state after every step; only a few blocks (the
RNG state) differ. A peer offers its block digests (OfferSnapshot); the holder asks for the blocks that its
own node's snapshot of that step lacks (SnapshotWants) and keeps the rest as views of that snapshot's memory.
The data parallel blocks that a snapshot's CheckPlan leaves undigested are trusted: kept by reference when both
snapshots lay that state out alike, while the sampled ones are compared (see decide). A fetch checks the
checksum over what was digested, and a local buffer written again (its write counter moved on) makes every
copy that refers to it stale (served as not held).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from dpcommon.checksum import CHECKSUM_BLOCK, CheckPlan
from dpcommon.protocol import CHUNK_BYTES, LocalSnapshot, OfferSnapshot, payload_bytes

OFFER_WAIT_S = 2.0  # how long an offer waits for the local snapshot of its step before it is asked for whole
EXPECT_RESTORE_S = 30.0  # after a Reconfigure, how long its restore step counts as coming (see LocalCopies.expect)
KEEP_PER_WORKER = 2  # local copies kept per worker: its ring (dpstate.replication.replicator.NSLOTS)


@dataclass(eq=False)
class LocalCopy:
    """One local worker's snapshot, by reference. The shared buffer's first 8 bytes count its writes."""

    rank: int
    step: int
    nbytes: int
    writes: int
    counter: np.ndarray  # a read-only view of the buffer's write counter
    data: memoryview  # a read-only view of the data
    digests: np.ndarray
    plan: CheckPlan | None = None  # which blocks its digests cover (None: all)

    def valid(self) -> bool:
        """Still the bytes that were announced (the worker has not written the buffer again)?"""
        return int(self.counter[0]) == self.writes


class LocalCopies:
    """The newest snapshot in each of this node's workers' shared buffers (LocalSnapshot announcements)."""

    def __init__(self, local_pids: Callable[[], Iterable[int]]):
        self._pids = local_pids
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}  # (pid, fd, inode) -> read-only mapping
        self._copies: dict[tuple[int, int], LocalCopy] = {}  # (pid, fd) -> what that buffer holds
        self._expected = (-1, 0.0)  # a step a local worker is about to hold (a restore), and until when

    def announce(self, msg: LocalSnapshot, payload: list) -> str:
        """Map the buffer a LocalSnapshot names (once per buffer) and take note of its copy; "" or why not."""
        pids = set(self._pids())
        for key in [k for k in self._maps if k[0] not in pids]:  # workers gone: their memory can go too
            del self._maps[key]
        for pair in [k for k in self._copies if k[0] not in pids]:  # (pid, fd): a mapping's key adds the inode
            del self._copies[pair]
        if msg.pid not in pids:
            return f"pid {msg.pid} is not a worker of this node"
        if len(payload) != 1:
            return f"expected 1 payload frame (the block digests), got {len(payload)}"
        digests = np.frombuffer(bytes(payload_bytes(payload[0])), dtype=np.int64)
        if msg.nbytes < 0 or digests.size != msg.nbytes // CHECKSUM_BLOCK:
            return f"{digests.size} block digests for {msg.nbytes} bytes"
        try:
            plan = CheckPlan.from_json(msg.checks)
        except ValueError as exc:
            return str(exc)
        key = (msg.pid, msg.fd, msg.inode)
        if key not in self._maps:
            try:
                mapping = _map_worker_buffer(msg.pid, msg.fd, msg.inode)
            except OSError as exc:
                return f"cannot map fd {msg.fd} of worker {msg.pid}: {exc}"
            for old in [k for k in self._maps if k[:2] == key[:2]]:  # the fd now names another buffer
                del self._maps[old]
            self._maps[key] = mapping
        mapping = self._maps[key]
        if msg.offset < 8 or msg.offset + msg.nbytes > len(mapping):
            return f"bytes {msg.offset}..{msg.offset + msg.nbytes} are outside the buffer ({len(mapping)} bytes)"
        data = memoryview(mapping)[msg.offset : msg.offset + msg.nbytes]
        counter = np.frombuffer(mapping, dtype=np.uint64, count=1)
        self._copies[key[:2]] = LocalCopy(msg.rank, msg.step, msg.nbytes, msg.writes, counter, data, digests, plan)
        self._prune(msg.pid)
        return ""

    def _prune(self, pid: int) -> None:
        """Keep a worker's KEEP_PER_WORKER newest copies that are still valid, and only the mappings they use
        (a buffer the worker replaced stays mapped only while a held snapshot refers to it)."""
        mine = sorted((c.step, k) for k, c in self._copies.items() if k[0] == pid and c.valid())
        keep = {k for _, k in mine[-KEEP_PER_WORKER:]}
        for key in [k for k in self._copies if k[0] == pid and k not in keep]:
            del self._copies[key]
        for mapped in [k for k in self._maps if k[0] == pid and k[:2] not in keep]:
            del self._maps[mapped]

    def of_step(self, step: int) -> list[LocalCopy]:
        """The valid local copies of `step`: one per worker that holds it, whatever ranks each carries."""
        return [c for c in self._copies.values() if c.step == step and c.valid()]

    def find(self, step: int, nbytes: int) -> LocalCopy | None:
        """A valid local copy of `step` with `nbytes` of data (the same layout), if any."""
        return next((c for c in self.of_step(step) if c.nbytes == nbytes), None)

    def newest_step(self) -> int:
        """The newest step announced by a local worker (-1: none): one behind an offer is worth waiting for."""
        return max((c.step for c in self._copies.values()), default=-1)

    def expect(self, step: int, until: float) -> None:
        """A local worker is restoring `step` (a Reconfigure): offers of it are worth waiting for until then,
        even from a node whose worker has no snapshot yet (a promoted spare)."""
        self._expected = (step, until)

    def coming(self, step: int, now: float) -> bool:
        """Is a local snapshot of `step` likely to be announced soon?"""
        return 0 <= self.newest_step() < step or (self._expected[0] == step and now < self._expected[1])


def _map_worker_buffer(pid: int, fd: int, inode: int) -> mmap.mmap:
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        if os.fstat(handle).st_ino != inode:
            raise OSError(f"fd {fd} of pid {pid} is not inode {inode} any more")
        return mmap.mmap(handle, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(handle)


@dataclass(eq=False)
class Offer:
    """A peer's OfferSnapshot: waiting for its step's local copy, then for the blocks it was asked for."""

    incoming: Any  # dpcommon.channel.Incoming (the reply goes to its sender)
    msg: OfferSnapshot
    meta: Any
    digests: np.ndarray
    data_nbytes: int
    deadline: float  # when it stops waiting for a local copy
    plan: CheckPlan | None = None  # which blocks its digests cover (None: all)
    tail: Any = b""  # the data past its last whole block, sent with the offer
    copy: LocalCopy | None = None
    wanted: list = field(default_factory=list)
    differs: list = field(default_factory=list)  # data parallel blocks digested on both sides that differ

    @property
    def nblocks(self) -> int:
        return -(-self.data_nbytes // CHECKSUM_BLOCK)


def parse_offer(incoming: Any, now: float) -> Offer | str:
    """An Offer from an OfferSnapshot's frames (meta, digests, tail), or why they are malformed."""
    msg, payload = incoming.msg, incoming.payload
    if len(payload) != 3:
        return f"expected 3 payload frames (meta, block digests, tail), got {len(payload)}"
    meta_len = payload_bytes(payload[0]).nbytes
    data_nbytes = msg.nbytes - meta_len
    digests = np.frombuffer(bytes(payload_bytes(payload[1])), dtype=np.int64)
    if data_nbytes < 0 or digests.size != data_nbytes // CHECKSUM_BLOCK:
        return f"{digests.size} block digests for {msg.nbytes} bytes with {meta_len} of meta"
    if payload_bytes(payload[2]).nbytes != data_nbytes % CHECKSUM_BLOCK:
        return f"a tail of {payload_bytes(payload[2]).nbytes} bytes for {data_nbytes} bytes of data"
    try:
        plan = CheckPlan.from_json(msg.checks)
    except ValueError as exc:
        return str(exc)
    return Offer(incoming, msg, payload[0], digests, data_nbytes, now + OFFER_WAIT_S, plan, payload[2])


def decide(offer: Offer, local: LocalCopies, now: float) -> bool:
    """Settle which whole blocks `offer` needs (offer.copy, offer.wanted, offer.differs; the tail came with it);
    False: wait for the local snapshot of its step (a local worker is behind it and the offer's wait has time
    left).

    Any local copy of the offer's step serves, of the same size or not: a process that carries other ranks
    than the offer's sender (a narrow job, and the restore step re-captured after a shrink or a grow) lays out
    the same data parallel part first, and only its per-rank part after it differs. Waiting for a copy of the
    offer's very size would sit out OFFER_WAIT_S (the restore step is expected) for a copy that never comes.
    Of several (one per local worker), the one that spares the most blocks, a same-sized one on a tie.

    A block the offer digested is kept by reference when the local copy digested it too, with the same digest.
    A block it left unchecked (data parallel state, trusted) is kept by reference only when both snapshots
    lay that state out alike (the same shared_key and shared_blocks), and only while every data parallel
    block digested on both sides matches: one that differs (offer.differs) means the ranks diverged, and the
    offer's unchecked blocks are asked for too. Blocks past the local copy's end are asked for."""
    copies = local.of_step(offer.msg.step)
    if not copies and now < offer.deadline and local.coming(offer.msg.step, now):
        return False
    blocks = offer.digests.size
    offer.copy, offer.wanted, offer.differs = None, list(range(blocks)), []
    for copy in copies:
        wanted, differs = _match(offer, copy)
        if len(wanted) < len(offer.wanted) or (len(wanted) == len(offer.wanted) and copy.nbytes == offer.data_nbytes):
            offer.copy, offer.wanted, offer.differs = copy, wanted, differs
    return True


def _match(offer: Offer, copy: LocalCopy) -> tuple[list, list]:
    """(the blocks `offer` needs, its data parallel blocks that differ) against one local copy (see decide)."""
    blocks = offer.digests.size
    common = min(blocks, copy.digests.size)  # the whole blocks that both hold (sizes differ: other ranks carried)
    present = np.arange(blocks) < common
    theirs = np.zeros(blocks, dtype=np.int64)
    theirs[:common] = copy.digests[:common]
    unchecked = offer.plan.unchecked(blocks) if offer.plan else np.zeros(blocks, dtype=bool)
    local_unchecked = copy.plan.unchecked(blocks) if copy.plan else np.zeros(blocks, dtype=bool)
    compared = ~unchecked & ~local_unchecked & present
    differ = compared & (offer.digests != theirs)
    trusted = (offer.plan is not None and copy.plan is not None and offer.plan.shared_key == copy.plan.shared_key
               and offer.plan.shared_blocks == copy.plan.shared_blocks)
    shared = present & (np.arange(blocks) < (offer.plan.shared_blocks if trusted and offer.plan is not None else 0))
    differs = np.flatnonzero(differ & shared).tolist()
    keep = (compared & ~differ) | (unchecked & shared & (not differs))
    return np.flatnonzero(~keep).tolist(), differs


def assemble(offer: Offer, blocks: list) -> list | str:
    """The snapshot's data as frames: the blocks received (in offer.wanted's order) and the local copy's for
    the rest, runs of these joined into views of up to CHUNK_BYTES (a fetch then sends as few messages as a
    snapshot received whole); or why it cannot be (the wrong number of blocks, or the local copy written since)."""
    if len(blocks) != len(offer.wanted):
        return f"expected {len(offer.wanted)} blocks, got {len(blocks)}"
    if offer.copy is not None and not offer.copy.valid():
        return "this node's copy of those blocks changed meanwhile; offer the snapshot again"
    received = dict(zip(offer.wanted, blocks))
    if offer.nblocks > offer.digests.size:
        received[offer.digests.size] = offer.tail
    frames: list = []
    start = None  # the first block of the current run of local blocks (adjacent in the local buffer)
    for i in range(offer.nblocks + 1):
        if start is not None and (i == offer.nblocks or i in received or (i - start) * CHECKSUM_BLOCK == CHUNK_BYTES):
            assert offer.copy is not None  # a block not received is the local copy's (without one, all are wanted)
            frames.append(offer.copy.data[start * CHECKSUM_BLOCK : i * CHECKSUM_BLOCK])
            start = None
        if i in received:
            frames.append(received[i])
        elif start is None and i < offer.nblocks:
            start = i
    return frames or [b""]
