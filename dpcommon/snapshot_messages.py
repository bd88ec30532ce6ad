"""The snapshot messages of DeadPool's wire protocol: a worker <-> a node's replica store, as frozen dataclasses.

dpcommon.protocol encodes them, says which channel each travels on and re-exports them (`p.PutSnapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PutSnapshot:
    """Store a snapshot; payload frames follow: meta (opaque bytes), then data (tensor bytes) cut by
    chunk_views (one frame when empty).

    held=True: no payload; the store already holds this rank's `step` with this checksum (a rank restored
    from it) and relabels that copy as of `generation` instead of receiving it again; refused when not held.
    parts=N: the data came before it as N SnapshotPart messages (streamed while it was captured); the payload is
    the meta alone.
    """

    rank: int
    step: int
    generation: int
    checksum: int  # dpstate.snapshot.packing.checksum(meta, data): computed and checked by workers only
    nbytes: int
    held: bool = False
    parts: int = 0


@dataclass(frozen=True)
class SnapshotPart:
    """Data chunk `index` (from 0, in order) of a snapshot whose PutSnapshot (parts > 0) follows once it is
    captured; one payload frame, not answered. Sent only after the holder's SnapshotReserved."""

    rank: int
    step: int
    generation: int
    index: int


@dataclass(frozen=True)
class ReserveSnapshot:
    """Sent ahead of a PutSnapshot of `step` (the sender's optimizer is past step-1): the holder drops that
    rank's oldest copy now if it is full, so the snapshot on its way is received into that copy's memory
    instead of a buffer of its own. Answered with SnapshotReserved, before which the sender sends nothing."""

    rank: int
    step: int
    generation: int


@dataclass(frozen=True)
class SnapshotReserved:
    rank: int
    step: int
    dropped: list[int] = field(default_factory=list)  # steps of the rank that made room


@dataclass(frozen=True)
class SnapshotAck:
    rank: int
    step: int
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class FetchSnapshot:
    """Ask for rank's snapshot of `step` over connection `stream` of `streams` (a fetch over several connections,
    each sent this): every one is answered with the SnapshotData (its meta payload on stream 0 only), then the
    chunks whose index modulo `streams` is `stream`."""

    rank: int
    step: int
    stream: int = 0
    streams: int = 1


@dataclass(frozen=True)
class SnapshotData:
    """Reply to FetchSnapshot; when found, its payload is the meta frame (stream 0; no payload on the others) and
    its share of the `chunks` SnapshotChunk messages follows with the data (nbytes: meta + data, as in PutSnapshot)."""

    rank: int
    step: int
    found: bool
    checksum: int = 0
    nbytes: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class SnapshotChunk:
    """Data chunk `index` of the snapshot a SnapshotData announced, whose bytes start at `offset` of its data (a
    held copy's chunks are not all of one size); in order on each connection (index modulo `streams` is that
    connection's `stream`); one payload frame."""

    rank: int
    step: int
    index: int
    offset: int = 0


@dataclass(frozen=True)
class LocalSnapshot:
    """A worker to its own node's agent: its snapshot of `step` lies in its shared buffer (a memfd: the agent
    maps /proc/<pid>/fd/<fd>, checked by inode) at `offset`, `nbytes` of data, written `writes` times so far
    (the buffer's write counter: a later write makes the copy stale). Payload: the data's block digests
    (dpcommon.checksum.block_digests, int64; 0 where its CheckPlan `checks` leaves a block unchecked). Not
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class SnapshotWants:
    rank: int
    step: int
    blocks: list[int] = field(default_factory=list)  # whole block indexes (CHECKSUM_BLOCK bytes each)
    differs: list[int] = field(default_factory=list)  # data parallel blocks digested on both sides that differ


@dataclass(frozen=True)
class SnapshotBlocks:
    """The blocks a SnapshotWants asked for, one payload frame each, in the order asked; answered with SnapshotAck."""

    rank: int
    step: int
    generation: int
    blocks: list[int] = field(default_factory=list)
