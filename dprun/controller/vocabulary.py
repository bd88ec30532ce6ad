"""The controller's vocabulary: the job spec, the inputs it handles and the actions it returns (plain dataclasses,
so a shell or a simulator can drive it), the outbox gathering those actions, and the records of a recovery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dpcommon.protocol import NO_RANK

from .faults import FaultSpec

OnSpareExhausted = Literal["fail", "wait", "shrink"]  # --on-spare-exhausted
ShrinkFallback = Literal["fail", "wait"]  # --shrink-fallback

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class JobSpec:
    nnodes: int
    spares: int
    nproc_per_node: int
    store_endpoint: str
    job_id: str = "deadpool"
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    probe_timeout: float = 1.0
    rdzv_timeout: float = 300.0
    faults: tuple[FaultSpec, ...] = ()
    replicas: int = 1  # replica stores holding each node's snapshots (ring: node ranks r+1 .. r+replicas)
    hang_timeout: float = 0.0  # no step anywhere for this long: find the rank that is not waiting on peers
    # "wait": the survivors wait for a node to join as a spare; "shrink": they go on narrow (controller.narrowing)
    on_spare_exhausted: OnSpareExhausted = "fail"
    shrink_fallback: ShrinkFallback = "fail"  # what "shrink" does where the job cannot shrink (said once)
    spare_wait_timeout: float = 1800.0
    restart_mode: bool = False  # the script does not use dpstate: recover by restarting every worker
    max_restarts: int = 3  # restart mode: restart recoveries allowed (torchrun's --max-restarts)
    save_dir: str = ""  # a job that ends with an error or a signal writes its newest complete state here
    resume_from: str = ""  # ... and one started with this folder of it (save_dir/step-S) goes on from step S
    resume_step: int = -1
    resume_older: tuple[tuple[str, int], ...] = ()  # older complete steps (folder, step), newest first: a resume
    # whose files turn out damaged when read goes on from the next of them
    save_every: int = 0  # background saves into save_dir every N steps (0: off) ...
    save_interval: float = 0.0  # ... and / or at most every so many seconds (0: off)
    save_keep: int = 2  # complete steps kept in save_dir by background saves
    files_timeout: float = 600.0  # for the nodes to write or read those files
    restore_wait: float = 120.0  # state that looks lost while a live node restores it: wait so long for it
    snapshots: bool = True  # False: --snapshot-interval off, so the first failure of a training node ends the job
    # the head's script and arguments, which every node should run (dprun.controller.admission)
    command: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# ----------------------------------------------------------------------------- inputs and actions


@dataclass(frozen=True)
class Received:
    """A decoded message from the agent whose socket identity is `node_id`."""

    node_id: str
    msg: Any


@dataclass(frozen=True)
class NodeGone:
    """The shell saw a node's agent vanish (its process exited, its connection dropped)."""

    node_id: str
    cause: str


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class ConnectionDropped:
    """The shell saw a connection to the controller's socket close (its ZeroMQ monitor): a peer's process may have
    died with its host's kernel still up (killed whole: its process group or cgroup), which then closes its
    connections although none of its processes can say a word."""


@dataclass(frozen=True)
class Paused:
    """The shell's loop did not run for `seconds` (dprun stopped by SIGSTOP or Ctrl-Z, its VM paused, starved of
    CPU): the silence its nodes seem to have kept meanwhile was the controller's own."""

    seconds: float


@dataclass(frozen=True)
class Shutdown:
    """The launcher was told to stop (a signal, a user's Ctrl-C): stop every node and end the job."""

    exit_code: int
    reason: str


@dataclass(frozen=True)
class Send:
    node_id: str
    msg: Any


@dataclass(frozen=True)
class Publish:
    event: dict


@dataclass(frozen=True)
class WakeNode:
    """Fault injection's wake-node: continue (SIGCONT) the node frozen by freeze-node. Its agent cannot act, so
    the launcher that started it must: the shell does it where that node runs on its machine, and says so where
    it cannot."""

    node_id: str
    spec: str


