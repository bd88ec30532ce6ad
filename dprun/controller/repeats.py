"""Failures that follow the work, not the machine: a worker that exits with the same error on two nodes at the
same step (a rank again on the spare that replaced its node, or several ranks at once) is a bug in the
training script or its data, which no spare can fix. Pure bookkeeping for the controller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dpcommon.exit_wording import OOM_KILLED, the_script_s_exit

HUNG = "no progress within --hang-timeout"  # a rank failed as hung (not an exit): the script's, where it follows
STEP_SLACK = 1  # steps apart that still count as "the same step": a rank reports its step after making it
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")  # what torch puts before each line a distributed rank prints
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def without_rank_prefix(line: str) -> str:
    """A line a rank printed, without the "[rankN]: " torch put before it (once or more)."""
    return _RANK_PREFIX.sub("", line.strip())


def signature(exitcode: int, detail: str) -> str | None:
    """What makes two exits the same failure: the exit code and the last line of stderr, without the rank
    prefix and memory addresses. None for a signal from outside (a kill -9, Slurm's): that says nothing of the
    script; but the kernel's OOM killer (detail OOM_KILLED, as its cgroup counted it) does: out of memory again
    where the spare took over, at the same step, is the script's appetite. None too for a worker that ended itself
    because the backend never released an old generation's collective (EXIT_UNRELEASED)."""
    if detail in (OOM_KILLED, HUNG):
        return detail
    if not the_script_s_exit(exitcode):
        return None
    line = _ADDRESS.sub("0x?", without_rank_prefix(detail))
    return f"exit code {exitcode}: {line}" if line and line != f"exit code {exitcode}" else f"exit code {exitcode}"


@dataclass(frozen=True)
class Sighting:
    node_id: str
    rank: int
    step: int  # the newest step the job had made when it struck

    def where(self) -> str:
        return f"rank {self.rank} on {self.node_id}" if self.rank >= 0 else f"{self.node_id} (no rank)"


class RepeatedFailures:
    """The failures seen so far, by signature: `seen` says when one strikes a second node at the same step."""

    def __init__(self) -> None:
        self._seen: dict[str, Sighting] = {}

    def seen(self, exitcode: int, detail: str, node_id: str, rank: int, step: int) -> str | None:
        """Record a worker's exit (rank on node_id, after the job's step `step`). If the same failure struck
        another node at about the same step, the job's end message saying so; else None."""
        key = signature(exitcode, detail)
        if key is None:
            return None
        earlier = self._seen.get(key)
        if (earlier is None or earlier.node_id == node_id or abs(earlier.step - step) > STEP_SLACK
                or max(earlier.rank, rank) < 0):  # spares alike (their environment?): the ranks train on
            self._seen[key] = Sighting(node_id, rank, step)
            return None
        if earlier.rank == rank >= 0:
            where = f"rank {rank} failed on {earlier.node_id} and again on {node_id}, which took its place"
        else:
            where = f"{earlier.where()} and {Sighting(node_id, rank, step).where()} failed"
        why = {OOM_KILLED: "the training script needs more memory at that step than a node gives it, and a spare "
                           "cannot fix that; make it need less (a smaller batch, say) and rerun",
               HUNG: "a rank that hangs again at the same step on another node most likely waits in the training "
                     "script for something that never comes (py-spy dump --pid PID shows where); fix it and rerun",
               }.get(key, "an error that recurs on another node at the same step is most likely in the training "
                          "script or its data, and a spare cannot fix it; fix it and rerun")
        return f"{where}, the same way after step {min(earlier.step, step)} ({key}): {why}"
