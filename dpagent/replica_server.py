"""Serves the replica store on the agent's replica ROUTER: PutSnapshot -> SnapshotAck, FetchSnapshot -> SnapshotData.

Checksums are computed by a verifier thread (zlib releases the GIL), so a 100 MB snapshot never stalls the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .channel import Channel, Incoming
from .events import EventPipe
from .protocol import FetchSnapshot, PutSnapshot, SnapshotAck, SnapshotData, SnapshotStored
from .replica_store import ReplicaStore, verify

log = logging.getLogger("dpagent")


@dataclass(frozen=True)
class Verified:
    """Event: the verifier thread checked a PutSnapshot's payload; error is "" when it matches."""

    incoming: Incoming
    error: str


class ReplicaServer:
    def __init__(
        self,
        channel: Channel,
        store: ReplicaStore,
        events: EventPipe,
        node_id: str,
        report: Callable[[SnapshotStored], Any],
    ):
        self.channel = channel
        self.store = store
        self.node_id = node_id
        self._report = report
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._verify_loop, args=(events,), name="verify", daemon=True)
        self._thread.start()

    def handle(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, PutSnapshot):
            if len(incoming.payload) != 2:
                self._ack(incoming, f"expected 2 payload frames (meta, data), got {len(incoming.payload)}")
                return
            self._jobs.put(incoming)
        elif isinstance(msg, FetchSnapshot):
            self._fetch(incoming, msg)
        else:
            self.channel.drop_unexpected(incoming)

    def on_verified(self, event: Verified) -> None:
        """Called in the loop thread: store the verified snapshot, ack the sender, tell the controller."""
        put: PutSnapshot = event.incoming.msg
        error = event.error or self.store.add(put, *event.incoming.payload, verified=True)
        self._ack(event.incoming, error)
        if error:
            log.warning("refused snapshot of rank %d step %d: %s", put.rank, put.step, error)
            return
        log.debug("stored snapshot rank %d step %d (%d bytes)", put.rank, put.step, put.nbytes)
        self._report(SnapshotStored(self.node_id, put.rank, put.step, put.generation))

    def _ack(self, incoming: Incoming, error: str) -> None:
        put: PutSnapshot = incoming.msg
        self.channel.reply(incoming, SnapshotAck(put.rank, put.step, ok=not error, error=error))

    def _fetch(self, incoming: Incoming, msg: FetchSnapshot) -> None:
        snap = self.store.get(msg.rank, msg.step)
        if snap is None:
            log.info("fetch of rank %d step %d: not held (held: %s)", msg.rank, msg.step, self.store.steps(msg.rank))
            self.channel.reply(incoming, SnapshotData(msg.rank, msg.step, found=False))
            return
        reply = SnapshotData(snap.rank, snap.step, found=True, checksum=snap.checksum, nbytes=snap.nbytes)
        self.channel.reply(incoming, reply, [snap.meta, snap.data])
        log.info("served snapshot of rank %d step %d (%d bytes)", snap.rank, snap.step, snap.nbytes)

    def _verify_loop(self, events: EventPipe) -> None:
        sender = events.sender()
        try:
            while True:
                incoming = self._jobs.get()
                if incoming is None:
                    return
                try:
                    error = verify(incoming.msg, *incoming.payload)
                except Exception as exc:  # never let a bad payload kill the thread
                    error = f"could not verify: {exc}"
                sender.post(Verified(incoming, error))
        finally:
            sender.close()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=1.0)
