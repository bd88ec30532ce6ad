"""Background snapshots: copy a state tree into a reusable host buffer, send it to the replica holder, await its ack.

Keeps a ring of NSLOTS host buffers (the newest complete snapshots stay intact while the next is captured);
fetch() pulls a snapshot back from a replica store and verifies its checksum. Which steps: dpstate.steps.interval.
The buffers are shared with this node's agent (dpstate.snapshot.shared; page-locked with CUDA), which holds peers'
identical blocks (data parallel state) by reference: a holder is offered the block digests and asks for what it lacks.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import zmq

from dpcommon import protocol as P
from dpcommon import traffic_class
from dpcommon.fetch_streams import fetch_streams
from dpcommon.checksum import BlockDigester, digest_threads

from dpstate.snapshot import shared
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.snapshot.checks import CheckPlanner, held_alike_elsewhere
from dpstate.steps.interval import SnapshotPolicy
from dpstate.snapshot.landing import Landing, enabled_by_env
from dpstate.groups.pgroup import trains_on_gpu
from .fetch import FETCHED, ReplicationError, Slot, receive_snapshot
from .holders import HolderLink
from .send import Delivery
from .stream import PartStream
from .priority import lower_io_threads, lower_priority
from .profile import PhaseClock, SnapshotStats, write_profile

# Local snapshots kept. The snapshot gate (dpstate.steps.session.Job._gate) makes a survivor roll back at most one
# snapshot (the newest, or the one before it while the newest is not yet held everywhere: the gate that waits
# for its acks is at the next snapshot step) while it captures the next one when the dead ranks' newest copies
# are good; every step submitted is captured, even across a reconfiguration (quiesce), so a rank holds the step
# it last reported (dprun.controller.timeline.survivor_floors). A walk back past bad copies of a dead rank can go
# further; a survivor then reports its missing copy (RestoreFailed, source "") and the plan for that step has no cut:
# "state lost" (the dead rank's copies at newer steps were bad).
NSLOTS = 2


@dataclass
class _Job:
    step: int
    slot: Slot
    tree: Any = None  # None: the slot is already packed (a re-put after restore)
    event: Any = None  # CUDA event recorded after the step, waited by the copy stream
    seq: int = 0
    device: int = 0  # the CUDA device of the step (the copy stream is made on it)
    held_at: frozenset = frozenset()  # replica endpoints that already hold this snapshot: relabel, not resend
    # the tensor_keys of tree's data parallel tensors, or a callable giving them (dpstate.snapshot.checks)
    shared: Any = None
    replicate: bool = True  # False once a reconfiguration dropped it: captured (kept locally), never sent


class Replicator:
    """Owned by the session; its thread captures and replicates, the main thread waits at the snapshot gate.
    `ctx` is accepted for older callers and not used: the snapshot traffic has a ZeroMQ context of its own."""

    def __init__(self, codec: P.Codec, rank: int, abort: AbortSignal, ctx: zmq.Context | None = None):
        self.codec, self.rank, self.abort = codec, rank, abort
        # Its own context for the snapshot traffic only (control messages never queue behind a snapshot), whose
        # I/O threads can be given a lower priority with this thread (DP_SNAPSHOT_NICE): one per connection of a
        # fetch, so that each receives on a core of its own (dpcommon.fetch_streams).
        try:
            before = set(os.listdir("/proc/self/task"))
        except OSError:
            before = set()
        self.fetch_streams = fetch_streams()
        self.ctx = zmq.Context(io_threads=self.fetch_streams)
        traffic_class.mark(self.ctx)  # Lower-Effort, and told apart from the groups' connections (severing)
        self.ctx.socket(zmq.DEALER).close(0)  # starts the I/O thread now
        lower_io_threads(before)
        # page-locked buffers only where the worker trains on a GPU (on the CPU: no CUDA context for pinning,
        # and the optimizer step lands in the snapshot, dpstate.snapshot.landing)
        self.pin = trains_on_gpu()
        self.digest_threads = digest_threads()  # checksum threads beside the copy (dpcommon.checksum)
        self.stream = os.environ.get("DP_SNAPSHOT_STREAM", "1") != "0"  # a whole put's parts go as they are copied
        # this node's agent, told of each local snapshot so that it can hold peers' identical blocks by reference
        self.local_store = os.environ.get("DP_LOCAL_REPLICA", "")
        # with CUDA too, once the driver page-locks a shared buffer (the side stream copies into it asynchronously)
        self.share = bool(self.local_store) and shared.supported() and (not self.pin or shared.can_page_lock())
        self.slots = [Slot() for _ in range(NSLOTS)]
        self.generation = -1
        self.endpoints: list[str] = []  # replica stores that get every snapshot
        self.last_capture_s = 0.0
        self.policy = SnapshotPolicy.from_env()
        self.checks = CheckPlanner()  # which blocks are checksummed (data parallel state: sampled)
        self.on_divergence: Callable[[int, int, list], None] | None = None  # (rank, step, blocks), said once
        self.landing = Landing(enabled=enabled_by_env() and not self.pin)  # optimizer steps into the slots
        self.stats = SnapshotStats()
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._busy = False
        self._active: _Job | None = None
        self._held: list[Slot] = []  # local snapshots being written to files (holding): nothing writes them
        self._epoch = 0  # bumped by quiesce(): the thread drops what it is doing
        self._submitted = 0  # sequence number of the newest job handed over
        self._acked = 0  # ... and of the newest one acked
        self._acked_at: dict[int, float] = {}  # sequence number -> perf_counter when it was acked (the newest few)
        self._error: BaseException | None = None
        self._idle = True  # no capture or fetch yet: the slots may be made room in ahead (reserve_ahead)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dpstate-replication", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        if os.environ.get("DP_SNAPSHOT_PROFILE"):
            atexit.register(write_profile, self)

    # ------------------------------------------------------------------ main thread

    def configure(self, generation: int, replica_to: str | list[str], rank: int) -> None:
        """Send future snapshots of `rank` to every replica store in `replica_to` (none = keep them local
        only); a snapshot counts as acked once every one of them holds it. Call when quiet."""
        endpoints = [replica_to] if isinstance(replica_to, str) else list(replica_to)
        with self._cond:
            self.generation, self.endpoints, self.rank = generation, [e for e in endpoints if e], rank
            self._cond.notify_all()

    def submit(self, step: int, tree: Any, shared: Any = None) -> None:
        """Capture `tree` (the state after `step`) in the background and replicate it. Its containers must be
        its own and its tensors unchanged until wait_acked() returns (the snapshot gate, before the optimizer step).
        `shared`: the tensors that every data parallel rank holds alike (dpstate.snapshot.checks.replicated_keys, or a
        callable giving them in the background). With snapshots off (policy), nothing is taken."""
        if not self.policy.enabled:
            return
        event, device = None, 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()  # the main thread's; a new thread starts on device 0
            event = torch.cuda.Event()
            event.record()  # the copy stream waits for the step's kernels
        with self._cond:
            slot = self._free_slot(step, live_first=True)
            slot.step = -1
            self._submitted += 1
            self._queue.append(_Job(step, slot, tree, event, self._submitted, device, shared=shared))
            self._cond.notify_all()

    def submit_packed(self, slot: Slot, held_at: Any = ()) -> None:
        """Replicate a slot that already holds a complete snapshot (the state just restored). Replica stores
        in `held_at` are said to hold that very copy already: they are asked to keep it for this generation
        (a message of a few bytes) and sent the whole snapshot only if they no longer hold it."""
        with self._cond:
            self._submitted += 1
            self._queue.append(_Job(slot.step, slot, seq=self._submitted, held_at=frozenset(held_at)))
            self._cond.notify_all()

    @property
    def submitted(self) -> int:
        """How many snapshots were handed over so far (captures and re-puts)."""
        return self._submitted

    def wait_captured(self, timeout: float | None = None) -> None:
        """Block (abortably) until every submitted snapshot is captured: its tensors may change from then on
        (the snapshot gate of a step whose acks are not due yet, Job._gate); its replication goes on."""
        self.abort.wait_for(self._cond, lambda: self._captured() or self._error is not None, timeout)
        if self._error is not None:
            raise self._error

    def _captured(self) -> bool:
        return all(j.tree is None for j in self._queue) and (self._active is None or self._active.tree is None)

    def acked_at(self, seq: int) -> float | None:
        """When submission `seq` was acked (time.perf_counter()), if it was and is among the newest few."""
        with self._cond:
            return self._acked_at.get(seq)

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
        """Stop replicating (a reconfiguration): queued and running sends are dropped, but every capture
        submitted is finished and kept locally, since the controller counts on a rank holding the step it
        reported; returns when the thread no longer touches tensors (at most the captures still to do)."""
        with self._cond:
            self._epoch += 1
            self._queue = [j for j in self._queue if j.tree is not None]
            for job in self._queue + ([self._active] if self._active is not None else []):
                job.replicate = False
            self._acked = self._submitted
            self._error = None
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy and not self._queue)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread, at exit: queued and running sends are dropped, a capture under way is finished.
        A daemon thread that comes back from a torch call while the interpreter finalizes aborts the process
        ("terminate called without an active exception", exit -6: measured, torch 2.13 on Python 3.11), which
        would bury a script's exit code and traceback. A capture still running after `timeout` is left."""
        with self._cond:
            self._closed = True
            self._epoch += 1
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def local(self, step: int) -> Slot | None:
        """The complete local snapshot of `step`, if still held."""
        with self._cond:
            for slot in self.slots:
                if slot.step == step and step >= 0:
                    return slot
        return None

    @contextmanager
    def holding(self, step: int):
        """The complete local snapshot of `step` (or None) for as long as it is written to a file (a stopping
        job's save, on the control thread while training may go on): no capture or optimizer step writes its
        buffer meanwhile; one that finds no other buffer free waits for the write."""
        with self._cond:
            slot = next((s for s in self.slots if s.step == step and step >= 0), None)
            if slot is not None:
                self._held.append(slot)
        try:
            yield slot
        finally:
            with self._cond:
                if slot is not None:
                    self._held.remove(slot)
                self._cond.notify_all()

    def forget_after(self, step: int) -> None:
        """Drop local snapshots newer than `step` (a rollback abandons them)."""
        with self._cond:
            for slot in self.slots:
                if slot.step > step:
                    slot.step = -1

    def forget(self, slot: Slot) -> None:
        """Drop one local snapshot (a prefetched copy no plan wants any more)."""
        with self._cond:
            slot.step = -1

    def local_steps(self) -> list[int]:
        with self._cond:
            return sorted(s.step for s in self.slots if s.step >= 0)

    def reserve_ahead(self, nbytes: int) -> int:
        """A spare while it idles: give every slot room for a snapshot of `nbytes` and fault its memory in, so
        that its restore and first capture after a failure write to memory already there. Stops at the first
        capture or fetch (a slot in use is never touched). Returns how many slots it prepared."""
        prepared = 0
        for slot in self.slots:
            with self._cond:  # a fetch starting meanwhile waits for this slot, then takes it as it is
                if not self._idle or not self.policy.enabled or self._closed:
                    break
                slot.reserve(nbytes, self.pin, self.share)
                slot.prefault()
                prepared += 1
        return prepared

    def _in_use(self) -> list[Slot]:
        active = [self._active.slot] if self._active is not None else []
        return [j.slot for j in self._queue] + active + self._held

    def _free_slot(self, step: int, live_first: bool = False) -> Slot:
        """An empty slot, else the one with the oldest snapshot; never one the thread works on. `live_first`: the
        one the optimizer's state lies in (dpstate.snapshot.landing), when it holds no snapshot yet. Under _cond."""
        self._idle = False
        while not (candidates := [s for s in self.slots if not any(s is u for u in self._in_use())]) and self._held:
            self._cond.wait()  # a file being written holds one: wait for it
        if not candidates:
            raise RuntimeError("no free snapshot buffer: snapshots are submitted faster than they are acked")
        live = [s for s in candidates if s.live and s.step < 0] if live_first else []
        return live[0] if live else min(candidates, key=lambda s: s.step)

    # ------------------------------------------------------------------ landing (main thread, optimizer steps)

    def land(self) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """Before an optimizer step (past the snapshot gate): where each tensor of the state it makes goes
        (dpstate.snapshot.landing), or None: in place, as usual."""
        if not self.policy.enabled:
            return None
        with self._cond:
            target = self.landing.choose(self.slots, self._in_use(), self.share)
            return self.landing.destination(target, list(self.slots)) if target is not None else None

    def unland(self) -> None:
        """The optimizers' state went back home (a reconfiguration): no slot holds it any more."""
        with self._cond:
            for slot in self.slots:
                slot.live = False
            self.landing.reset()

    # ------------------------------------------------------------------ fetch (main thread, own socket)

    def fetch(self, endpoint: str, rank: int, step: int, timeout: float = 60.0) -> Slot:
        """Pull rank's snapshot of `step` from the replica store at `endpoint` into a local slot (pinned with
        CUDA): its data chunks are copied into the slot's buffer and digested as they arrive; then the checksum is
        checked."""
        t0 = time.perf_counter()

        def reserve(nbytes: int) -> Slot:
            with self._cond:
                slot = self._free_slot(step)
                slot.reserve(nbytes, self.pin, self.share)
            return slot

        got = receive_snapshot(self.ctx, self.codec, self.abort, endpoint, rank, step, timeout, reserve,
                               self.digest_threads, self.fetch_streams)
        t1 = time.perf_counter()
        slot, reply = got.slot, got.reply
        slot.layout = FETCHED
        try:  # (the digests are kept: its re-put announces them)
            S.check(slot.seal(slot.meta, slot.nbytes, got.digester.plan, got.digester), reply.checksum)
        except S.SnapshotError as exc:
            raise ReplicationError(f"fetched snapshot of rank {rank} step {step}: {exc}") from None
        slot.checksum, slot.step = reply.checksum, step
        st = self.stats
        st.fetches, st.fetch_s = st.fetches + 1, st.fetch_s + t1 - t0
        st.fetch_verify_s += time.perf_counter() - t1
        return slot

    def fetch_first(self, sources: list[str], rank: int, step: int,
                    on_bad: Callable[[str, str], None]) -> Slot | None:
        """fetch() from each store in turn until one has a good copy; on_bad(store, why) for each that has
        not (missing, corrupt). None if none has."""
        for source in sources:
            try:
                return self.fetch(source, rank, step)
            except ReplicationError as exc:
                on_bad(source, str(exc))
        return None

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        lower_priority(threading.get_native_id())
        links: dict[str, HolderLink] = {}  # replica endpoint -> our DEALER to it, watched
        local = None  # our DEALER to this node's agent (LocalSnapshot)
        if self.share:
            local = self.ctx.socket(zmq.DEALER)
            local.setsockopt(zmq.LINGER, 0)
            local.connect(self.local_store)
        copy_stream = None
        while True:
            with self._cond:
                self._busy, self._active = False, None
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                job, epoch = self._queue.pop(0), self._epoch
                endpoints, generation, rank = list(self.endpoints), self.generation, self.rank
                self._busy, self._active = True, job
            try:
                for dropped in set(links) - set(endpoints):
                    links.pop(dropped).close()
                for endpoint in endpoints:
                    if endpoint not in links:
                        links[endpoint] = HolderLink(self.ctx, endpoint)

                # defaults bind this job's step and epoch (as lambdas with defaults would, which mypy cannot type)
                def on_differs(blocks: list, step: int = job.step) -> None:
                    self._diverged(rank, step, blocks)

                def cancelled(e: int = epoch) -> bool:
                    return e != self._epoch

                delivery = Delivery(self.codec, self.stats, job.slot, rank, job.step, generation, job.held_at,
                                    on_differs=on_differs, cancelled=cancelled,
                                    gone=lambda endpoint: links[endpoint].gone())
                if job.tree is None:  # a restored snapshot put again (once a recovery): offered where it can be
                    offered = job.slot.digests is not None
                else:
                    job.shared = job.shared() if callable(job.shared) else job.shared
                    offered = (self.share and not job.slot.share_refused
                               and held_alike_elsewhere(job.tree, job.shared))
                delivery.offer = offered
                parts = None
                if not offered and job.replicate:  # sent whole: holders make room while we capture, and the
                    reserve = self.codec.encode(delivery.reserve())  # snapshot lands in their oldest copy's memory
                    delivery.reserved = frozenset(e for e in endpoints if e not in job.held_at)
                    for endpoint in delivery.reserved:
                        links[endpoint].sock.send_multipart(reserve)
                    if self.stream and job.tree is not None and delivery.reserved:
                        parts = PartStream(self.codec, {e: links[e].sock for e in delivery.reserved}, rank,
                                           job.step, generation)
                if job.tree is not None:
                    if job.event is not None and (copy_stream is None or copy_stream.device.index != job.device):
                        torch.cuda.set_device(job.device)  # this thread's current device: the worker's
                        copy_stream = torch.cuda.Stream(device=job.device)
                    self._capture(job, copy_stream, parts)
                    delivery.slot = job.slot  # a new one where the optimizer's state lay in the old (landing)
                    if parts is not None:
                        delivery.streamed = parts.streamed()
                        self.stats.streamed += bool(delivery.streamed)
                if local is not None and job.slot.digests is not None:  # captured, or restored (re-put)
                    self._announce(local, job.slot, rank)
                with self._cond:
                    if not job.replicate:  # dropped by a reconfiguration: captured (kept locally), not sent
                        continue
                ok = delivery.run({e: links[e].sock for e in endpoints})
                with self._cond:
                    if epoch == self._epoch and ok:
                        self._acked = max(self._acked, job.seq)
                        self._acked_at[job.seq] = time.perf_counter()
                        for old in [s for s in self._acked_at if s <= job.seq - 8]:
                            del self._acked_at[old]
                        self._cond.notify_all()
            except BaseException as exc:  # keep the thread alive; the snapshot gate reports the error
                with self._cond:
                    if epoch == self._epoch:
                        self._error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
                        self._cond.notify_all()

    def _diverged(self, rank: int, step: int, blocks: list) -> None:
        if self.checks.divergence(rank, step, blocks) and self.on_divergence is not None:
            self.on_divergence(rank, step, blocks)

    def _capture(self, job: _Job, stream: Any, parts: PartStream | None = None) -> None:
        """Pack job.tree into its slot: meta first, then the tensors copied, checksummed meanwhile (and sent
        meanwhile, by `parts`, where it goes whole). Not interrupted by quiesce(): a reconfiguration waits for it
        (see NSLOTS)."""
        laps = PhaseClock(self.stats)
        skeleton, tensors = S.flatten(job.tree)
        specs, nbytes, shared_nbytes, flags = self.checks.layout(tensors, job.shared)
        slot = job.slot
        if slot.live and slot.layout != specs:  # the optimizer's state lies here in another layout: leave it be
            with self._cond:
                index = next(i for i, s in enumerate(self.slots) if s is slot)
                slot = job.slot = self.slots[index] = Slot()
        slot.reserve(nbytes, self.pin, self.share)
        # data parallel blocks are trusted (sampled) only where a holder keeps them by reference to its node's
        plan = self.checks.plan(specs, flags, shared_nbytes, job.step) if slot.shared is not None else None
        meta = S.encode_meta(skeleton, specs, nbytes, {"rank": self.rank}, plan)
        slot.prepare_layout(specs, nbytes)
        slot.nbytes = 0
        laps.lap("meta")
        # the checksum's digests of each range of blocks as soon as it is copied, on other threads: a capture
        # costs about its copy, not the copy plus the checksum
        digester = BlockDigester(slot.buffer[:nbytes].numpy(), plan, self.digest_threads)
        if parts is not None:
            parts.begin(slot.buffer[:nbytes].numpy())
        if stream is not None:
            stream.wait_event(job.event)
            marks: list = []
            with torch.cuda.stream(stream):
                S.copy_into(tensors, specs, slot.buffer, non_blocking=True,
                            on_copied=_device_progress(digester, stream, marks))
            if parts is not None:
                for end, event in marks:
                    event.synchronize()  # the parts below `end` are on the host: sent while the rest is copied
                    parts.ready(end)
            stream.synchronize()
        else:
            def on_copied(end: int) -> None:
                digester.ready(end)
                if parts is not None:
                    parts.ready(end)

            self.stats.landed_bytes += S.copy_into(tensors, specs, slot.buffer, on_copied=on_copied)
        if parts is not None:
            parts.ready(nbytes)
        laps.lap("copy")
        kept = tensors  # where they lay (dpstate.snapshot.landing); the references go at the end of this capture
        with self._cond:
            job.tree = None  # the step's tensors may now change (wait_captured)
            del tensors
            self._cond.notify_all()
        crc = slot.seal(meta, nbytes, plan, digester)  # padding included: every byte that is sent
        laps.lap("crc")
        slot.meta, slot.nbytes, slot.checksum = meta, nbytes, crc
        slot.capture_s = self.last_capture_s = laps.finish()
        stats = self.stats
        stats.captures += 1
        stats.capture_s += slot.capture_s
        stats.bytes += nbytes + len(meta)
        with self._cond:
            slot.step = job.step
            self.landing.record(kept, specs, nbytes)

    def _announce(self, sock: Any, slot: Slot, rank: int) -> None:
        """Tell this node's agent where the snapshot just captured lies (LocalSnapshot: not answered)."""
        buf = slot.shared
        assert buf is not None  # the caller saw digests, which only a capture into a shared buffer keeps
        msg = P.LocalSnapshot(rank=rank, step=slot.step, pid=os.getpid(), fd=buf.fd, inode=buf.inode,
                              offset=shared.HEADER_BYTES, nbytes=slot.nbytes, writes=buf.writes,
                              checks=slot.plan.as_json() if slot.plan else {})
        sock.send_multipart(self.codec.encode(msg, [slot.digests]))


def _device_progress(digester: BlockDigester, stream: Any, marks: list,
                     every: int = 64 << 20) -> Callable[[int], None]:
    """copy_into's on_copied for device copies queued on `stream`: every `every` bytes, an event recorded after
    them, which the digester's threads wait for before they read those bytes; (end, event) added to `marks`."""
    queued_to = 0

    def on_copied(end: int) -> None:
        nonlocal queued_to
        if end - queued_to >= every:
            event = torch.cuda.Event()
            event.record(stream)
            digester.ready(end, wait=event.synchronize)
            marks.append((end, event))
            queued_to = end

    return on_copied


_LIVE: "weakref.WeakSet[Replicator]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for replicator in list(_LIVE):
        replicator.close()
