"""Replication: PutSnapshot / SnapshotAck and FetchSnapshot / SnapshotData between dpstate's Replicator and a
real ROUTER (dpagent's ReplicaServer), the local ring of buffers, corrupt and missing snapshots, aborts."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from dpcommon import protocol as P
from dpcommon.checksum import BlockDigester
from dpcommon.replica_store import intact
from dpstate.snapshot import packing as S
from dpstate.replication import holders
from dpstate.steps.abort import Aborted, AbortSignal, classify
from dpstate.replication.holders import GONE_AFTER_S, HolderGone
from dpstate.replication.prefetch import Prefetch
from dpstate.replication.replicator import ReplicationError
from dpstate.snapshot.state import Tracked
from conftest import free_port, rss_shmem
from helpers.e2e import wait_for
from helpers.fake_agents import TOKEN
from helpers.replication import replicator, state

pytestmark = pytest.mark.timeout(60)


def test_put_is_acked_and_fetch_returns_the_same_bytes(replica):
    model, opt, tracked = state()
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(5, tracked.capture(5))
    rep.wait_acked(timeout=10)
    assert replica.store.steps(1) == [5]
    assert replica.newest_stored(1) == 5
    held = rep.local(5)
    assert held is not None and rep.last_capture_s > 0

    other = replicator(rank=0)
    fetched = other.fetch(replica.replica_endpoint, 1, 5, timeout=10)
    assert fetched.meta == held.meta and torch.equal(fetched.data, held.data)
    assert fetched.checksum == held.checksum == S.checksum(held.meta, held.data)
    tree = S.unpack(fetched.meta, fetched.data)
    assert tree["step"] == 5
    for key, value in model.state_dict().items():
        assert torch.equal(tree["state"]["model"][key], value)

    with pytest.raises(ReplicationError, match="has no snapshot"):
        other.fetch(replica.replica_endpoint, 1, 4, timeout=10)


def test_ring_keeps_the_newest_nslots_and_rollback_forgets_newer(replica):
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    for step in range(6):
        rep.submit(step, tracked.capture(step))
        rep.wait_acked(timeout=10)  # what the snapshot gate does
    assert rep.local_steps() == [4, 5]  # NSLOTS = 2 local copies
    assert replica.store.steps(1) == [4, 5]  # the replica store keeps 2
    sock = zmq.Context.instance().socket(zmq.DEALER)  # what a worker sends before its next capture
    sock.linger = 0
    sock.connect(replica.replica_endpoint)
    codec = P.Codec(TOKEN)
    sock.send_multipart(codec.encode(P.ReserveSnapshot(rank=1, step=6, generation=0)))
    assert sock.poll(10_000)
    assert codec.decode(sock.recv_multipart())[0] == P.SnapshotReserved(1, 6, [4])
    sock.close(0)
    assert replica.store.steps(1) == [5]  # step 6 will take step 4's memory
    rep.submit(6, tracked.capture(6))
    rep.wait_acked(timeout=10)
    assert replica.store.steps(1) == [5, 6]
    rep.forget_after(5)
    assert rep.local_steps() == [5]
    slot = rep.local(5)
    rep.configure(1, replica.replica_endpoint, 1)
    rep.submit_packed(slot)  # re-replicate the restored state in the new generation
    rep.wait_acked(timeout=10)
    assert replica.store.steps(1)[-1] == 5


def test_a_reconfiguration_drops_the_send_but_keeps_the_capture(replica):
    """quiesce() right after submit(): the step is captured and held locally (the controller counts on a
    rank holding the step it reported), and nothing of it reaches the replica store."""
    model, _, tracked = state()
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(0, tracked.capture(0))
    rep.wait_acked(timeout=10)
    with rep._cond:  # the thread cannot take the job before quiesce() marks it (quiesce waits unlocked)
        rep.submit(1, tracked.capture(1))
        rep.quiesce()
    assert rep.local_steps() == [0, 1]
    tree = S.unpack(rep.local(1).meta, rep.local(1).data)
    assert tree["step"] == 1 and torch.equal(tree["state"]["model"]["0.weight"], model[0].weight)
    assert replica.store.steps(1) == [0]
    rep.wait_acked(timeout=1)  # nothing left to wait for


def test_a_restored_snapshot_is_relabelled_where_held_and_sent_whole_where_not(replica):
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    for step in (3, 4):
        rep.submit(step, tracked.capture(step))
        rep.wait_acked(timeout=10)
    held = replica.store.get(1, 3)
    rep.forget_after(3)
    rep.configure(1, replica.replica_endpoint, 1)
    rep.submit_packed(rep.local(3), held_at=[replica.replica_endpoint])  # the plan says it holds step 3
    rep.wait_acked(timeout=10)
    assert replica.store.steps(1) == [3] and replica.store.get(1, 3).generation == 1
    assert replica.store.get(1, 3).chunks is held.chunks  # the same frames: nothing was sent again
    assert (rep.stats.relabels, rep.stats.relabel_refused) == (1, 0)

    replica.store.corrupt_all()  # now the copy there is bad: the relabel is refused and the copy sent
    rep.configure(2, replica.replica_endpoint, 1)
    rep.submit_packed(rep.local(3), held_at=[replica.replica_endpoint])
    rep.wait_acked(timeout=10)
    assert (rep.stats.relabels, rep.stats.relabel_refused) == (1, 1)
    good = replica.store.get(1, 3)
    assert good.generation == 2 and S.checksum(good.meta, good.data) == good.checksum


def test_a_snapshot_larger_than_a_chunk_travels_in_chunks_and_comes_back_whole(replica):
    """10 MB of state: the holder keeps its data as the frames it received (4 MB chunks), the relabel check
    and the fetch's checksum run over them, and a fetch joins them into one buffer, bit for bit; a byte
    flipped in one chunk is caught by the fetch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1600, 1600)
    tracked = Tracked()
    tracked.add(model=model)
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(2, tracked.capture(2))
    rep.wait_acked(timeout=10)
    held, local = replica.store.get(1, 2), rep.local(2)
    assert [len(P.payload_bytes(c)) for c in held.chunks] == [P.CHUNK_BYTES, P.CHUNK_BYTES,
                                                              local.nbytes - 2 * P.CHUNK_BYTES]
    assert intact(held)
    fetched = replicator(rank=0).fetch(replica.replica_endpoint, 1, 2, timeout=10)
    assert torch.equal(fetched.data, local.data) and fetched.checksum == local.checksum
    assert torch.equal(S.unpack(fetched.meta, fetched.data)["state"]["model"]["weight"], model.weight)
    replica.store.corrupt_all()
    assert not intact(replica.store.get(1, 2))
    with pytest.raises(ReplicationError, match="checksum mismatch"):
        replicator(rank=0).fetch(replica.replica_endpoint, 1, 2, timeout=10)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_fetch_digests_its_chunks_as_they_arrive_and_still_catches_a_flipped_byte(replica, monkeypatch, caplog,
                                                                                    streams):
    """41 MB of state: the fetch hands ranges of blocks to the digest threads while later chunks are still on
    their way, its checksum is the capture's, and a byte flipped in a middle chunk is caught. Over 3
    connections (DP_FETCH_STREAMS), each brings every third chunk and the snapshot comes back whole all the same."""
    monkeypatch.setenv("DP_FETCH_STREAMS", str(streams))
    caplog.set_level(logging.INFO, logger="dpagent")
    handed: list[tuple[int, int]] = []  # (blocks handed to the threads so far, of how many) after each chunk
    ready = BlockDigester.ready

    def recording(self, upto, wait=None):
        ready(self, upto, wait)
        handed.append((self.done_to, self.blocks))

    monkeypatch.setattr(BlockDigester, "ready", recording)
    tracked = Tracked()
    tracked.add(model=torch.nn.Linear(3200, 3200))
    rep = replicator()
    rep.configure(0, replica.replica_endpoint, 1)
    rep.submit(2, tracked.capture(2))
    rep.wait_acked(timeout=20)
    handed.clear()
    caplog.clear()
    fetched = replicator(rank=0).fetch(replica.replica_endpoint, 1, 2, timeout=20)
    assert fetched.checksum == rep.local(2).checksum and torch.equal(fetched.data, rep.local(2).data)
    assert any(0 < done < blocks for done, blocks in handed), handed  # (4 MB chunks; 16 blocks a range)
    served = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("served snapshot"))
    assert served == [f"served snapshot of rank 1 step 2 ({rep.local(2).nbytes + len(rep.local(2).meta)} bytes; "
                      f"connection {i} of {streams})" for i in range(1, streams + 1)]
    replica.store.corrupt_all()
    with pytest.raises(ReplicationError, match="checksum mismatch"):
        replicator(rank=0).fetch(replica.replica_endpoint, 1, 2, timeout=20)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_copy_held_in_chunks_of_uneven_sizes_comes_back_whole_over_any_number_of_connections(replica, monkeypatch,
                                                                                              streams):
    """A copy held partly by reference to a local one (dedup) is kept in chunks of uneven sizes: each chunk says
    where its bytes start, and a fetch over one connection or several puts each in its place, bit for bit."""
    monkeypatch.setenv("DP_FETCH_STREAMS", str(streams))
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, "", 1)  # kept local only: its meta, data and checksum make the copy the store holds
    rep.submit(7, tracked.capture(7))
    rep.wait_acked(timeout=10)
    local = rep.local(7)
    raw = bytes(local.data.numpy())
    cuts = [0, 1, 1000, 1001, 5000, len(raw)]
    put = P.PutSnapshot(1, 7, 0, local.checksum, len(local.meta) + len(raw))
    assert replica.store.add(put, local.meta, *[raw[a:b] for a, b in zip(cuts, cuts[1:])]) == ""
    fetched = replicator(rank=0).fetch(replica.replica_endpoint, 1, 7, timeout=10)
    assert bytes(fetched.data.numpy()) == raw and fetched.checksum == local.checksum