@dataclass(frozen=True)
class Finish:
    exit_code: int
    message: str
    saved_in: str = ""  # the step folder the job's state was saved in as it ended (--save-dir), if it was


class Outbox:
    """The actions that handling one input produced, in order: the controller and its parts add to it, and the
    controller hands them back."""

    def __init__(self) -> None:
        self.actions: list[Any] = []

    def send(self, node_id: str, msg: Any) -> None:
        self.actions.append(Send(node_id, msg))

    def publish(self, name: str, **fields: Any) -> None:
        self.actions.append(Publish({"event": name, **fields}))

    def extend(self, actions: list[Any]) -> None:
        self.actions.extend(actions)

    def take(self) -> list[Any]:
        out, self.actions = self.actions, []
        return out


def out_of_range(msg: Any, nproc_per_node: int, world_size: int) -> str | None:
    """Why a message must be dropped that names a local rank or a rank this job does not have (None: it names
    none, or ones it has, or no rank at all)."""
    local_rank = getattr(msg, "local_rank", 0)
    if not 0 <= local_rank < nproc_per_node:
        return f"local_rank {local_rank} out of range"
    rank = getattr(msg, "rank", 0)
    if not NO_RANK <= rank < world_size:  # (NO_RANK: a restart-mode worker that failed before any generation)
        return f"rank {rank} out of range"
    return None


# ----------------------------------------------------------------------------- recovery bookkeeping


@dataclass
class Recovery:
    """One reconstruction, from the first failure it covers to the first step after it."""

    failed: list[str]
    t_fail: float
    t_detect: float
    generation: int = -1
    t_decide: float = 0.0
    restore_step: int = -1
    lost_steps: int = 0
    peak_step: int = 0  # the newest step any rank had reached when this recovery's first failure came
    promoted: dict[int, str] = field(default_factory=dict)  # node rank -> spare node id
    replan: bool = False  # no node to replace, but the plan must change (holder lost, a copy bad)
    waiting_since: float | None = None  # on_spare_exhausted=wait: when waiting for a spare began
    ready: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (rebuild_s, restore_s)
    stepped: set[int] = field(default_factory=set)  # ranks that completed a step after the restore step
    retries: int = 0  # generations planned again with no node lost (a rank failed to connect or restore)
    why: str = ""  # what the last rank that asked for a new plan said
    settle_until: float = 0.0  # a peer error alone: decide no sooner (a dead worker's exit may be on its way)
    probed_for_lost: bool = False  # a plan found state lost and every node was probed once more before ending
    bad_copies: list[str] = field(default_factory=list)  # "rank R step S on NODE: why", as workers reported them
    free_replans: int = 0  # replans owed to a dropped bad copy: they do not count against MAX_REPLANS
    no_local: dict[int, int] = field(default_factory=dict)  # rank -> a step it reported no local copy of (nor older)
    restoring_until: float | None = None  # state looked lost while a live node still restored it: wait so long
    sources: dict[int, str] = field(default_factory=dict)  # the plan's: rank -> holder node id, "" (own copy) or INIT
    from_disk: str = ""  # the step folder every rank went back to (state lost in memory: background saves)
    shrink_refused: str = ""  # --on-spare-exhausted shrink: why this job could not (said once)
    shrunk: list[str] = field(default_factory=list)  # the nodes that left the layout, their ranks trained by others
    undone: list[str] = field(default_factory=list)  # the nodes of a grow not trained yet that left (undo_grow)

    def continued(self) -> "Recovery":
        """A new pending recovery that carries this one on (a failure or a replan before it completed)."""
        return Recovery(failed=list(self.failed), t_fail=self.t_fail, t_detect=self.t_detect,
                        peak_step=self.peak_step, retries=self.retries, bad_copies=list(self.bad_copies),
                        probed_for_lost=self.probed_for_lost, no_local=dict(self.no_local),
                        shrink_refused=self.shrink_refused)


@dataclass
class Flush:
    """A probe round: every node in `waiting` must Pong(seq >= seq) before `deadline`."""

    seq: int
    deadline: float
    waiting: set[str]
