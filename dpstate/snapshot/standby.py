"""A spare's worker makes room for its restore while it idles: on Standby (the largest snapshot of its local rank
on any node) the replicator's buffers are reserved and faulted in on a background thread, off the recovery path.
"""

from __future__ import annotations

import sys
import threading

from dpcommon import protocol as P

from dpstate.replication.priority import lower_priority
from dpstate.replication.replicator import Replicator


class RestoreRoom:
    """Owned by a worker's Job: one background reservation at a time, for the newest size its spare was told."""

    def __init__(self, replicator: Replicator, local_rank: int):
        self._replicator, self._local_rank = replicator, local_rank
        self._lock = threading.Lock()
        self._wanted = 0  # the newest size asked for
        self._thread: threading.Thread | None = None
        self.prepared = (0, 0)  # (slots, bytes each) made room in so far

    def on_message(self, msg: P.Standby) -> None:
        """Control's callback (its thread: returns at once)."""
        sizes = msg.snapshot_bytes
        nbytes = sizes[self._local_rank] if self._local_rank < len(sizes) else 0
        with self._lock:
            if nbytes <= self._wanted:
                return
            self._wanted = nbytes
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dpstate-standby", daemon=True)
                self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reservation under way, if any."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        lower_priority(threading.get_native_id())
        done = 0
        while True:
            with self._lock:
                if self._wanted <= done:
                    self._thread = None
                    return
                nbytes = done = self._wanted
            try:
                slots = self._replicator.reserve_ahead(nbytes)
            except Exception as exc:  # noqa: BLE001 (no room: the restore allocates as it would have)
                print(f"dpstate: a spare could not make room for a restore ahead ({exc})", file=sys.stderr, flush=True)
                continue
            if slots:
                self.prepared = (slots, nbytes)
                print(f"dpstate: spare worker {self._local_rank} made room for a restore while idle: "
                      f"{slots} x {nbytes / 1e6:.0f} MB", file=sys.stderr, flush=True)
