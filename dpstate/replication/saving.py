"""A stopping job's own copy of a rank: where no replica of a rank is left (its holder died), the rank's worker
writes its local snapshot of the step the controller names (SaveSnapshots, local=True) as a file, or, when its
agent lost the controller, every step it holds."""

from __future__ import annotations

from typing import Any, Callable

from dpcommon import protocol as P
from dpcommon.snapshot_files import cannot_write, finish_files, step_folder, write_snapshot


def save_local(replicator: Any, msg: P.SaveSnapshots, rank: int, node_id: str,
               send: Callable[[P.SnapshotFiles], Any]) -> None:
    """If msg asks for this rank: write its local snapshot of msg.step into msg.directory (of every step it
    holds, each into msg.directory/step-S, for msg.step NO_RANK) and `send` the answer."""
    if rank not in msg.ranks:
        return
    writer = f"rank-{rank}"
    if msg.step != P.NO_RANK:
        error = _write(replicator, msg.directory, rank, msg.step)
        error = finish_files(msg.directory, msg.step, {str(rank): error}, msg.world_size, writer)[str(rank)]
        send(P.SnapshotFiles(node_id, msg.step, {str(rank): error}))
        return
    written: list[int] = []  # the steps written
    errors: list[str] = []  # why the others were not
    for step in replicator.local_steps():
        folder = step_folder(msg.directory, step)
        error = _write(replicator, folder, rank, step)
        error = finish_files(folder, step, {str(rank): error}, msg.world_size, writer)[str(rank)]
        if error:
            errors.append(error)
        else:
            written.append(step)
    send(P.SnapshotFiles(node_id, msg.step, {str(rank): "; ".join(errors)}, steps=written))


def _write(replicator: Any, folder: Any, rank: int, step: int) -> str:
    """Write this rank's local snapshot of `step` as a file in `folder`: "" or why not."""
    with replicator.holding(step) as slot:  # training may go on meanwhile (a first SIGTERM): not into this slot
        if slot is None:
            return f"rank {rank} no longer holds step {step} (it holds {replicator.local_steps()})"
        try:
            write_snapshot(folder, rank, step, slot.checksum, slot.meta, [slot.data.numpy()])
        except OSError as exc:
            return cannot_write(rank, exc)
    return ""
