"""`dprun ckpt list` and `dprun ckpt verify` on saved steps made as a job makes them (dpstate's capture, packed,
written with dpagent's write_snapshot and write_manifest), whole, or damaged as a disk or a kill damages them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from dpcommon.save_manifest import write_manifest
from dpcommon.snapshot_files import write_snapshot
from dpstate.snapshot import packing as S
from dpstate.snapshot.state import Tracked
from helpers.cli import run

pytestmark = pytest.mark.timeout(60)


def save_step(save_dir: Path, step: int, world_size: int = 2, manifest: bool = True) -> Path:
    """A step-S folder of `world_size` ranks of a small model and its optimizer, as a save writes it."""
    folder = save_dir / f"step-{step}"
    for rank in range(world_size):
        torch.manual_seed(rank)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        tracked = Tracked()
        tracked.add(model=model, optimizer=opt)
        meta, data = S.pack(tracked.capture(step))
        write_snapshot(folder, rank, step, S.checksum(meta, data), meta, [data.numpy()])
    if manifest:
        write_manifest(folder, step, world_size, list(range(world_size)), "node-0")
    return folder


def truncate(path: Path, by: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-by])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x20  # in the data, past the header and the meta
    path.write_bytes(bytes(data))


def test_a_whole_step_verifies_and_lists_as_complete(tmp_path, capsys):
    folder = save_step(tmp_path, 7)
    code, out, err = run(capsys, "ckpt", "verify", str(folder))
    nbytes = sum(p.stat().st_size for p in folder.glob("rank-*.dpsnap"))
    assert (code, err) == (0, ""), out
    assert out.strip() == f"step-7: complete, 2 ranks, {nbytes} bytes verified"
    code, out, _ = run(capsys, "ckpt", "list", str(tmp_path))
    header, row = out.splitlines()
    assert code == 0 and header.split() == ["STEP", "STATE", "RANKS", "SIZE", "AGE", "WHY", "NOT"]
    assert row.split()[:3] == ["step-7", "complete", "2"] and "KiB" in row


@pytest.mark.parametrize("damage, said", [
    (lambda f: truncate(f / "rank-1.dpsnap"), r"rank-1\.dpsnap is \d+ bytes, its manifest says \d+: cut short"),
    (lambda f: flip_byte(f / "rank-0.dpsnap"),
     r"rank-0\.dpsnap is corrupt: its bytes do not match the checksum it was saved with"),
    (lambda f: [p.unlink() for p in f.glob("manifest.*.json")],
     r"step-5 has no manifest: its save did not finish"),
    (lambda f: (f / "rank-1.dpsnap").unlink(), r"rank-1\.dpsnap is missing"),
], ids=["truncated", "flipped-byte", "no-manifest", "missing-file"])
def test_a_damaged_step_is_said_naming_the_file_and_why_and_verify_fails(tmp_path, capsys, damage, said):
    folder = save_step(tmp_path, 5)
    damage(folder)
    code, out, err = run(capsys, "ckpt", "verify", str(folder))
    assert code == 1 and err == "", out
    assert out.startswith("step-5: cannot be resumed from, 1 problem:\n"), out
    assert re.search(said, out), out
    assert str(folder) in out.splitlines()[1], "the problem names the file or folder"


def test_a_torn_file_without_a_manifest_is_said_as_torn_too(tmp_path, capsys):
    """A save cut short by a kill: no manifest, and a rank file that is not whole; both are said."""
    folder = save_step(tmp_path, 3, manifest=False)
    truncate(folder / "rank-0.dpsnap")
    code, out, _ = run(capsys, "ckpt", "verify", str(folder))
    assert code == 1 and "2 problems" in out and "has no manifest" in out, out
    assert re.search(r"rank-0\.dpsnap is cut short: 100 of \d+ bytes missing", out), out


def test_a_save_dir_is_verified_step_by_step_naming_the_step_a_resume_would_take(tmp_path, capsys):
    """The newest step damaged: exit 1, and the step that --resume-from would go on from is the one before."""
    for step in (10, 20, 30):
        save_step(tmp_path, step)
    flip_byte(tmp_path / "step-30" / "rank-1.dpsnap")
    code, out, _ = run(capsys, "ckpt", "verify", str(tmp_path))
    lines = out.splitlines()
    assert code == 1, out
    assert lines[0] == "step-30: cannot be resumed from, 1 problem:" and "rank-1.dpsnap is corrupt" in lines[1]
    assert lines[2].startswith("step-20: complete, 2 ranks,") and lines[3].startswith("step-10: complete")
    assert lines[4] == f"--resume-from {tmp_path} would go on from step-20 (the newest complete step, every byte intact)"
    code, out, _ = run(capsys, "ckpt", "list", str(tmp_path))
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["step-30", "complete"], ["step-20", "complete"], ["step-10", "complete"]], "list reads no byte of data"
    (tmp_path / "step-20" / "rank-0.dpsnap").unlink()
    code, out, _ = run(capsys, "ckpt", "list", str(tmp_path))
    row = out.splitlines()[2]
    assert row.split()[:2] == ["step-20", "INCOMPLETE"] and row.endswith("rank-0.dpsnap is missing"), out


def test_every_step_damaged_says_none_can_be_resumed(tmp_path, capsys):
    save_step(tmp_path, 1, manifest=False)
    truncate(save_step(tmp_path, 2) / "rank-0.dpsnap")
    code, out, _ = run(capsys, "ckpt", "verify", str(tmp_path))
    assert code == 1 and out.splitlines()[-1] == (f"--resume-from {tmp_path} has no step to go on from: every step is "
                                                  "damaged or incomplete"), out


@pytest.mark.parametrize("args, said", [
    (["list", "{tmp}/nowhere"], "dprun ckpt: {tmp}/nowhere does not exist or is not a folder"),
    (["verify", "{tmp}/empty"], ("dprun ckpt: {tmp}/empty holds no step-S folder: not a --save-dir, or nothing was "
                                "saved in it yet")),
    (["list", "{tmp}/file"], "dprun ckpt: {tmp}/file does not exist or is not a folder"),
    (["export", "{tmp}/save/step-4", "{tmp}/out", "--format", "onnx"], ("dprun ckpt: unknown --format 'onnx': give "
                                                                       "torch or dcp")),
    (["export", "{tmp}/save/step-4", "{tmp}/full", "--format", "torch"], ("dprun ckpt: {tmp}/full exists and is not "
                                                                         "an empty folder: give a new or empty one")),
    (["export", "{tmp}/save", "{tmp}/out", "--format", "torch"], ("dprun ckpt: {tmp}/save is not a step-S folder of a "
                                                                "--save-dir (dprun ckpt list DIR shows them)")),
    (["export", "{tmp}/save/step-4", "{tmp}/out"], "dprun ckpt: missing option '--format' (see dprun ckpt --help)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, said):
    save_step(tmp_path / "save", 4)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    code, out, err = run(capsys, "ckpt", *[a.format(tmp=tmp_path) for a in args])
    assert (code, out) == (2, "") and err == said.format(tmp=tmp_path) + "\n", err
    assert not (tmp_path / "out").exists() and (tmp_path / "full" / "keep.txt").exists()


def test_a_damaged_step_is_not_exported_and_says_to_run_verify(tmp_path, capsys):
    folder = save_step(tmp_path, 6)
    flip_byte(folder / "rank-1.dpsnap")
    code, out, err = run(capsys, "ckpt", "export", str(folder), str(tmp_path / "out"), "--format", "torch")
    assert code == 1 and out == "", out
    assert err == (f"dprun ckpt: {folder} cannot be exported: {folder}/rank-1.dpsnap is corrupt: its bytes do not "
                   f"match the checksum it was saved with; run dprun ckpt verify {folder}\n")
    assert not (tmp_path / "out").exists(), "nothing written"


@pytest.mark.slow  # starts a `python -m dprun` process
def test_piped_output_is_plain_text_one_line_per_step(tmp_path):
    """As a script or `| grep` reads it: no colours, no box drawing, no wrapping of a long reason."""
    save_step(tmp_path, 8)
    save_step(tmp_path, 9, manifest=False)
    proc = subprocess.run([sys.executable, "-m", "dprun", "ckpt", "list", str(tmp_path)], capture_output=True, check=False,
                          text=True, cwd=REPO, timeout=50,
                          env=dict(os.environ, COLUMNS="40", TERM="xterm-256color", FORCE_COLOR=""))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and "\x1b" not in proc.stdout and not re.search("[\u2500-\u257f]", proc.stdout)
    assert lines[1].split()[:2] == ["step-9", "INCOMPLETE"] and lines[1].endswith(
        "step-9 has no manifest: its save did not finish (the job was stopped or killed while it wrote it)")
    assert lines[2].split()[:2] == ["step-8", "complete"]
