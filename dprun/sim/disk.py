"""The simulated job's --save-dir: snapshot files and manifest parts that outlive every node (as
dpcommon.snapshot_files and dpcommon.save_manifest write, read and prune them).

A file holds the state of its rank at the step its copy was of: in the simulator's terms the step itself
(training is deterministic: a rank's state at step S is the same in every timeline), so a file is right when
its content is the step its folder names. Only intact copies are written (write_copies checks each first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dpcommon.snapshot_files import CANNOT_WRITE

NO_SPACE = "[Errno 28] No space left on device"


@dataclass
class SimDisk:
    world_size: int
    files: dict[str, dict[int, int]] = field(default_factory=dict)  # step folder -> rank -> the state its file holds
    manifests: dict[str, set[int]] = field(default_factory=dict)  # step folder -> ranks its manifest parts name
    full: bool = False  # every write fails (as a full disk: ENOSPC)
    pruned: list[str] = field(default_factory=list)  # folders removed by a prune, in order

    def write(self, folder: str, copies: dict[int, int]) -> dict[str, str]:
        """Each copy (rank -> the state it holds) as its rank's file, then the writer's manifest part naming
        those written (write_copies, finish_files): for each rank, "" or why not."""
        if self.full:
            return {str(rank): f"{CANNOT_WRITE} rank {rank}'s file: {NO_SPACE}" for rank in copies}
        self.files.setdefault(folder, {}).update(copies)
        if copies:
            self.manifests.setdefault(folder, set()).update(copies)
        return {str(rank): "" for rank in copies}

    def read(self, folder: str, rank: int, step: int) -> int | str:
        """read_files: the state a rank's file holds, or why it cannot be read."""
        state = self.files.get(folder, {}).get(rank)
        if state is None:
            return f"[Errno 2] No such file or directory: '{folder}/rank-{rank}.dpsnap'"
        if state != step:
            return f"{folder}/rank-{rank}.dpsnap holds rank {rank} step {state}, not rank {rank} step {step}"
        return state

    def complete(self, folder: str) -> bool:
        """Its manifests name a file of every rank, each there (save_manifest.SavedStep.complete)."""
        return (self.manifests.get(folder, set()) >= set(range(self.world_size))
                and set(self.files.get(folder, {})) >= set(range(self.world_size)))

    def complete_steps(self) -> list[tuple[int, str]]:
        """(step, folder) of the complete steps, newest first."""
        return sorted(((_step_of(f), f) for f in self.files if self.complete(f)), reverse=True)

    def prune(self, keep: int) -> list[str]:
        """save_manifest.prune: complete steps past the newest `keep`, and incomplete ones older than the newest
        complete step, go; never the newest complete step nor a step newer than it."""
        complete = self.complete_steps()
        if not complete:
            return []
        newest = complete[0][0]
        doomed = [f for _, f in complete[max(1, keep):]]
        doomed += [f for f in self.files if not self.complete(f) and _step_of(f) < newest]
        for folder in doomed:
            self.files.pop(folder, None)
            self.manifests.pop(folder, None)
        self.pruned += doomed
        return doomed


def _step_of(folder: str) -> int:
    found = re.search(r"step-(\d+)$", folder)
    return int(found[1]) if found else -1
