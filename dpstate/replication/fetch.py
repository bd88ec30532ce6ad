"""Pulling one snapshot back from a replica store: FetchSnapshot, then SnapshotData and its SnapshotChunk
messages, each chunk copied into a Slot (a host buffer for one snapshot) while the next is on its way.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import zmq

from dpcommon import protocol as P
from dpcommon.checksum import BlockDigester, CheckPlan
from dpcommon.memory import huge_page_buffer

from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.snapshot.shared import PageLockError, SharedBuffer


FETCHED = ("fetched",)  # Slot.layout of a fetched snapshot: the next capture into that slot zeroes it first


class ReplicationError(RuntimeError):
    """The replica holder refused a snapshot (after retries), or a fetched snapshot is missing or corrupt."""


@dataclass
class Slot:
    """One host buffer holding (at most) one complete snapshot."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    step: int = -1  # -1: empty or being written
    meta: bytes = b""
    nbytes: int = 0
    checksum: int = 0
    capture_s: float = 0.0
    shared: SharedBuffer | None = None  # the buffer's memory, when the node's agent may map it
    digests: Any = None  # dpcommon.checksum.block_digests of the data, when captured into a shared buffer
    plan: CheckPlan | None = None  # which blocks its checksum digests (None: all)
    layout: Any = ()  # the tensor specs last captured here (FETCHED: a fetched snapshot's; (): new memory)
    share_refused: bool = False  # CUDA would not page-lock a shared buffer: private pinned ones from then on
    live: bool = False  # the optimizer's state lies in it (dpstate.snapshot.landing): written by the step, not a copy

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def reserve(self, nbytes: int, pin: bool, share: bool = False) -> None:
        """Make room for `nbytes` about to be written (a shared buffer counts the write: see dpstate.snapshot.shared).
        Shared and pinned: a page-locked shared buffer, or a private pinned one where CUDA refuses that."""
        self.step, self.digests, self.plan = -1, None, None
        share = share and not self.share_refused
        if self.buffer.numel() < nbytes or (self.shared is not None) != share:
            self.release()  # drop the old one first (peak memory)
            if share:
                try:
                    self.shared = SharedBuffer(max(nbytes, 1), page_locked=pin)
                except PageLockError as exc:
                    print(f"dpstate: {exc}; this buffer is a private pinned one (its snapshots are sent whole)",
                          file=sys.stderr, flush=True)
                    self.share_refused = True
            if self.shared is not None:
                self.buffer = self.shared.tensor
            elif pin:
                self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            else:  # written at once from end to end: huge pages fault it in faster (a restore's fetch)
                self.buffer = torch.frombuffer(huge_page_buffer(nbytes), dtype=torch.uint8)
        if self.shared is not None:
            self.shared.begin_write()

    def prefault(self) -> None:
        """Fault the buffer's memory in now (a spare's, made room in while idle), so that writing it later
        costs no page faults; a page-locked buffer is resident already."""
        if self.shared is not None:
            self.shared.populate()
        elif not self.buffer.is_pinned():
            self.buffer.zero_()

    def seal(self, meta: Any, nbytes: int, plan: CheckPlan | None, digester: BlockDigester | None = None) -> int:
        """The checksum of meta + the buffer's first `nbytes` with `plan` (the meta's), from `digester`'s digests
        where it made them while the buffer was copied; a shared buffer keeps the block digests too (the same
        pass), which its node's agent is told."""
        if digester is not None:
            crc, digests = digester.checksum(meta)
        else:
            crc, digests = S.checksum_and_digests(meta, self.buffer[:nbytes], plan)
        self.plan = plan
        self.digests = digests if self.shared is not None else None
        return crc

    def prepare_layout(self, specs: list, nbytes: int) -> None:
        """Before a capture with `specs`: where the buffer last held another layout, zero it, so that the
        padding between tensors is the same on every rank (data parallel blocks are compared and trusted
        whole; a block whose padding kept another layout's bytes would differ)."""
        if self.layout and self.layout != specs:
            self.buffer[:nbytes].zero_()
        self.layout = specs

    def release(self) -> None:
        """Empty, its memory given back."""
        self.step, self.nbytes, self.shared, self.digests, self.plan, self.layout = -1, 0, None, None, None, ()
        self.live = False
        self.buffer = torch.empty(0, dtype=torch.uint8)


