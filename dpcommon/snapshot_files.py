"""A snapshot as a file: what a stopping job leaves on disk (SaveSnapshots) and a resumed one reads back
(LoadSnapshots), so that its state outlives the job. One file per rank: a JSON header line, the meta, the data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .checksum import checksums_both
from .direct_write import write_synced
from .protocol import CHUNK_BYTES, PutSnapshot, SnapshotStored
from .replica_store import ReplicaStore, Snapshot, frame_view

FORMAT = "deadpool-snapshot/1"
HEADER_KEYS = ("rank", "step", "checksum", "nbytes", "meta_bytes")  # each an int; so is "check" (or "crc32")
FILE_CHECKS = ("check", "crc32")  # the payload's check over every byte: now, and in files of before
CANNOT_WRITE = "cannot write"  # how a file that the disk refused is said (SnapshotFiles): no other step would fit


def cannot_write(rank: int, exc: OSError) -> str:
    """A save's answer for a rank whose file the disk refused (full, read-only, no permission)."""
    return f"{CANNOT_WRITE} rank {rank}'s file: {exc}"


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    """Where a job's saved snapshots of `step` go: DIRECTORY/step-STEP (what --resume-from names)."""
    return Path(directory) / f"step-{step}"


def rank_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.dpsnap"


def write_snapshot(folder: str | os.PathLike, rank: int, step: int, checksum: int, meta: Any,
                   chunks: list, check: int | None = None) -> Path:
    """Write a snapshot (its meta and data chunks, bytes-like) as folder/rank-R.dpsnap, whole or not at all
    (a temporary file, synced, then renamed). Its header holds `checksum` (the snapshot's, which its check plan
    may compute over a sample of its blocks) and "check", the same checksum with every block digested
    (dpcommon.checksum.checksums_both; computed here unless given), that the file is checked against when read."""
    path = rank_file(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = frame_view(meta)
    views = [frame_view(c) for c in chunks]
    header = {"format": FORMAT, "rank": rank, "step": step, "checksum": checksum,
              "nbytes": meta.nbytes + sum(v.nbytes for v in views), "meta_bytes": meta.nbytes,
              "check": checksums_both(meta, views)[1] if check is None else check}
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")  # two writers (a retry) do not mix
    try:
        write_synced(partial, [memoryview(json.dumps(header).encode() + b"\n"), meta, *views])
        os.replace(partial, path)
    except BaseException:  # (a full disk): what was written goes, so that it neither stays nor fills the disk
        partial.unlink(missing_ok=True)
        raise
    return path


def file_check(header: dict) -> int | None:
    """A file's check over every byte of its payload as its header says it ("check"; "crc32" in the files of
    before), None in the oldest files (checked against the snapshot's checksum alone)."""
    return next((header[key] for key in FILE_CHECKS if key in header), None)


def read_header(path: str | os.PathLike) -> dict:
    """The header of a snapshot file; ValueError if it is not one, or not a whole one (a key missing or not a
    non-negative int)."""
    with open(path, "rb") as f:
        line = f.readline(4096)
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DeadPool snapshot file ({FORMAT})")
    bad = [key for key in HEADER_KEYS + tuple(k for k in FILE_CHECKS if k in header) if not _count(header.get(key))]
    if bad or header["meta_bytes"] > header["nbytes"]:
        raise ValueError(f"{path} is not a whole DeadPool snapshot file: its header's "
                         f"{', '.join(bad) or 'meta_bytes'} {'is' if len(bad) < 2 else 'are'} missing or wrong")
    return header


def _count(value: Any) -> bool:
    """Is `value` a non-negative int (not a bool), as every number in a header is?"""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_snapshot(path: str | os.PathLike, generation: int) -> tuple[PutSnapshot, bytes, list[bytes]]:
    """A snapshot file as a put of `generation` with its payload (meta, data chunks), its bytes checked
    against the checksums they were saved with: every byte against its "check" (or a file of before's "crc32";
    the oldest: against the snapshot's checksum alone). ValueError: not a snapshot file, cut short or corrupt."""
    header = read_header(path)
    with open(path, "rb") as f:
        f.readline(4096)
        meta = f.read(header["meta_bytes"])
        left = header["nbytes"] - len(meta)
        chunks = []
        while left > 0:
            chunk = f.read(min(CHUNK_BYTES, left))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    if left or len(meta) != header["meta_bytes"]:
        raise ValueError(f"{path} is cut short: {left} of {header['nbytes']} bytes missing")
    chunks = chunks or [b""]
    planned, every = checksums_both(memoryview(meta), [memoryview(c) for c in chunks])
    if "crc32" in header and "check" not in header:
        every = zlib.crc32(meta)  # (a file of before: its check is zlib.crc32 over the payload)
        for chunk in chunks:
            every = zlib.crc32(chunk, every)
    if file_check(header) not in (None, every) or planned != header["checksum"]:
        raise ValueError(f"{path} is corrupt: its bytes do not match the checksum it was saved with")
    put = PutSnapshot(rank=header["rank"], step=header["step"], generation=generation,
                      checksum=header["checksum"], nbytes=header["nbytes"])
    return put, meta, chunks


def save_held(store: ReplicaStore, folder: str | os.PathLike, step: int, ranks: list[int], world_size: int,
              writer: str) -> dict[str, str]:
    """SaveSnapshots: write the copies `store` holds of `ranks` at `step` into `folder`, then `writer`'s
    manifest part naming them. Returns, for each rank, "" or why its file was not written."""
    copies, results = held_copies(store, step, ranks)
    return {**results, **write_copies(folder, step, copies, world_size, writer)}


def held_copies(store: ReplicaStore, step: int, ranks: list[int]) -> tuple[dict[int, Snapshot], dict[str, str]]:
    """The copies of `ranks` at `step` that `store` holds, and why each other rank has none (the store's part
    of a save: on the agent's loop, which alone touches the store; write_copies may then run on a thread)."""
    copies, missing = {}, {}
    for rank in ranks:
        snap = store.get(rank, step)
        if snap is None:
            missing[str(rank)] = f"rank {rank} step {step} is not held here (held: {store.steps(rank)})"
        else:
            copies[rank] = snap
    return copies, missing


class CopyRoom:
    """Memory kept for a background save's copy-out, faulted in once and reused by every save (one is written
    at a time): the part of each rank it writes that refers to a worker's buffer, which is most of a data
    parallel rank's state. Copying into it runs at memcpy speed without the GIL (7.8 GB/s here), where a fresh
    bytes object (page faults, the GIL held) ran at 1.0 GB/s."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self._buffer.size < nbytes:
            self._buffer = np.zeros(nbytes, np.uint8)  # (zeros: faulted in here, not during a copy)
        return self._buffer[:nbytes]


def copy_out(copies: dict[int, Snapshot], step: int, room: CopyRoom) -> tuple[dict[int, Snapshot], dict[str, str]]:
    """A background save's first part, done before its thread yields to training (the worker writes its buffer
    over two snapshots on, and a copy-out at nice 19 beside busy cores lost that race): every copy with what
    refers to a worker's buffer copied into `room`, and why each one whose buffer was written meanwhile is not."""
    local = {rank: snap for rank, snap in copies.items() if snap.base is not None}
    sizes = {rank: sum(v.nbytes for v in map(frame_view, snap.chunks) if v.obj is snap.base.data.obj)
             for rank, snap in local.items()}
    space, at, missed = room.take(sum(sizes.values())), 0, {}
    out = dict(copies)
    for rank, snap in local.items():
        copied = _copied(snap, space[at : at + sizes[rank]])
        at += sizes[rank]
        if copied is None:
            del out[rank]
            missed[str(rank)] = _changed(rank, step)
        else:
            out[rank] = copied
    return out, missed


