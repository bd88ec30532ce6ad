"""A survivor still inside an old generation's step a while after a newer one was asked for says so with its stacks,
and one held in a torch.distributed wait that severing should have released ends itself, so that its node is
replaced without delay.

Severing (dpstate.groups.severing) and the abortable waits release a survivor in milliseconds. Now and then, under
load, a Gloo op kept waiting after every connection of its process group had closed (an FSDP2 all-gather, a
tensor-parallel all-reduce; a few runs in 100 of the saved 3D job): nothing in the process can end that wait, and
the job would wait the collective timeout (600 s) for it. The end is the one --hang-timeout would give, sooner.
Only where the groups' connections were severed (a job with a mesh, on Gloo): elsewhere a wait on a frozen peer is
ended by that timeout with an error the rank recovers from, keeping its process, which beats losing its node.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Callable

from dpcommon import stack_dump
from dpcommon.exit_wording import EXIT_UNRELEASED

from .abort import AbortSignal

CONFIRM_S = 5.0  # the wait must be at the same place this much later: a long collective passes, a stuck one not


def warn_after_s() -> float:
    """DP_RELEASE_WARN_S (default 30; 0: never)."""
    return float(os.environ.get("DP_RELEASE_WARN_S", "30"))


def waiting_in_torch_distributed(frame: FrameType | None, depth: int = 3) -> str | None:
    """Where a thread whose innermost Python frame is `frame` waits in torch.distributed ("name (file:line)"), or
    None where it is elsewhere. Up to `depth` frames of torch's own plumbing may lie between (a funcol wait is
    torch/_ops.py inside wait_tensor), but not torch.nn: a module still computing, without a collective, is no
    hang."""
    for _ in range(depth):
        if frame is None:
            return None
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path:
            return f"{frame.f_code.co_name} ({path.rsplit('/torch/', 1)[1]}:{frame.f_lineno})"
        if "/torch/" not in path or "/torch/nn/" in path:
            return None
        frame = frame.f_back
    return None


class ReleaseWatch:
    """on_abort (an AbortSignal callback) starts a timer for the generation asked for. If, when it fires, the
    main thread is still in its step: a line and every thread's stack; if it also waits in torch.distributed, at
    the same place CONFIRM_S later, and may_end() (its connections were severed), it ends the process with
    EXIT_UNRELEASED (its agent reports the exit)."""

    def __init__(self, abort: AbortSignal, in_step: Callable[[], bool], where: Callable[[], str],
                 may_end: Callable[[], bool], warn_s: float | None = None, confirm_s: float = CONFIRM_S,
                 end: Callable[[int], None] = os._exit, main_ident: int | None = None):
        self._abort, self._in_step, self._where, self._may_end = abort, in_step, where, may_end
        self.warn_s = warn_after_s() if warn_s is None else warn_s
        self.confirm_s, self._end = confirm_s, end
        self._main = threading.main_thread().ident if main_ident is None else main_ident
        self._lock = threading.Lock()
        self._watching = -1  # the newest generation asked for that a timer runs for
        self.checked = self.warned = 0

    def on_abort(self) -> None:
        target = self._abort.target
        if self.warn_s <= 0 or not self._abort.superseded():
            return
        with self._lock:
            if target <= self._watching:
                return
            self._watching = target
        self._after(self.warn_s, self._counted, self._warn, target)

    def _after(self, seconds: float, fn: Callable[..., None], *args: object) -> None:
        timer = threading.Timer(seconds, fn, args=args)
        timer.daemon = True
        timer.start()

    def _counted(self, check: Callable[..., None], *args: object) -> None:
        """A timer's check, counted in `checked` once what it said is written (a reader waits on `checked`)."""
        try:
            check(*args)
        finally:
            self.checked += 1

    def _still_held(self) -> bool:
        return self._abort.superseded() and self._in_step()

    def _waiting_at(self) -> str | None:
        return waiting_in_torch_distributed(sys._current_frames().get(self._main or -1))

    def _warn(self, target: int) -> None:
        if target != self._watching or not self._still_held():  # (a newer generation's timer says it)
            return
        print(f"dpstate: {self._where()} is still in its step {self.warn_s:g} s after generation {target} was asked "
              "for (its stacks follow)", file=sys.stderr, flush=True)
        stack_dump.write_now()
        self.warned += 1
        waiting = self._waiting_at()
        if waiting is not None and self._may_end():
            self._after(self.confirm_s, self._counted, self._end_if_still_waiting, target, waiting)

    def _end_if_still_waiting(self, target: int, waiting: str) -> None:
        if target != self._watching or not self._still_held() or self._waiting_at() != waiting:
            return
        print(f"dpstate: {self._where()}: a collective of the old generation never let go ({waiting}, "
              f"{self.warn_s + self.confirm_s:g} s after generation {target} was asked for); this worker ends "
              f"itself (exit code {EXIT_UNRELEASED}) so that its node is replaced", file=sys.stderr, flush=True)
        self._end(EXIT_UNRELEASED)
