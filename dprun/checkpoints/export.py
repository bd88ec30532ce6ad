"""`dprun ckpt export`: a saved step's rank files decoded into the state dicts a job tracked, written as one
torch.save file per rank, or as one torch.distributed.checkpoint folder of the job's global state
(dprun.checkpoints.dcp_export).
"""

from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dpcommon.save_manifest import SavedStep, read_step
from dpcommon.snapshot_files import read_header
from dpstate.snapshot import packing as S

from .commands import is_step_folder, step_problems

EXPORT_FORMAT = "deadpool-export/1"
RESERVED = ("step", "deadpool")  # the torch export's own top-level keys, beside the tracked names


class ExportError(Exception):
    """A one-line reason an export cannot be made, and the exit code it ends with (2: bad input, 1: the step is
    incomplete or damaged)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- the step and its files


def checked_step(folder: str | os.PathLike) -> SavedStep:
    """The step saved in `folder`, complete and undamaged (every byte read); ExportError otherwise."""
    path = Path(folder)
    if not path.is_dir() or not is_step_folder(path):
        raise ExportError(f"{folder} is not a step-S folder of a --save-dir (dprun ckpt list DIR shows them)")
    saved = read_step(path)
    problems = step_problems(saved)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExportError(f"{path} cannot be exported: {problems[0]}{more}; run dprun ckpt verify {path}", 1)
    return saved


def prepare_out(out: str | os.PathLike) -> tuple[Path, bool]:
    """OUT made ready to be written: an empty or new folder (and whether it was made here, to be removed again
    should the export fail). ExportError if it holds anything: an export never writes over files."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder: give a new or empty one")
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, made


@dataclass
class Lazy:
    """A tensor of a rank file, not read yet: its dtype and shape from the meta, read when asked."""

    source: RankFile
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        return self.source.tensor(self.index)


class RankFile:
    """One rank's file of a saved step: its header, its meta (the state tree's skeleton and tensor specs), and
    its tensors read one at a time (a whole job's state never has to fit in memory at once). Kept open: a job
    that prunes the step meanwhile does not take it away from an export under way."""

    def __init__(self, path: Path):
        self.path = path
        header = read_header(path)
        self.file: io.BufferedReader = open(path, "rb")  # noqa: SIM115 - kept open until close(): see the docstring
        line = self.file.readline(4096)
        self.rank = int(header["rank"])
        self.meta = S.decode_meta(self.file.read(header["meta_bytes"]))
        self.data_start = len(line) + header["meta_bytes"]
        self.specs = [S.TensorSpec(d, tuple(int(s) for s in shape), int(o), int(n))
                      for d, shape, o, n in self.meta["tensors"]]

    def close(self) -> None:
        self.file.close()

    def tensor(self, index: int) -> torch.Tensor:
        """The tensor of spec `index`, as dpstate.snapshot.packing.unpack decodes it (a copy of its own)."""
        spec = self.specs[index]
        dtype = S.dtype_of(spec.dtype)
        self.file.seek(self.data_start + spec.offset)
        raw = bytearray(spec.nbytes)
        if self.file.readinto(raw) != spec.nbytes:
            raise ExportError(f"{self.path} is cut short: rank {self.rank}'s tensor {index} is not all there", 1)
        if not spec.nbytes:
            return torch.empty(spec.shape, dtype=dtype)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        if dtype == torch.bool:
            return flat.view(torch.bool).reshape(spec.shape)
        return flat.view(dtype).reshape(spec.shape)

    def tree(self, lazy: bool = False) -> dict:
        """The state tree this rank's snapshot holds ({"step", "state", "rng", "threads", "layout"}); `lazy`:
        each tensor a Lazy, read when asked."""
        if lazy:
            tensors: list[Any] = [Lazy(self, i, S.dtype_of(s.dtype), s.shape) for i, s in enumerate(self.specs)]
        else:
            tensors = [self.tensor(i) for i in range(len(self.specs))]
        tree = S.unflatten(self.meta["skeleton"], tensors)
        if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict) or "step" not in tree:
            raise ExportError(f"{self.path} holds no dpstate state tree (a snapshot of another kind)", 1)
        return tree


