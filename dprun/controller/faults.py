"""Fault injection specs (`--inject KIND:NODE@TRIGGER`): parsing and when each one fires.

Pure logic: the controller asks `due()` with what it knows (steps per node rank, time, recoveries).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass

from dpcommon.protocol import FaultKind

KINDS: dict[FaultKind, str] = {  # one per FaultKind (a test checks)
    "kill-node": "SIGKILL the node's agent and workers together",
    "kill-worker": "SIGKILL one worker of the node (local rank 0, or NODE.LOCAL)",
    "freeze-node": "SIGSTOP the node's agent and workers (a hung kernel or a partition); never woken by itself",
    "wake-node": "SIGCONT the node that was frozen at that node rank (standalone mode: the head sends it)",
    "hang-worker": "SIGSTOP one worker: alive, no progress (caught by --hang-timeout)",
    "kill-spare": "SIGKILL a spare (NODE counts the spares in order of registration)",
    "corrupt-replicas": "flip a byte in every snapshot the node's replica store holds (a restore must notice)",
}
TRIGGERS = {
    "step=N": "when the job reaches step N (the first rank to report it; faults naming the same step fire together)",
    "t=SECONDS": "SECONDS after training starts",
    "during-recovery": "as the next recovery begins (the new generation is planned, sent right after the fault)",
}

_SPEC = re.compile(
    r"^(?P<kind>[a-z-]+):(?P<node>\d+)(?:\.(?P<local>\d+))?"
    r"@(?:(?P<trigger>step|t)=(?P<value>\d+(?:\.\d+)?)|(?P<recovery>during-recovery))$"
)

class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    node_rank: int  # for kill-spare: index among the spares
    trigger: str  # "step", "t" or "during-recovery"
    value: float = 0.0
    local_rank: int = 0

    def __str__(self) -> str:
        local = f".{self.local_rank}" if self.local_rank else ""
        if self.trigger == "during-recovery":
            return f"{self.kind}:{self.node_rank}{local}@during-recovery"
        return f"{self.kind}:{self.node_rank}{local}@{self.trigger}={self.value:g}"  # as typed: step=8, t=2.5

    @property
    def on_spare(self) -> bool:
        return self.kind == "kill-spare"


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if not match:
        raise FaultSpecError(f"bad --inject {text!r}: expected KIND:NODE@step=N, KIND:NODE@t=SECONDS or "
                             "KIND:NODE@during-recovery, e.g. kill-node:1@step=20")
    kind = typing.cast(FaultKind, match["kind"])
    if kind not in KINDS:
        raise FaultSpecError(f"bad --inject {text!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if match["recovery"]:
        return FaultSpec(kind, int(match["node"]), "during-recovery", 0.0, int(match["local"] or 0))
    trigger, value = match["trigger"], float(match["value"])
    if trigger == "step" and not value.is_integer():
        raise FaultSpecError(f"bad --inject {text!r}: step must be a whole number")
    return FaultSpec(kind, int(match["node"]), trigger, value, int(match["local"] or 0))


class FaultPlan:
    """The faults still to fire; each fires once."""

    def __init__(self, specs: list[FaultSpec]):
        self.pending = list(specs)

    def due(self, step_of_node_rank: dict[int, int], seconds_since_start: float | None,
            recovering: bool = False) -> list[FaultSpec]:
        """The faults to fire now (removed from the plan). A step trigger looks at the newest step any node
        rank reported, so `kill-node:1@step=8 --inject kill-node:2@step=8` kills both nodes at once."""
        fired = []
        job_step = max(step_of_node_rank.values(), default=-1)
        for spec in self.pending:
            if spec.trigger == "step":
                ready = job_step >= spec.value
            elif spec.trigger == "t":
                ready = seconds_since_start is not None and seconds_since_start >= spec.value
            else:
                ready = recovering
            if ready:
                fired.append(spec)
        for spec in fired:
            self.pending.remove(spec)
        return fired
