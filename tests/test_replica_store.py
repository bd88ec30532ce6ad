"""Unit tests of the replica store: retention, verification, fetch, generations (no sockets, no processes)."""

from __future__ import annotations

import os
import zlib

import pytest
import zmq

from dpcommon.protocol import PutSnapshot
from dpcommon.replica_store import ReplicaStore


def put(rank=0, step=0, generation=0, meta=b"meta", data=b"data", checksum=None, nbytes=None):
    msg = PutSnapshot(
        rank=rank,
        step=step,
        generation=generation,
        checksum=zlib.crc32(data, zlib.crc32(meta)) if checksum is None else checksum,
        nbytes=len(meta) + len(data) if nbytes is None else nbytes,
    )
    return msg, meta, data


def test_keeps_newest_two_steps_per_rank():
    """Two: the snapshot gate lets no restore go back past the newest step acked (see make_room)."""
    store = ReplicaStore()
    for step in range(6):
        for rank in (0, 1):
            assert store.add(*put(rank, step, data=f"r{rank}s{step}".encode())) == ""
    assert store.steps(0) == [4, 5]
    assert store.steps(1) == [4, 5]
    assert store.ranks() == [0, 1]
    assert len(store) == 4
    assert store.get(0, 3) is None
    assert bytes(store.get(1, 4).data) == b"r1s4"


def test_out_of_order_put_older_than_kept_is_refused_but_a_gap_is_filled():
    store = ReplicaStore()
    for step in (4, 6):
        assert store.add(*put(0, step)) == ""
    assert "older than" in store.add(*put(0, 1))
    assert store.add(*put(0, 5)) == ""  # newer than the oldest kept: the oldest goes
    assert store.steps(0) == [5, 6]


def test_size_mismatch_is_refused_and_the_checksum_is_left_to_the_loader():
    store = ReplicaStore()
    msg, meta, data = put(0, 1, nbytes=3)
    assert "size" in store.add(msg, meta, data)
    assert store.get(0, 1) is None
    msg, meta, _ = put(0, 1)
    assert store.add(msg, meta, b"dat!") == ""  # same size, other bytes: held (the worker that loads it checks)
    assert bytes(store.get(0, 1).data) == b"dat!"


def test_fetch_found_missing_and_newest():
    store = ReplicaStore()
    assert store.get(0, 0) is None
    assert store.get(0, -1) is None
    store.add(*put(0, 7, meta=b"m7", data=b"d7"))
    store.add(*put(0, 8, meta=b"m8", data=b"d8"))
    snap = store.get(0, 7)
    assert (snap.rank, snap.step, bytes(snap.meta), bytes(snap.data)) == (0, 7, b"m7", b"d7")
    assert snap.checksum == zlib.crc32(b"d7", zlib.crc32(b"m7"))
    assert snap.nbytes == 4
    assert store.get(0, -1).step == 8  # a negative step asks for the newest
    assert store.get(0, 9) is None
    assert store.get(1, 7) is None


def test_generations_fence_stale_puts_and_replace_abandoned_steps():
    store = ReplicaStore(keep=3)
    for step in (8, 9, 10):
        store.add(*put(0, step, generation=0, data=b"old"))
    # generation 1 rolled back to step 8 and recomputes 9: old 9 and 10 belong to an abandoned timeline
    assert store.add(*put(0, 9, generation=1, data=b"new")) == ""
    assert store.steps(0) == [8, 9]
    assert store.get(0, 9).generation == 1 and bytes(store.get(0, 9).data) == b"new"
    assert store.get(0, 8).generation == 0
    # a late put from the fenced generation is refused
    assert "stale generation" in store.add(*put(0, 10, generation=0))
    assert store.steps(0) == [8, 9]


def test_same_step_is_replaced_and_bad_rank_refused():
    store = ReplicaStore()
    store.add(*put(0, 1, data=b"one"))
    store.add(*put(0, 1, data=b"two"))
    assert store.steps(0) == [1] and bytes(store.get(0, 1).data) == b"two"
    assert "bad rank" in store.add(*put(-1, 1))
    with pytest.raises(ValueError):
        ReplicaStore(keep=0)


