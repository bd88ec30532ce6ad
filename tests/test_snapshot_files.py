"""Snapshot files (dpagent.snapshot_files): what a stopping job writes and a resumed one reads, checked whole."""

from __future__ import annotations

import os

import pytest

from dpagent.checksum import CHECKSUM_BLOCK, checksum_chunks
from dpagent.protocol import PutSnapshot, SnapshotStored, chunk_views
from dpagent.replica_store import ReplicaStore
from dpagent.snapshot_files import load_into, rank_file, read_snapshot, save_held, saved_step, step_folder

META = b'{"step": 7}'


def _store_with(rank: int, step: int, data: bytes) -> ReplicaStore:
    chunks = chunk_views(data, 2 * CHECKSUM_BLOCK)  # several chunks, as a holder receives them
    store = ReplicaStore()
    put = PutSnapshot(rank=rank, step=step, generation=3, checksum=checksum_chunks(META, chunks),
                      nbytes=len(META) + len(data))
    assert store.add(put, META, *chunks) == ""
    return store


def test_a_saved_snapshot_reads_back_bit_for_bit_into_a_fresh_store(tmp_path):
    data = os.urandom(5 * CHECKSUM_BLOCK + 123)
    folder = step_folder(tmp_path, 7)
    assert save_held(_store_with(1, 7, data), folder, 7, [1, 2]) == {"1": "", "2": "rank 2 step 7 is not held "
                                                                           "here (held: [])"}
    assert [p.name for p in folder.iterdir()] == ["rank-1.dpsnap"], "no partial file is left"
    fresh, reports = ReplicaStore(), []
    assert load_into(fresh, folder, 7, [1], "n0", reports.append) == {"1": ""}
    assert bytes(fresh.get(1, 7).data) == data and bytes(fresh.get(1, 7).meta) == META
    assert fresh.get(1, 7).generation == 0, "the resumed job's first generation"
    assert reports == [SnapshotStored("n0", 1, 7, 0, len(META) + len(data))]


def test_a_copy_damaged_in_memory_is_not_saved(tmp_path):
    store = _store_with(0, 7, os.urandom(3 * CHECKSUM_BLOCK))
    assert store.corrupt_all() == 1
    assert save_held(store, tmp_path, 7, [0]) == {"0": "the copy of rank 0 step 7 held here is corrupt"}
    assert not list(tmp_path.iterdir())


def test_a_damaged_or_cut_file_is_refused_saying_so(tmp_path):
    folder = step_folder(tmp_path, 7)
    save_held(_store_with(0, 7, os.urandom(3 * CHECKSUM_BLOCK)), folder, 7, [0])
    path = rank_file(folder, 0)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt"):
        read_snapshot(path, generation=0)
    path.write_bytes(bytes(raw[:-100]))
    with pytest.raises(ValueError, match="cut short"):
        read_snapshot(path, generation=0)
    path.write_bytes(b"not a snapshot\n")
    with pytest.raises(ValueError, match="not a DeadPool snapshot file"):
        read_snapshot(path, generation=0)
    results = load_into(ReplicaStore(), folder, 7, [0], "n0", lambda _: None)
    assert "not a DeadPool snapshot file" in results["0"]


def test_saved_step_names_the_step_of_a_whole_folder_and_what_is_wrong_with_any_other(tmp_path):
    folder = step_folder(tmp_path, 7)
    for rank in (0, 1):
        save_held(_store_with(rank, 7, os.urandom(CHECKSUM_BLOCK)), folder, 7, [rank])
    assert saved_step(folder, 2) == 7
    with pytest.raises(ValueError, match="no snapshot of rank 2"):
        saved_step(folder, 4)
    with pytest.raises(ValueError, match="rank-1.dpsnap"):
        saved_step(folder, 1)
    (folder / "rank-x.dpsnap").write_bytes(b"")
    with pytest.raises(ValueError, match="rank-x.dpsnap"):
        saved_step(folder, 2)
    with pytest.raises(ValueError, match="not a folder"):
        saved_step(tmp_path / "nowhere", 2)
