"""The chunks of snapshots streamed to this replica store while their senders capture them (SnapshotPart), kept
until the PutSnapshot that closes each (parts > 0) takes them: one snapshot on its way per sender and rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpcommon.protocol import PutSnapshot, SnapshotPart


@dataclass
class _Stream:
    step: int
    generation: int
    frames: list = field(default_factory=list)  # as received: the store keeps them, no copy
    broken: str = ""  # why its put will be refused (a part missing or out of order)


class StreamedPuts:
    """Parts are kept as they arrive, in order; a put takes its sender's parts of its rank and step. A stream that
    a newer one of the same sender and rank replaces (its put never came: the sender moved on, or died and came
    back) is dropped with its frames."""

    def __init__(self) -> None:
        self._streams: dict[tuple[Any, int], _Stream] = {}  # (sender, rank) -> the snapshot on its way

    def add(self, sender: Any, part: SnapshotPart, payload: list) -> None:
        key = (sender, part.rank)
        stream = self._streams.get(key)
        if stream is None or (stream.step, stream.generation) != (part.step, part.generation):
            stream = self._streams[key] = _Stream(part.step, part.generation)
        if stream.broken:
            return
        if part.index != len(stream.frames) or len(payload) != 1:
            stream.broken = (f"part {part.index} came after {len(stream.frames)} parts, with {len(payload)} "
                             "payload frames")
            stream.frames = []  # the memory goes now: its put is refused and the sender sends the snapshot whole
            return
        stream.frames.append(payload[0])

    def take(self, sender: Any, put: PutSnapshot) -> list | str:
        """The data frames of `put` (parts > 0) in order, or why they cannot be had."""
        stream = self._streams.pop((sender, put.rank), None)
        if stream is None or (stream.step, stream.generation) != (put.step, put.generation):
            return f"none of the {put.parts} parts of rank {put.rank} step {put.step} came"
        if stream.broken:
            return stream.broken
        if len(stream.frames) != put.parts:
            return f"{len(stream.frames)} of the {put.parts} parts of rank {put.rank} step {put.step} came"
        return stream.frames

    def pending(self) -> int:
        """Snapshots on their way (for tests and the log)."""
        return len(self._streams)
