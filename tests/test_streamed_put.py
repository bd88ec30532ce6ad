"""A snapshot sent whole streams its chunks to the holder while it is captured (SnapshotPart), then the put that
closes them: real sockets (a ReplicaServer behind FakeAgents), bytes compared; the holder's bookkeeping alone."""

from __future__ import annotations

import time

import pytest
import torch

from dpagent.streamed_puts import StreamedPuts
from dpcommon import protocol as P
from dpstate.replication import stream
from dpstate.snapshot.state import Tracked
from helpers.replication import data_parallel_state, replicator, sharing_replicator

pytestmark = pytest.mark.timeout(60)


def put(step: int = 5, parts: int = 2, rank: int = 1) -> P.PutSnapshot:
    return P.PutSnapshot(rank, step, 0, 0, 0, parts=parts)


def part(index: int, step: int = 5, rank: int = 1) -> P.SnapshotPart:
    return P.SnapshotPart(rank, step, 0, index)


def test_a_put_takes_its_senders_parts_in_order_and_is_refused_when_one_is_missing():
    puts = StreamedPuts()
    for i in range(2):
        puts.add(b"a", part(i), [f"a{i}".encode()])
        puts.add(b"b", part(i), [f"b{i}".encode()])
    assert puts.take(b"a", put()) == [b"a0", b"a1"]
    assert "2 of the 3 parts of rank 1 step 5 came" in puts.take(b"b", put(parts=3))
    assert puts.pending() == 0

    puts.add(b"a", part(0), [b"x"])
    puts.add(b"a", part(2), [b"y"])  # part 1 lost
    assert "part 2 came after 1 parts" in puts.take(b"a", put(parts=3))
    assert "none of the 2 parts" in puts.take(b"a", put())


def test_a_stream_is_dropped_when_its_sender_streams_a_newer_step_of_the_rank():
    puts = StreamedPuts()
    puts.add(b"a", part(0, step=5), [b"old"])
    puts.add(b"a", part(0, step=6), [b"new"])
    assert puts.pending() == 1
    assert "none of the 1 parts of rank 1 step 5" in puts.take(b"a", put(step=5, parts=1))
    puts.add(b"a", part(0, step=6), [b"new"])
    puts.add(b"a", part(1, step=6), [b"more"])
    assert puts.take(b"a", put(step=6, parts=2)) == [b"new", b"more"]


def big_state(tensors: int = 6) -> Tracked:
    """`tensors` tensors of 4 MB: a capture reports its progress after each."""
    torch.manual_seed(0)

    class Params(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(tensors)])

    tracked = Tracked()
    tracked.add(model=Params())
    return tracked


def test_the_holder_has_parts_before_the_capture_ends_and_stores_the_snapshot_bitwise(replica, monkeypatch):
    """A capture slowed after each tensor: the holder receives the first parts while the copy goes on, and the
    snapshot it stores (and a fetch returns) is the capture's, byte for byte."""
    arrived: list[float] = []
    ready_calls: list[float] = []
    add = replica.server._streams.add

    def recording_add(sender, msg, payload):
        arrived.append(time.monotonic())
        add(sender, msg, payload)

    real_ready = stream.PartStream.ready

    def slow_ready(self, upto):
        ready_calls.append(time.monotonic())
        real_ready(self, upto)
        time.sleep(0.05)

    monkeypatch.setattr(replica.server._streams, "add", recording_add)
    monkeypatch.setattr(stream.PartStream, "ready", slow_ready)
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(3, big_state().capture(3))
    rep.wait_acked(timeout=20)
    local = rep.local(3)
    assert rep.stats.streamed == 1 and rep.stats.offers == 0
    assert len(arrived) == -(-local.nbytes // P.CHUNK_BYTES) >= 6
    assert arrived[0] < ready_calls[-1], "no part reached the holder before the capture ended"
    held = replica.store.get(1, 3)
    assert held.checksum == local.checksum and bytes(held.data) == local.data.numpy().tobytes()
    fetched = replicator(rank=0).fetch(replica.replica_endpoint, 1, 3, timeout=10)
    assert torch.equal(fetched.data, local.data) and fetched.meta == local.meta


def test_a_refused_stream_is_sent_whole_and_stored_bitwise(replica, monkeypatch):
    """The holder loses a part (dropped here): it refuses the put that closes the stream, and the sender sends
    the snapshot whole instead."""
    add = replica.server._streams.add

    def losing_add(sender, msg, payload):
        if msg.index != 1:
            add(sender, msg, payload)

    monkeypatch.setattr(replica.server._streams, "add", losing_add)
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(4, big_state(3).capture(4))
    rep.wait_acked(timeout=20)
    local = rep.local(4)
    held = replica.store.get(1, 4)
    assert rep.stats.streamed == 1
    assert held.checksum == local.checksum and bytes(held.data) == local.data.numpy().tobytes()


def test_sharded_state_is_sent_whole_and_data_parallel_state_offered(holder, peer_node, monkeypatch):
    """With buffers shared with the node's agent, a capture holding DTensor shards (its layout lists them) and no
    data parallel state goes whole (streamed): no holder keeps another rank's shards; data parallel state is
    still offered by its digests (dedup)."""
    rep = sharing_replicator(monkeypatch, 1, peer_node.replica_endpoint)
    rep.configure(0, holder.replica_endpoint, 1)
    tree = data_parallel_state(1).capture(2)
    rep.submit(2, tree)
    rep.wait_acked(timeout=20)
    assert (rep.stats.offers, rep.stats.streamed) == (1, 0)
    tree = data_parallel_state(1).capture(3)
    tree["layout"]["shards"] = {"model": [["weight", 0, 0]]}  # what Tracked records of a DTensor's shard
    rep.submit(3, tree)
    rep.wait_acked(timeout=20)
    assert (rep.stats.offers, rep.stats.streamed) == (1, 1)
    local = rep.local(3)
    held = holder.store.get(1, 3)
    assert held.base is None and bytes(held.data) == local.data.numpy().tobytes()


def test_a_stream_ignores_answers_of_older_snapshots_while_it_waits_for_its_reservation():
    """PartStream reads its holders' sockets before the delivery does: an older snapshot's late ack there is
    dropped (as the delivery drops it), and only this snapshot's SnapshotReserved starts the parts."""
    import zmq

    codec = P.Codec(b"k" * 32)
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(codec.encode(P.ReserveSnapshot(1, 5, 0)))
        ident = router.recv_multipart()[0]
        for msg in (P.SnapshotAck(1, 4, ok=True), P.SnapshotReserved(1, 5)):
            router.send_multipart([ident, *codec.encode(msg)])
        parts = stream.PartStream(codec, {"h": dealer}, 1, 5, 0)
        parts.begin(bytes(P.CHUNK_BYTES + 10))
        deadline = time.monotonic() + 10
        while "h" not in parts.sent and time.monotonic() < deadline:
            parts.ready(P.CHUNK_BYTES)
            time.sleep(0.01)
        assert parts.sent == {"h": 1}
        parts.ready(P.CHUNK_BYTES + 10)
        assert parts.streamed() == {"h": 2}
        got = [codec.decode(router.recv_multipart()[1:])[0] for _ in range(2)]
        assert got == [P.SnapshotPart(1, 5, 0, 0), P.SnapshotPart(1, 5, 0, 1)]
    finally:
        ctx.destroy(linger=0)
