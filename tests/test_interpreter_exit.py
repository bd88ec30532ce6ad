"""A process's quick exit (dpcommon.interpreter_exit): what was garbage at exit is still finalized, and the
objects left alive are frozen out of the finalization's collections."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]  # (a python process of its own)

SCRIPT = """
import atexit, gc, sys
from dpcommon.interpreter_exit import exit_quickly

class Flushes:
    def __init__(self, path):
        self.path, self.me = path, self  # a cycle: only a collection finalizes it
    def __del__(self):
        open(self.path, "w").write("finalized")

atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))  # runs last (LIFO)
exit_quickly()
exit_quickly()  # (once per process, however often asked)
Flushes(sys.argv[1])
"""


def test_garbage_at_exit_is_finalized_and_what_lives_is_frozen(tmp_path):
    said = tmp_path / "said"
    gc_off = "import gc; gc.disable(); "  # (no automatic collection before exit: exit's own does it)
    proc = subprocess.run([sys.executable, "-c", gc_off + SCRIPT, str(said)], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert said.read_text() == "finalized"
    assert proc.stdout.split() == ["frozen", "True"], proc.stdout
