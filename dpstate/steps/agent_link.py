"""The worker's line to its agent: a background thread owns the DEALER, sends Hello, relays the outbox.

Reconfigure sets the abort signal at once and wakes waiters; Stop aborts and, unless the rank finished, exits;
Standby (a spare's) goes to on_standby.
Any thread may send: messages go through an inproc PUSH/PULL outbox to the thread that owns the socket.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from typing import Any, Callable

import zmq

from dpcommon import protocol as P
from dpcommon import stack_dump

from .abort import AbortSignal

_ids = itertools.count()


class Control:
    """Connection to the agent at `endpoint` (ipc://...), identity str(local_rank)."""

    def __init__(self, endpoint: str, token: str, node_id: str, local_rank: int, abort: AbortSignal,
                 ctx: zmq.Context | None = None):
        self.endpoint, self.node_id, self.local_rank = endpoint, node_id, local_rank
        self.abort = abort
        self.codec = P.Codec(token)
        self.ctx = ctx or zmq.Context.instance()
        self.finished = False  # the rank passed its final barrier: a Stop then lets the script end by itself
        self.stop_grace = float(os.environ.get("DP_STOP_GRACE", "2"))
        self.dropped = 0  # messages refused by the codec
        # what this worker is doing, sent to the agent every status_interval: the controller's hang evidence
        self.status: Any = None  # callable returning a WorkerStatus, or None
        self.status_interval = float(os.environ.get("DP_STATUS_INTERVAL", "0.5"))
        self.on_standby: Callable[[P.Standby], None] | None = None  # called on this thread: must not block
        self.on_save: Callable[[P.SaveSnapshots], None] | None = None  # on this thread (the job is stopping)
        self.standby: P.Standby | None = None  # the newest one (it may come before on_standby is set)
        self._cond = threading.Condition()
        self._latest: P.Reconfigure | None = None
        self._stop: P.Stop | None = None
        self._closing = threading.Event()
        self._watchdog: threading.Timer | None = None
        addr = f"inproc://dpstate-outbox-{os.getpid()}-{next(_ids)}"
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(addr)
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)
        self._push_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dpstate-control", daemon=True)

    # ------------------------------------------------------------------ public

    def start(self) -> "Control":
        self._thread.start()
        self.send(P.Hello(node_id=self.node_id, local_rank=self.local_rank, pid=os.getpid()))
        return self

    def send(self, msg: Any) -> None:
        """Queue a message for the agent (from any thread)."""
        frames = self.codec.encode(msg)
        with self._push_lock:
            self._push.send_multipart(frames)

    @property
    def latest(self) -> P.Reconfigure | None:
        return self._latest

    @property
    def stop_message(self) -> P.Stop | None:
        return self._stop

    def wait_reconfigure(self, newer_than: int, timeout: float | None = None) -> P.Reconfigure | None:
        """The newest Reconfigure with generation > newer_than, or None after timeout.
        Raises SystemExit(exit_code) when a Stop arrived."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._stop is not None:
                    raise SystemExit(self._stop.exit_code)
                if self._latest is not None and self._latest.generation > newer_than:
                    return self._latest
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def wait_standby(self, seen: P.Standby | None = None) -> P.Standby | None:
        """Block until a Standby other than `seen` has arrived (returns the newest), or None once a Reconfigure or
        Stop has: a spare's main thread waits for whichever comes first."""
        with self._cond:
            self._cond.wait_for(lambda: (self.standby is not None and self.standby is not seen)
                                or self._latest is not None or self._stop is not None)
            return self.standby if self._latest is None and self._stop is None else None

    def close(self, linger_s: float = 2.0) -> None:
        """Flush queued messages (up to linger_s) and end the thread."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._closing.is_set():
            return
        self._linger_ms = int(linger_s * 1000)
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(linger_s + 1.0)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, str(self.local_rank).encode())
        dealer.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_status = time.monotonic()
        try:
            while not self._closing.is_set():
                if self.status is not None and time.monotonic() >= next_status:
                    next_status = time.monotonic() + self.status_interval
                    status = self.status()
                    if status is not None:
                        dealer.send_multipart(self.codec.encode(status))
                for sock, _ in poller.poll(50):
                    if sock is self._pull:
                        dealer.send_multipart(self._pull.recv_multipart())
                    else:
                        self._receive(dealer.recv_multipart())
            while self._pull.poll(0):  # flush what is queued
                dealer.send_multipart(self._pull.recv_multipart())
        finally:
            dealer.setsockopt(zmq.LINGER, getattr(self, "_linger_ms", 0))
            dealer.close()
            self._pull.close(0)

    def _receive(self, frames: list) -> None:
        try:
            msg, _ = self.codec.decode(frames)
        except P.ProtocolError:
            self.dropped += 1
            return
        if isinstance(msg, P.Reconfigure):
            with self._cond:
                if self._latest is not None and msg.generation <= self._latest.generation:
                    return
                self._latest = msg
                self._cond.notify_all()
            self.abort.request(msg.generation, msg.reason)
        elif isinstance(msg, P.Standby):
            with self._cond:
                self.standby = msg
                self._cond.notify_all()
            if self.on_standby is not None:
                self.on_standby(msg)
        elif isinstance(msg, P.SaveSnapshots) and self.on_save is not None:
            self.on_save(msg)
        elif isinstance(msg, P.Stop):
            with self._cond:
                if self._stop is not None:
                    return
                self._stop = msg
                self._cond.notify_all()
            if self.finished:
                return
            self.abort.stop(msg.reason)
            self._watchdog = threading.Timer(self.stop_grace, self._exit_after_grace, args=(msg,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def _exit_after_grace(self, msg: P.Stop) -> None:
        """The main thread should exit by itself at its next abortable point; if it does not, we end it."""
        if self.finished:
            return
        print(f"dpstate: Stop ({msg.reason}) and the main thread did not exit in {self.stop_grace:.0f} s; "
              f"exiting with {msg.exit_code}; where each thread was:", file=sys.stderr, flush=True)
        try:  # where it was stuck (the script's code, or ours), to the process's stderr whatever sys.stderr is now
            stack_dump.write_now()
        finally:
            os._exit(msg.exit_code)
