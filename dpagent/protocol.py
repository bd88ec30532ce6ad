"""The one wire protocol of DeadPool: typed messages, framing, versioning and authentication.

Controller, agents and workers speak it over ZeroMQ; it has no torch and no I/O of its own.

A message travels as ZeroMQ frames::

    [b"DP" + version byte, type name, JSON body, HMAC-SHA256(token, frames 0..2)] + payload frames

Payload frames (snapshot bytes) are not covered by the MAC; the body carries their checksum.
`Codec.decode` refuses anything malformed, oversized, unauthenticated or of another version by
raising `ProtocolError`; callers drop and count such messages and carry on.

Who sends what (the reconstruction protocol of docs/DESIGN.md):

agent -> controller : Register, Heartbeat, Pong, WorkerExited, Leaving, and relayed from workers:
                      Progress, WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged; from its replica
                      store: SnapshotStored
controller -> agent : Welcome, Reconfigure, Stop, Ping, Inject, Standby (to spares), SaveSnapshots (a job
                      that stops) and LoadSnapshots (one resumed from files)  ->  SnapshotFiles
agent -> worker     : Reconfigure, Stop, Standby, SaveSnapshots (relayed)
worker -> agent     : Hello, WorkerStatus (kept by the agent, summarised in its Heartbeat), Progress,
                      WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged, SnapshotFiles
worker -> replica   : PutSnapshot (+ payload frames: meta, then data in chunks; none with held=True)
                      ->  SnapshotAck
worker -> replica   : FetchSnapshot  ->  SnapshotData (+ the meta frame when found), then one
                      SnapshotChunk message per data chunk, in order

Snapshot data travels in chunks of CHUNK_BYTES (the last one shorter), one frame each: a holder's
allocator then reuses a dropped copy's memory chunk by chunk, where one big frame needed one big hole
that the agent's small allocations had often cut into (docs/performance.md, "memory"). A put is one
multipart message (the holder keeps its frames). A fetch's chunks are messages of their own: ZeroMQ hands
over a multipart message only once all of it has arrived, so the fetcher could not copy one chunk into
place while the next was on its way (108 MB: 150-210 ms as one message, 80-100 ms streamed, this host).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from .checksum import CHECKSUM_BLOCK
from .exit_wording import OOM_KILLED, OWN_SIGNALS, describe_end, describe_exit  # (older call sites name them here)

PROTOCOL_VERSION = 19  # 2: PutSnapshot.held; 3: ReserveSnapshot; 4: Progress.snapshot; 5: data in chunks;
#                      6: a fetch's chunks stream as SnapshotChunk messages; 7: dedup (OfferSnapshot, ...);
#                      8: check plans (data parallel blocks sampled: dpagent.checksum.CheckPlan);
#                      9: SnapshotStored.nbytes and Standby (spares reserve snapshot memory while idle);
#                      10: SaveSnapshots, LoadSnapshots, SnapshotFiles (a stopped job's state on disk)
#                      11: Stop.keep_store (a node fenced for its worker's exit keeps its store for a save)
#                      12: Welcome.save_dir, SaveSnapshots of every step held (NO_RANK), SnapshotFiles.steps:
#                          an agent that loses its controller writes its copies to the job's --save-dir
#                      13: WorkerExited.raised (a worker that crashed while it exited on a Python exception)
#                      14: Leaving (an agent that stops on its own says so), refusals (protocol.refusal)
#                      15: WorkerExited.oom_killed (its SIGKILL came from the kernel's OOM killer); AgentExited
#                          (a member's dprun tells the controller that its agent died)
#                      16: WorkerExited.step (the newest step that worker made, as its agent heard)
#                      17: Register.terms (what the node's dprun was told of the job: dprun.admission); Diverged
#                      18: WorkerReady.mesh (a sharded or 3D-parallel job's layout: dpstate.parallel)
#                      19: Welcome.world_size, SaveSnapshots.world_size/background/keep (background saves,
#                          manifests: --save-every),
#                          LoadSnapshots.generation (a running job restored from disk)
MAGIC = b"DP" + bytes([PROTOCOL_VERSION])
MAX_BODY_BYTES = 1 << 20  # control messages are small; snapshot bytes travel as payload frames
NO_RANK = -1  # node_rank / step value meaning "none"
CHUNK_BYTES = 4 << 20  # snapshot data frames; a whole number of dpagent.checksum's blocks


class ProtocolError(ValueError):
    """A message that must be dropped: malformed, unauthenticated, oversized or of another version.
    `refusal`: "token" or "version" where the sender is of another job or DeadPool version (it is told: refusal())."""

    def __init__(self, why: str, refusal: str = ""):
        super().__init__(why)
        self.refusal = refusal


class Refused(ProtocolError):
    """The controller refused this node, whose messages it could not authenticate. A refusal cannot be signed
    with a key the node does not share, so it is not authenticated either: a node heeds it only before its Welcome."""

    def __init__(self, code: str):
        super().__init__(f"refused by the controller: {REFUSALS[code]}")
        self.code = code


REFUSAL = b"DP\x00"  # a refusal's first frame ("version 0", which no protocol version is), then its code
REFUSALS = {
    "token": "its messages fail authentication with the job's token (give every node the same DP_JOB_TOKEN or "
             "--token-file)",
    "version": f"it speaks another protocol version than {PROTOCOL_VERSION} (run the same DeadPool on every node)",
}


def refusal(code: str) -> list[bytes]:
    """The frames that tell a peer why its messages are dropped (a ProtocolError's refusal)."""
    return [REFUSAL, code.encode()]


_REGISTRY: dict[str, type] = {}


def _message(cls):
    cls = dataclass(frozen=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


# ----------------------------------------------------------------------------- agent -> controller


@_message
class Register:
    """An agent announces itself. `want_spare` and `node_rank` are hints the controller may honour. `terms`: what
    its dprun was told of the job ({"nnodes", "rdzv_id", "script"}; empty from a bare dpagent), which the
    controller checks against its own (dprun.admission)."""

    node_id: str
    host: str
    pid: int
    nproc: int
    want_spare: bool
    node_rank: int  # NO_RANK when the agent has no preference
    replica_endpoint: str  # tcp:// address of the agent's replica store
    terms: dict = field(default_factory=dict)


@_message
class Heartbeat:
    """`workers`: str(local_rank) -> {"rank", "step", "activity", "age", "room", "pid"} from each worker's
    latest WorkerStatus (age in seconds; a stopped or wedged worker's age grows; pid on the node's host): the
    controller's hang evidence."""

    node_id: str
    generation: int
    workers: dict = field(default_factory=dict)


@_message
class Pong:
    node_id: str
    seq: int


@_message
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


@_message
class AgentExited:
    """From a member node's dprun: its agent died of a signal (the OOM killer, a kill -9, a crash), so it could not
    say so itself. The controller fails the node at once, for that (as a standalone job's dprun tells it of its
    own agents), not at the heartbeat timeout."""

    node_id: str
    how: str  # describe_exit(), or OOM_KILLED


@_message
class Leaving:
    """The agent stops on its own, not told to by a Stop: the dprun that ran it died (a member node's), or it got
    a stop signal the job did not share. The controller fails the node at once, for that reason (not at its
    heartbeat timeout, nor for its workers' exit codes); a fenced node whose store stayed loses it."""

    node_id: str
    reason: str


@_message
class SnapshotStored:
    """A replica store (on node `node_id`) holds a complete snapshot of `rank` at `step`."""

    node_id: str
    rank: int
    step: int
    generation: int
    nbytes: int = 0  # the snapshot's size (meta + data): what a spare taking this rank over must make room for


# ----------------------------------------------------------------------------- worker -> agent (-> controller)


@_message
class Hello:
    """First message of a worker to its agent."""

    node_id: str
    local_rank: int
    pid: int


@_message
class Progress:
    """A rank completed training step `step` in `generation`; `snapshot`: it snapshots that step (its capture
    has begun). The controller learns the snapshot grid from these too, not only from replica reports, which
    die with their holder."""

    node_id: str
    generation: int
    rank: int
    step: int
    metrics: dict = field(default_factory=dict)
    snapshot: bool = False


@_message
class WorkerReady:
    """A rank rebuilt its communicators and restored its state for `generation`."""

    node_id: str
    generation: int
    rank: int
    rebuild_s: float
    restore_s: float
    restored_from: str = ""  # "local", "replica", "init" or "" for a fresh start
    mesh: str = ""  # the layout of job.parallelize ("pp=2 x dp=2 x tp=2"), "" for a data parallel or plain job


@_message
class PeerError:
    """A rank's collective failed with a peer error: a hint for the controller to probe now."""

    node_id: str
    generation: int
    rank: int
    detail: str


@_message
class WorkerStatus:
    """Worker -> its agent only, every heartbeat interval from the worker's control thread.

    activity: "compute" (in the step body), "collective" (waiting on peers), "snapshot" (waiting for a
    replica ack), "finishing" (past its last step, at the final barrier), "recovering", "idle" (spare, or
    between steps).
    room: bytes a spare's worker has reserved and faulted in for its restore (Standby), 0 if none.
    """

    node_id: str
    local_rank: int
    rank: int
    generation: int
    step: int
    activity: str
    room: int = 0


@_message
class RestoreFailed:
    """A rank could not restore `step` from `source` (missing, corrupt): the controller drops that copy
    and plans again; the worker waits for the next Reconfigure."""

    node_id: str
    generation: int
    rank: int
    step: int
    source: str
    reason: str


@_message
class Diverged:
    """A replica holder found `rank`'s data parallel state at `step` unlike its own node's copy (`blocks`: the
    first blocks that differ): a rank whose parameters drift from its peers' (dpstate.checks). Said once."""

    node_id: str
    generation: int
    rank: int
    step: int
    blocks: list


@_message
class RankFinished:
    """A rank passed the final barrier after its last step: its work is done and kept."""

    node_id: str
    generation: int
    rank: int
    step: int


# ----------------------------------------------------------------------------- controller -> agent (-> worker)


@_message
class Welcome:
    """Registration accepted. role is "active" or "spare"; the node rank comes with Reconfigure."""

    node_id: str
    role: str
    job_id: str
    heartbeat_interval: float
    heartbeat_timeout: float
    prespawn: bool = True  # start workers now (dpstate scripts wait in init()); False: only on Reconfigure
    save_dir: str = ""  # the job's --save-dir: where this node writes its copies should it lose the controller
    world_size: int = 0  # the job's ranks (the manifests of what this node saves name it)


@_message
class Reconfigure:
    """Join generation `generation` as node `node_rank`. One per recipient node, O(1) in size.

    restart_workers: for scripts that do not use dpstate (restart mode), the agent kills its workers
    (without reporting those exits), starts new ones with RANK/WORLD_SIZE/MASTER_ADDR... in their
    environment, and reports WorkerReady(restored_from="restart") for each once started.

    restore_step: NO_RANK for a fresh start, else every rank loads its state at that step.
    restore_from: for each global rank of this node, the replica endpoint that holds its snapshot at
    restore_step, or "" when the rank's own process may have it locally (a survivor).
    replica_to: the replica endpoint where this node's ranks send their snapshots from now on.
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
    restore_also: dict = field(default_factory=dict)  # str(rank) -> further endpoints holding restore_step
    restart_workers: bool = False  # restart mode: kill this node's workers and start fresh ones, ranks in env


@_message
class Stop:
    """Stop all workers and exit. Sent at the end of a job and to fence a failed node. keep_store: stop the
    workers but stay, the replica store serving (Ping, SaveSnapshots), until a Stop without it."""

    reason: str
    exit_code: int = 0
    keep_store: bool = False


@_message
class Ping:
    seq: int


@_message
class Standby:
    """To a spare (and relayed to its workers): the largest snapshot of each local rank on any node, in bytes
    (meta + data), so that each worker makes room for its restore while idle, not after a failure."""

    snapshot_bytes: list[int]  # local rank -> bytes


@_message
class SaveSnapshots:
    """The job is stopping, or with `background`, saves as it trains: write the snapshots of `ranks` at `step` as
    files in `directory`
    (dpagent.snapshot_files): those this node's replica store holds, or with `local`, relayed to the node's
    workers, their own local copies (a rank whose every replica died with its holder). Each answers with
    SnapshotFiles. `step` NO_RANK (from an agent that lost its controller, to its workers): every step each
    holds, each into `directory`/step-S."""

    directory: str
    step: int
    ranks: list[int]
    local: bool = False
    world_size: int = 0  # the job's, for the manifest part written after the files (dpagent.save_manifest)
    background: bool = False  # a save while training goes on (--save-every): no worker is stopped for it
    keep: int = 0  # background: then prune `directory`'s parent to its newest `keep` complete steps (0: do not)


@_message
class LoadSnapshots:
    """A job resumed from files: read `ranks`' snapshot files of `step` from `directory` into this node's
    replica store (each reported with SnapshotStored, as a replica would be), then answer SnapshotFiles."""

    directory: str
    step: int
    ranks: list[int]
    generation: int = 0  # the copies' generation: 0 for a resumed job, the new one for a recovery from disk


@_message
class SnapshotFiles:
    """The answer to SaveSnapshots / LoadSnapshots (an agent's, or a worker's for its own rank): for each rank
    asked, "" when its file was written or read, else why not."""

    node_id: str
    step: int
    results: dict[str, str]  # str(rank) -> "" or the error
    steps: list[int] = field(default_factory=list)  # for a SaveSnapshots of every step held: those written


@_message
class Inject:
    """Fault injection, carried out by the agent on itself: kill-node, kill-worker, ..."""

    kind: str
    local_rank: int = 0


# ----------------------------------------------------------------------------- worker <-> replica store


@_message
class PutSnapshot:
    """Store a snapshot; payload frames follow: meta (opaque bytes), then data (tensor bytes) cut by
    chunk_views (one frame when empty).

    held=True: no payload; the store already holds this rank's `step` with this checksum (a rank restored
    from it) and relabels that copy as of `generation` instead of receiving it again; refused when not held.
    """

    rank: int
    step: int
    generation: int
    checksum: int  # dpstate.snapshot.checksum(meta, data): computed and checked by workers only
    nbytes: int
    held: bool = False


@_message
class ReserveSnapshot:
    """Sent ahead of a PutSnapshot of `step` (the sender's optimizer is past step-1): the holder drops that
    rank's oldest copy now if it is full, so the snapshot on its way is received into that copy's memory
    instead of a buffer of its own. Answered with SnapshotReserved, before which the sender sends nothing."""

    rank: int
    step: int
    generation: int


@_message
class SnapshotReserved:
    rank: int
    step: int
    dropped: list[int] = field(default_factory=list)  # steps of the rank that made room


@_message
class SnapshotAck:
    rank: int
    step: int
    ok: bool
    error: str = ""


@_message
class FetchSnapshot:
    rank: int
    step: int


@_message
class SnapshotData:
    """Reply to FetchSnapshot; when found, its payload is the meta frame and `chunks` SnapshotChunk messages
    follow with the data (nbytes: meta + data, as in PutSnapshot)."""

    rank: int
    step: int
    found: bool
    checksum: int = 0
    nbytes: int = 0
    chunks: int = 0


@_message
class SnapshotChunk:
    """Data chunk `index` (from 0, in order) of the snapshot a SnapshotData announced; one payload frame."""

    rank: int
    step: int
    index: int


@_message
class LocalSnapshot:
    """A worker to its own node's agent: its snapshot of `step` lies in its shared buffer (a memfd: the agent
    maps /proc/<pid>/fd/<fd>, checked by inode) at `offset`, `nbytes` of data, written `writes` times so far
    (the buffer's write counter: a later write makes the copy stale). Payload: the data's block digests
    (dpagent.checksum.block_digests, int64; 0 where its CheckPlan `checks` leaves a block unchecked). Not
    answered; lets the agent hold peers' identical blocks (data parallel state) by reference instead of
    receiving them."""

    rank: int
    step: int
    pid: int
    fd: int
    inode: int
    offset: int
    nbytes: int
    writes: int
    checks: dict = field(default_factory=dict)  # CheckPlan.as_json() ({}: every block digested)


@_message
class OfferSnapshot:
    """A PutSnapshot whose data is sent only where the holder lacks it: payload = meta, the data's block
    digests (int64; 0 where the CheckPlan `checks` leaves a block unchecked: the data parallel blocks that the
    holder's own node's copy of the step stands for), then the data's tail (past its last whole block: the
    per-rank state, as a capture lays it out). The holder makes room as for a ReserveSnapshot. Answered with
    SnapshotWants (the whole blocks to send as SnapshotBlocks), or at once with SnapshotAck when the holder's
    own node has every whole block already."""

    rank: int
    step: int
    generation: int
    checksum: int
    nbytes: int  # meta + data, as in PutSnapshot
    checks: dict = field(default_factory=dict)  # CheckPlan.as_json() ({}: every block digested)


@_message
class SnapshotWants:
    rank: int
    step: int
    blocks: list[int] = field(default_factory=list)  # whole block indexes (CHECKSUM_BLOCK bytes each)
    differs: list[int] = field(default_factory=list)  # data parallel blocks digested on both sides that differ


@_message
class SnapshotBlocks:
    """The blocks a SnapshotWants asked for, one payload frame each, in the order asked; answered with SnapshotAck."""

    rank: int
    step: int
    generation: int
    blocks: list[int] = field(default_factory=list)


Message = typing.Union[tuple(_REGISTRY.values())]  # type: ignore[valid-type]


def message_types() -> dict[str, type]:
    return dict(_REGISTRY)


# ----------------------------------------------------------------------------- codec


def _check_type(value: Any, annotation: Any) -> bool:
    if annotation in ("int", int):
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in ("float", float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in ("str", str):
        return isinstance(value, str)
    if annotation in ("bool", bool):
        return isinstance(value, bool)
    if annotation in ("dict", dict):
        return isinstance(value, dict)
    if annotation in ("list", list):
        return isinstance(value, list)
    if not isinstance(annotation, str):
        return True
    if annotation.startswith("list["):
        return isinstance(value, list) and all(_check_type(item, annotation[5:-1]) for item in value)
    if annotation.startswith("dict[str, "):  # (JSON: a dict's keys are strings)
        return isinstance(value, dict) and all(_check_type(item, annotation[10:-1]) for item in value.values())
    return True


_FIELDS: dict[type, dict[str, Any]] = {}  # message class -> field name -> annotation (cached: hot path)


def _fields_of(cls: type) -> dict[str, Any]:
    known = _FIELDS.get(cls)
    if known is None:
        known = _FIELDS[cls] = {f.name: f.type for f in dataclasses.fields(cls)}
    return known


def _from_body(cls: type, body: Any):
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: body is not an object")
    known = _fields_of(cls)
    for name, value in body.items():
        annotation = known.get(name, _MISSING)
        if annotation is _MISSING:
            raise ProtocolError(f"{cls.__name__}: unknown field {name!r}")
        if not _check_type(value, annotation):
            raise ProtocolError(f"{cls.__name__}.{name}: bad value {value!r}")
    try:
        return cls(**body)
    except TypeError as exc:  # a required field is missing
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


_MISSING = object()


class Codec:
    """Encodes and authenticates messages with the job's secret token."""

    def __init__(self, token: str | bytes):
        if isinstance(token, str):
            token = token.encode()
        if not token:
            raise ValueError("the job token must not be empty")
        self._key = token

    def _mac(self, kind: bytes, body: bytes) -> bytes:
        return hmac.digest(self._key, b"".join((MAGIC, len(kind).to_bytes(4, "big"), kind, body)), hashlib.sha256)

    def encode(self, msg: Any, payload: Sequence[Any] = ()) -> list:
        kind = type(msg).__name__.encode()
        if kind.decode() not in _REGISTRY:
            raise TypeError(f"not a protocol message: {msg!r}")
        fields = {name: getattr(msg, name) for name in _fields_of(type(msg))}
        body = json.dumps(fields, separators=(",", ":")).encode()
        return [MAGIC, kind, body, self._mac(kind, body), *payload]

    def decode(self, frames: Sequence[Any]) -> tuple[Any, list]:
        """Returns (message, payload frames); raises ProtocolError for anything to drop (Refused for a refusal)."""
        if len(frames) == 2 and bytes(_buffer(frames[0])) == REFUSAL:
            code = bytes(_buffer(frames[1])).decode(errors="replace")
            if code in REFUSALS:
                raise Refused(code)
            raise ProtocolError(f"a refusal of unknown kind {code[:40]!r}")
        if len(frames) < 4:
            raise ProtocolError(f"expected at least 4 frames, got {len(frames)}")
        magic, kind, body, mac = (bytes(_buffer(f)) for f in frames[:4])
        if magic[:2] != MAGIC[:2]:
            raise ProtocolError("not a DeadPool message")
        if magic != MAGIC:
            raise ProtocolError(f"protocol version {magic[2:]!r} is not {PROTOCOL_VERSION}", refusal="version")
        if len(body) > MAX_BODY_BYTES:
            raise ProtocolError(f"body of {len(body)} bytes is over {MAX_BODY_BYTES}")
        if not hmac.compare_digest(mac, self._mac(kind, body)):
            raise ProtocolError("bad MAC: wrong job token or a tampered message", refusal="token")
        cls = _REGISTRY.get(kind.decode(errors="replace"))
        if cls is None:
            raise ProtocolError(f"unknown message type {kind[:40]!r}")
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise ProtocolError(f"{cls.__name__}: body is not JSON ({exc})") from None
        return _from_body(cls, parsed), list(frames[4:])


def _buffer(frame: Any):
    """The bytes of a zmq.Frame (copy=False receive) or of a bytes-like frame."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def payload_bytes(frame: Any) -> memoryview:
    """A zero-copy view of a payload frame."""
    return memoryview(_buffer(frame))


def chunk_views(data: Any, size: int = CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy views cutting snapshot data (bytes-like) into frames of `size` (one when shorter)."""
    view = memoryview(data).cast("B")
    return [view[i : i + size] for i in range(0, len(view), size)] or [view]


def block_views(data: Any) -> list[memoryview]:
    """Zero-copy views of the data's dedup blocks (dpagent.checksum.CHECKSUM_BLOCK each; the last, the tail)."""
    return chunk_views(data, CHECKSUM_BLOCK)


__all__ = [name for name in _REGISTRY] + [
    "Codec",
    "Message",
    "NO_RANK",
    "PROTOCOL_VERSION",
    "CHUNK_BYTES",
    "chunk_views",
    "block_views",
    "ProtocolError",
    "REFUSAL",
    "REFUSALS",
    "Refused",
    "refusal",
    "message_types",
    "payload_bytes",
    "OOM_KILLED",
    "OWN_SIGNALS",
    "describe_exit",
    "describe_end",
]
