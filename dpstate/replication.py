"""Background snapshots: copy a state tree into a reusable host buffer, send it to the replica holder, await its ack.

Keeps a ring of three buffers (the newest two complete snapshots stay intact while the next is captured);
fetch() pulls a snapshot back from a replica store and verifies its checksum. SnapshotPolicy says which steps
are snapshotted (DP_SNAPSHOT_INTERVAL: every step, every N-th, off, or auto: measured against a budget).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
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

NSLOTS = 4  # local snapshots kept: a survivor may have to roll back 3 steps (see dprun.controller._survivor_floors)


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
    borrowed: bool = False  # buffer is a received ZeroMQ frame (a fetch, zero-copy): never written into

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def reserve(self, nbytes: int, pin: bool) -> None:
        self.step = -1
        if self.borrowed or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # drop the old one first (peak memory)
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.borrowed = False


@dataclass
class _Job:
    step: int
    slot: Slot
    tree: Any = None  # None: the slot is already packed (a re-put after restore)
    event: Any = None  # CUDA event recorded after the step, waited by the copy stream
    seq: int = 0
    device: int = 0  # the CUDA device of the step (the copy stream is made on it)


class Replicator:
    """Owned by the session; its thread captures and replicates, the main thread waits in the pre-step hook."""

    def __init__(self, codec: P.Codec, rank: int, abort: AbortSignal, ctx: zmq.Context | None = None):
        self.codec, self.rank, self.abort = codec, rank, abort
        # Its own context: one ZeroMQ I/O thread for the snapshot traffic only (control messages never queue
        # behind a snapshot), which can be given a lower priority with this thread (DP_SNAPSHOT_NICE).
        try:
            before = set(os.listdir("/proc/self/task"))
        except OSError:
            before = set()
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.socket(zmq.DEALER).close(0)  # starts the I/O thread now
        _lower_io_threads(before)
        self.pin = torch.cuda.is_available()
        self.slots = [Slot() for _ in range(NSLOTS)]
        self.generation = -1
        self.endpoints: list[str] = []  # replica stores that get every snapshot
        self.last_capture_s = 0.0
        self.policy = SnapshotPolicy.from_env()
        self.stats = SnapshotStats()
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
        if os.environ.get("DP_SNAPSHOT_PROFILE"):
            import atexit

            atexit.register(write_profile, self)

    # ------------------------------------------------------------------ main thread

    def configure(self, generation: int, replica_to: str | list[str], rank: int) -> None:
        """Send future snapshots of `rank` to every replica store in `replica_to` (none = keep them local
        only); a snapshot counts as acked once every one of them holds it. Call when quiet."""
        endpoints = [replica_to] if isinstance(replica_to, str) else list(replica_to)
        with self._cond:
            self.generation, self.endpoints, self.rank = generation, [e for e in endpoints if e], rank
            self._cond.notify_all()

    def submit(self, step: int, tree: Any) -> None:
        """Capture `tree` (the state after `step`) in the background and replicate it. Its containers must be
        its own and its tensors unchanged until wait_acked() returns (the optimizer pre-step hook).
        With snapshots off (policy), nothing is taken."""
        if not self.policy.enabled:
            return
        event, device = None, 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()  # the main thread's; a new thread starts on device 0
            event = torch.cuda.Event()
            event.record()  # the copy stream waits for the step's kernels
        with self._cond:
            slot = self._free_slot(step)
            slot.step = -1
            self._submitted += 1
            self._queue.append(_Job(step, slot, tree, event, self._submitted, device))
            self._cond.notify_all()

    def submit_packed(self, slot: Slot) -> None:
        """Replicate a slot that already holds a complete snapshot (the state just restored)."""
        with self._cond:
            self._submitted += 1
            self._queue.append(_Job(slot.step, slot, seq=self._submitted))
            self._cond.notify_all()

    def wait_acked(self, timeout: float | None = None) -> None:
        """Block (abortably) until every submitted snapshot is captured and acked by the replica holder."""
        if self._acked < self._submitted:
            t0 = time.perf_counter()
            try:
                self.abort.wait_for(self._cond, lambda: self._acked >= self._submitted or self._error is not None,
                                    timeout)
            finally:
                self.stats.waits += 1
                self.stats.wait_s += time.perf_counter() - t0
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
        """Pull rank's snapshot of `step` from the replica store at `endpoint` into a local slot (on CPU the
        received frame itself becomes the slot's buffer: no copy; with CUDA it is copied into pinned memory)."""
        t0 = time.perf_counter()
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
            t1 = time.perf_counter()
            with self._cond:
                slot = self._free_slot(step)
                if self.pin:
                    slot.reserve(data.nbytes, self.pin)
                else:
                    slot.step, slot.buffer, slot.borrowed = -1, torch.empty(0, dtype=torch.uint8), False
            if self.pin:
                slot.buffer[: data.nbytes].copy_(S._as_uint8(data))
            else:
                slot.buffer, slot.borrowed = S._as_uint8(data), True  # keeps the frame alive
            slot.meta, slot.nbytes = meta, data.nbytes
            t2 = time.perf_counter()
            try:
                S.verify(meta, slot.data, msg.checksum)
            except S.SnapshotError as exc:
                raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: {exc}") from None
            slot.checksum, slot.step = msg.checksum, step
            st = self.stats
            st.fetches, st.fetch_s, st.fetch_verify_s = st.fetches + 1, st.fetch_s + t1 - t0, st.fetch_verify_s + time.perf_counter() - t2
            return slot
        finally:
            sock.close(0)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        _lower_priority(threading.get_native_id())
        socks: dict[str, zmq.Socket] = {}  # replica endpoint -> our DEALER to it
        copy_stream = None
        while True:
            with self._cond:
                self._busy, self._active = False, None
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._queue))
                job, epoch = self._queue.pop(0), self._epoch
                endpoints, generation, rank = list(self.endpoints), self.generation, self.rank
                self._busy, self._active = True, job
            try:
                if job.tree is not None:
                    if job.event is not None and (copy_stream is None or copy_stream.device.index != job.device):
                        torch.cuda.set_device(job.device)  # this thread's current device: the worker's
                        copy_stream = torch.cuda.Stream(device=job.device)
                    if not self._capture(job, epoch, copy_stream):
                        continue
                for gone in set(socks) - set(endpoints):
                    socks.pop(gone).close(0)
                for endpoint in endpoints:
                    if endpoint not in socks:
                        socks[endpoint] = self.ctx.socket(zmq.DEALER)
                        socks[endpoint].setsockopt(zmq.LINGER, 0)
                        socks[endpoint].connect(endpoint)
                ok = self._replicate([socks[e] for e in endpoints], job, epoch, generation, rank)
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
        stats = self.stats
        skeleton, tensors = S.flatten(job.tree)
        specs, nbytes = S.layout(tensors)
        meta = S.encode_meta(skeleton, specs, nbytes, {"step": job.step, "rank": self.rank})
        slot = job.slot
        slot.reserve(nbytes, self.pin)
        slot.nbytes = 0
        ends = [spec.offset for spec in specs[1:]] + [nbytes]
        crc = zlib.crc32(meta)
        t1 = time.perf_counter()
        stats.meta_s += t1 - t0
        if stream is not None:
            stream.wait_event(job.event)
            with torch.cuda.stream(stream):
                S.copy_into(tensors, specs, slot.buffer, non_blocking=True)
            stream.synchronize()
            t2 = time.perf_counter()
            stats.copy_s += t2 - t1
            crc = zlib.crc32(slot.buffer[:nbytes].numpy(), crc) if nbytes else crc
            stats.crc_s += time.perf_counter() - t2
        else:
            view = slot.buffer.numpy()
            for t, spec, end in zip(tensors, specs, ends):
                if epoch != self._epoch:
                    return False
                ta = time.perf_counter()
                S.copy_into([t], [spec], slot.buffer)
                tb = time.perf_counter()
                crc = zlib.crc32(view[spec.offset : end], crc)
                stats.copy_s += tb - ta
                stats.crc_s += time.perf_counter() - tb
        job.tree = tensors = None  # the step's tensors may now change
        slot.meta, slot.nbytes, slot.checksum = meta, nbytes, crc
        slot.capture_s = self.last_capture_s = time.perf_counter() - t0
        stats.captures += 1
        stats.capture_s += slot.capture_s
        stats.bytes += nbytes + len(meta)
        with self._cond:
            if epoch != self._epoch:
                slot.step = -1
                return False
            slot.step = job.step
        return True

    def _replicate(self, socks: list, job: _Job, epoch: int, generation: int, rank: int) -> bool:
        """Send the slot to every replica store at once, then wait until each has acked it."""
        slot = job.slot
        msg = P.PutSnapshot(rank=rank, step=job.step, generation=generation, checksum=slot.checksum,
                            nbytes=len(slot.meta) + slot.nbytes)
        data = slot.data.numpy() if slot.nbytes else b""
        tries = {id(sock): 0 for sock in socks}
        waiting = list(socks)
        t0 = time.perf_counter()
        for sock in waiting:
            sock.send_multipart(self.codec.encode(msg, [slot.meta, data]), copy=False)
        poller = zmq.Poller()
        for sock in waiting:
            poller.register(sock, zmq.POLLIN)
        while waiting:
            if epoch != self._epoch:
                return False
            for sock, _ in poller.poll(50):
                try:
                    ack, _ = self.codec.decode(sock.recv_multipart())
                except P.ProtocolError:
                    continue
                if not (isinstance(ack, P.SnapshotAck) and ack.rank == rank and ack.step == job.step):
                    continue
                if ack.ok:
                    waiting.remove(sock)
                    poller.unregister(sock)
                    continue
                tries[id(sock)] += 1
                if tries[id(sock)] >= 3:
                    raise ReplicationError(f"the replica store refused rank {rank} step {job.step}: {ack.error}")
                sock.send_multipart(self.codec.encode(msg, [slot.meta, data]), copy=False)
        if socks:
            self.stats.sends += 1
            self.stats.send_s += time.perf_counter() - t0
        return True


