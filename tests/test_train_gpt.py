"""examples/train_gpt.py alone (no dprun, world 1): it trains, writes its summary, and is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_gpt.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # a torch process per run: 10-25 s a test


def run(tmp_path: Path, name: str, *args: str) -> dict:
    summary = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(TRAIN), "--summary", str(summary), *args], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "world 1" in out.stdout
    return json.loads(summary.read_text())


def test_standalone_runs_and_is_deterministic(tmp_path):
    args = ("--steps", "5", "--log-every", "1")
    first = run(tmp_path, "a", *args)
    assert first["final_step"] == 5 and first["loss"] > 0 and len(first["params_sha256"]) == 64
    assert run(tmp_path, "b", *args) == first


def test_any_text_file_and_model_flags(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    got = run(tmp_path, "d", "--data", str(text), "--steps", "3", "--n-layer", "1", "--n-embd", "16",
              "--n-head", "2", "--block-size", "8", "--batch-size", "2", "--lr", "0.01", "--seed", "1")
    assert got["final_step"] == 3 and got["loss"] > 0
