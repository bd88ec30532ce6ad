"""Sending one captured snapshot to its replica holders until each acks it: a relabel where a holder has that
copy already, else an offer (data parallel state in a shared buffer: digests and the tail; the holder asks for
the blocks it lacks) or the whole snapshot once the holder made room for it (ReserveSnapshot -> SnapshotReserved),
or, where its parts were streamed during the capture (dpstate.replication.stream), the put that closes them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from dpcommon import protocol as P
from dpcommon.checksum import CHECKSUM_BLOCK

from .fetch import ReplicationError, Slot
from .holders import HolderGone
from .profile import SnapshotStats


@dataclass
class Delivery:
    """One snapshot (`slot`, of `rank` at `step`) on its way to the holders of `generation`."""

    codec: P.Codec
    stats: SnapshotStats
    slot: Slot
    rank: int
    step: int
    generation: int
    held_at: frozenset = frozenset()  # endpoints that hold this very copy already: asked to relabel it
    reserved: frozenset = frozenset()  # endpoints sent ReserveSnapshot before the capture
    offer: bool = True  # offered by its digests where it has them (it holds data parallel state), else sent whole
    streamed: dict = field(default_factory=dict)  # endpoint -> parts it got during the capture (all of them)
    on_differs: Callable[[list], Any] = lambda blocks: None  # a holder found diverged data parallel blocks
    cancelled: Callable[[], bool] = lambda: False  # a reconfiguration dropped it
    gone: Callable[[str], bool] = lambda endpoint: False  # the holder's process died (dpstate.replication.holders)
    _full: list = field(default_factory=list)

    def reserve(self) -> P.ReserveSnapshot:
        return P.ReserveSnapshot(rank=self.rank, step=self.step, generation=self.generation)

    def run(self, socks: dict[str, Any]) -> bool:
        """Send to every holder in `socks` (endpoint -> DEALER) and wait for their acks; False when cancelled.
        A refused relabel is answered with the snapshot; ReplicationError after 3 refusals of it; HolderGone
        where a holder that has not acked went away."""
        slot = self.slot
        put = self._put()
        self.offer = self.offer and slot.digests is not None
        if self.offer:
            offer = P.OfferSnapshot(self.rank, self.step, self.generation, slot.checksum, put.nbytes,
                                    slot.plan.as_json() if slot.plan else {})
            tail = memoryview(self._data())[slot.digests.size * CHECKSUM_BLOCK :]
            self._full = self.codec.encode(offer, [slot.meta, slot.digests, tail])
        else:
            self._full = self.codec.encode(put, [slot.meta, *P.chunk_views(self._data())])
        relabeled = {id(sock) for e, sock in socks.items() if e in self.held_at}
        streamed = {id(sock) for e, sock in socks.items() if e in self.streamed} - relabeled
        reserving: set = set()
        if not self.offer:  # sent whole: each holder first drops its oldest copy to take it in that memory
            reserving = {id(sock) for sock in socks.values()} - relabeled - streamed
            for endpoint, sock in socks.items():
                if id(sock) in reserving and endpoint not in self.reserved:
                    sock.send_multipart(self.codec.encode(self.reserve()))
        tries = {id(sock): 0 for sock in socks.values()}
        waiting = list(socks.values())
        t0 = time.perf_counter()
        for endpoint, sock in socks.items():
            if id(sock) in relabeled:
                sock.send_multipart(self.codec.encode(dataclasses.replace(put, held=True)))
            elif id(sock) in streamed:
                sock.send_multipart(self.codec.encode(dataclasses.replace(put, parts=self.streamed[endpoint]),
                                                      [slot.meta]))
            elif id(sock) not in reserving:
                self._send(sock)  # an offer: the holder makes room as it takes it in
        poller = zmq.Poller()
        for sock in waiting:
            poller.register(sock, zmq.POLLIN)
        endpoint_of = {id(sock): endpoint for endpoint, sock in socks.items()}
        while waiting:
            if self.cancelled():
                return False
            gone = next((endpoint_of[id(s)] for s in waiting if self.gone(endpoint_of[id(s)])), None)
            if gone is not None:
                raise HolderGone(gone, self.rank, self.step)
            for sock, _ in poller.poll(10):  # 10 ms: a reconfiguration is noticed that fast
                try:
                    ack, _ = self.codec.decode(sock.recv_multipart())
                except P.ProtocolError:
                    continue
                if getattr(ack, "rank", None) != self.rank or getattr(ack, "step", None) != self.step:
                    continue
                if isinstance(ack, P.SnapshotReserved) and id(sock) in reserving:
                    reserving.discard(id(sock))
                    self._send(sock)
                elif isinstance(ack, P.SnapshotWants) and self.offer:
                    if ack.differs:
                        self.on_differs(ack.differs)
                    self._send_blocks(sock, ack.blocks)
                elif isinstance(ack, P.SnapshotAck) and ack.ok:
                    waiting.remove(sock)
                    poller.unregister(sock)
                elif isinstance(ack, P.SnapshotAck) and id(sock) in relabeled:  # no longer held there: send it
                    relabeled.discard(id(sock))
                    self.stats.relabel_refused += 1
                    self._send(sock)
                elif isinstance(ack, P.SnapshotAck):
                    tries[id(sock)] += 1
                    if tries[id(sock)] >= 3:
                        raise ReplicationError(f"the replica store refused rank {self.rank} step {self.step}: "
                                               f"{ack.error}")
                    self._send(sock)
        if socks:
            self.stats.sends += 1
            self.stats.send_s += time.perf_counter() - t0
            self.stats.relabels += len(relabeled)
        return True

    def _put(self) -> P.PutSnapshot:
        return P.PutSnapshot(rank=self.rank, step=self.step, generation=self.generation,
                             checksum=self.slot.checksum, nbytes=len(self.slot.meta) + self.slot.nbytes)

    def _data(self) -> Any:
        return self.slot.data.numpy() if self.slot.nbytes else b""

    def _send(self, sock: Any) -> None:
        sock.send_multipart(self._full, copy=False)
        self.stats.offers += self.offer

    def _send_blocks(self, sock: Any, wanted: list) -> None:
        """The whole blocks a holder asked for (SnapshotWants; the tail came with the offer)."""
        blocks = P.block_views(self._data())[: self.slot.digests.size]
        wanted = [i for i in wanted if isinstance(i, int) and 0 <= i < len(blocks)]
        msg = P.SnapshotBlocks(self.rank, self.step, self.generation, wanted)
        sock.send_multipart(self.codec.encode(msg, [blocks[i] for i in wanted]), copy=False)
        self.stats.blocks_sent += len(wanted)
