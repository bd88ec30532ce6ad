"""`dprun ckpt list | verify | export`: what a --save-dir holds, whether every byte of it is intact, and its steps
exported in torch's own formats (the work is dpcommon.save_manifest's and dprun.checkpoints.export's; this prints).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from dpcommon.save_manifest import SavedStep, read_step, step_folders, verify_step
from dpcommon.snapshot_files import read_snapshot

from dprun.monitor.dashboard import duration

HELP = {"help_option_names": ["-h", "--help"]}
ckpt_app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True, context_settings=HELP,
                       help="List, verify and export the steps that --save-dir holds.")
FORMATS = ("torch", "dcp")


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"dprun ckpt: {message}", file=sys.stderr)
    raise typer.Exit(code)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def step_problems(saved: SavedStep) -> list[str]:
    """Everything wrong with a step, each naming its file: what its manifests say (presence, sizes), then every
    byte of every file read against its checksum (a file already said to be wrong is not said twice). Where no
    manifest names the step's files, each rank file found is read too, so that a torn one is said as such."""
    problems = list(saved.problems)
    named = {saved.folder / entry.file for entry in saved.ranks.values()}
    loose = [p for p in sorted(saved.folder.glob("rank-*.dpsnap")) if p not in named] if not saved.ranks else []
    for path in loose:
        try:
            read_snapshot(path, generation=0)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
    for problem in verify_step(saved):
        if not any(_names(problem, path) and _names(said, path) for path in named for said in problems):
            problems.append(problem)
    return problems


def _names(problem: str, path: Path) -> bool:
    """Whether `problem` is about the file `path` (rank-1.dpsnap is not rank-10.dpsnap)."""
    return re.search(re.escape(str(path)) + r"(?![\w.-])", problem) is not None


def is_step_folder(path: Path) -> bool:
    """A step-S folder (as a --save-dir holds them) rather than a --save-dir."""
    return path.name.startswith("step-") and path.name[5:].isdigit()


def _save_dir_steps(save_dir: Path) -> list[SavedStep]:
    """Every step of a --save-dir, newest first; a one-line error (exit 2) where it is not one."""
    if not save_dir.is_dir():
        _fail(f"{save_dir} does not exist or is not a folder")
    steps = step_folders(save_dir)
    if not steps:
        _fail(f"{save_dir} holds no step-S folder: not a --save-dir, or nothing was saved in it yet")
    return [read_step(folder, step) for step, folder in steps]


def _why(saved: SavedStep) -> str:
    """The first thing that keeps a step from being complete, on one line, its folder's path left out (the
    row says which step it is)."""
    first = saved.problems[0].replace(f"{saved.folder}/", "").replace(f"{saved.folder}", saved.folder.name)
    more = f" (+{len(saved.problems) - 1} more)" if len(saved.problems) > 1 else ""
    return " ".join(first.split()) + more


@ckpt_app.command("list", context_settings=HELP)
def list_steps(save_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A job's --save-dir.")]) -> None:
    """Each step saved in DIR, newest first: complete or not (and why not), ranks, size, age. Reads the
    manifests and the files' sizes only (dprun ckpt verify reads every byte)."""
    steps = _save_dir_steps(save_dir)
    now = time.time()
    rows = [(f"step-{s.step}", "complete" if s.complete else "INCOMPLETE", str(s.world_size or len(s.ranks) or "-"),
             human_bytes(s.nbytes), duration(s.age_s(now)), "" if s.complete else _why(s)) for s in steps]
    header = ("STEP", "STATE", "RANKS", "SIZE", "AGE", "WHY NOT")
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*header, box=None, header_style="bold")
        for row in rows:
            table.add_row(*row, style=None if row[1] == "complete" else "yellow")
        Console().print(table)
    else:  # piped: plain aligned columns, one line per step (a rich table wraps and pads to 80 columns)
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
        for row in (header, *rows):
            print(("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]).rstrip())
    sys.stdout.flush()


@ckpt_app.command("verify", context_settings=HELP)
def verify(path: Annotated[Path, typer.Argument(metavar="DIR[/step-S]",
                                                help="A --save-dir (every step) or one of its step-S folders.")],
           ) -> None:
    """Read every byte of every rank file against its checksum and check each step is complete. Exit 0: every
    step checked is whole; 1: one of them is not (each problem names its file); 2: PATH is not a save."""
    if path.is_dir() and is_step_folder(path) and not step_folders(path):
        steps = [read_step(path)]
    else:
        steps = _save_dir_steps(path)
    damaged, usable = 0, None
    for saved in steps:
        problems = step_problems(saved)
        if problems:
            damaged += 1
            print(f"step-{saved.step}: cannot be resumed from, {len(problems)} problem{'s' * (len(problems) > 1)}:")
            for problem in problems:
                print(f"  {' '.join(problem.split())}")
        else:
            usable = usable if usable is not None else saved
            print(f"step-{saved.step}: complete, {saved.world_size} ranks, {saved.nbytes} bytes verified")
    if len(steps) > 1 and usable is None:
        print(f"--resume-from {path} has no step to go on from: every step is damaged or incomplete")
    elif len(steps) > 1 and usable is not None:  # (always, past the branch above)
        print(f"--resume-from {path} would go on from step-{usable.step} (the newest complete step, every byte "
              "intact)")
    sys.stdout.flush()
    raise typer.Exit(1 if damaged else 0)


@ckpt_app.command("export", context_settings=HELP)
def export(step: Annotated[Path, typer.Argument(metavar="DIR/step-S", help="The step folder to export.")],
           out: Annotated[Path, typer.Argument(metavar="OUT", help="A new or empty folder to write.")],
           fmt: Annotated[str, typer.Option(
               "--format", metavar="torch|dcp",
               help="torch: OUT/rank-R.pt per rank, each rank's own state (sharded entries: its local shard), for "
                    "torch.load. dcp: a torch.distributed.checkpoint folder of the global state (shards placed, "
                    "replicas once), for dcp.load, resharded to any layout, or dcp_to_torch_save.")],
           ) -> None:
    """Write a saved step in torch's own formats, checked first (every byte; an incomplete or damaged step is
    refused with exit 1: see dprun ckpt verify)."""
    from .export import ExportError, export_dcp, export_torch

    if fmt not in FORMATS:
        _fail(f"unknown --format {fmt!r}: give torch or dcp")
    started = time.perf_counter()
    try:
        if fmt == "torch":
            files = export_torch(step, out)
            nbytes = sum(f.stat().st_size for f in files)
            print(f"exported {step} as {len(files)} torch.save files (rank-R.pt) in {out}: {human_bytes(nbytes)} "
                  f"in {time.perf_counter() - started:.1f} s")
        else:
            written = export_dcp(step, out)
            print(f"exported {step} (step {written.step}, {written.world_size} ranks) as a torch.distributed."
                  f"checkpoint folder {out}: {written.tensors} tensors in {written.chunks} chunks, "
                  f"{human_bytes(written.nbytes)} in {time.perf_counter() - started:.1f} s")
            for name, ranks in written.per_rank.items():
                print(f"  {name!r} differs between ranks: kept per rank as {name}.rank_R ({len(ranks)} ranks)")
    except ExportError as exc:
        _fail(str(exc), exc.code)
    except OSError as exc:
        _fail(f"cannot export {step} to {out}: {exc}", 1)