@dataclass
class Received:
    """A fetched snapshot in its slot (meta and size set; its step and checksum are the caller's to set once it
    checked `digester`'s checksum against the reply's)."""

    slot: Slot
    reply: P.SnapshotData
    digester: BlockDigester  # the data's block digests, made on other threads as the chunks came in


def receive_snapshot(ctx: zmq.Context, codec: P.Codec, abort: AbortSignal, endpoint: str, rank: int, step: int,
                     timeout: float, reserve: Callable[[int], Slot], digest_threads: int, streams: int = 1) -> Received:
    """Ask the store at `endpoint` for rank's snapshot of `step` over `streams` connections and receive it into
    reserve(data size), each chunk at its place whichever connection brought it, each range of chunks digested on
    `digest_threads` threads while the next arrive (a restore costs about its transfer, not the transfer plus the
    check). ReplicationError: not held, a meta without a check plan, connections that disagree, or not received
    whole in `timeout` s; Aborted when `abort` is triggered meanwhile."""
    socks = []
    try:
        for stream in range(streams):
            sock = ctx.socket(zmq.DEALER)
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send_multipart(codec.encode(P.FetchSnapshot(rank=rank, step=step, stream=stream, streams=streams)))
        deadline = time.monotonic() + timeout
        late = f"no SnapshotData from {endpoint} for rank {rank} step {step} in {timeout} s"
        replies = [_reply(sock, codec, abort, deadline, late, rank, step) for sock in socks]
        msg, payload = replies[0]
        if not msg.found or not payload:
            raise ReplicationError(f"the replica store at {endpoint} has no snapshot of rank {rank} step {step}")
        if any(other != msg for other, _ in replies[1:]):  # (replaced between two of the requests)
            raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: the connections to {endpoint} "
                                   "were answered with different copies")
        meta = bytes(P.payload_bytes(payload[0]))
        try:
            plan = CheckPlan.from_meta(meta)
        except ValueError as exc:
            raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: {exc}") from None
        nbytes = msg.nbytes - len(meta)
        slot = reserve(max(nbytes, 0))
        data = slot.buffer[: max(nbytes, 0)]
        digester = BlockDigester(data.numpy(), plan, digest_threads)
        readers = [_ChunkReader(sock, codec, msg, abort, deadline, endpoint, stream, streams)
                   for stream, sock in enumerate(socks)]
        if _receive_into(readers, data, digester.ready) != nbytes:
            raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: size mismatch")
        slot.meta, slot.nbytes = meta, nbytes
        return Received(slot, msg, digester)
    finally:
        for sock in socks:
            sock.close(0)


def _reply(sock: Any, codec: P.Codec, abort: AbortSignal, deadline: float, late: str, rank: int,
           step: int) -> tuple[P.SnapshotData, list]:
    """The SnapshotData answering this connection's FetchSnapshot, with its payload (the meta, on stream 0)."""
    while True:
        _await(sock, abort, deadline, late)
        head = _recv_head(sock, 5)  # the message's 4 frames, then the meta
        _drain(sock)
        try:
            msg, payload = codec.decode(head)
        except P.ProtocolError:
            continue
        if isinstance(msg, P.SnapshotData) and msg.rank == rank and msg.step == step:
            return msg, payload


