"""Serves the replica store on the agent's replica ROUTER: PutSnapshot -> SnapshotAck, FetchSnapshot -> SnapshotData
and its SnapshotChunks, ReserveSnapshot -> SnapshotReserved (room made for a snapshot on its way), then its
SnapshotParts (not answered; dpagent.streamed_puts) as the sender captures it; dedup
(dpagent.dedup): LocalSnapshot (not answered), OfferSnapshot (room made as it comes) -> SnapshotAck, or
SnapshotWants -> SnapshotBlocks -> SnapshotAck when the holder's node lacks some of its blocks.

The holder checks sizes only: the checksum is checked end to end by the worker that loads a snapshot (a bad
copy there is reported and another one used), so a holder spends no CPU per snapshot beyond receiving it.
The one exception, a relabel (keep a held copy for a new generation), checks the copy in a background thread
when given the agent's EventPipe: at tens of GB that takes seconds, which the agent's loop (heartbeats) must
not wait for. So are a stopping job's files written, and a resumed job's read (SaveSnapshots, LoadSnapshots).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq

from dpcommon.channel import Channel, Incoming
from dpcommon.checksum import checksum_chunks
from .dedup import EXPECT_RESTORE_S, OFFER_WAIT_S, LocalCopies, Offer, assemble, decide, parse_offer
from .loop_events import EventPipe
from .streamed_puts import StreamedPuts
from dpcommon.protocol import (FetchSnapshot, LoadSnapshots, LocalSnapshot, OfferSnapshot, PutSnapshot, ReserveSnapshot,
                       SaveSnapshots, SnapshotAck, SnapshotBlocks, SnapshotChunk, SnapshotData, SnapshotFiles,
                       SnapshotPart, SnapshotReserved, SnapshotStored, SnapshotWants)
from dpcommon.replica_store import ReplicaStore, Snapshot, frame_view, intact
from dpcommon.save_manifest import prune
from dpcommon.snapshot_files import (CopyRoom, check_copies, copy_out, held_copies, read_files, store_loaded,
                                     write_copies)

log = logging.getLogger("dpagent")
DIFFERS_SAID_EVERY = 100  # snapshots of a rank whose blocks differ, between two warnings of it


@dataclass(frozen=True)
class RelabelChecked:
    """A held copy's bytes were checked for a relabel (posted to the agent loop)."""

    incoming: Incoming
    put: PutSnapshot
    snapshot: Snapshot
    intact: bool


class RelabelChecker:
    """One thread that checksums held copies for relabels and posts each RelabelChecked to the agent loop."""

    def __init__(self, events: EventPipe, check: Callable[[Any, list], int] = checksum_chunks):
        self._events, self._check = events, check
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dpagent-relabel-check", daemon=True)
        self._thread.start()

    def submit(self, incoming: Incoming, put: PutSnapshot, snap: Snapshot) -> None:
        self._jobs.put((incoming, put, snap))

    def close(self) -> None:
        """Stop after the check under way (not waited for: the agent is exiting)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            incoming, put, snap = job
            try:
                ok = intact(snap, self._check)  # snap.checksum == put.checksum: relabel_candidate checked it
            except Exception:  # unreadable: as good as corrupt, the sender sends it whole
                ok = False
            try:
                with self._events.sender() as sender:  # a socket per result: none open while checking
                    sender.post(RelabelChecked(incoming, put, snap, ok))
            except zmq.ZMQError:  # the agent's context is closing
                return


@dataclass(frozen=True)
class FilesDone:
    """A SaveSnapshots' files written or a LoadSnapshots' read, on a thread (posted to the agent loop): for a
    save, each rank's "" or why not; for a load, what dpcommon.snapshot_files.read_files read."""

    msg: SaveSnapshots | LoadSnapshots
    outcome: dict


