"""A process's exit without the interpreter walking every object torch made: at exit, one collection, then every
object left is frozen out of the collections that the interpreter's finalization runs (gc.freeze).

Measured on this project's 2-core host: a process that imported torch spent 0.6-0.9 s of CPU exiting, 0.6 s less
with this; every job's dprun and workers exit, so the test suite and each job's end pay it.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def _collect_then_freeze() -> None:
    gc.collect()  # what is garbage now is finalized as it would have been (files flushed, __del__ run)
    gc.freeze()


def exit_quickly() -> None:
    """Register the collection and freeze to run at exit, once per process. It runs before the atexit functions
    registered earlier (torch's), which still run; only the finalization's walks over live objects are skipped."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_collect_then_freeze)
