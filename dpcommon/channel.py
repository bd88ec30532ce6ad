"""ZeroMQ sockets that speak the DeadPool protocol: typed messages in and out through the job's Codec.

Shared by the agent and the controller. Nothing here blocks, and anything the Codec refuses is dropped and counted.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zmq

from .protocol import Codec, ProtocolError, Refused

log = logging.getLogger("dpagent")


@dataclass
class Incoming:
    """One decoded message. `envelope` is what a ROUTER must put in front of a reply (identity [, b""])."""

    msg: Any
    payload: list = field(default_factory=list)
    envelope: list = field(default_factory=list)

    @property
    def sender(self) -> bytes | None:
        return self.envelope[0] if self.envelope else None


class Channel:
    """A socket plus the Codec. ROUTER channels see and address peers by identity; others do not.

    recv_ready() never blocks; messages the Codec refuses are counted in `dropped` and reported through
    `on_drop(channel, reason)`. send() never blocks either: a message a full queue cannot take is counted in
    `send_dropped` and send() returns False.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        codec: Codec,
        name: str,
        *,
        zero_copy: bool = False,
        on_drop: Callable[["Channel", str], None] | None = None,
    ):
        self.sock = sock
        self.codec = codec
        self.name = name
        self.router = sock.type == zmq.ROUTER
        self.zero_copy = zero_copy
        self.on_drop = on_drop
        self.dropped = 0
        self.send_dropped = 0
        self.refused = ""  # the code of the last refusal heard (its peer cannot authenticate us; protocol.Refused)

    # ------------------------------------------------------------------ receive

    def recv_ready(self, limit: int = 64) -> list[Incoming]:
        """Up to `limit` messages that are already queued; malformed ones are dropped and counted."""
        out: list[Incoming] = []
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=not self.zero_copy)
            except zmq.Again:
                break
            incoming = self._decode(frames)
            if incoming is not None:
                out.append(incoming)
        return out

    def recv(self, timeout: float | None = None) -> Incoming | None:
        """Blocking receive of the next valid message (for clients and tests); None on timeout."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poller.poll(None if left is None else int(left * 1000)):
                return None
            got = self.recv_ready(limit=1)
            if got:
                return got[0]
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _decode(self, frames: list) -> Incoming | None:
        envelope: list = []
        if self.router:
            if len(frames) < 2:
                self._drop("no identity frame")
                return None
            envelope.append(_bytes(frames[0]))
            frames = frames[1:]
            if len(_bytes_view(frames[0])) == 0:  # a REQ peer's empty delimiter
                envelope.append(b"")
                frames = frames[1:]
        try:
            msg, payload = self.codec.decode(frames)
        except ProtocolError as exc:
            if isinstance(exc, Refused):
                self.refused = exc.code
            self._drop(str(exc))
            return None
        return Incoming(msg, payload, envelope)

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop(self, reason)

    def drop_unexpected(self, incoming: Incoming) -> None:
        """Count a well-formed message that has no business on this socket."""
        self._drop(f"unexpected {type(incoming.msg).__name__}")

    # ------------------------------------------------------------------ send

    def send(self, msg: Any, payload: Sequence[Any] = (), to: bytes | Sequence[bytes] | None = None) -> bool:
        """Sends without blocking; `to` is a ROUTER peer's identity (or a whole envelope)."""
        frames = self.codec.encode(msg, payload)
        if self.router:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER send needs a peer identity")
            envelope = [to] if isinstance(to, bytes) else list(to)
            frames = envelope + frames
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=not payload)
            return True
        except zmq.Again:
            self.send_dropped += 1
            log.debug("%s: queue full, dropped %s (%d so far)", self.name, type(msg).__name__, self.send_dropped)
            return False
        except zmq.ZMQError as exc:
            self.send_dropped += 1
            log.debug("%s: could not send %s: %s", self.name, type(msg).__name__, exc)
            return False

    def reply(self, incoming: Incoming, msg: Any, payload: Sequence[Any] = ()) -> bool:
        return self.send(msg, payload, to=incoming.envelope if self.router else None)


def poll_ms(deadline: float, now: float) -> int:
    """A zmq poll timeout that wakes at `deadline` (time.monotonic() seconds), not before: whole milliseconds
    rounded up (pyzmq truncates a float, and a loop polling 0 ms until its deadline spins), 0 once past."""
    return max(0, math.ceil((deadline - now) * 1000))


def _bytes_view(frame: Any):
    return frame.buffer if hasattr(frame, "buffer") else frame


def _bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)
