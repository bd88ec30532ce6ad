"""The plain writes saving.py holds background saves to: a save's bytes written as files, fsynced, renamed, by
one or several writers at once; and the control's, at a save thread's priority beside a training run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import _common as C

from dpcommon.direct_write import write_synced

WRITE_CHUNK = 4 << 20


def plain_write(folder: Path, nbytes: int, writers: int, direct: bool, nice: int = 0) -> float:
    """Seconds to write `nbytes` into `folder` as `writers` files written concurrently (threads: a write and an
    fsync release the GIL), each its share, as a save writes a file (dpcommon.direct_write: past the page cache
    if `direct`), fsynced, renamed into place; the files go after. `nice`: the writing threads' priority (the
    agents' save threads run at 19)."""
    shares = [nbytes // writers + (i < nbytes % writers) for i in range(writers)]
    block = memoryview(os.urandom(WRITE_CHUNK))  # content does not matter to the disk (no compression here)
    start = threading.Barrier(writers + 1)
    errors: list[BaseException] = []

    def write(i: int, size: int) -> None:
        partial, path = folder / f"plain-{i}.partial", folder / f"plain-{i}.dpsnap"
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        start.wait()
        try:
            whole, rest = divmod(size, WRITE_CHUNK)
            write_synced(partial, [block] * whole + [block[:rest]], direct=direct)
            os.replace(partial, path)
        except OSError as exc:  # (said by the caller: a plain write that failed measured nothing)
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i, size)) for i, size in enumerate(shares)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for i in range(writers):
        for suffix in ("partial", "dpsnap"):
            (folder / f"plain-{i}.{suffix}").unlink(missing_ok=True)
    if errors:
        raise errors[0]
    return took


def write_aside(folder: Path, nbytes: int, writers: int, direct: bool) -> float:
    """plain_write at nice 19 from a new session whose scheduling group is niced too (benchmarks/_aside_write.py):
    the seconds it took, measured there (its process's start is not counted)."""
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("_aside_write.py")), str(folder), str(nbytes),
                          str(writers), str(int(direct))], capture_output=True, text=True, start_new_session=True,
                         timeout=600)
    if res.returncode != 0:
        raise OSError(f"the control's write exited {res.returncode}: {res.stderr.strip()[-500:]}")
    return float(json.loads(res.stdout)["seconds"])


class BesideWriter:
    """The control run's writer: a thread that, each time the run in `folder` has passed a multiple of `every`
    steps (its timings.jsonl), writes `nbytes` into `plain_dir` by `writers` writers at nice 19 in a niced
    scheduling group of their own (write_aside), as a save of that step would, and keeps each write's [start, end]
    (Unix time) and bytes per second. `direct`: as the saves write (DP_SAVE_DIRECT)."""

    def __init__(self, folder: Path, plain_dir: Path, nbytes: int, writers: int, every: int, last: int,
                 direct: bool):
        self.folder, self.plain_dir, self.nbytes, self.writers = folder, plain_dir, nbytes, writers
        self.direct = direct
        self.every, self.last = every, last
        self.windows: list[tuple[float, float]] = []
        self.mb_per_s: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beside-writer", daemon=True)

    def __enter__(self) -> Self:
        self.plain_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.plain_dir, ignore_errors=True)

    def _step(self) -> int:
        return max(C.step_times(C.read_jsonl(self.folder / "timings.jsonl")), default=0)

    def _run(self) -> None:
        due = self.every
        while due < self.last and not self._stop.wait(0.05):
            if self._step() < due:
                continue
            t0 = time.time()
            try:
                took = write_aside(self.plain_dir, self.nbytes, self.writers, self.direct)
            except OSError as exc:
                self.error = exc
                return
            self.windows.append((t0, t0 + took))
            self.mb_per_s.append(self.nbytes / 1e6 / took)
            due = (self._step() // self.every + 1) * self.every
