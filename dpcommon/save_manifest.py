"""A saved step's manifests: which rank files a step-S folder holds, with sizes and checksums, and so whether it
is complete; the steps of a --save-dir, newest first, and which of them to prune.

Every writer of a step's files (a node's agent, or a worker writing its own copy) writes its rank files first,
each atomically, then its manifest part `manifest.WRITER.json` naming them. A step is complete when its parts
together name a file of every rank and each named file is there at its size: a save cut short (a kill of
everything) leaves no part, or parts that do not cover every rank, and the step is not complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .snapshot_files import file_check, read_header, read_snapshot

FORMAT = "deadpool-save/1"
MANIFEST_GLOB = "manifest.*.json"


@dataclass(frozen=True)
class RankEntry:
    """One rank's file as its manifest part names it."""

    file: str  # its name in the step folder
    size: int  # bytes on disk
    check: int  # over every byte of its payload (the file's header says the same: snapshot_files.file_check)
    checksum: int  # the snapshot's own checksum


@dataclass
class SavedStep:
    """A step-S folder as found: what its manifests name, and what keeps it from being complete."""

    step: int
    folder: Path
    world_size: int = 0  # as its manifests say (0: none readable)
    ranks: dict[int, RankEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # each names the file and what is wrong with it

    @property
    def complete(self) -> bool:
        return self.world_size > 0 and not self.problems

    @property
    def nbytes(self) -> int:
        return sum(entry.size for entry in self.ranks.values())

    def age_s(self, now: float | None = None) -> float:
        parts = list(self.folder.glob(MANIFEST_GLOB))
        newest = max((p.stat().st_mtime for p in parts), default=self.folder.stat().st_mtime)
        return max(0.0, (time.time() if now is None else now) - newest)


def writer_name(writer: str) -> str:
    """A writer's id as a file name part (node ids hold a host name and a pid)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", writer)[:120] or "writer"


def write_manifest(folder: str | os.PathLike, step: int, world_size: int, ranks: list[int], writer: str) -> Path:
    """After `ranks`' files of `step` are written whole in `folder`: this writer's manifest part naming them
    (sizes and checksums read back from their headers), written atomically and synced."""
    folder = Path(folder)
    path = folder / f"manifest.{writer_name(writer)}.json"
    entries = _entries_of(path, step)  # this writer's earlier files of the step (a save on stop after a
    for rank in sorted(ranks):  # background one) stay named
        file = folder / f"rank-{rank}.dpsnap"
        header = read_header(file)
        entries[str(rank)] = {"file": file.name, "size": file.stat().st_size, "check": file_check(header) or 0,
                              "checksum": header["checksum"]}
    body = {"format": FORMAT, "step": step, "world_size": world_size, "writer": writer,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ranks": entries}
    partial = path.with_suffix(f".{os.getpid()}.partial")
    try:
        with open(partial, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        _sync_folder(folder)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _entries_of(path: Path, step: int) -> dict:
    """The rank entries of an existing manifest part of `step` ({} if none, or unreadable)."""
    try:
        body = json.loads(path.read_text())
        return dict(body["ranks"]) if body.get("format") == FORMAT and body.get("step") == step else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _sync_folder(folder: Path) -> None:
    """The renames into `folder` made durable (a power loss after a rename can otherwise lose it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_step(folder: str | os.PathLike, step: int | None = None) -> SavedStep:
    """What `folder`'s manifest parts say, each named file checked for presence and size (cheap: no byte is
    read past a header). `step`: the step its name says (else taken from the name)."""
    folder = Path(folder)
    if step is None:
        step = int(folder.name[5:]) if folder.name[5:].isdigit() else -1
    saved = SavedStep(step, folder)
    parts = sorted(folder.glob(MANIFEST_GLOB))
    if not parts:
        saved.problems.append(f"{folder} has no manifest: its save did not finish (the job was stopped or killed "
                              "while it wrote it)")
        return saved
    sizes = set()
    for part in parts:
        try:
            body = json.loads(part.read_text())
            if body.get("format") != FORMAT or body.get("step") != step:
                raise ValueError(f"not a manifest of step {step} ({FORMAT})")
            sizes.add(int(body["world_size"]))
            for rank, entry in body["ranks"].items():
                check = entry["check"] if "check" in entry else entry["crc32"]  # (a save of before: crc32)
                saved.ranks[int(rank)] = RankEntry(entry["file"], int(entry["size"]), int(check),
                                                   int(entry["checksum"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            saved.problems.append(f"{part} is damaged: {exc}")
    if len(sizes) > 1:
        saved.problems.append(f"{folder}'s manifests disagree on the job's size: {sorted(sizes)} ranks")
    saved.world_size = max(sizes, default=0)
    missing = sorted(set(range(saved.world_size)) - set(saved.ranks))
    if missing:
        saved.problems.append(f"{folder}'s manifests name no file of rank{'s' if len(missing) > 1 else ''} "
                              f"{_ranks(missing)}: its save did not finish")
    for rank, entry in sorted(saved.ranks.items()):
        path = folder / entry.file
        try:
            size = path.stat().st_size
        except OSError:
            saved.problems.append(f"{path} is missing")
            continue
        if size != entry.size:
            saved.problems.append(f"{path} is {size} bytes, its manifest says {entry.size}: cut short or damaged")
    return saved


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def verify_step(saved: SavedStep) -> list[str]:
    """Every byte of every named file read and checked against its manifest's checksums: what is wrong
    (besides saved.problems), each naming its file."""
    problems = []
    for rank, entry in sorted(saved.ranks.items()):
        path = saved.folder / entry.file
        try:
            put, _, _ = read_snapshot(path, generation=0)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
            continue
        if (put.rank, put.step) != (rank, saved.step):
            problems.append(f"{path} holds rank {put.rank} step {put.step}, not rank {rank} step {saved.step}")
        elif file_check(read_header(path)) not in (None, entry.check) or put.checksum != entry.checksum:
            problems.append(f"{path} is not the file its manifest names (its checksum differs)")
    return problems


def step_folders(save_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """A --save-dir's step-S folders, newest first, whole or not."""
    return sorted(((int(p.name[5:]), p) for p in Path(save_dir).glob("step-*") if p.name[5:].isdigit() and p.is_dir()),
                  reverse=True)


def saved_steps(save_dir: str | os.PathLike) -> list[SavedStep]:
    """Every step-S folder of `save_dir`, read (read_step), newest first."""
    return [read_step(folder, step) for step, folder in step_folders(save_dir)]


def complete_steps(save_dir: str | os.PathLike, world_size: int) -> tuple[list[SavedStep], list[SavedStep]]:
    """The steps of `save_dir` that a job of `world_size` ranks can go on from, newest first, and the newer
    ones it cannot (incomplete, or of another size: each says why in its problems)."""
    usable, skipped = [], []
    for saved in saved_steps(save_dir):
        if saved.complete and saved.world_size != world_size:
            saved.problems.append(f"{saved.folder} holds a job of {saved.world_size} ranks and this one has "
                                  f"{world_size} (--nnodes x --nproc-per-node): resume it with as many ranks")
        if saved.complete:
            usable.append(saved)
        elif not usable:
            skipped.append(saved)
    return usable, skipped


def prune(save_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Remove what a --save-dir no longer needs: complete steps past the newest `keep`, and incomplete ones older
    than the newest complete step (a save that was cut short). Never the newest complete step, nor a step newer
    than it (a save may be writing it now). Returns the folders removed."""
    keep = max(1, keep)
    steps = saved_steps(save_dir)
    complete = [s for s in steps if s.complete]
    if not complete:
        return []
    newest = complete[0].step
    doomed = [s.folder for s in complete[keep:]] + [s.folder for s in steps if not s.complete and s.step < newest]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)  # (another node pruning the same folder: either one finishes)
    return doomed


def resume_steps(folder: str | os.PathLike, world_size: int) -> tuple[list[SavedStep], list[SavedStep]]:
    """What `--resume-from FOLDER` can go on from, newest first (the first is tried first; should a file of it
    turn out damaged when read, the next): FOLDER itself if it is a step-S folder, else its complete steps. And
    the newer steps it cannot use, each saying why. ValueError, saying what is wrong, if there is none."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{folder} is not a folder of saved steps (give a --save-dir, or one of its step-S folders)")
    if not step_folders(path):  # a step-S folder itself
        saved = read_step(path)
        if saved.complete and saved.world_size != world_size:
            saved.problems.append(f"{path} holds a job of {saved.world_size} ranks and this one has {world_size} "
                                  "(--nnodes x --nproc-per-node): resume it with as many ranks as it was saved with")
        if not saved.complete:
            raise ValueError(f"cannot resume from {folder}: {saved.problems[0]}")
        return [saved], []
    usable, skipped = complete_steps(path, world_size)
    if not usable:
        why = f" (newest: {skipped[0].problems[0]})" if skipped else ""
        raise ValueError(f"no step-S folder in {folder} is a complete save of a job of {world_size} ranks{why}")
    return usable, skipped


def newest_saved(folder: str | os.PathLike, world_size: int) -> tuple[Path, int]:
    """The step folder a resume from `folder` goes on from first, and its step (ValueError: none)."""
    newest = resume_steps(folder, world_size)[0][0]
    return newest.folder, newest.step
