"""Watches backend (Gloo / NCCL) futures from one polling thread and runs their Python follow-ups there.

No Python callback is ever attached to a backend future and no Python thread blocks in a backend wait.

Why (measured with torch 2.13, Gloo): a group abandoned with an op stuck on a frozen peer keeps that op
until the peer's sockets close. If that happens while the interpreter is finalizing, a Python callback on
the op's future (add_done_callback / then), run by the Gloo thread, aborts the process ("terminate called
after throwing an instance of 'gloo::IoException'"), and a Python thread blocked in work.wait() that wakes
then aborts it too ("terminate called without an active exception"). A future nobody in Python waits on
is harmless. Entries are removed as soon as their owner gives up on them, so abandoned ops cost nothing.
The thread is stopped at exit (close, an atexit handler): a follow-up completes a Python future, whose waiter
(the main thread) may go on to exit while the follow-up is still in torch's set_result; a daemon thread that
then takes the GIL back during finalization is ended by pthread_exit, whose unwinding through that C++ frame
aborts the process ("terminate called without an active exception"; seen in 3-4 of 20 torchrun runs of
examples/train_gpt.py, gdb on the core).
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any, Callable

POLL_S = 0.0002  # the first polls after a future is watched or one completes: a bucket's all-reduce takes ms
MAX_POLL_S = 0.002  # polls back off to this while nothing completes (each poll costs ~30 us of CPU)
BACKOFF = 1.5


class FutureWatcher:
    """watch(fut, on_done) calls on_done(fut) in the watcher thread once fut.done(); unwatch() forgets it."""

    def __init__(self, poll_s: float = POLL_S, max_poll_s: float = MAX_POLL_S):
        self.poll_s, self.max_poll_s = poll_s, max(poll_s, max_poll_s)
        self._sleep_s = poll_s
        self._cond = threading.Condition()
        self._entries: dict[int, tuple[Any, Callable[[Any], Any]]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, fut: Any, on_done: Callable[[Any], Any]) -> int:
        with self._cond:
            self._next += 1
            self._entries[self._next] = (fut, on_done)
            self._sleep_s = self.poll_s  # a new op (the next bucket, the last one of a step): poll closely
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="dpstate-futures", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def unwatch(self, token: int) -> None:
        with self._cond:
            self._entries.pop(token, None)

    @property
    def pending(self) -> int:
        return len(self._entries)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once it has finished the follow-ups it is running (at exit: see the module's
        docstring); futures still watched are not followed up. Later watch() calls start no thread."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._entries and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                entries = list(self._entries.items())
            done = [(token, fut, fn) for token, (fut, fn) in entries if fut.done()]
            if not done:
                # Backing off: while a backward issues bucket after bucket, the earliest all-reduce is pending
                # for most of it; polling every 0.2 ms throughout cost ~10 % of a core (2-core host).
                time.sleep(self._sleep_s)
                self._sleep_s = min(self.max_poll_s, self._sleep_s * BACKOFF)
                continue
            with self._cond:
                self._sleep_s = self.poll_s
                for token, _, _ in done:
                    self._entries.pop(token, None)
            for _, fut, fn in done:
                try:
                    fn(fut)
                except Exception:  # a follow-up must never stop the watcher
                    pass


WATCHER = FutureWatcher()
atexit.register(WATCHER.close)