def test_zero_copy_frames_are_kept_as_given():
    data = os.urandom(1 << 20)
    msg, meta, _ = put(2, 3, meta=b"{}", data=data)
    frame_meta, frame_data = zmq.Frame(b"{}"), zmq.Frame(data)
    store = ReplicaStore(keep=1)
    assert store.add(msg, frame_meta, frame_data) == ""
    snap = store.get(2, 3)
    assert snap.chunks[0] is frame_data  # no copy
    assert store.total_bytes == len(data) + 2
    store.drop_rank(2)
    assert store.ranks() == []


def test_corrupt_all_breaks_every_checksum_so_a_fetch_can_tell():
    import zlib

    from dpcommon.protocol import PutSnapshot
    from dpcommon.replica_store import ReplicaStore

    store = ReplicaStore()
    meta, data = b"meta", bytes(range(256)) * 4
    put = PutSnapshot(rank=1, step=3, generation=0, checksum=zlib.crc32(data, zlib.crc32(meta)), nbytes=len(meta) + len(data))
    assert store.add(put, meta, data) == ""
    assert store.corrupt_all() == 1
    held = store.get(1, 3)
    assert zlib.crc32(bytes(held.data), zlib.crc32(bytes(held.meta))) != held.checksum


def test_a_held_copy_is_relabelled_for_a_new_generation_only_if_it_is_intact():
    from dpcommon.checksum import checksum

    store = ReplicaStore(keep=3)
    for step in (4, 5, 6):
        data = bytes([step]) * 3000
        assert store.add(*put(1, step, meta=b"m", data=data, checksum=checksum(b"m", data))) == ""
    five = store.get(1, 5)
    relabel = PutSnapshot(rank=1, step=5, generation=1, checksum=five.checksum, nbytes=five.nbytes, held=True)
    assert store.relabel(relabel) == ""
    assert store.steps(1) == [4, 5]  # step 6 belonged to the abandoned timeline of generation 0
    assert store.get(1, 5).generation == 1 and store.get(1, 5).chunks is five.chunks  # kept, not received again
    assert "stale generation" in store.add(*put(1, 7, generation=0))  # generation 0 is fenced from now on

    assert "not held" in store.relabel(PutSnapshot(1, 9, 1, five.checksum, five.nbytes, held=True))
    assert "not held" in store.relabel(PutSnapshot(1, 5, 1, five.checksum ^ 1, five.nbytes, held=True))
    store.corrupt_all()
    assert "corrupt" in store.relabel(PutSnapshot(1, 4, 1, store.get(1, 4).checksum, store.get(1, 4).nbytes, held=True))
    assert store.steps(1) == [5]  # the corrupt copy is dropped: the sender sends its own whole


def test_a_reserve_drops_the_oldest_copy_of_a_full_rank_only():
    """ReserveSnapshot: the snapshot on its way takes the oldest copy's memory; nothing else is dropped."""
    store = ReplicaStore()
    for step in range(2):
        assert store.add(*put(0, step, generation=1)) == ""
    assert store.add(*put(1, 0, generation=1)) == ""
    assert [s.step for s in store.make_room(0, 2, generation=1)] == [0]
    assert store.steps(0) == [1] and store.steps(1) == [0]  # other ranks keep theirs
    assert store.make_room(0, 2, generation=1) == []  # not full any more
    assert store.add(*put(0, 2, generation=1)) == ""
    assert store.make_room(0, 2, generation=2) == []  # step 2 held: a relabel or a re-put, no new memory
    assert store.make_room(0, 3, generation=0) == []  # a fenced sender makes no room
    assert store.make_room(1, 1, generation=1) == []  # room to spare
    assert store.steps(0) == [1, 2]
    rolled = ReplicaStore()
    for step in (2, 3):
        assert rolled.add(*put(0, step, generation=1)) == ""
    assert rolled.make_room(0, 1, generation=2) == []  # a rollback's re-put supersedes steps 2 and 3
    assert rolled.steps(0) == [2, 3]
