"""What a spare is told to prepare while it idles: the largest snapshot of each local rank on any node, so that
its workers make room for a restore before a failure instead of after it (pure logic, used by the controller).
"""

from __future__ import annotations

from dpcommon import protocol as p

ROUND_BYTES = 1 << 20
MAX_HEADROOM = 16 << 20


def with_headroom(nbytes: int) -> int:
    """What to reserve for a snapshot of `nbytes`: 1/64 more (at most 16 MiB), in whole MiB. A snapshot's meta
    grows by a few bytes now and then (step numbers, the check plan), which must not send spares a new size."""
    return -(-(nbytes + min(nbytes // 64, MAX_HEADROOM) + 1) // ROUND_BYTES) * ROUND_BYTES


class SpareSizing:
    """The room a spare's worker makes per local rank: the largest snapshot stored (SnapshotStored) with
    headroom; it grows only when a snapshot outgrows it, and spares hear of it then."""

    def __init__(self, nproc_per_node: int):
        self.snapshot_bytes = [0] * nproc_per_node

    def stored(self, rank: int, nbytes: int) -> bool:
        """Take in one stored snapshot's size; True when it outgrew its local rank's room (tell the spares)."""
        local = rank % len(self.snapshot_bytes)
        if nbytes <= self.snapshot_bytes[local]:
            return False
        self.snapshot_bytes[local] = with_headroom(nbytes)
        return True

    def message(self) -> p.Standby | None:
        """What to send a spare now (None: no snapshot size known yet)."""
        return p.Standby(snapshot_bytes=list(self.snapshot_bytes)) if any(self.snapshot_bytes) else None
