"""Where a worker's stdout and stderr go: per-rank log files, the console (torchrun's -r/-t/--local-ranks-filter)
and a short tail of stderr that is sent with the worker's exit, for the job's failure summary.

One pump thread per piped stream copies bytes as they come; nothing here parses or buffers whole lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

OUT, ERR = 1, 2  # torchrun's Std bits: 0 none, 1 stdout, 2 stderr, 3 both
TAIL_BYTES = 8192
TAIL_LINES = 20


def parse_std(spec: str, what: str = "--redirects") -> dict[int, int] | int:
    """torchrun's syntax: "3" (every local rank) or "0:1,1:2" (per local rank); ValueError when malformed."""
    spec = (spec or "0").strip()
    try:
        if ":" not in spec:
            value = int(spec)
            if value not in (0, 1, 2, 3):
                raise ValueError
            return value
        out = {}
        for part in spec.split(","):
            rank, level = part.split(":")
            out[int(rank)] = int(level)
            if out[int(rank)] not in (0, 1, 2, 3) or int(rank) < 0:
                raise ValueError
        return out
    except ValueError:
        raise ValueError(f"bad {what} {spec!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                         "or per local rank, e.g. 0:3,1:2") from None


def parse_ranks(spec: str) -> set[int] | None:
    """--local-ranks-filter "0,1" -> {0, 1}; "" -> None (no filter); ValueError when malformed."""
    if not spec or not spec.strip():
        return None
    try:
        ranks = {int(x) for x in spec.split(",")}
    except ValueError:
        raise ValueError(f"bad --local-ranks-filter {spec!r}: expected local ranks like 0,1,2") from None
    if any(r < 0 for r in ranks):
        raise ValueError(f"bad --local-ranks-filter {spec!r}: local ranks are 0 or more")
    return ranks


@dataclass(frozen=True)
class OutputSpec:
    """How this node's workers' output is handled (the same for every node of a job)."""

    log_dir: str | None = None  # per-rank files: <log_dir>/<job>/<node>/attempt_<k>/<local_rank>/{stdout,stderr}.log
    redirects: str = "0"  # to the files only
    tee: str = "0"  # to the files and the console (the default for every stream when log_dir is set)
    local_ranks_filter: frozenset | None = None  # only these local ranks reach the console

    def bits(self, spec: str, local_rank: int) -> int:
        parsed = parse_std(spec)
        return parsed if isinstance(parsed, int) else parsed.get(local_rank, 0)

    def routes(self, local_rank: int, stream: int) -> tuple[bool, bool]:
        """(to the log file, to the console) for one stream of one local rank."""
        redirect = bool(self.bits(self.redirects, local_rank) & stream)
        to_file = self.log_dir is not None  # tee'd or not, every stream has its file once there is a log dir
        shown = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
        return to_file, shown and not redirect


class WorkerOutput:
    """The pipes and pumps of one worker: popen_kwargs() before Popen, start(popen) after, join() at exit."""

    def __init__(self, spec: OutputSpec, local_rank: int, folder: Path | None):
        self.folder = folder if spec.log_dir else None
        self.routes = {s: spec.routes(local_rank, s) for s in (OUT, ERR)}
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def log_path(self) -> str:
        return str(self.folder / "stderr.log") if self.folder else ""

    def popen_kwargs(self) -> dict:
        to_file, shown = self.routes[OUT]
        stdout = subprocess.PIPE if to_file else (None if shown else subprocess.DEVNULL)
        return {"stdout": stdout, "stderr": subprocess.PIPE}

    def start(self, popen: subprocess.Popen) -> None:
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        for stream, pipe, console_fd in ((OUT, popen.stdout, 1), (ERR, popen.stderr, 2)):
            if pipe is None:
                continue
            to_file, shown = self.routes[stream]
            name = "stdout.log" if stream == OUT else "stderr.log"
            file = open(self.folder / name, "ab", buffering=0) if to_file and self.folder else None
            thread = threading.Thread(target=self._pump, args=(pipe, file, console_fd if shown else None,
                                                               stream == ERR),
                                      name=f"pump-{popen.pid}-{stream}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, pipe, file, console_fd: int | None, keep_tail: bool) -> None:
        fd = pipe.fileno()
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                if file is not None:
                    try:
                        file.write(chunk)
                    except OSError:
                        file = None
                if console_fd is not None:
                    try:
                        _write_all(console_fd, chunk)
                    except OSError:
                        console_fd = None
                if keep_tail:
                    with self._lock:
                        self._tail += chunk
                        del self._tail[:-TAIL_BYTES]
        finally:
            pipe.close()
            if file is not None:
                file.close()

    def join(self, timeout: float) -> None:
        """Waits (at most `timeout` s in all) for the pumps to drain what the worker wrote before it exited."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def tail(self, lines: int = TAIL_LINES) -> str:
        with self._lock:
            text = self._tail.decode(errors="replace")
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])


# dpstate's own notices on a worker's stderr (a spare's warm-up, the snapshot interval, a SIGTERM it outlives...),
# after torch's "[rankN]: " prefixes as dprun.controller.repeats strips them: not why a worker failed, and a spare
# prints some that its predecessor did not, so the same bug must not read as another. Its errors are exception lines
# ("RuntimeError: dpstate: ..."), kept; and so are the two lines it ends a worker with: a SystemExit's message
# (dpstate.steps.session, no Reconfigure after a failure) and os._exit's notice (dpstate.steps.agent_link, Stop
# unheeded).
_DPSTATE_NOTICE = re.compile(r"^(?:\[rank\d+\]:\s*)*dpstate: (?!rank \d+: no Reconfigure within |Stop \()")


def last_line(text: str, width: int = 200) -> str:
    """The last line of `text` that is not blank nor one of dpstate's notices, stripped and cut to `width`."""
    for line in reversed(text.splitlines()):
        if line.strip() and not _DPSTATE_NOTICE.match(line.strip()):
            return line.strip()[:width]
    return ""


CRASHES = (-signal.SIGABRT, -signal.SIGSEGV)  # the process's own end; a SIGKILL or SIGTERM came from outside
_RANK_PREFIX = re.compile(r"^(?:\[rank\d+\]: ?)*")  # torch's excepthook puts "[rankN]: " before each line
_EXCEPTION_NAME = re.compile(r"^(?:\w+\.)*(\w+)(?::|$)")


def raised_exception(text: str) -> str:
    """The exception line of the last Python traceback in `text` (a worker's stderr tail), or ""."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines)
              if _RANK_PREFIX.sub("", line).startswith("Traceback (most recent call last):")]
    for line in lines[starts[-1] + 1:] if starts else []:
        body = _RANK_PREFIX.sub("", line)
        if body.strip() and not body[0].isspace():  # past the indented frames, source lines and carets
            return line.strip()
    return ""


def exception_name(line: str) -> str:
    """The unqualified class name of an exception line ("[rank0]: a.b.KeyError: 'x'" -> "KeyError"), or ""."""
    named = _EXCEPTION_NAME.match(_RANK_PREFIX.sub("", line))
    return named.group(1) if named else ""


def crash_exception(tail: str, exitcode: int, width: int = 200) -> str:
    """For a worker that crashed (SIGABRT, SIGSEGV) after a Python traceback, as a process may while it exits on
    the exception ("terminate called without an active exception"), the exception's line; else ""."""
    return raised_exception(tail)[:width] if exitcode in CRASHES else ""


def failure_detail(tail: str, raised: str, width: int = 200) -> str:
    """What a failed worker's stderr says went wrong: its last line, after `raised`, the exception of one that
    crashed as it exited on it (crash_exception), if any: that is what the user has to fix."""
    last = last_line(tail, width)
    return f"{raised} (then: {last})" if raised and last and raised != last else raised or last


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
