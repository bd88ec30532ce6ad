"""The one wire protocol of DeadPool: which message travels where, framing, versioning and authentication.

Controller, agents and workers speak it over ZeroMQ; it has no torch and no I/O of its own. The messages are
dataclasses in dpcommon.control_messages (control) and dpcommon.snapshot_messages (snapshots), re-exported here so that
`from dpcommon import protocol as p; p.Heartbeat` names them all. Version history and design notes: docs/protocol.md.

A message travels as ZeroMQ frames::

    [b"DP" + version byte, type name, JSON body, HMAC-SHA256(token, frames 0..2)] + payload frames

Payload frames (snapshot bytes) are not covered by the MAC; the body carries their checksum.
`Codec.decode` refuses anything malformed, oversized, unauthenticated or of another version, and any field
value outside its type (a closed set's other strings included), by raising `ProtocolError`; callers drop and
count such messages and carry on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import typing
from typing import Any, Callable, Literal, Sequence, Union

from .checksum import CHECKSUM_BLOCK
from .exit_wording import OOM_KILLED, OWN_SIGNALS, describe_end, describe_exit  # (older call sites name them here)
from .control_messages import (
    NO_RANK, Activity, AgentExited, Demote, Diverged, FaultKind, Heartbeat, Hello, Inject, JobTerms, Leaving,
    LoadSnapshots, PeerError, Ping, Pong, Progress, RankFinished, Reconfigure, Register, RestoredFrom, RestoreFailed,
    Role, SaveSnapshots, SnapshotFiles, SnapshotStored, Standby, Stop, Welcome, WorkerExited, WorkerReady,
    WorkerStatus, WorkerSummary,
)
from .snapshot_messages import (
    FetchSnapshot, LocalSnapshot, OfferSnapshot, PutSnapshot, ReserveSnapshot, SnapshotAck, SnapshotBlocks,
    SnapshotChunk, SnapshotData, SnapshotPart, SnapshotReserved, SnapshotWants,
)

PROTOCOL_VERSION = 26  # what each version changed: docs/protocol.md
MAGIC = b"DP" + bytes([PROTOCOL_VERSION])
MAX_BODY_BYTES = 1 << 20  # control messages are small; snapshot bytes travel as payload frames
CHUNK_BYTES = 4 << 20  # snapshot data frames (why chunks: docs/protocol.md); a whole number of CHECKSUM_BLOCKs


# Who sends what (the sequences: docs/sequences.md). Each receiver dispatches on the type and drops, counted,
# what has no business on its socket (dpcommon.channel.Channel.drop_unexpected; the controller's _drop).
ToController = Union[
    Register, Heartbeat, Pong, WorkerExited, Leaving, SnapshotStored, SnapshotFiles,  # an agent's own
    Progress, WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged,  # relayed from its workers
    AgentExited,  # from a member node's dprun, for its agent that died
]
ToAgent = Union[
    Welcome, Reconfigure, Stop, Demote, Ping, Inject, Standby, SaveSnapshots, LoadSnapshots,  # from the controller
    Hello, WorkerStatus, Progress, WorkerReady, PeerError, RestoreFailed, RankFinished, Diverged,  # from its workers
    SnapshotFiles,
]
ToWorker = Union[
    Reconfigure, Stop, Standby, SaveSnapshots,  # from its agent, relayed from the controller
    SnapshotReserved, SnapshotAck, SnapshotWants, SnapshotData, SnapshotChunk,  # a replica store's answers
]
ToReplica = Union[
    ReserveSnapshot, SnapshotPart, PutSnapshot, OfferSnapshot, SnapshotBlocks, LocalSnapshot, FetchSnapshot,
]
Message = Union[ToController, ToAgent, ToWorker, ToReplica]

_REGISTRY: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


def message_types() -> dict[str, type]:
    return dict(_REGISTRY)


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


# ----------------------------------------------------------------------------- checking a body's values


class _BadValue(Exception):
    pass


_T = typing.TypeVar("_T")
Check = Callable[[Any], Any]  # a JSON value -> that value as its field's type (nested dataclasses built)
_SCALARS: dict[Any, Callable[[Any], bool]] = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
    dict: lambda v: isinstance(v, dict),  # a field typed `dict` or `list` takes any JSON object or array
    list: lambda v: isinstance(v, list),
}


def _check_of(annotation: Any) -> Check:
    """The check of a field's type; TypeError (at import) for a type the codec cannot check."""
    if annotation in _SCALARS:
        return _as_is(_SCALARS[annotation])
    if annotation is Any:  # any JSON value (a step's metrics): json.loads made nothing else
        return lambda v: v
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        allowed = frozenset(args)
        return _as_is(lambda v: isinstance(v, str) and v in allowed)
    if origin is list and args[0] in _SCALARS:  # (block lists can be long: checked, not copied)
        ok = _SCALARS[args[0]]
        return _as_is(lambda v: isinstance(v, list) and all(map(ok, v)))
    if origin is list:
        item = _check_of(args[0])
        return lambda v: [item(x) for x in v] if isinstance(v, list) else _bad()
    if origin is dict and args[0] is str:  # (JSON: an object's keys are strings)
        value = _check_of(args[1])
        return lambda v: {k: value(x) for k, x in v.items()} if isinstance(v, dict) else _bad()
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        _checks_of(annotation)
        return lambda v: _from_body(annotation, v)
    raise TypeError(f"the codec has no check for a field of type {annotation!r}")


