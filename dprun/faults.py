"""Fault injection specs (`--inject KIND:NODE@TRIGGER`): parsing and when each one fires.

Pure logic: the controller asks `due()` with what it knows (steps per node rank, time since start).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = {
    "kill-node": "SIGKILL the node's agent and workers together",
    "kill-worker": "SIGKILL one worker of the node (local rank 0, or NODE.LOCAL)",
}

_SPEC = re.compile(r"^(?P<kind>[a-z-]+):(?P<node>\d+)(?:\.(?P<local>\d+))?@(?P<trigger>step|t)=(?P<value>\d+(?:\.\d+)?)$")

HELP = (
    "Inject a fault, KIND:NODE@TRIGGER (repeatable). KIND: "
    + ", ".join(f"{k} ({v})" for k, v in KINDS.items())
    + ". NODE: the active node rank. TRIGGER: step=N (when that node reports step N) or t=SECONDS after"
    " training starts. Example: kill-node:1@step=20"
)


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    node_rank: int
    trigger: str  # "step" or "t"
    value: float
    local_rank: int = 0

    def __str__(self) -> str:
        local = f".{self.local_rank}" if self.local_rank else ""
        value = int(self.value) if self.trigger == "step" else self.value
        return f"{self.kind}:{self.node_rank}{local}@{self.trigger}={value}"


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if not match:
        raise FaultSpecError(f"bad --inject {text!r}: expected KIND:NODE@step=N or KIND:NODE@t=SECONDS, e.g. kill-node:1@step=20")
    kind = match["kind"]
    if kind not in KINDS:
        raise FaultSpecError(f"bad --inject {text!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    trigger = match["trigger"]
    value = float(match["value"])
    if trigger == "step" and not value.is_integer():
        raise FaultSpecError(f"bad --inject {text!r}: step must be a whole number")
    return FaultSpec(kind, int(match["node"]), trigger, value, int(match["local"] or 0))


class FaultPlan:
    """The faults still to fire; each fires once."""

    def __init__(self, specs: list[FaultSpec]):
        self.pending = list(specs)

    def due(self, step_of_node_rank: dict[int, int], seconds_since_start: float | None) -> list[FaultSpec]:
        fired = []
        for spec in self.pending:
            if spec.trigger == "step":
                ready = step_of_node_rank.get(spec.node_rank, -1) >= spec.value
            else:
                ready = seconds_since_start is not None and seconds_since_start >= spec.value
            if ready:
                fired.append(spec)
        for spec in fired:
            self.pending.remove(spec)
        return fired
