"""Serves the replica store on the agent's replica ROUTER: PutSnapshot -> SnapshotAck, FetchSnapshot -> SnapshotData.

The holder checks sizes only: the checksum is checked end to end by the worker that loads a snapshot (a bad
copy there is reported and another one used), so a holder spends no CPU per snapshot beyond receiving it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .channel import Channel, Incoming
from .protocol import FetchSnapshot, PutSnapshot, SnapshotAck, SnapshotData, SnapshotStored
from .replica_store import ReplicaStore

log = logging.getLogger("dpagent")


class ReplicaServer:
    def __init__(self, channel: Channel, store: ReplicaStore, node_id: str, report: Callable[[SnapshotStored], Any]):
        self.channel = channel
        self.store = store
        self.node_id = node_id
        self._report = report

    def handle(self, incoming: Incoming) -> None:
        msg = incoming.msg
        if isinstance(msg, PutSnapshot):
            self._put(incoming, msg)
        elif isinstance(msg, FetchSnapshot):
            self._fetch(incoming, msg)
        else:
            self.channel.drop_unexpected(incoming)

    def _put(self, incoming: Incoming, put: PutSnapshot) -> None:
        """Store the snapshot (frames kept as received: no copy), ack the sender, tell the controller."""
        if put.held:
            error = self.store.relabel(put) if not incoming.payload else "a held=True put has no payload"
        elif len(incoming.payload) != 2:
            error = f"expected 2 payload frames (meta, data), got {len(incoming.payload)}"
        else:
            error = self.store.add(put, *incoming.payload)
        self.channel.reply(incoming, SnapshotAck(put.rank, put.step, ok=not error, error=error))
        if error:
            log.warning("refused snapshot of rank %d step %d: %s", put.rank, put.step, error)
            return
        log.debug("stored snapshot rank %d step %d (%d bytes)", put.rank, put.step, put.nbytes)
        self._report(SnapshotStored(self.node_id, put.rank, put.step, put.generation))

    def _fetch(self, incoming: Incoming, msg: FetchSnapshot) -> None:
        snap = self.store.get(msg.rank, msg.step)
        if snap is None:
            log.info("fetch of rank %d step %d: not held (held: %s)", msg.rank, msg.step, self.store.steps(msg.rank))
            self.channel.reply(incoming, SnapshotData(msg.rank, msg.step, found=False))
            return
        reply = SnapshotData(snap.rank, snap.step, found=True, checksum=snap.checksum, nbytes=snap.nbytes)
        self.channel.reply(incoming, reply, [snap.meta, snap.data])
        log.info("served snapshot of rank %d step %d (%d bytes)", snap.rank, snap.step, snap.nbytes)