def check_copies(copies: dict[int, Snapshot], step: int) -> tuple[dict[int, int], dict[str, str]]:
    """Each intact copy's file check (its every block digested, as write_snapshot's "check"), and why each other
    one is not to be written: a file that could not be resumed from is worse than none said."""
    checks, corrupt = {}, {}
    for rank, snap in copies.items():
        planned, every = checksums_both(frame_view(snap.meta), [frame_view(c) for c in snap.chunks])
        if planned != snap.checksum:
            corrupt[str(rank)] = f"the copy of rank {rank} step {step} held here is corrupt"
        else:
            checks[rank] = every
    return checks, corrupt


def write_copies(folder: str | os.PathLike, step: int, copies: dict[int, Snapshot], world_size: int,
                 writer: str, checks: dict[int, int] | None = None) -> dict[str, str]:
    """Write each copy as its rank's file in `folder`, then `writer`'s manifest part naming those written
    (dpcommon.save_manifest): for each rank, "" or why not (a damaged copy, a full disk, a copy whose local buffer
    was written meanwhile: dpagent.dedup). `checks`: check_copies's, done before (a background save does that
    pass before it yields to training); the copies it leaves out are not written."""
    results: dict[str, str] = {}
    if checks is None:
        checks, results = check_copies(copies, step)
    for rank, every in checks.items():
        snap = copies[rank]
        try:
            path = write_snapshot(folder, rank, step, snap.checksum, snap.meta, list(snap.chunks), check=every)
            results[str(rank)] = ""
        except OSError as exc:
            results[str(rank)] = cannot_write(rank, exc)
            continue
        if snap.stale():  # its local copy (dedup) was written meanwhile: the file may mix two steps
            path.unlink(missing_ok=True)
            results[str(rank)] = _changed(rank, step)
    return finish_files(folder, step, results, world_size, writer)


