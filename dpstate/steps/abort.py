"""The abort signal of a worker: set when a newer generation or a Stop arrives, it releases abortable waits.

Waits on torch futures and on conditions watch it; callbacks run at once in the thread that sets it.

What torch 2.13 (CPU, Gloo) raises, measured on this box (tests/test_dpstate_abort.py checks it):

* A peer process killed (SIGKILL): a pending Gloo collective fails within milliseconds with a plain
  ``RuntimeError`` (not ``torch.distributed.DistError``): "[.../gloo/transport/tcp/pair.cc:...] Connection
  closed by peer [addr]:port. This is typically caused by a remote worker crashing ..." (also seen:
  "Connection reset by peer"). ``work.wait()``, ``work.get_future().wait()`` and blocking calls all raise it.
* A peer frozen (SIGSTOP): nothing raises until the group's timeout. ``ProcessGroupGloo.abort()`` does not
  release the waiter; waiting on ``work.get_future()`` with this signal does (``wait_future``).
* A DDP comm hook whose future is completed with an exception: ``loss.backward()`` raises a plain
  ``RuntimeError('Unable to cast <the exception message> to Tensor')`` in the main thread; the original type is
  lost, so we recognise our own aborts by ``ABORT_MARKER`` in the message.
* TCPStore failures raise ``torch.distributed.DistStoreError`` / ``DistNetworkError`` (subclasses of
  ``DistError``, itself a ``RuntimeError``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import time
from typing import Any, Callable

from .watch import WATCHER

ABORT_MARKER = "dpstate: aborted"
# In the message of dpstate.replication.holders.HolderGone, which a DDP comm hook's future turns into a RuntimeError
HOLDER_GONE_MARKER = "closed its connection before it acked"

# Substrings of the messages Gloo / NCCL / c10d put in the RuntimeErrors they raise when a peer is gone.
_PEER_PATTERNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Socket Timeout",
    "Timed out",
    "timed out",
    "gloo",
    "Gloo",
    "NCCL",
    "ProcessGroup",
    HOLDER_GONE_MARKER,
)


class Aborted(RuntimeError):
    """Raised by an abortable wait once the signal is set; the message starts with ABORT_MARKER."""


class AbortSignal:
    """Set when the agent asks for a newer generation (or Stop); cleared by entering that generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = -1  # the generation this worker is working in
        self._target = -1  # the newest generation asked for
        self._stopped: str | None = None
        self._reason = ""
        self._callbacks: dict[int, Callable[[], Any]] = {}
        self._next_token = 0

    # ------------------------------------------------------------------ state

    def request(self, generation: int, reason: str = "") -> None:
        """A newer generation was asked for: abort everything of the current one."""
        with self._lock:
            if generation <= self._target:
                return
            self._target = generation
            self._reason = f"generation {generation} requested" + (f" ({reason})" if reason else "")
            fire = generation > self._active
        if fire:
            self._fire()

    def stop(self, reason: str) -> None:
        with self._lock:
            if self._stopped is not None:
                return
            self._stopped = reason or "stop"
            self._reason = f"stop: {self._stopped}"
        self._fire()

    def enter(self, generation: int) -> None:
        """The worker now works in `generation`; the signal clears unless a newer one was asked for."""
        with self._lock:
            self._active = max(self._active, generation)

    def trigger(self, reason: str = "aborted") -> None:
        """Abort the current generation without naming a newer one (tests, fatal local errors)."""
        with self._lock:
            self._target = max(self._target, self._active + 1)
            self._reason = reason
        self._fire()

    @property
    def stopped(self) -> bool:
        return self._stopped is not None

    @property
    def target(self) -> int:
        return self._target

    def is_set(self) -> bool:
        return self._stopped is not None or self._target > self._active

    def superseded(self) -> bool:
        """A newer generation was asked for (not a Stop): the current step's result will be abandoned."""
        return self._target > self._active

    @property
    def reason(self) -> str:
        return self._reason

    def error(self) -> Aborted:
        return Aborted(f"{ABORT_MARKER}: {self._reason}")

    def check(self) -> None:
        if self.is_set():
            raise self.error()

    def check_superseded(self) -> None:
        """check(), but only for a newer generation, not a Stop."""
        if self.superseded():
            raise self.error()

    # ------------------------------------------------------------------ callbacks

    def add_callback(self, fn: Callable[[], Any]) -> int:
        """fn() runs (in the setting thread) each time the signal fires; returns a token for removal."""
        with self._lock:
            self._next_token += 1
            self._callbacks[self._next_token] = fn
            return self._next_token

    def remove_callback(self, token: int) -> None:
        with self._lock:
            self._callbacks.pop(token, None)

    def _fire(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks.values())
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback must never break the signal
                pass

    # ------------------------------------------------------------------ abortable waits

    def wait_future(self, fut: Any, timeout: float | None = None) -> Any:
        """fut.wait() that raises Aborted as soon as the signal is set (the collective is abandoned).
        The future is polled by the watcher thread: no Python callback ever rides on a backend thread."""
        done = threading.Event()
        watch_token = WATCHER.watch(fut, lambda _f: done.set())
        token = self.add_callback(done.set)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not done.is_set():
                self.check()
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"no result within {timeout} s")
                done.wait(left)
            if not fut.done():  # woken by the signal
                self.check()
            return fut.wait()  # done: returns the value or raises the error at once
        finally:
            WATCHER.unwatch(watch_token)
            self.remove_callback(token)

    def wait_for(self, cond: threading.Condition, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """cond.wait_for(predicate) that raises Aborted when the signal is set; TimeoutError after timeout."""

        def wake() -> None:
            with cond:
                cond.notify_all()

        token = self.add_callback(wake)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            with cond:
                while not predicate():
                    self.check()
                    left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                    if left <= 0:
                        raise TimeoutError(f"condition not met within {timeout} s")
                    cond.wait(left)
        finally:
            self.remove_callback(token)

    def sleep(self, seconds: float) -> None:
        """time.sleep that raises Aborted when the signal is set."""
        ev = threading.Event()
        token = self.add_callback(ev.set)
        try:
            self.check()
            ev.wait(seconds)
            self.check()
        finally:
            self.remove_callback(token)


def classify(exc: BaseException, signal: AbortSignal | None = None) -> str | None:
    """'abort' (caused by our signal), 'peer' (a collective or store failed), or None (a bug to propagate). An
    error that torch wrapped in its own (pipelining's "[Stage 0] failed to run forward") is what it wraps."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        kind = _classify_one(link, signal)
        if kind is not None:
            return kind
        link = link.__cause__ or link.__context__
    return None


def _classify_one(exc: BaseException, signal: AbortSignal | None) -> str | None:
    if not isinstance(exc, Exception):
        return None
    text = str(exc)
    if isinstance(exc, Aborted) or ABORT_MARKER in text:
        return "abort"
    if signal is not None and signal.is_set() and isinstance(exc, RuntimeError):
        return "abort"
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return "peer"
    except ImportError:  # pragma: no cover
        pass
    if type(exc).__name__ in ("PeerConnectError", "HolderGone"):  # dpstate.groups.pgroup: a rank died while the group
        # connected; dpstate.replication.holders: a replica holder's process died before it acked a snapshot
        return "peer"
    if type(exc).__name__ in ("GpuPlacementError", "StalePartsError"):  # setup errors that no recovery mends
        return None
    if (isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)) and any(p in text for p in _PEER_PATTERNS)
            and _raised_by_torch_or_dpstate(exc)):
        return "peer"
    return None


def describe(exc: BaseException) -> str:
    """`Type: message` of an error for a PeerError: the link of its chain that classify() recognised (not torch's
    wrapper around it), without the wrapping that a DDP comm hook's failed future gets (see above): "RuntimeError:
    Unable to cast X to Tensor" reads "X"."""
    link: BaseException | None = exc
    seen: set[int] = set()
    while link is not None and id(link) not in seen and _classify_one(link, None) is None:
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    exc = link if link is not None and id(link) not in seen else exc
    text = str(exc)
    unwrapped = re.fullmatch(r"Unable to cast (.*) to Tensor", text, re.DOTALL)
    return unwrapped.group(1) if unwrapped else f"{type(exc).__name__}: {text}"


def _package_dir(origin: str | None) -> str:
    return os.path.dirname(os.path.abspath(origin)) + os.sep if origin else "\0"


_TORCH_SPEC = importlib.util.find_spec("torch")  # found, not imported: this module does not need torch itself
_OURS = (_package_dir(os.path.dirname(os.path.abspath(__file__))),  # dpstate/ (this module is in dpstate/steps/)
         _package_dir(_TORCH_SPEC.origin if _TORCH_SPEC else None))  # torch/


def _raised_by_torch_or_dpstate(exc: BaseException) -> bool:
    """A peer's failure surfaces through torch (a collective, DDP's backward, the store) or dpstate (its
    watcher of futures); the training script's own error that merely reads like one ("fetching shard:
    Connection reset by peer") was raised in its own code, and is the script's: no peer is probed for it.
    An exception never raised (no traceback) is taken at its word."""
    tb = exc.__traceback__
    if tb is None:
        return True
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_OURS):
            return True
        tb = tb.tb_next
    return False
