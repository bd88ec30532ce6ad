"""The control messages of DeadPool's wire protocol: controller <-> agent <-> worker, as frozen dataclasses.

dpcommon.protocol encodes them, says which channel each travels on and re-exports them (`p.Heartbeat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

NO_RANK = -1  # node_rank / step value meaning "none"

# Closed sets of values: the codec refuses any other.
# WorkerStatus.activity
Activity = Literal["compute", "collective", "snapshot", "finishing", "recovering", "rendezvous", "idle"]
RestoredFrom = Literal["", "local", "replica", "init", "restart"]  # WorkerReady.restored_from
Role = Literal["active", "spare"]  # Welcome.role
FaultKind = Literal["kill-node", "kill-worker", "freeze-node", "wake-node", "hang-worker", "kill-spare",
                    "corrupt-replicas"]  # Inject.kind; what each does: dprun.controller.faults.KINDS


# ----------------------------------------------------------------------------- agent -> controller


@dataclass(frozen=True)
class JobTerms:
    """What a node's dprun was told of the job, for the controller to check against its own
    (dprun.controller.admission). A bare dpagent was told nothing: nnodes 0, rdzv_id "", script []."""

    nnodes: int = 0
    rdzv_id: str = ""
    script: list[str] = field(default_factory=list)  # the script and its arguments


@dataclass(frozen=True)
class Register:
    """An agent announces itself. `want_spare` and `node_rank` are hints the controller may honour."""

    node_id: str
    host: str
    pid: int
    nproc: int
    want_spare: bool
    node_rank: int  # NO_RANK when the agent has no preference
    replica_endpoint: str  # tcp:// address of the agent's replica store
    terms: JobTerms = field(default_factory=JobTerms)


@dataclass(frozen=True)
class WorkerSummary:
    """A worker's latest WorkerStatus as its agent's Heartbeat carries it (no message of its own): with its age in
    seconds (a stopped or wedged worker's grows) and its pid on the node's host (0: the agent has no such worker)."""

    activity: Activity
    rank: int = NO_RANK
    step: int = NO_RANK
    age: float = 0.0
    room: int = 0
    pid: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """`workers`: str(local_rank) -> that worker's WorkerSummary: the controller's hang evidence."""

    node_id: str
    generation: int
    workers: dict[str, WorkerSummary] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A summary may be given as its JSON object, as tests and tools write one; the codec builds (and checks)
        # those it decodes itself.
        if any(isinstance(summary, dict) for summary in self.workers.values()):
            built = {local: WorkerSummary(**summary) if isinstance(summary, dict) else summary
                     for local, summary in self.workers.items()}
            object.__setattr__(self, "workers", built)


@dataclass(frozen=True)
class Pong:
    node_id: str
    seq: int


@dataclass(frozen=True)
class WorkerExited:
    """A local worker process ended; exitcode < 0 is -signal, as in subprocess.

    detail: its last line of stderr (or how it ended); stderr_tail: its last lines of stderr when it failed;
    log_path: its stderr log file under --log-dir, if any (for the job's failure summary);
    raised: for one that crashed (SIGABRT, SIGSEGV) after printing a Python traceback, the exception's line:
    the script raised, as with an exit code of 1 (dpagent.output.crash_exception);
    oom_killed: its SIGKILL came from the kernel's OOM killer, as its memory cgroup counted (dpagent.oom);
    step: the newest step it made, as its agent heard (its Progress, or the step it restored for its WorkerReady),
    in whichever generation: NO_RANK if none. The agent's `generation` may be newer than the one it trained in.
    """

    node_id: str
    generation: int
    local_rank: int
    pid: int
    exitcode: int
    detail: str = ""
    stderr_tail: str = ""
    log_path: str = ""
    raised: str = ""
    oom_killed: bool = False
    step: int = NO_RANK


@dataclass(frozen=True)
class AgentExited:
    """From a member node's dprun: its agent died of a signal (the OOM killer, a kill -9, a crash), so it could not
    say so itself. The controller fails the node at once, for that (as a standalone job's dprun tells it of its
    own agents), not at the heartbeat timeout."""

    node_id: str
    how: str  # describe_exit(), or OOM_KILLED


@dataclass(frozen=True)
class Leaving:
    """The agent stops on its own, not told to by a Stop: the dprun that ran it died (a member node's), or it got
    a stop signal the job did not share. The controller fails the node at once, for that reason (not at its
    heartbeat timeout, nor for its workers' exit codes); a fenced node whose store stayed loses it."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class SnapshotStored:
    """A replica store (on node `node_id`) holds a complete snapshot of `rank` at `step`."""

    node_id: str
    rank: int
    step: int
    generation: int
    nbytes: int = 0  # the snapshot's size (meta + data): what a spare taking this rank over must make room for


# ----------------------------------------------------------------------------- worker -> agent (-> controller)


@dataclass(frozen=True)
class Hello:
    """First message of a worker to its agent."""

    node_id: str
    local_rank: int
    pid: int


@dataclass(frozen=True)
class Progress:
    """A rank completed training step `step` in `generation`; `snapshot`: it snapshots that step (its capture
    has begun). The controller learns the snapshot grid from these too, not only from replica reports, which
    die with their holder."""

    node_id: str
    generation: int
    rank: int
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)  # step.log()'s, JSON values (dpstate.steps.metrics)
    snapshot: bool = False


@dataclass(frozen=True)
class WorkerReady:
    """A rank rebuilt its communicators and restored its state for `generation`."""

    node_id: str
    generation: int
    rank: int
    rebuild_s: float
    restore_s: float
    restored_from: RestoredFrom = ""  # "" for a fresh start; "restart": a restart mode worker started anew
    mesh: str = ""  # the layout of job.parallelize ("pp=2 x dp=2 x tp=2"), "" for a data parallel or plain job


@dataclass(frozen=True)
class PeerError:
    """A rank's collective failed with a peer error: a hint for the controller to probe now."""

    node_id: str
    generation: int
    rank: int
    detail: str


@dataclass(frozen=True)
class WorkerStatus:
    """Worker -> its agent only, every heartbeat interval from the worker's control thread.

    activity: "compute" (in the step body), "collective" (waiting on peers), "snapshot" (waiting for a
    replica ack), "finishing" (past its last step, at the final barrier), "recovering", "rendezvous" (arrived
    at a new generation's group, waiting for every other rank to), "idle" (spare, or between steps).
    room: bytes a spare's worker has reserved and faulted in for its restore (Standby), 0 if none.
    """

    node_id: str
    local_rank: int
    rank: int
    generation: int
    step: int
    activity: Activity
    room: int = 0


@dataclass(frozen=True)
class RestoreFailed:
    """A rank could not restore `step` from `source` (missing, corrupt): the controller drops that copy
    and plans again; the worker waits for the next Reconfigure."""

    node_id: str
    generation: int
    rank: int
    step: int
    source: str
    reason: str


@dataclass(frozen=True)
class Diverged:
    """A replica holder found `rank`'s data parallel state at `step` unlike its own node's copy (`blocks`: the
    first blocks that differ): a rank whose parameters drift from its peers' (dpstate.snapshot.checks). Said once."""

    node_id: str
    generation: int
    rank: int
    step: int
    blocks: list[int]


@dataclass(frozen=True)
class RankFinished:
    """A rank passed the final barrier after its last step: its work is done and kept."""

    node_id: str
    generation: int
    rank: int
    step: int


# ----------------------------------------------------------------------------- controller -> agent (-> worker)


@dataclass(frozen=True)
class Welcome:
    """Registration accepted, as an active node or a spare; the node rank comes with Reconfigure."""

    node_id: str
    role: Role
    job_id: str
    heartbeat_interval: float
    heartbeat_timeout: float
    prespawn: bool = True  # start workers now (dpstate scripts wait in init()); False: only on Reconfigure
    save_dir: str = ""  # the job's --save-dir: where this node writes its copies should it lose the controller
    world_size: int = 0  # the job's ranks (the manifests of what this node saves name it)


@dataclass(frozen=True)
class Reconfigure:
    """Join generation `generation` as node `node_rank`. One per recipient node, O(1) in size.

    restart_workers: for scripts that do not use dpstate (restart mode), the agent kills its workers
    (without reporting those exits), starts new ones with RANK/WORLD_SIZE/MASTER_ADDR... in their
    environment, and reports WorkerReady(restored_from="restart") for each once started.

    restore_step: NO_RANK for a fresh start, else every rank loads its state at that step.
    restore_from: for each snapshot this node's processes restore (keyed by the rank that took it), the replica
    endpoint that holds it at restore_step, or "" when the rank's own process may have it locally (a survivor).
    replica_to: the replica endpoint where this node's ranks send their snapshots from now on.
    carry: a narrow job (dprun.controller.narrowing): for each process rank, the logical data-parallel ranks it
    trains, its own first; world_size then counts processes. Empty at full width (process rank = logical rank).
    A process's own logical rank is the one its messages and snapshots carry.
    adopt_from: for each logical rank that one of this node's processes trains and did not before, the rank
    whose snapshot at restore_step holds it (dpstate.snapshot.rank_parts).
    """

    generation: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    world_size: int
    restore_step: int
    store_endpoint: str  # host:port of the torch TCPStore
    replica_to: str
    restore_from: dict[str, str] = field(default_factory=dict)  # str(rank) -> endpoint
    reason: str = ""
    replica_also: list[str] = field(default_factory=list)  # --replicas > 1: further endpoints to send snapshots to
    restore_also: dict[str, list[str]] = field(default_factory=dict)  # str(rank) -> further endpoints with it
    restart_workers: bool = False  # restart mode: kill this node's workers and start fresh ones, ranks in env
    carry: list[list[int]] = field(default_factory=list)  # process rank -> its logical ranks (narrow only)
    adopt_from: dict[str, int] = field(default_factory=dict)  # str(logical rank new here) -> snapshot holding it


@dataclass(frozen=True)
class Stop:
    """Stop all workers and exit. Sent at the end of a job and to fence a failed node. keep_store: stop the
    workers but stay, the replica store serving (Ping, SaveSnapshots), until a Stop without it."""

    reason: str
    exit_code: int = 0
    keep_store: bool = False


@dataclass(frozen=True)
class Demote:
    """To a live node that leaves the layout with its data-parallel replica (a sharded job's shrink): its workers
    are replaced by fresh spare ones, which wait set up as any spare's do; its store keeps what it holds."""

    reason: str


@dataclass(frozen=True)
class Ping:
    seq: int


@dataclass(frozen=True)
class Standby:
    """To a spare (and relayed to its workers): the largest snapshot of each local rank on any node, in bytes
    (meta + data), so that each worker makes room for its restore while idle, not after a failure."""

    snapshot_bytes: list[int]  # local rank -> bytes


@dataclass(frozen=True)
class SaveSnapshots:
    """The job is stopping, or with `background`, saves as it trains: write the snapshots of `ranks` at `step` as
    files in `directory`
    (dpcommon.snapshot_files): those this node's replica store holds, or with `local`, relayed to the node's
    workers, their own local copies (a rank whose every replica died with its holder). Each answers with
    SnapshotFiles. `step` NO_RANK (from an agent that lost its controller, to its workers): every step each
    holds, each into `directory`/step-S."""

    directory: str
    step: int
    ranks: list[int]
    local: bool = False
    world_size: int = 0  # the job's, for the manifest part written after the files (dpcommon.save_manifest)
    background: bool = False  # a save while training goes on (--save-every): no worker is stopped for it
    keep: int = 0  # background: then prune `directory`'s parent to its newest `keep` complete steps (0: do not)


@dataclass(frozen=True)
class LoadSnapshots:
    """A job resumed from files: read `ranks`' snapshot files of `step` from `directory` into this node's
    replica store (each reported with SnapshotStored, as a replica would be), then answer SnapshotFiles."""

    directory: str
    step: int
    ranks: list[int]
    generation: int = 0  # the copies' generation: 0 for a resumed job, the new one for a recovery from disk


@dataclass(frozen=True)
class SnapshotFiles:
    """The answer to SaveSnapshots / LoadSnapshots (an agent's, or a worker's for its own rank): for each rank
    asked, "" when its file was written or read, else why not."""

    node_id: str
    step: int
    results: dict[str, str]  # str(rank) -> "" or the error
    steps: list[int] = field(default_factory=list)  # for a SaveSnapshots of every step held: those written


@dataclass(frozen=True)
class Inject:
    """Fault injection, carried out by the agent on itself: kill-node, kill-worker, ..."""

    kind: FaultKind
    local_rank: int = 0