def _changed(rank: int, step: int) -> str:
    """Why a copy that refers to a worker's buffer (dedup) is not saved: the worker wrote the buffer again."""
    return f"the copy of rank {rank} step {step} held here changed while it was written"


def _copied(snap: Snapshot, space: np.ndarray) -> Snapshot | None:
    """`snap` with the chunks that refer to its local buffer copied into `space` (the others are the store's own
    frames, which nothing writes over); None if that buffer was written meanwhile."""
    local = snap.base.data.obj
    chunks, at = [], 0
    for view in map(frame_view, snap.chunks):
        if view.obj is local:
            np.copyto(space[at : at + view.nbytes], np.frombuffer(view, np.uint8))
            view, at = space[at : at + view.nbytes].data, at + view.nbytes  # (.data: memoryview(array))
        chunks.append(view)
    return None if snap.stale() else dataclasses.replace(snap, chunks=tuple(chunks), base=None)


def finish_files(folder: str | os.PathLike, step: int, results: dict[str, str], world_size: int,
                 writer: str) -> dict[str, str]:
    """Write `writer`'s manifest part naming the ranks written (results ""); should the disk refuse it, each of
    them is answered with why (a file that no manifest names is not part of a complete step)."""
    written = [int(rank) for rank, error in results.items() if not error]
    if not written:
        return results
    from .save_manifest import write_manifest  # (it reads these files' headers: imports this module)
    try:
        write_manifest(folder, step, world_size, written, writer)
    except (OSError, ValueError) as exc:
        return {**results, **{str(rank): f"{CANNOT_WRITE} the manifest of rank {rank}'s file: {exc}"
                              for rank in written}}
    return results


Loaded = dict  # rank -> (its file, put, meta, chunks) as read, or why it could not be


def read_files(folder: str | os.PathLike, step: int, ranks: list[int]) -> Loaded:
    """LoadSnapshots: each rank's file of `step` in `folder`, read and checked (the disk's part of a load: may
    run on a thread), or why it cannot be used (each names the file); store_loaded() puts them in a store."""
    loaded: Loaded = {}
    for rank in ranks:
        path = rank_file(folder, rank)
        try:
            put, meta, chunks = read_snapshot(path, generation=0)
            if (put.rank, put.step) != (rank, step):
                raise ValueError(f"{path} holds rank {put.rank} step {put.step}, not rank {rank} step {step}")
            loaded[rank] = (path, put, meta, chunks)
        except (OSError, ValueError) as exc:
            loaded[rank] = str(exc)
    return loaded


def store_loaded(store: ReplicaStore, loaded: Loaded, node_id: str,
                 report: Callable[[SnapshotStored], Any], generation: int = 0) -> dict[str, str]:
    """Put what read_files read into `store` as copies of `generation` (a resumed job's first, or a running
    job's next, restored from disk), each reported as stored: for each rank, "" or why not."""
    results = {}
    for rank, read in loaded.items():
        if isinstance(read, str):
            results[str(rank)] = read
            continue
        path, put, meta, chunks = read
        error = store.add(dataclasses.replace(put, generation=generation), meta, *chunks)
        results[str(rank)] = f"{path}: {error}" if error else ""
        if not error:
            report(SnapshotStored(node_id, rank, put.step, generation, put.nbytes))
    return results
