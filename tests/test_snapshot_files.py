"""Snapshot files (dpcommon.snapshot_files): what a stopping job writes and a resumed one reads, checked whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dpcommon.checksum import CHECKSUM_BLOCK, CheckPlan, checksum_chunks
from dpagent.dedup import LocalCopy
from dpcommon.protocol import PutSnapshot, SnapshotStored, chunk_views
from dpcommon.replica_store import ReplicaStore
from dpagent.lost_save import LostSave, save_store
from dpcommon.protocol import SnapshotFiles
from dpcommon.snapshot_files import (
    check_copies, rank_file, read_files, read_snapshot, save_held, step_folder, store_loaded,
    write_snapshot,
)

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
    assert save_held(_store_with(1, 7, data), folder, 7, [1, 2], 3, "n0") == {
        "1": "", "2": "rank 2 step 7 is not held here (held: [])"}
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.n0.json", "rank-1.dpsnap"], "no partial file"
    fresh, reports = ReplicaStore(), []
    assert store_loaded(fresh, read_files(folder, 7, [1]), "n0", reports.append) == {"1": ""}
    assert bytes(fresh.get(1, 7).data) == data and bytes(fresh.get(1, 7).meta) == META
    assert fresh.get(1, 7).generation == 0, "the resumed job's first generation"
    assert reports == [SnapshotStored("n0", 1, 7, 0, len(META) + len(data))]


def test_a_copy_damaged_in_memory_is_not_saved(tmp_path):
    store = _store_with(0, 7, os.urandom(3 * CHECKSUM_BLOCK))
    assert store.corrupt_all() == 1
    assert save_held(store, tmp_path, 7, [0], 1, "n0") == {"0": "the copy of rank 0 step 7 held here is corrupt"}
    assert not list(tmp_path.iterdir())
    assert check_copies({0: store.get(0, 7)}, 7) == ({}, {"0": "the copy of rank 0 step 7 held here is corrupt"})


def test_a_copy_whose_local_buffer_is_written_while_it_is_saved_leaves_no_file(tmp_path):
    """A held copy that refers to this node's worker's snapshot buffer (dedup) whose worker writes the buffer
    again while the file is written (training that goes on): the file could mix two steps, so it is removed and
    the answer says why (the controller then asks the next source)."""
    data = os.urandom(3 * CHECKSUM_BLOCK)
    counter = np.ones(1, dtype=np.uint64)  # the buffer's write counter, as dpstate.snapshot.shared keeps it

    class RewrittenAsRead:  # a chunk of the worker's buffer: once armed, the worker writes it as it is read
        armed = False

        @property
        def buffer(self):
            if self.armed:
                counter[0] += np.uint64(1)
            return data

    base = LocalCopy(rank=0, step=7, nbytes=len(data), writes=1, counter=counter, data=memoryview(data),
                     digests=np.zeros(0, dtype=np.int64))
    store = ReplicaStore()
    put = PutSnapshot(rank=0, step=7, generation=3, checksum=checksum_chunks(META, [data]),
                      nbytes=len(META) + len(data))
    chunk = RewrittenAsRead()
    assert store.add(put, META, chunk, base=base) == ""
    chunk.armed = True  # the save starts; so does the worker's next optimizer step, into this buffer
    assert save_held(store, tmp_path, 7, [0], 1, "n0") == {"0": "the copy of rank 0 step 7 held here changed while it was "
                                                       "written"}
    assert not list(tmp_path.iterdir())


def test_a_background_save_copies_out_only_what_refers_to_a_worker_s_buffer_and_writes_it_whole(tmp_path):
    """A background save (training goes on): the chunks that are views of this node's worker's snapshot buffer
    (dedup) are copied into memory kept for it before the slow write, the frames received stay as they are; the
    file reads back bit for bit. A buffer written again before its copy-out is done leaves no file."""
    import mmap

    from dpcommon.snapshot_files import CopyRoom, check_copies, copy_out, write_copies

    received = os.urandom(2 * CHECKSUM_BLOCK)
    worker = mmap.mmap(-1, 3 * CHECKSUM_BLOCK)
    worker.write(os.urandom(3 * CHECKSUM_BLOCK))
    counter = np.ones(1, dtype=np.uint64)
    base = LocalCopy(rank=0, step=7, nbytes=len(worker), writes=1, counter=counter,
                     data=memoryview(worker).toreadonly(), digests=np.zeros(0, dtype=np.int64))
    chunks = [base.data[: CHECKSUM_BLOCK], received, base.data[CHECKSUM_BLOCK:]]
    whole = bytes(chunks[0]) + received + bytes(chunks[2])
    store = ReplicaStore()
    put = PutSnapshot(rank=0, step=7, generation=3, checksum=checksum_chunks(META, chunks), nbytes=len(META) + len(whole))
    assert store.add(put, META, *chunks, base=base) == ""
    room = CopyRoom()
    copies = {0: store.get(0, 7)}
    held, changed = copy_out(copies, 7, room)
    assert changed == {} and held[0].base is None
    checks, corrupt = check_copies(held, 7)  # (digested before the save's thread yields to training)
    assert corrupt == {} and list(checks) == [0]
    worker.seek(0)
    worker.write(b"\0" * len(worker))  # the worker's next snapshots, after the copy-out: the file is the copy's
    assert write_copies(step_folder(tmp_path, 7), 7, held, 1, "n0", checks) == {"0": ""}
    assert room.take(0).base.size == 3 * CHECKSUM_BLOCK  # the worker's blocks only, not the received ones
    _, meta, read = read_snapshot(rank_file(step_folder(tmp_path, 7), 0), generation=4)
    assert meta == META and b"".join(read) == whole
    counter[0] += np.uint64(1)  # written again before a save's copy-out: the bytes are not the step's any more
    assert copy_out(copies, 7, room) == ({}, {"0": "the copy of rank 0 step 7 held here changed while it was written"})


def test_a_damaged_or_cut_file_is_refused_saying_so(tmp_path):
    folder = step_folder(tmp_path, 7)
    save_held(_store_with(0, 7, os.urandom(3 * CHECKSUM_BLOCK)), folder, 7, [0], 1, "n0")
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
    results = store_loaded(ReplicaStore(), read_files(folder, 7, [0]), "n0", lambda _: None)
    assert "not a DeadPool snapshot file" in results["0"]


def test_a_flipped_byte_in_a_block_the_snapshots_check_plan_leaves_unchecked_is_refused(tmp_path):
    """A snapshot's checksum may digest only one in `every` of its shared blocks (its check plan, as
    --snapshot-check 8 makes them): its file is still checked over every byte when read back."""
    plan = CheckPlan(shared_blocks=8, shared_key=1, every=8, phase=0)  # only block 0 of the 8 is digested
    meta = json.dumps({"step": 7, "checks": plan.as_json()}).encode()
    data = os.urandom(8 * CHECKSUM_BLOCK)
    chunks = chunk_views(data, 2 * CHECKSUM_BLOCK)
    checksum = checksum_chunks(meta, chunks)
    path = write_snapshot(step_folder(tmp_path, 7), 0, 7, checksum, meta, chunks)
    put, _, read = read_snapshot(path, generation=0)
    assert (put.checksum, b"".join(read)) == (checksum, data)
    raw = bytearray(path.read_bytes())
    at = len(raw) - len(data) + 4 * CHECKSUM_BLOCK + 12345  # in block 4, which the plan leaves undigested
    raw[at] ^= 0x01
    flipped = raw[len(raw) - len(data):]
    assert checksum_chunks(meta, chunk_views(bytes(flipped), 2 * CHECKSUM_BLOCK)) == checksum, "the plan misses it"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="is corrupt: its bytes do not match the checksum it was saved with"):
        read_snapshot(path, generation=0)
    assert "corrupt" in read_files(step_folder(tmp_path, 7), 7, [0])[0]


@pytest.mark.parametrize("before", ["no check", "crc32"])
def test_files_of_before_are_still_read_and_checked(tmp_path, before):
    """The oldest files had only the snapshot's checksum; later ones a zlib.crc32 over the payload; now "check"
    (the snapshot's checksum with every block digested: dpcommon.checksum.checksums_both)."""
    import zlib

    data = os.urandom(2 * CHECKSUM_BLOCK + 5)
    path = write_snapshot(tmp_path, 0, 7, checksum_chunks(META, [data]), META, [data])
    header, _, rest = path.read_bytes().partition(b"\n")
    old = json.loads(header)
    del old["check"]
    if before == "crc32":
        old["crc32"] = zlib.crc32(data, zlib.crc32(META))
    path.write_bytes(json.dumps(old).encode() + b"\n" + rest)
    assert b"".join(read_snapshot(path, generation=0)[2]) == data
    path.write_bytes(json.dumps(old).encode() + b"\n" + rest[:-1] + bytes([rest[-1] ^ 1]))
    with pytest.raises(ValueError, match="corrupt"):
        read_snapshot(path, generation=0)


@pytest.mark.parametrize("change", [{"meta_bytes": None}, {"nbytes": None}, {"rank": "0"}, {"step": True},
                                    {"check": -1}, {"crc32": "1"}, {"meta_bytes": 10 ** 6}])
def test_a_header_missing_a_key_or_with_a_wrong_one_is_not_a_whole_snapshot_file(tmp_path, change):
    path = write_snapshot(tmp_path, 0, 7, checksum_chunks(META, [b"abc"]), META, [b"abc"])
    header, _, rest = path.read_bytes().partition(b"\n")
    doc = json.loads(header)
    for key, value in change.items():
        if value is None:
            del doc[key]
        else:
            doc[key] = value
    path.write_bytes(json.dumps(doc).encode() + b"\n" + rest)
    with pytest.raises(ValueError, match=f"is not a whole DeadPool snapshot file: its header's {next(iter(change))} "):
        read_snapshot(path, generation=0)
    assert "not a whole DeadPool snapshot file" in read_files(tmp_path, 7, [0])[0]


@pytest.mark.slow  # starts a python process
def test_a_file_the_disk_cannot_take_is_not_left_half_written(tmp_path):
    """A full disk (here a file size limit, RLIMIT_FSIZE, which fails a write as a full disk does, without
    root): the write fails with its OS error and takes its partial file with it, which would otherwise stay
    in the --save-dir and keep the disk full for the older step tried next."""
    script = (
        "import errno, resource, signal, sys\n"
        "from dpcommon.snapshot_files import write_snapshot\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))\n"
        "try:\n"
        "    write_snapshot(sys.argv[1], 3, 7, 0, b'{}', [bytes(256 * 1024)])\n"
        "except OSError as exc:\n"
        "    sys.exit(0 if exc.errno == errno.EFBIG else 2)\n"
        "sys.exit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "step-7")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "step-7").iterdir()) == [], "neither the file nor its partial"


def test_a_node_that_lost_its_controller_writes_each_copy_it_holds_once_and_says_what_it_wrote(tmp_path):
    store = _store_with(0, 10, os.urandom(2 * CHECKSUM_BLOCK))
    data = os.urandom(CHECKSUM_BLOCK)
    put = PutSnapshot(rank=2, step=9, generation=3, checksum=checksum_chunks(META, [data]), nbytes=len(META) + len(data))
    assert store.add(put, META, data) == ""
    other = _store_with(2, 9, os.urandom(CHECKSUM_BLOCK))  # another holder of rank 2 wrote it first: not again
    save_held(other, step_folder(tmp_path, 9), 9, [2], 3, "n1")
    before = rank_file(step_folder(tmp_path, 9), 2).read_bytes()
    save = LostSave(str(tmp_path), waiting={1}, world_size=3, writer="n0")
    save_store(store, save)
    assert rank_file(step_folder(tmp_path, 10), 0).exists()
    assert rank_file(step_folder(tmp_path, 9), 2).read_bytes() == before
    assert save.request().step == -1 and save.request().ranks == [1] and save.request().local
    assert "not written: rank 1" in save.summary()
    save.answered(SnapshotFiles("n1", -1, {"1": ""}, steps=[11, 10]))
    assert not save.waiting
    assert save.summary() == (f"wrote rank 0 (held) step 10; rank 1 (own) steps 10, 11 to {tmp_path}; once every "
                              "rank's file of a step is there (other nodes write theirs), go on with: dprun ... "
                              f"--resume-from {tmp_path}")
    assert LostSave(str(tmp_path), set(), 1, "n0").summary() == f"this node held no snapshot to write to {tmp_path}"
    assert LostSave(str(tmp_path), {3}, 4, "n0").summary() == f"nothing written to {tmp_path}; not written: rank 3"
