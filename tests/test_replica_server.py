"""The agent's replica server on real ZeroMQ sockets: a relabel's checksum runs beside the agent's loop, which
keeps serving meanwhile; the relabel is answered when the check ends (kept, corrupt, or changed meanwhile)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import zmq

from dpcommon import protocol as P
from dpcommon.channel import Channel
from dpcommon.checksum import checksum, checksum_chunks
from dpagent.loop_events import EventPipe
from dpagent.replica_server import RelabelChecked, RelabelChecker, ReplicaServer
from dpcommon.replica_store import ReplicaStore

pytestmark = pytest.mark.timeout(30)

TOKEN = b"relabel-test-token"


class Holder:
    """A replica server driven by the test's own loop (as the agent's), a DEALER client, and a checksum that
    waits for the test's go before it runs."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.codec = P.Codec(TOKEN)
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        self.channel = Channel(router, self.codec, "replica", zero_copy=True)
        self.events = EventPipe(self.ctx)
        self.store = ReplicaStore()
        self.reports: list[P.SnapshotStored] = []
        self.server = ReplicaServer(self.channel, self.store, "holder", self.reports.append, self.events)
        self.checking, self.go = threading.Event(), threading.Event()
        self.server.checker.close()
        self.server.checker = RelabelChecker(self.events, check=self._held_check)
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.linger = 0
        self.client.connect(f"tcp://127.0.0.1:{port}")
        self.received: list[Any] = []

    def _held_check(self, meta: Any, chunks: list) -> int:
        self.checking.set()
        assert self.go.wait(20), "the test never let the check run"
        return checksum_chunks(meta, chunks)

    def hold(self, rank: int, step: int, data: bytes) -> P.PutSnapshot:
        put = P.PutSnapshot(rank=rank, step=step, generation=0, checksum=checksum(b"m", data), nbytes=1 + len(data))
        assert self.store.add(put, b"m", data) == ""
        return put

    def send(self, msg: Any) -> None:
        self.client.send_multipart(self.codec.encode(msg))

    def pump(self, until: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        """Run the agent's side (replica socket, event pipe) and collect the client's replies until `until`."""
        poller = zmq.Poller()
        for sock in (self.channel.sock, self.events.wake, self.client):
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; received {self.received}"
            ready = dict(poller.poll(50))
            if self.channel.sock in ready:
                for incoming in self.channel.recv_ready():
                    self.server.handle(incoming)
            if self.events.wake in ready:
                for event in self.events.drain():
                    assert isinstance(event, RelabelChecked)
                    self.server.relabel_checked(event)
            if self.client in ready:
                self.received.append(self.codec.decode(self.client.recv_multipart())[0])

    def acks(self) -> list[P.SnapshotAck]:
        return [m for m in self.received if isinstance(m, P.SnapshotAck)]

    def close(self) -> None:
        self.go.set()
        self.server.close()
        self.client.close(0)
        self.channel.sock.close(0)
        self.events.close()
        self.ctx.term()


@pytest.fixture
def holder():
    h = Holder()
    try:
        yield h
    finally:
        h.close()


def relabel_of(put: P.PutSnapshot, generation: int = 1) -> P.PutSnapshot:
    return P.PutSnapshot(rank=put.rank, step=put.step, generation=generation, checksum=put.checksum,
                         nbytes=put.nbytes, held=True)


def test_the_holder_keeps_serving_while_a_relabel_is_checked_and_answers_it_after(holder):
    held = holder.hold(rank=1, step=5, data=bytes(range(256)) * 4096)
    holder.hold(rank=2, step=3, data=b"other rank" * 10)
    holder.send(relabel_of(held))
    holder.pump(holder.checking.is_set, "the relabel's check to start")

    holder.send(P.FetchSnapshot(rank=2, step=3))  # served while the check is still under way
    holder.pump(lambda: any(isinstance(m, P.SnapshotData) for m in holder.received), "the fetch to be served")
    assert holder.acks() == [] and holder.store.get(1, 5).generation == 0

    holder.go.set()
    holder.pump(holder.acks, "the relabel's ack")
    assert [(a.rank, a.step, a.ok) for a in holder.acks()] == [(1, 5, True)]
    assert holder.store.get(1, 5).generation == 1
    assert [(r.rank, r.step, r.generation) for r in holder.reports] == [(1, 5, 1)]


def test_a_copy_damaged_or_replaced_during_its_check_is_refused(holder):
    first = holder.hold(rank=1, step=5, data=b"\x01" * 100_000)
    holder.send(relabel_of(first))
    holder.pump(holder.checking.is_set, "the first check to start")
    assert holder.store.corrupt_all() == 1  # the copy checked is not the one held any more
    holder.go.set()
    holder.pump(holder.acks, "the first ack")
    assert not holder.acks()[0].ok and "changed while it was checked" in holder.acks()[0].error

    holder.received.clear()
    second = holder.hold(rank=1, step=6, data=b"\x02" * 100_000)
    holder.store.corrupt_all()  # damaged before the check: the check itself finds it
    holder.send(relabel_of(second))
    holder.pump(holder.acks, "the second ack")
    assert not holder.acks()[0].ok and "corrupt" in holder.acks()[0].error
    assert 6 not in holder.store.steps(1) and holder.reports == []
