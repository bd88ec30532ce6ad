"""The snapshot sender's connections to replica holders, each watched by a ZeroMQ socket monitor, so that a holder
whose process died (its kernel closed the connection) fails the delivery in a second instead of never acking.

A rank that waits at the snapshot gate for a dead holder's ack enters no collective, so no collective error tells
anyone of the death: without this, only the holder node's heartbeat timeout did (measured: a SIGKILLed node
under --heartbeat-timeout 5 took 5.0 s to detect; with this, the controller's probe after the rank's PeerError).
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from dpstate.steps.abort import HOLDER_GONE_MARKER
from .fetch import ReplicationError

GONE_AFTER_S = 1.0  # a holder's connection down this long (ZeroMQ retries every 100 ms): its process is gone
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class HolderGone(ReplicationError):
    """A replica holder closed its connection before acking a snapshot and did not come back: its node is probably
    down. dpstate.steps.abort.classify counts it as a peer's failure: the rank reports it (PeerError) and the controller
    probes every node, failing the holder's unless it answers."""

    def __init__(self, endpoint: str, rank: int, step: int):
        super().__init__(f"the replica store at {endpoint} {HOLDER_GONE_MARKER} rank {rank} step {step}: its node "
                         "is probably down")


class HolderLink:
    """A DEALER connected to one replica store, and since when its connection is down (None: up, or never up
    yet: a holder still starting is waited for as before)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self.sock.get_monitor_socket(_WATCHED)
        self.sock.connect(endpoint)
        self.down_since: float | None = None

    def gone(self, now: float | None = None) -> bool:
        """Whether the holder's connection closed at least GONE_AFTER_S ago and has not been made again."""
        now = time.monotonic() if now is None else now
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.down_since = self.down_since if self.down_since is not None else now
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since = None
        return self.down_since is not None and now - self.down_since >= GONE_AFTER_S

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)