def _idle_priority() -> None:
    """This thread yields to the node's training (nice 19): nothing waits for a background save, and its checksum
    pass, copy-out and writes must not take cores from the workers' steps. (Not SCHED_IDLE: on a node whose
    training keeps every core busy, a save must still finish, slowly.)"""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _files_thread(events: EventPipe, msg: SaveSnapshots | LoadSnapshots, work: Callable[[], dict]) -> None:
    try:
        outcome = work()
    except Exception as exc:  # noqa: BLE001 (any failure is the answer's, not a silent thread's death)
        outcome = {str(rank): f"{type(exc).__name__}: {exc}" for rank in msg.ranks}
    try:
        with events.sender() as sender:
            sender.post(FilesDone(msg, outcome))
    except zmq.ZMQError:  # the agent's context is closing
        pass


class ReplicaServer:
    """Without `events`, relabels are checked inline (a holder loop that has nothing else to do).
    `local_pids`: this node's workers, whose shared snapshot buffers may be mapped (none: no dedup)."""

    def __init__(self, channel: Channel, store: ReplicaStore, node_id: str, report: Callable[[SnapshotStored], Any],
                 events: EventPipe | None = None, local_pids: Callable[[], Any] = tuple):
        self.channel = channel
        # a fetch queues one message per chunk (1,000 for 4 GB: ZeroMQ's default limit, past which a ROUTER
        # drops messages); they reference the store's frames, so an unbounded queue costs no copy
        channel.sock.setsockopt(zmq.SNDHWM, 0)
        self.store = store
        self.node_id = node_id
        self._report = report
        self.events = events
        self.checker = RelabelChecker(events) if events is not None else None
        self.local = LocalCopies(local_pids)
        self._waiting: list[Offer] = []  # offers waiting for their step's local copy
        self._awaiting: dict[tuple, Offer] = {}  # (sender, rank, step) -> an offer waiting for its blocks
        self._differing: dict[int, int] = {}  # rank -> its snapshots whose data parallel blocks differed here
        self._copy_room = CopyRoom()  # a background save's copy-out (one save at a time)
        self._streams = StreamedPuts()  # the parts of snapshots being captured and sent whole

    def handle(self, incoming: Incoming) -> None:
        msg = incoming.msg
        now = time.monotonic()
        if isinstance(msg, SnapshotPart):
            self._streams.add(incoming.sender, msg, incoming.payload)
        elif isinstance(msg, PutSnapshot):
            self._put(incoming, msg)
        elif isinstance(msg, OfferSnapshot):
            self._offer(incoming, now)
        elif isinstance(msg, SnapshotBlocks):
            self._blocks(incoming, msg)
        elif isinstance(msg, LocalSnapshot):
            error = self.local.announce(msg, incoming.payload)
            if error:
                log.warning("local snapshot of rank %d step %d not usable for dedup: %s", msg.rank, msg.step, error)
            self.tick(now)
        elif isinstance(msg, ReserveSnapshot):
            dropped = self.store.make_room(msg.rank, msg.step, msg.generation)
            self.channel.reply(incoming, SnapshotReserved(msg.rank, msg.step, [s.step for s in dropped]))
            del dropped  # the copies' memory is freed here, after the reply is queued
        elif isinstance(msg, FetchSnapshot):
            self._fetch(incoming, msg)
        else:
            self.channel.drop_unexpected(incoming)

    def _put(self, incoming: Incoming, put: PutSnapshot) -> None:
        """Store the snapshot (frames kept as received: no copy), ack the sender, tell the controller."""
        if put.held and not incoming.payload and self.checker is not None:
            candidate = self.store.relabel_candidate(put)
            if not isinstance(candidate, str):
                self.checker.submit(incoming, put, candidate)  # answered in relabel_checked()
                return
            error = candidate
        elif put.held:
            error = self.store.relabel(put) if not incoming.payload else "a held=True put has no payload"
        elif put.parts:
            frames = self._streams.take(incoming.sender, put)
            if isinstance(frames, str):
                error = frames
            elif len(incoming.payload) != 1:
                error = f"a streamed put's payload is its meta alone, got {len(incoming.payload)} frames"
            else:
                error = self.store.add(put, incoming.payload[0], *frames)
        elif len(incoming.payload) < 2:
            error = f"expected payload frames (meta, data chunks), got {len(incoming.payload)}"
        else:
            error = self.store.add(put, *incoming.payload)
        self._answer(incoming, put, error)

    def _offer(self, incoming: Incoming, now: float) -> None:
        offer = parse_offer(incoming, now)
        if isinstance(offer, str):
            self._answer(incoming, incoming.msg, offer)
            return
        # as a ReserveSnapshot would: the oldest copy goes now (freed here), the blocks still to come take its memory
        self.store.make_room(offer.msg.rank, offer.msg.step, offer.msg.generation)
        self._waiting.append(offer)
        self.tick(now)

    def tick(self, now: float) -> None:
        """Settle the offers whose local copy came (or whose wait is over): ask for the blocks they lack."""
        for offer in list(self._waiting):
            if decide(offer, self.local, now):
                self._waiting.remove(offer)
                if offer.copy is None and now >= offer.deadline:  # a wait sat out: the next step's gate waits too
                    log.info("offer of rank %d step %d: no snapshot of that step on this node within %.1f s; "
                             "asked for whole", offer.msg.rank, offer.msg.step, OFFER_WAIT_S)
                self._ask(offer)

    def expect_local(self, step: int, now: float) -> None:
        """This node's workers are restoring `step` (a Reconfigure): offers of it wait for their snapshot."""
        self.local.expect(step, now + EXPECT_RESTORE_S)

    def next_deadline(self) -> float | None:
        return min((o.deadline for o in self._waiting), default=None)

    def _ask(self, offer: Offer) -> None:
        msg = offer.msg
        if not offer.wanted:
            self._store_offer(offer, [])
            return
        for key in [k for k in self._awaiting if k[1] == msg.rank and k[2] < msg.step]:
            del self._awaiting[key]  # superseded: its sender moved on
        self._awaiting[(offer.incoming.sender, msg.rank, msg.step)] = offer
        if offer.differs:  # said the first time for a rank, then every DIFFERS_SAID_EVERY-th: not every step
            seen = self._differing[msg.rank] = self._differing.get(msg.rank, 0) + 1
            if seen == 1 or seen % DIFFERS_SAID_EVERY == 0:
                log.warning("rank %d step %d: data parallel blocks %s differ from this node's copy of that step "
                            "(%d snapshot(s) of it so far); all of its data parallel blocks are asked for",
                            msg.rank, msg.step, offer.differs[:8], seen)
        self.channel.reply(offer.incoming, SnapshotWants(msg.rank, msg.step, offer.wanted, offer.differs))

    def _blocks(self, incoming: Incoming, msg: SnapshotBlocks) -> None:
        offer = self._awaiting.pop((incoming.sender, msg.rank, msg.step), None)
        if offer is None or msg.blocks != offer.wanted or msg.generation != offer.msg.generation:
            put = PutSnapshot(msg.rank, msg.step, msg.generation, 0, 0)
            self._answer(incoming, put, f"no offer of rank {msg.rank} step {msg.step} waits for these blocks")
            return
        self._store_offer(offer, incoming.payload)

    def _store_offer(self, offer: Offer, blocks: list) -> None:
        msg = offer.msg
        put = PutSnapshot(msg.rank, msg.step, msg.generation, msg.checksum, msg.nbytes)
        chunks = assemble(offer, blocks)
        if isinstance(chunks, str):
            error = chunks
        else:
            base = offer.copy if len(blocks) < offer.digests.size else None
            error = self.store.add(put, offer.meta, *chunks, base=base)
        self._answer(offer.incoming, put, error)

    def relabel_checked(self, done: RelabelChecked) -> None:
        """The background check of a relabel finished: keep the copy (or not) and answer the sender."""
        self._answer(done.incoming, done.put, self.store.relabel_checked(done.put, done.snapshot, done.intact))

    def files(self, msg: SaveSnapshots | LoadSnapshots, pause: Callable[[], Any] = nullcontext) -> None:
        """Write the store's copies as files (a stopping job; within `pause`: dpagent.workers.WorkerGroup.paused)
        or read files for it (a resumed one). The disk's part runs on a thread, so that the agent goes on
        heartbeating through a slow disk; its FilesDone comes back through `events`, for files_done()."""
        if isinstance(msg, SaveSnapshots):
            copies, missing = held_copies(self.store, msg.step, msg.ranks)  # (the store: here, on the loop)

            def work() -> dict:
                held: dict[int, Snapshot] = copies
                changed: dict[str, str] = {}
                checks: dict[int, int] | None = None
                corrupt: dict[str, str] = {}
                if msg.background:
                    # training goes on: copied out and digested first, then the thread yields to it (the digest
                    # pass at nice 19 beside busy cores took a third of a save, 10x its time at normal priority)
                    held, changed = copy_out(copies, msg.step, self._copy_room)
                    checks, corrupt = check_copies(held, msg.step)
                    _idle_priority()
                with pause():  # (a save on stop: the workers' buffers that copies refer to are still)
                    written = write_copies(msg.directory, msg.step, held, msg.world_size, self.node_id, checks)
                if msg.keep and not any(written.values()):
                    prune(Path(msg.directory).parent, msg.keep)
                return {**missing, **changed, **corrupt, **written}
        else:
            for rank in msg.ranks:  # what the files replace: a timeline past them, or a damaged step passed over
                self.store.drop_after(rank, msg.step)

            def work() -> dict:
                return read_files(msg.directory, msg.step, msg.ranks)
        threading.Thread(target=_files_thread, args=(self.events, msg, work), name="dpagent-files",
                         daemon=True).start()

    def files_done(self, done: FilesDone) -> SnapshotFiles:
        """The answer to a SaveSnapshots or LoadSnapshots once its files are written or read (a load's copies
        go into the store here)."""
        msg, saving = done.msg, isinstance(done.msg, SaveSnapshots)
        results = (done.outcome if isinstance(msg, SaveSnapshots) else
                   store_loaded(self.store, done.outcome, self.node_id, self._report, msg.generation))
        log.info("%s snapshots of step %d in %s: %s", "saved" if saving else "loaded", msg.step, msg.directory,
                 {rank: error or "ok" for rank, error in sorted(results.items())})
        return SnapshotFiles(self.node_id, msg.step, results)

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()

    def _answer(self, incoming: Incoming, put: PutSnapshot, error: str) -> None:
        """Report a stored snapshot to the controller, then ack it (docs/sequences.md): the report is on its
        way before the sender can move on."""
        if error:
            log.warning("refused snapshot of rank %d step %d: %s", put.rank, put.step, error)
        else:
            log.debug("stored snapshot rank %d step %d (%d bytes)", put.rank, put.step, put.nbytes)
            self._report(SnapshotStored(self.node_id, put.rank, put.step, put.generation, put.nbytes))
        self.channel.reply(incoming, SnapshotAck(put.rank, put.step, ok=not error, error=error))

    def _fetch(self, incoming: Incoming, msg: FetchSnapshot) -> None:
        if not 0 <= msg.stream < msg.streams:
            self.channel.drop_unexpected(incoming)
            return
        snap = self.store.get(msg.rank, msg.step)  # a stale one (its local copy written since) is not held
        if snap is None:
            log.info("fetch of rank %d step %d: not held (held: %s)", msg.rank, msg.step, self.store.steps(msg.rank))
            self.channel.reply(incoming, SnapshotData(msg.rank, msg.step, found=False))
            return
        reply = SnapshotData(snap.rank, snap.step, found=True, checksum=snap.checksum, nbytes=snap.nbytes,
                             chunks=len(snap.chunks))
        self.channel.reply(incoming, reply, [snap.meta] if msg.stream == 0 else [])
        offsets = list(itertools.accumulate((frame_view(c).nbytes for c in snap.chunks), initial=0))
        for index in range(msg.stream, len(snap.chunks), msg.streams):  # queued zero-copy (an unbounded queue)
            chunk = SnapshotChunk(snap.rank, snap.step, index, offsets[index])
            self.channel.reply(incoming, chunk, [snap.chunks[index]])
        log.info("served snapshot of rank %d step %d (%d bytes; connection %d of %d)", snap.rank, snap.step,
                 snap.nbytes, msg.stream + 1, msg.streams)
