"""Background snapshots: copy a state tree into a reusable host buffer, send it to the replica holder, await its ack.

Keeps a ring of three buffers (the newest two complete snapshots stay intact while the next is captured);
fetch() pulls a snapshot back from a replica store and verifies its checksum.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from dpagent import protocol as P

from . import snapshot as S
from .abort import AbortSignal

NSLOTS = 3


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

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def reserve(self, nbytes: int, pin: bool) -> None:
        self.step = -1
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)


@dataclass
class _Job:
    step: int
    slot: Slot
    tree: Any = None  # None: the slot is already packed (a re-put after restore)
    event: Any = None  # CUDA event recorded after the step, waited by the copy stream
    seq: int = 0


class Replicator:
    """Owned by the session; its thread captures and replicates, the main thread waits in the pre-step hook."""

    def __init__(self, codec: P.Codec, rank: int, abort: AbortSignal, ctx: zmq.Context | None = None):
        self.codec, self.rank, self.abort = codec, rank, abort
        self.ctx = ctx or zmq.Context.instance()
        self.pin = torch.cuda.is_available()
        self.slots = [Slot() for _ in range(NSLOTS)]
        self.generation = -1
        self.endpoint = ""
        self.last_capture_s = 0.0
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._busy = False
        self._active: _Job | None = None
        self._epoch = 0  # bumped by quiesce(): the thread drops what it is doing
        self._submitted = 0  # sequence number of the newest job handed over
        self._acked = 0  # ... and of the newest one acked
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dpstate-replication", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread

    def configure(self, generation: int, replica_to: str, rank: int) -> None:
        """Send future snapshots of `rank` to `replica_to` ('' = keep them local only). Call when quiet."""
        with self._cond:
            self.generation, self.endpoint, self.rank = generation, replica_to, rank
            self._cond.notify_all()

    def submit(self, step: int, tree: Any) -> None:
        """Capture `tree` (the state after `step`) in the background and replicate it. Its containers must be
        its own and its tensors unchanged until wait_acked() returns (the optimizer pre-step hook)."""
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()  # the copy stream waits for the step's kernels
        with self._cond:
            slot = self._free_slot(step)
            slot.step = -1
            self._submitted += 1
            self._queue.append(_Job(step, slot, tree, event, self._submitted))
            self._cond.notify_all()

    def submit_packed(self, slot: Slot) -> None:
        """Replicate a slot that already holds a complete snapshot (the state just restored)."""
        with self._cond:
            self._submitted += 1
            self._queue.append(_Job(slot.step, slot, seq=self._submitted))
            self._cond.notify_all()

    def wait_acked(self, timeout: float | None = None) -> None:
        """Block (abortably) until every submitted snapshot is captured and acked by the replica holder."""
        self.abort.wait_for(self._cond, lambda: self._acked >= self._submitted or self._error is not None, timeout)
        if self._error is not None:
            raise self._error

    def quiesce(self) -> None:
        """Drop queued work and wait until the thread stopped touching tensors (bounded by one tensor copy)."""
        with self._cond:
            self._epoch += 1
            self._queue.clear()
            self._acked = self._submitted
            self._error = None
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy)

    def local(self, step: int) -> Slot | None:
        """The complete local snapshot of `step`, if still held."""
        with self._cond:
            for slot in self.slots:
                if slot.step == step and step >= 0:
                    return slot
        return None

    def forget_after(self, step: int) -> None:
        """Drop local snapshots newer than `step` (a rollback abandons them)."""
        with self._cond:
            for slot in self.slots:
                if slot.step > step:
                    slot.step = -1

    def local_steps(self) -> list[int]:
        with self._cond:
            return sorted(s.step for s in self.slots if s.step >= 0)

    def _free_slot(self, step: int) -> Slot:
        """An empty slot, else the one with the oldest snapshot; never one the thread works on. Under _cond."""
        in_use = [j.slot for j in self._queue] + ([self._active.slot] if self._active is not None else [])
        candidates = [s for s in self.slots if not any(s is u for u in in_use)]
        if not candidates:
            raise RuntimeError("no free snapshot buffer: snapshots are submitted faster than they are acked")
        return min(candidates, key=lambda s: s.step)

    # ------------------------------------------------------------------ fetch (main thread, own socket)

    def fetch(self, endpoint: str, rank: int, step: int, timeout: float = 60.0) -> Slot:
        """Pull rank's snapshot of `step` from the replica store at `endpoint` into a local slot."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            sock.send_multipart(self.codec.encode(P.FetchSnapshot(rank=rank, step=step)))
            deadline = time.monotonic() + timeout
            while True:
                self.abort.check()
                if time.monotonic() > deadline:
                    raise ReplicationError(f"no SnapshotData from {endpoint} for rank {rank} step {step} in {timeout} s")
                if not sock.poll(50):
                    continue
                try:
                    msg, payload = self.codec.decode(sock.recv_multipart(copy=False))
                except P.ProtocolError:
                    continue
                if isinstance(msg, P.SnapshotData) and msg.rank == rank and msg.step == step:
                    break
            if not msg.found or len(payload) != 2:
                raise ReplicationError(f"the replica store at {endpoint} has no snapshot of rank {rank} step {step}")
            meta, data = bytes(P.payload_bytes(payload[0])), P.payload_bytes(payload[1])
            if msg.nbytes != len(meta) + data.nbytes:
                raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: size mismatch")
            with self._cond:
                slot = self._free_slot(step)
                slot.reserve(data.nbytes, self.pin)
            slot.buffer[: data.nbytes].copy_(S._as_uint8(data))
            slot.meta, slot.nbytes = meta, data.nbytes
            try:
                S.verify(meta, slot.data, msg.checksum)
            except S.SnapshotError as exc:
                raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: {exc}") from None
            slot.checksum, slot.step = msg.checksum, step
            return slot
        finally:
            sock.close(0)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        sock, connected = None, None
        copy_stream = None
        while True:
            with self._cond:
                self._busy, self._active = False, None
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._queue))
                job, epoch = self._queue.pop(0), self._epoch
                endpoint, generation, rank = self.endpoint, self.generation, self.rank
                self._busy, self._active = True, job
            try:
                if job.tree is not None:
                    if job.event is not None and copy_stream is None:
                        copy_stream = torch.cuda.Stream()
                    if not self._capture(job, epoch, copy_stream):
                        continue
                if endpoint and (sock is None or connected != endpoint):
                    if sock is not None:
                        sock.close(0)
                    sock, connected = self.ctx.socket(zmq.DEALER), endpoint
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(endpoint)
                ok = self._replicate(sock, job, epoch, generation, rank) if endpoint else True
                with self._cond:
                    if epoch == self._epoch and ok:
                        self._acked = max(self._acked, job.seq)
                        self._cond.notify_all()
            except BaseException as exc:  # keep the thread alive; the pre-step hook reports the error
                with self._cond:
                    if epoch == self._epoch:
                        self._error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
                        self._cond.notify_all()

    def _capture(self, job: _Job, epoch: int, stream: Any) -> bool:
        """Pack job.tree into its slot: meta first, then each tensor copied and checksummed while in cache."""
        t0 = time.perf_counter()
        skeleton, tensors = S.flatten(job.tree)
        specs, nbytes = S.layout(tensors)
        meta = S.encode_meta(skeleton, specs, nbytes, {"step": job.step, "rank": self.rank})
        slot = job.slot
        slot.reserve(nbytes, self.pin)
        slot.nbytes = 0
        ends = [spec.offset for spec in specs[1:]] + [nbytes]
        crc = zlib.crc32(meta)
        if stream is not None:
            stream.wait_event(job.event)
            with torch.cuda.stream(stream):
                S.copy_into(tensors, specs, slot.buffer, non_blocking=True)
            stream.synchronize()
            crc = zlib.crc32(slot.buffer[:nbytes].numpy(), crc) if nbytes else crc
        else:
            view = slot.buffer.numpy()
            for t, spec, end in zip(tensors, specs, ends):
                if epoch != self._epoch:
                    return False
                S.copy_into([t], [spec], slot.buffer)
                crc = zlib.crc32(view[spec.offset : end], crc)
        job.tree = tensors = None  # the step's tensors may now change
        slot.meta, slot.nbytes, slot.checksum = meta, nbytes, crc
        slot.capture_s = self.last_capture_s = time.perf_counter() - t0
        with self._cond:
            if epoch != self._epoch:
                slot.step = -1
                return False
            slot.step = job.step
        return True

    def _replicate(self, sock: zmq.Socket, job: _Job, epoch: int, generation: int, rank: int) -> bool:
        slot, error = job.slot, ""
        for _attempt in range(3):
            msg = P.PutSnapshot(rank=rank, step=job.step, generation=generation, checksum=slot.checksum,
                                nbytes=len(slot.meta) + slot.nbytes)
            data = slot.data.numpy() if slot.nbytes else b""
            sock.send_multipart(self.codec.encode(msg, [slot.meta, data]), copy=False)
            while True:
                if epoch != self._epoch:
                    return False
                if not sock.poll(50):
                    continue
                try:
                    ack, _ = self.codec.decode(sock.recv_multipart())
                except P.ProtocolError:
                    continue
                if isinstance(ack, P.SnapshotAck) and ack.rank == rank and ack.step == job.step:
                    break
            if ack.ok:
                return True
            error = ack.error
        raise ReplicationError(f"the replica store refused rank {rank} step {job.step}: {error}")
