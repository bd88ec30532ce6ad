"""Jobs of examples/train_gpt_3d.py (FSDP2, tensor and pipeline parallelism on a DeviceMesh) run by dprun: the
layouts the tests use, their step counts, and the 3D job with background saves that two test files share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conftest import REPO
from helpers.e2e import Run, dprun

TRAIN_3D = str(REPO / "examples" / "train_gpt_3d.py")
MODEL = ["--seed", "0", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
         "--batch-size", "4", "--microbatches", "2", "--log-every", "0"]
LAYOUTS = {  # name: (dims, the mesh as dprun reports it)
    "3d": (["--pp", "2", "--dp", "2", "--tp", "2"], "pp=2 x dp=2 x tp=2"),
    "dp-pp": (["--pp", "2", "--dp", "2"], "pp=2 x dp=2 x tp=1"),
    "fsdp-tp": (["--dp", "2", "--tp", "2"], "pp=1 x dp=2 x tp=2"),
}
STEPS = {"3d": 20, "dp-pp": 16, "fsdp-tp": 16}


def run_layout(procs, tmp_path: Path, layout: str, name: str, *options: str, timeout: float = 240,
               env: dict | None = None) -> Run:
    """dprun OPTIONS train_gpt_3d.py of `layout` (MODEL, its dims) for its STEPS."""
    dims, _ = LAYOUTS[layout]
    return dprun(procs, tmp_path, name, *options, steps=STEPS[layout], timeout=timeout, script=TRAIN_3D,
                 script_args=[*MODEL, *dims], env=env)


@dataclass
class Saved3dJob:
    run: Run  # to its end, whatever it ended with: its test checks that
    saved: Path  # its --save-dir: steps 10, 15 and 20 (--save-every 5, --save-keep 3)


def saved_3d_job(procs, tmp_path: Path) -> Saved3dJob:
    """The 3D job (pp=2 x dp=2 x tp=2) on 4 nodes of 2 workers and a spare, node rank 2 killed at step 6, saving
    in the background every 5 steps: one job of 8 ranks that both test_e2e_parallel (its recovery, its resume
    from disk) and test_ckpt_export (a DCP export of a saved step) need."""
    saved = tmp_path / "saved"
    run = run_layout(procs, tmp_path, "3d", "kill", "--nnodes", "4", "--nproc-per-node", "2", "--spares", "1",
                     "--inject", "kill-node:2@step=6", "--save-dir", str(saved), "--save-every", "5",
                     "--save-keep", "3")
    return Saved3dJob(run, saved)