def _as_is(ok: Callable[[Any], bool]) -> Check:
    return lambda v: v if ok(v) else _bad()


def _bad() -> Any:
    raise _BadValue


_CHECKS: dict[type, dict[str, Check]] = {}  # message class -> field name -> its check


def _checks_of(cls: type) -> dict[str, Check]:
    known = _CHECKS.get(cls)
    if known is None:
        hints = typing.get_type_hints(cls)
        known = _CHECKS[cls] = {f.name: _check_of(hints[f.name]) for f in dataclasses.fields(cls)}
    return known


def _from_body(cls: type, body: Any) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: body is not an object")
    checks = _CHECKS[cls]
    values = {}
    for name, value in body.items():
        check = checks.get(name)
        if check is None:
            raise ProtocolError(f"{cls.__name__}: unknown field {name!r}")
        try:
            values[name] = check(value)
        except _BadValue:
            raise ProtocolError(f"{cls.__name__}.{name}: bad value {value!r:.200}") from None
        except ProtocolError as exc:  # a nested dataclass's
            raise ProtocolError(f"{cls.__name__}.{name}: {exc}") from None
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


def checked(cls: type[_T], body: Any) -> _T:
    """`body`, a JSON object, as a `cls` (a message or a field's dataclass), checked as the codec checks what it
    decodes; ProtocolError (a ValueError) saying what is wrong."""
    _checks_of(cls)
    return typing.cast(_T, _from_body(cls, body))


def _body_of(obj: Any) -> dict:
    """A nested dataclass's JSON object (json.dumps calls this for values it cannot encode itself)."""
    checks = _CHECKS.get(type(obj))
    if checks is None:
        raise TypeError(f"not a protocol value: {obj!r:.200}")
    return {name: getattr(obj, name) for name in checks}


for _cls in _REGISTRY.values():  # every field type checked once, here: one the codec cannot check fails at import
    _checks_of(_cls)


# ----------------------------------------------------------------------------- codec


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

    def encode(self, msg: Message, payload: Sequence[Any] = ()) -> list:
        name = type(msg).__name__
        if _REGISTRY.get(name) is not type(msg):
            raise TypeError(f"not a protocol message: {msg!r:.200}")
        kind = name.encode()
        fields = {field: getattr(msg, field) for field in _CHECKS[type(msg)]}
        body = json.dumps(fields, separators=(",", ":"), default=_body_of).encode()
        return [MAGIC, kind, body, self._mac(kind, body), *payload]

    def decode(self, frames: Sequence[Any]) -> tuple[Message, list]:
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
    """Zero-copy views of the data's dedup blocks (dpcommon.checksum.CHECKSUM_BLOCK each; the last, the tail)."""
    return chunk_views(data, CHECKSUM_BLOCK)


__all__ = [
    # messages, by channel
    "ToController", "ToAgent", "ToWorker", "ToReplica", "Message", "message_types",
    "Register", "Heartbeat", "WorkerSummary", "Pong", "WorkerExited", "AgentExited", "Leaving", "SnapshotStored",
    "Hello", "Progress", "WorkerReady", "PeerError", "WorkerStatus", "RestoreFailed", "Diverged", "RankFinished",
    "Welcome", "Reconfigure", "Stop", "Demote", "Ping", "Standby", "SaveSnapshots", "LoadSnapshots", "SnapshotFiles",
    "Inject",
    "PutSnapshot", "ReserveSnapshot", "SnapshotReserved", "SnapshotAck", "FetchSnapshot", "SnapshotData",
    "SnapshotChunk", "SnapshotPart", "LocalSnapshot", "OfferSnapshot", "SnapshotWants", "SnapshotBlocks",
    "JobTerms", "Activity", "RestoredFrom", "Role", "FaultKind", "NO_RANK",
    # framing and the codec
    "PROTOCOL_VERSION", "MAGIC", "MAX_BODY_BYTES", "CHUNK_BYTES", "Codec", "ProtocolError", "Refused", "REFUSAL",
    "REFUSALS", "refusal", "checked", "payload_bytes", "chunk_views", "block_views",
    # the wording of exits, now dpcommon.exit_wording's
    "OOM_KILLED", "OWN_SIGNALS", "describe_exit", "describe_end",
]
