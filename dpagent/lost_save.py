"""What an agent that lost its controller leaves on disk: every copy its replica store holds and, asked of its
workers, their own snapshots, each in the job's --save-dir/step-S, before it kills them and exits 3.

The controller is one process on the first node: if that node dies, its agents' copies would die with them.
A step-S folder that every rank wrote to is what `dprun --resume-from` goes on from (it picks the newest).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dpcommon.protocol import NO_RANK, SaveSnapshots, SnapshotFiles
from dpcommon.replica_store import ReplicaStore
from dpcommon.snapshot_files import rank_file, save_held, step_folder

log = logging.getLogger("dpagent")


@dataclass
class LostSave:
    """A save under way after the controller was lost: the workers' answers awaited, what was written."""

    directory: str
    waiting: set[int]  # global ranks of this node's live workers that have not answered yet
    world_size: int  # the job's (for the manifests: dpcommon.save_manifest)
    writer: str  # this node's id, which names its manifest parts
    written: dict[str, list[int]] = field(default_factory=dict)  # "rank R (held)" / "(own)" -> steps
    errors: list[str] = field(default_factory=list)
    warned: bool = False  # told that a second signal cuts it short

    def request(self) -> SaveSnapshots:
        """To this node's workers: every step each holds, each into directory/step-S."""
        return SaveSnapshots(self.directory, NO_RANK, sorted(self.waiting), local=True, world_size=self.world_size)

    def answered(self, msg: SnapshotFiles) -> None:
        for rank, error in msg.results.items():
            self.waiting.discard(int(rank))
            if msg.steps:
                self.written[f"rank {rank} (own)"] = sorted(msg.steps)
            if error:
                self.errors.append(error)

    def summary(self) -> str:
        """One line for the log: what is on disk now, and how to go on from it."""
        missing = f"; not written: {', '.join(f'rank {r}' for r in sorted(self.waiting))}" if self.waiting else ""
        failed = f"; errors: {'; '.join(self.errors)}" if self.errors else ""
        if not self.written:
            if not missing and not failed:  # a spare, or a node whose workers had no snapshot yet
                return f"this node held no snapshot to write to {self.directory}"
            return f"nothing written to {self.directory}{missing}{failed}"
        what = "; ".join(f"{who} step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
                         for who, steps in sorted(self.written.items()))
        return (f"wrote {what} to {self.directory}{missing}{failed}; once every rank's file of a step is there "
                f"(other nodes write theirs), go on with: dprun ... --resume-from {self.directory}")


def save_store(store: ReplicaStore, save: LostSave) -> None:
    """Write every copy `store` holds into save.directory/step-S, but those a file already exists for (another
    node holding the same copy wrote it: files are written whole or not at all) and those gone stale (kept by
    reference to this node's own snapshot, which its worker has written over since)."""
    by_step: dict[int, list[int]] = {}
    for rank in store.ranks():
        for step in store.steps(rank):
            if store.get(rank, step) is not None and not rank_file(step_folder(save.directory, step), rank).exists():
                by_step.setdefault(step, []).append(rank)
    for step, ranks in sorted(by_step.items()):
        results = save_held(store, step_folder(save.directory, step), step, ranks, save.world_size, save.writer)
        for who, error in sorted(results.items()):  # (keyed by str(rank))
            if error:
                save.errors.append(error)
            else:
                save.written.setdefault(f"rank {who} (held)", []).append(step)
