"""A stopping job's own copy of a rank: where no replica of a rank is left (its holder died), the rank's worker
writes its local snapshot of the step the controller names (SaveSnapshots, local=True) as a file."""

from __future__ import annotations

from typing import Any, Callable

from dpagent import protocol as P
from dpagent.snapshot_files import write_snapshot


def save_local(replicator: Any, msg: P.SaveSnapshots, rank: int, node_id: str,
               send: Callable[[P.SnapshotFiles], Any]) -> None:
    """If msg asks for this rank: write its local snapshot of msg.step into msg.directory and `send` the answer."""
    if rank not in msg.ranks:
        return
    slot = replicator.local(msg.step)
    if slot is None:
        error = f"rank {rank} no longer holds step {msg.step} (it holds {replicator.local_steps()})"
    else:
        try:
            write_snapshot(msg.directory, rank, msg.step, slot.checksum, slot.meta, [slot.data.numpy()])
            error = ""
        except OSError as exc:
            error = f"rank {rank}: {exc}"
    send(P.SnapshotFiles(node_id, msg.step, {str(rank): error}))