def open_ranks(saved: SavedStep) -> dict[int, RankFile]:
    """Every rank's file of a checked step, opened, by rank."""
    files: dict[int, RankFile] = {}
    try:
        for rank, entry in sorted(saved.ranks.items()):
            files[rank] = RankFile(saved.folder / entry.file)
    except BaseException:
        for opened in files.values():
            opened.close()
        raise
    return files


def map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """`obj` rebuilt with `leaf` applied to every value that is not a dict, list or tuple (namedtuples are leaves;
    a state dict's `_metadata` is kept)."""
    if isinstance(obj, dict):
        out = type(obj)((k, map_leaves(v, leaf)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(map_leaves(v, leaf) for v in obj)
    return leaf(obj)


def materialized(obj: Any) -> Any:
    """`obj` with each Lazy read."""
    return map_leaves(obj, lambda v: v.read() if isinstance(v, Lazy) else v)


# ----------------------------------------------------------------------------- --format torch


def plain_numpy(obj: Any) -> Any:
    """`obj` with each numpy array a tensor: torch.load(weights_only=True) refuses numpy arrays (numpy's RNG state
    holds one), and it reads everything else a snapshot holds."""
    return map_leaves(obj, lambda v: torch.from_numpy(v.copy()) if type(v).__module__ == "numpy" else v)


def torch_doc(tree: dict, rank: int, world_size: int) -> dict:
    """What rank-R.pt holds: {"step": S, <each tracked name>: its state dict, "deadpool": {format, rank,
    world_size, rng, threads, layout}} (layout: dpstate.snapshot.state; sharded entries hold this rank's local
    shard)."""
    clash = sorted(set(tree["state"]) & set(RESERVED))
    if clash:
        raise ExportError(f"the job tracked state under the name(s) {clash}, which a torch export keeps for its own "
                          "keys: export --format dcp")
    extra = {"format": EXPORT_FORMAT, "rank": rank, "world_size": world_size, "rng": tree.get("rng"),
             "threads": tree.get("threads"), "layout": tree.get("layout")}
    return plain_numpy({"step": tree["step"], **tree["state"], "deadpool": extra})


def export_torch(folder: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    """Each rank's state of the step in `folder` as OUT/rank-R.pt (torch.save; torch.load(weights_only=True)
    reads it). Returns the files written."""
    saved = checked_step(folder)
    path, made = prepare_out(out)
    written: list[Path] = []
    files: dict[int, RankFile] = {}
    try:
        files = open_ranks(saved)
        for rank, source in files.items():  # one rank's state in memory at a time
            doc = torch_doc(source.tree(), rank, saved.world_size)
            source.close()
            target = path / f"rank-{rank}.pt"
            torch.save(doc, target)
            written.append(target)
    except BaseException:
        _undo(path, made, written)
        raise
    finally:
        for source in files.values():
            source.close()
    return written


def _undo(path: Path, made: bool, written: list[Path]) -> None:
    """An export that failed leaves nothing: its folder if it made it, else the files it wrote."""
    if made:
        shutil.rmtree(path, ignore_errors=True)
        return
    for target in written:
        target.unlink(missing_ok=True)
    for leftover in path.iterdir():  # (DCP's files, written under its own names)
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def export_dcp(folder: str | os.PathLike, out: str | os.PathLike) -> Any:
    """The global state of the step in `folder` as a torch.distributed.checkpoint folder OUT
    (dprun.checkpoints.dcp_export). Returns what was written (dcp_export.Written)."""
    from .dcp_export import GlobalState, save

    saved = checked_step(folder)
    files = open_ranks(saved)
    try:
        state = GlobalState()
        for rank, source in files.items():
            state.add_rank(rank, source.tree(lazy=True))
        state_dict = state.state_dict()
        path, made = prepare_out(out)
        try:
            return save(state_dict, path, state)
        except BaseException:
            _undo(path, made, [])
            raise
    finally:
        for source in files.values():
            source.close()
