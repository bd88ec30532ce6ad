"""Heartbeat timers between an agent and its controller, paranoid-pirate style (the ZeroMQ guide).

Pure: the caller passes the clock. We beat every `interval`; the peer is lost after `timeout` of silence.
"""

from __future__ import annotations

PAUSED_AFTER_S = 1.0  # a loop turn this much later than due: its process did not run (agent and controller)


class Liveness:
    def __init__(self, interval: float, timeout: float, now: float):
        if interval <= 0 or timeout <= 0:
            raise ValueError("heartbeat interval and timeout must be positive")
        self.interval = interval
        self.timeout = timeout
        self.last_heard = now
        self.next_beat = now  # the first beat goes out at once
        self._turned = now

    def turned(self, now: float) -> None:
        """A turn of the owner's loop, which turns at least every `interval`: one that comes much later means
        this process did not run (SIGSTOP, its host paused, starved of CPU), and that silence was not the
        peer's: it is not counted against it."""
        gap, self._turned = now - self._turned, now
        if gap > self.interval + PAUSED_AFTER_S:
            self.last_heard = min(now, self.last_heard + gap - self.interval)

    def heard(self, now: float) -> None:
        """Anything valid arrived from the peer."""
        self.last_heard = now

    def beat_due(self, now: float) -> bool:
        return now >= self.next_beat

    def beat_sent(self, now: float) -> None:
        self.next_beat = now + self.interval

    def lost(self, now: float) -> bool:
        return now - self.last_heard >= self.timeout

    def silent_for(self, now: float) -> float:
        return now - self.last_heard

    def next_deadline(self) -> float:
        """The next moment something is due: a beat or the loss deadline."""
        return min(self.next_beat, self.last_heard + self.timeout)
