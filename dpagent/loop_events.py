"""Hands events from helper threads (worker waiters, the snapshot verifier) to the agent loop.

Events go through a queue; an inproc PUSH/PULL pair only wakes the loop, so it never polls for them.
"""

from __future__ import annotations

import itertools
import queue
from typing import Any

import zmq

_ids = itertools.count()


class EventPipe:
    """The loop polls `wake` and calls drain(); any thread posts through its own sender()."""

    def __init__(self, ctx: zmq.Context):
        self._ctx = ctx
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.address = f"inproc://dpagent-events-{next(_ids)}"
        self.wake = ctx.socket(zmq.PULL)
        self.wake.linger = 0
        self.wake.bind(self.address)

    def sender(self) -> "EventSender":
        """A sender for the calling thread (zmq sockets are not shared between threads)."""
        return EventSender(self)

    def drain(self) -> list[Any]:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        events = []
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                return events

    def close(self) -> None:
        self.wake.close(linger=0)


class EventSender:
    def __init__(self, pipe: EventPipe):
        self._pipe = pipe
        self._sock = pipe._ctx.socket(zmq.PUSH)
        self._sock.linger = 100
        self._sock.connect(pipe.address)

    def post(self, event: Any) -> None:
        self._pipe._queue.put(event)  # queued first, so a wake-up never finds it missing
        try:
            self._sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:  # full (the loop is awake anyway) or the context is closing
            pass

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "EventSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