def test_without_replica_snapshots_stay_local():
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, "", 1)
    rep.submit(1, tracked.capture(1))
    rep.wait_acked(timeout=10)
    assert rep.local_steps() == [1]


def test_a_local_snapshot_written_to_a_file_is_not_overwritten_by_training_that_goes_on():
    """A stopping job's save writes step 2's local snapshot on the control thread while training goes on (a
    worker notes its first SIGTERM and trains until its agent stops it): captures take the other buffer, and
    one that finds no buffer free waits for the file instead of failing or writing into it."""
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, "", 1)
    for step in (1, 2):
        rep.submit(step, tracked.capture(step))
        rep.wait_acked(timeout=10)
    kept = rep.local(2)
    meta, data = kept.meta, kept.data.clone()
    capturing, release = threading.Event(), threading.Event()

    def slow_capture():  # the replicator's thread calls it as the capture of step 4 starts
        capturing.set()
        release.wait(10)
        return []

    errors = []

    def next_step():
        try:
            rep.submit(5, tracked.capture(5))
        except Exception as exc:  # noqa: BLE001 (the old ring gave up: "no free snapshot buffer")
            errors.append(exc)

    try:
        with rep.holding(2) as held:
            assert held is kept
            rep.submit(3, tracked.capture(3))
            rep.wait_acked(timeout=10)
            assert rep.local_steps() == [2, 3]  # training went on in the other buffer
            rep.submit(4, tracked.capture(4), slow_capture)
            assert capturing.wait(10)
            stepper = threading.Thread(target=next_step)
            stepper.start()
            stepper.join(0.5)
            assert stepper.is_alive() and not errors, errors  # one buffer in the file, the other in capture
            assert held.step == 2 and held.meta == meta and torch.equal(held.data, data)
        stepper.join(10)  # the file is written: its buffer is free again
        assert not stepper.is_alive() and not errors, errors
    finally:
        release.set()
    rep.wait_acked(timeout=10)
    assert rep.local_steps() == [4, 5]