def _receive_into(readers: list[_ChunkReader], buffer: torch.Tensor, received: Callable[[int], Any]) -> int:
    """Each reader's chunks copied to their place in `buffer` as they come, whichever connection is ready first;
    received(n) each time the first n bytes are all there. Returns where the chunks end, back to back; data that
    does not fit is dropped (the end then differs from the buffer's size). ReplicationError: a chunk missing, out
    of order on its connection, not where the one before it ended, or not in time."""
    view = buffer.numpy().data  # memoryview(array), which numpy's stubs accept only from Python 3.12 on
    pending = [r for r in readers if r.index < r.reply.chunks]
    poller = zmq.Poller()
    for reader in pending:
        poller.register(reader.sock, zmq.POLLIN)
    placed: dict[int, tuple[int, int]] = {}  # chunk index -> (offset, size)
    prefix = end = 0  # the chunks all there from the first on, and where the last of them ends
    while pending:
        ready = {sock for sock, _ in poller.poll(50)}
        pending[0].abort.check()
        for reader in list(pending):
            if reader.sock not in ready and time.monotonic() <= reader.deadline:
                continue
            chunk = reader.expect()
            placed[chunk.index] = (chunk.offset, reader.payload_into(view, chunk.offset))
            if reader.index >= reader.reply.chunks:
                pending.remove(reader)
                poller.unregister(reader.sock)
        if prefix not in placed:
            continue
        while prefix in placed:
            offset, size = placed.pop(prefix)
            if offset != end:
                raise ReplicationError(f"chunk {prefix} of rank {readers[0].reply.rank} step {readers[0].reply.step} "
                                       f"starts at byte {offset}, not where the chunks before it end ({end})")
            prefix, end = prefix + 1, end + size
        received(min(end, len(view)))
    return end


def _await(sock: Any, abort: AbortSignal, deadline: float, late: str) -> None:
    """Wait (abortably) until a message is ready; ReplicationError(late) past `deadline`."""
    while True:
        abort.check()
        if time.monotonic() > deadline:
            raise ReplicationError(late)
        if sock.poll(50):
            return


def _recv_head(sock: Any, nframes: int) -> list:
    """Receive the first `nframes` frames of the next message (fewer if it has fewer); the rest stay queued."""
    head = [sock.recv(copy=False)]
    while len(head) < nframes and sock.get(zmq.RCVMORE):
        head.append(sock.recv(copy=False))
    return head


def _drain(sock: Any) -> None:
    """Receive and drop the rest of a multipart message."""
    while sock.get(zmq.RCVMORE):
        sock.recv(copy=False)


@dataclass
class _ChunkReader:
    """One connection's share of the SnapshotChunk messages that follow a SnapshotData reply: chunks `stream`,
    `stream` + `streams`, ... in that order."""

    sock: Any
    codec: P.Codec
    reply: P.SnapshotData
    abort: AbortSignal
    deadline: float
    endpoint: str
    stream: int = 0
    streams: int = 1

    def __post_init__(self) -> None:
        self.index = self.stream  # the next chunk this connection brings

    def expect(self) -> P.SnapshotChunk:
        """Receive the next chunk's header (its payload frame is left for payload_into). ReplicationError:
        another message, or none in time."""
        index = self.index
        what = f"chunk {index} of {self.reply.chunks} of rank {self.reply.rank} step {self.reply.step}"
        _await(self.sock, self.abort, self.deadline, f"{what} did not come from {self.endpoint} in time")
        msg: P.Message | P.ProtocolError
        try:
            msg, _ = self.codec.decode(_recv_head(self.sock, 4))
        except P.ProtocolError as exc:
            msg = exc
        if not (isinstance(msg, P.SnapshotChunk) and msg.offset >= 0
                and (msg.rank, msg.step, msg.index) == (self.reply.rank, self.reply.step, index)):
            _drain(self.sock)
            raise ReplicationError(f"{what}: {self.endpoint} sent {msg!r} instead")
        self.index += self.streams
        return msg

    def payload_into(self, view: memoryview, offset: int) -> int:
        """Copy the chunk's payload to `view` at `offset` (what does not fit is dropped); its size."""
        size = 0
        while self.sock.get(zmq.RCVMORE):
            room = view[offset + size :] if offset + size < len(view) else view[:0]
            size += self.sock.recv_into(room) if len(room) else len(self.sock.recv(copy=False))
        return size