# A lower priority for the snapshot threads does not make their work smaller: where training keeps every core
# busy, the step waits for it in the optimizer pre-step hook anyway. Seen on a 2-core host shared with other
# jobs at nice 10: a 5 MB capture took 150 ms of wall time for 10 ms of CPU (other processes went first)
# while training waited. So by default they run as training does; DP_SNAPSHOT_NICE=N to try otherwise.
SNAPSHOT_NICE = int(os.environ.get("DP_SNAPSHOT_NICE", "0"))


def _lower_priority(tid: int) -> None:
    """Lower the scheduling priority of one thread (Linux: nice is per thread) by DP_SNAPSHOT_NICE (default 0:
    as training); used for the replication thread and the snapshot context's ZeroMQ I/O thread."""
    if SNAPSHOT_NICE <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + SNAPSHOT_NICE))
    except OSError:
        pass


def _lower_io_threads(before: set[str]) -> None:
    """Renice the ZeroMQ I/O threads that appeared since `before` (the tids of this process's tasks)."""
    try:
        for tid in set(os.listdir("/proc/self/task")) - before:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    _lower_priority(int(tid))
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------- profile


@dataclass
class SnapshotStats:
    """Where snapshot time goes in this worker (seconds summed over snapshots). The background thread's:
    meta (flatten + layout + torch.save of the skeleton), copy (tensors into the host buffer), crc (checksum),
    send (PutSnapshot handed to ZeroMQ until every SnapshotAck: the socket writes, the holder's receive, verify
    and store). The main thread's: wait (the optimizer pre-step hook blocked on the previous snapshot)."""

    captures: int = 0
    bytes: int = 0
    meta_s: float = 0.0
    copy_s: float = 0.0
    crc_s: float = 0.0
    capture_s: float = 0.0
    sends: int = 0
    send_s: float = 0.0
    waits: int = 0
    wait_s: float = 0.0
    fetches: int = 0
    fetch_s: float = 0.0  # request until the whole snapshot is received
    fetch_verify_s: float = 0.0

    def as_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        out["threads_cpu_s"] = thread_cpu_times()
        return out