EXIT_MID_CAPTURE = """
import threading, torch
from dpcommon import protocol as P
from dpstate.steps.abort import AbortSignal
from dpstate.replication.replicator import Replicator
started = threading.Event()

def shared_keys():  # called by the replicator's thread as its capture starts: a second of torch calls
    started.set()
    for _ in range(100_000):
        torch.zeros(1).view(torch.uint8)
    return []

Replicator(P.Codec(b"k" * 32), 0, AbortSignal()).submit(1, {"w": torch.zeros(4)}, shared_keys)
started.wait(60)
raise ValueError("bad batch at step 2")
"""


@pytest.mark.slow  # a torch process: ~20 s on a busy host
def test_a_process_that_exits_on_an_error_mid_capture_keeps_its_exit_code_and_traceback():
    """The replicator's thread is stopped before the interpreter finalizes: one that came back from a torch call
    then would abort the process ("terminate called without an active exception", exit -6)."""
    run = subprocess.run([sys.executable, "-c", EXIT_MID_CAPTURE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.rstrip().endswith("ValueError: bad batch at step 2"), run.stderr[-2000:]


class BadStore:
    """A ROUTER that makes room for every put but never acks one, and answers every fetch with data that
    fails its checksum (two chunks); for step 4 with more data than it announces, for step 5 with its chunks
    out of order, for step 6 with one chunk of the two it announces."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.codec = P.Codec(TOKEN)
        self.puts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg, _ = self.codec.decode(frames)
            if isinstance(msg, P.PutSnapshot):
                self.puts += 1
            elif isinstance(msg, P.ReserveSnapshot):
                self.sock.send_multipart([ident] + self.codec.encode(P.SnapshotReserved(msg.rank, msg.step)))
            elif isinstance(msg, P.FetchSnapshot):
                reply = P.SnapshotData(msg.rank, msg.step, True, checksum=12345,
                                       nbytes=8 if msg.step == 4 else 12, chunks=2)
                self.sock.send_multipart([ident] + self.codec.encode(reply, [b"meta"] if msg.stream == 0 else []))
                own = [i for i in range(2) if i % msg.streams == msg.stream]
                if msg.step == 5:  # out of order on its connection: reversed, or another connection's chunk
                    own = [1, 0] if msg.streams == 1 else [(i + 1) % 2 for i in own]
                elif msg.step == 6:  # the last chunk never comes
                    own = [i for i in own if i != 1]
                for index in own:
                    chunk = P.SnapshotChunk(msg.rank, msg.step, index, 4 * index)
                    self.sock.send_multipart([ident] + self.codec.encode(chunk, [b"data"]))

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.parametrize("streams", ["1", "2"])
def test_corrupt_fetch_is_refused_and_a_missing_ack_is_abortable(monkeypatch, streams):
    monkeypatch.setenv("DP_FETCH_STREAMS", streams)
    bad = BadStore()
    try:
        abort = AbortSignal()
        rep = replicator(abort=abort)
        with pytest.raises(ReplicationError, match="checksum"):
            rep.fetch(bad.endpoint, 1, 3, timeout=10)
        with pytest.raises(ReplicationError, match="size mismatch"):
            rep.fetch(bad.endpoint, 1, 4, timeout=10)
        with pytest.raises(ReplicationError, match="chunk [01] of 2 .* sent SnapshotChunk"):
            rep.fetch(bad.endpoint, 1, 5, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ReplicationError, match="chunk 1 of 2 .* did not come .* in time"):
            rep.fetch(bad.endpoint, 1, 6, timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        assert rep.local_steps() == []

        _, _, tracked = state()
        rep.configure(0, bad.endpoint, 1)
        rep.submit(1, tracked.capture(1))
        with pytest.raises(TimeoutError):
            rep.wait_acked(timeout=0.3)
        threading.Timer(0.2, abort.trigger, args=("test",)).start()
        t0 = time.monotonic()
        with pytest.raises(Aborted):
            rep.wait_acked()
        assert time.monotonic() - t0 < 1.0
        assert bad.puts == 1
        t0 = time.monotonic()
        rep.quiesce()  # the thread gives up waiting for the ack
        assert time.monotonic() - t0 < 1.0
        assert rep.local_steps() == [1]  # captured, just not acked
    finally:
        bad.close()


def test_a_holder_whose_process_died_fails_the_wait_for_its_ack_within_seconds():
    """A rank waiting at the snapshot gate for a dead holder's ack enters no collective that could fail: the
    socket monitor sees the holder's connection close, and after GONE_AFTER_S without it coming back the wait
    raises HolderGone, which the rank reports as a peer's failure (before, it waited for the heartbeat timeout)."""
    bad = BadStore()  # takes the snapshot and never acks it
    _, _, tracked = state()
    rep = replicator()
    rep.configure(0, bad.endpoint, 1)
    rep.submit(1, tracked.capture(1))
    wait_for(lambda: bad.puts == 1, 10, "the holder to take the snapshot")
    bad.close()  # what the kernel does with the sockets of a process that died
    closed = time.monotonic()
    with pytest.raises(HolderGone, match=f"at {bad.endpoint} closed its connection before it acked rank 1 step 1"):
        rep.wait_acked(timeout=10)
    waited = time.monotonic() - closed
    assert GONE_AFTER_S - 0.05 <= waited < GONE_AFTER_S + 2, waited
    assert classify(HolderGone(bad.endpoint, 1, 1)) == "peer"
    rep.quiesce()  # a recovery: the error is the failure's, and the capture is kept
    assert rep.local_steps() == [1]


def test_a_holder_that_never_answered_yet_is_waited_for(monkeypatch):
    """Only a connection that was made and then lost counts: a holder not listening yet (its agent still
    starting) is retried by ZeroMQ and waited for, as before."""
    monkeypatch.setattr(holders, "GONE_AFTER_S", 0.05)
    ctx = zmq.Context()
    link = holders.HolderLink(ctx, f"tcp://127.0.0.1:{free_port()}")
    try:
        until = time.monotonic() + 0.5  # ZeroMQ retries the connection every 100 ms meanwhile
        while time.monotonic() < until:
            assert not link.gone()
            time.sleep(0.05)
    finally:
        link.close()
        ctx.term()


def test_a_prefetch_serves_the_restore_it_was_started_for_and_nothing_else(replica):
    """A promoted spare fetches its restore snapshot while its script builds the model (dpstate.replication.prefetch):
    the restore of that generation, rank and step takes the very slot; any other plan gets nothing and the
    slot is given back; a fetch that fails or hangs leaves nothing behind and stops at the abort."""
    _, _, tracked = state()
    owner = replicator()
    owner.configure(0, replica.replica_endpoint, 1)
    owner.submit(5, tracked.capture(5))
    owner.wait_acked(timeout=10)

    rep = replicator()
    slot = Prefetch(rep, 3, 1, 5, [replica.replica_endpoint]).take(3, 1, 5)
    assert slot is not None and slot.step == 5 and rep.local(5) is slot
    assert torch.equal(slot.data, owner.local(5).data)

    other = replicator()
    assert Prefetch(other, 3, 1, 5, [replica.replica_endpoint]).take(4, 1, 5) is None  # a newer plan
    assert other.local_steps() == []
    assert Prefetch(other, 3, 1, 4, [replica.replica_endpoint]).take(3, 1, 4) is None  # not held there
    assert other.local_steps() == []

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes the request and never answers
    silent.linger = 0
    try:
        abort = AbortSignal()
        hanging = Prefetch(replicator(abort=abort), 3, 1, 5,
                           [f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"])
        threading.Timer(0.2, abort.trigger, args=("a newer generation",)).start()
        t0 = time.monotonic()
        assert hanging.take(3, 1, 5) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        silent.close(0)
        ctx.term()


@pytest.mark.parametrize("share", [False, True], ids=["private-buffers", "shared-with-the-agent"])
def test_a_spare_makes_room_while_idle_and_its_restore_and_next_capture_write_there(replica, monkeypatch, share):
    """Standby: a spare's worker reserves its ring while idle and faults it in (dpstate.snapshot.standby), so that after
    a failure its restore's fetch and its first capture write to that very memory, not to fresh pages; once a
    slot is in use, reserving ahead touches nothing."""
    from dprun.controller.spare_sizing import with_headroom
    from dpstate.replication.replicator import NSLOTS

    if share:
        monkeypatch.setenv("DP_LOCAL_REPLICA", replica.replica_endpoint)  # the holder plays the spare's agent too
    _, _, tracked = state()
    owner = replicator()
    owner.configure(0, replica.replica_endpoint, 1)
    owner.submit(5, tracked.capture(5))
    owner.wait_acked(timeout=10)
    room = with_headroom(len(owner.local(5).meta) + owner.local(5).nbytes)

    spare = replicator()
    assert spare.share is share
    before = rss_shmem()
    assert spare.reserve_ahead(room) == NSLOTS
    if share:
        assert rss_shmem() - before >= NSLOTS * room, "the shared buffers were not faulted in"
    memory = sorted(slot.buffer.data_ptr() for slot in spare.slots)
    assert all(slot.buffer.numel() >= room for slot in spare.slots)

    restored = spare.fetch(replica.replica_endpoint, 1, 5, timeout=10)
    assert restored.buffer.data_ptr() in memory and torch.equal(restored.data, owner.local(5).data)
    spare.configure(1, replica.replica_endpoint, 1)
    spare.submit(6, tracked.capture(6))
    spare.wait_acked(timeout=10)
    assert spare.local_steps() == [5, 6]
    assert sorted(slot.buffer.data_ptr() for slot in spare.slots) == memory
    assert spare.reserve_ahead(2 * room) == 0, "a slot in use was reserved again"
    assert sorted(slot.buffer.data_ptr() for slot in spare.slots) == memory and spare.local_steps() == [5, 6]


def test_standby_makes_room_for_its_local_ranks_size_on_a_thread_and_only_for_a_larger_one():
    from dpstate.snapshot.standby import RestoreRoom

    rep = replicator()
    standby = RestoreRoom(rep, local_rank=1)
    standby.on_message(P.Standby([1 << 30, 3 << 20]))  # local rank 0's size is not this worker's
    standby.join(timeout=10)
    assert standby.prepared == (2, 3 << 20) and all(s.buffer.numel() == 3 << 20 for s in rep.slots)
    standby.on_message(P.Standby([0, 2 << 20]))  # smaller: nothing to do
    standby.on_message(P.Standby([5]))  # no size for local rank 1
    standby.join(timeout=10)
    assert standby.prepared == (2, 3 << 20) and all(s.buffer.numel() == 3 << 20 for s in rep.slots)
    standby.on_message(P.Standby([0, 4 << 20]))
    standby.join(timeout=10)
    assert standby.prepared == (2, 4 << 20) and all(s.buffer.numel() == 4 << 20 for s in rep.slots)


def test_on_a_kernel_without_the_populate_advice_a_buffer_is_faulted_in_by_zeroing(monkeypatch):
    from dpstate.snapshot import shared

    monkeypatch.setattr(shared, "MADV_POPULATE_WRITE", 12345)  # unknown advice: EINVAL, as before Linux 5.14
    buffer = shared.SharedBuffer(4 << 20)
    before = rss_shmem()
    buffer.populate()
    assert rss_shmem() - before >= 4 << 20