def thread_cpu_times(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) per thread of a process, summed by thread name (Linux /proc; {} elsewhere).
    Python threads are named by their threading name, others (ZeroMQ's I/O thread, Gloo's) by the OS's."""
    names = {}
    if pid == "self":
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), comm)
        out[name] = round(out.get(name, 0.0) + cpu, 3)
    return out


def write_profile(rep: "Replicator") -> None:
    """At exit, with DP_SNAPSHOT_PROFILE=PATH: this rank's SnapshotStats as JSON in PATH.rank<R>.<pid>.json."""
    path = os.environ.get("DP_SNAPSHOT_PROFILE")
    if not path:
        return
    import json

    data = {"rank": rep.rank, "pid": os.getpid(), "policy": rep.policy.state_dict(), **rep.stats.as_dict()}
    try:
        with open(f"{path}.rank{rep.rank}.{os.getpid()}.json", "w") as f:
            json.dump(data, f)
    except OSError as exc:
        print(f"dpstate: cannot write the snapshot profile: {exc}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- policy

POLICY_NAME = "__dpstate_snapshot_policy__"  # the name under which an auto policy's decision is tracked
DEFAULT_BUDGET = 0.01
MAX_INTERVAL = 10_000


class SnapshotPolicy:
    """Which steps are snapshotted, from DP_SNAPSHOT_INTERVAL (dprun --snapshot-interval):

    * ``1`` (default) / ``N``: the state before training (step 0) and every step that is a multiple of N. The
      controller restores the newest step replicated for every rank, so a failure costs at most N + 1 steps
      (the ``+ 1``: a peer may finish one more step while the newest snapshot is still in flight).
    * ``off``: no snapshots at all (for comparison; a failure then cannot be recovered).
    * ``auto`` / ``auto:BUDGET``: measure what a snapshot costs and take the smallest interval that keeps the
      cost under BUDGET (a fraction of step time; DP_SNAPSHOT_BUDGET, default 0.01). After `warmup` steps
      snapshotted every step, `pairs` steps after a snapshot and `pairs` steps after none alternate; the cost
      of one snapshot is the median over adjacent pairs of (step after one - step after none), over the median
      step after none, the largest over the ranks (an all-reduce at the same step on every rank), and the
      interval is ceil(cost / budget).
      The decision is part of every snapshot (tracked as POLICY_NAME), so after a rollback all ranks, a
      promoted spare included, hold the same one; a rollback to before it measures again. Afterwards the
      steps that follow a snapshot keep being compared with those that do not, and every `refresh`
      snapshots (at a snapshot step, so again on every rank at once) the interval is decided anew.
    """

    def __init__(self, spec: str | None = "1", budget: float | str | None = None,
                 warmup: int = 3, pairs: int = 8, refresh: int = 4):
        text = (spec or "1").strip().lower()
        self.budget = float(budget) if budget not in (None, "") else DEFAULT_BUDGET
        if text.startswith("auto"):
            _, _, given = text.partition(":")
            if given:
                self.budget = float(given.rstrip("%")) / (100 if given.endswith("%") else 1)
            self.mode, self.interval = "auto", 1
        elif text in ("off", "0", "none", "never"):
            self.mode, self.interval = "off", 0
        else:
            try:
                self.interval = int(text)
            except ValueError:
                raise ValueError(f"DP_SNAPSHOT_INTERVAL must be a positive number, 'auto[:BUDGET]' or 'off', "
                                 f"got {spec!r}") from None
            if self.interval < 1:
                raise ValueError(f"DP_SNAPSHOT_INTERVAL must be at least 1 (or 'off'), got {spec!r}")
            self.mode = "fixed"
        if not 0 < self.budget < 1:
            raise ValueError(f"the snapshot budget must be a fraction between 0 and 1, got {self.budget:g}")
        self.warmup, self.pairs, self.refresh = max(0, warmup), max(1, pairs), max(1, refresh)
        self.decisions = 0
        self.decided = self.mode != "auto"
        self.cost: float | None = None  # measured fraction of a step's time that one snapshot costs (auto)
        self.decided_at = -1
        self._reset_samples()

    @classmethod
    def from_env(cls) -> "SnapshotPolicy":
        warmup, _, pairs = os.environ.get("DP_SNAPSHOT_AUTO_STEPS", "3,8").partition(",")
        return cls(os.environ.get("DP_SNAPSHOT_INTERVAL", "1"), os.environ.get("DP_SNAPSHOT_BUDGET"),
                   int(warmup or 3), int(pairs or 8))

    def __repr__(self) -> str:
        return f"SnapshotPolicy({self.describe()})"

    def describe(self) -> str:
        if self.mode == "off":
            return "off"
        if self.mode == "fixed":
            return f"every {self.interval} step(s)"
        if not self.decided:
            return f"auto (budget {self.budget:.1%}, measuring)"
        return (f"auto: one snapshot costs {self.cost:.2%} of a step, budget {self.budget:.1%} -> every "
                f"{self.interval} step(s), worst case {self.max_lost_steps} step(s) lost")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def max_lost_steps(self) -> int:
        """Steps a failure can cost at most with the interval in force (0 when off: everything is lost)."""
        if self.mode == "off":
            return 0
        return (self.interval if self.decided else 2) + 1

    # ------------------------------------------------------------------ schedule

    def _window(self) -> tuple[int, int]:
        start = (self._since or 0) + self.warmup
        return start, start + 2 * self.pairs  # measured steps: [start, end)

    def wants(self, step: int) -> bool:
        """Is `step` snapshotted? A pure function of the decision and the measuring window."""
        if self.mode == "off":
            return False
        if step <= 0:
            return True
        if self.decided:
            return step % self.interval == 0
        start, end = self._window()
        if self._since is None or step < start or step >= end:
            return True
        return (step - start) % 2 == 0

    def after_step(self, step: int, now: float) -> bool:
        """Record that `step` ended at `now`; True when the auto decision is due at this step (all ranks agree)."""
        if self.mode != "auto":
            return False
        if self._since is None or self._last is None or step != self._last + 1:
            self._reset_samples()
            self._since = step
        elif self.decided:
            if self.interval > 1:  # steady state: steps after a snapshot vs. the others
                self._record(self.wants(self._last), now - self._last_t)
                self._new_with += self.wants(self._last)
        else:
            start, end = self._window()
            if start < step <= end:  # the step before it is in the alternating window
                self._record(self.wants(self._last), now - self._last_t)
        self._last, self._last_t = step, now
        if self.decided:
            # every `refresh` snapshots since the last decision (counted from this timeline's samples)
            return (self.interval > 1 and self.wants(step) and len(self._with) >= self.refresh
                    and self._new_with >= self.refresh)
        return step == self._window()[1]

    def _record(self, after_snapshot: bool, seconds: float) -> None:
        if after_snapshot:
            self._with.append(seconds)
            self._pending = seconds
        else:
            self._without.append(seconds)
            if self._pending is not None:  # the step right after one that followed a snapshot: a pair
                self._pairs.append(self._pending - seconds)
                self._pending = None
        del self._with[: -2 * self.refresh], self._pairs[: -2 * max(self.refresh, self.pairs)]
        del self._without[:-64]

    def local_cost(self) -> float:
        """This rank's measured cost of one snapshot, as a fraction of a step without one: the median over
        pairs of adjacent steps (one after a snapshot, the next after none) of their difference, over the
        median step without one. Adjacent steps share the host's condition, so other jobs' bursts on a shared
        machine mostly cancel out (a difference of two medians of separate steps does not)."""
        if not self._without:
            return 0.0
        base = statistics.median(self._without)
        if base <= 0:
            return 0.0
        if self._pairs:
            return max(0.0, statistics.median(self._pairs) / base)
        return max(0.0, (statistics.median(self._with) - base) / base) if self._with else 0.0

    def decide(self, cost: float, step: int = -1) -> int:
        """Fix the interval from the cost agreed over the ranks (the largest)."""
        self.cost = max(0.0, float(cost))
        self.interval = min(MAX_INTERVAL, max(1, math.ceil(self.cost / self.budget - 1e-9)))
        self.decided, self.decided_at = True, step
        self.decisions += 1
        self._new_with = 0
        return self.interval

    def _reset_samples(self) -> None:
        self._since: int | None = None
        self._last: int | None = None
        self._last_t = 0.0
        self._with: list[float] = []
        self._without: list[float] = []
        self._pairs: list[float] = []  # (step after a snapshot) - (the next step, after none)
        self._pending: float | None = None
        self._new_with = 0

    # ------------------------------------------------------------------ part of every snapshot (auto)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "interval": self.interval, "decided": self.decided,
                "cost": self.cost, "budget": self.budget, "decided_at": self.decided_at}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") == self.mode:
            self.interval, self.decided = int(state["interval"]), bool(state["decided"])
            self.cost, self.decided_at = state.get("cost"), int(state.get("decided_at", -1))
        self._reset_samples()  # a rollback: measure again from the restore step if undecided
