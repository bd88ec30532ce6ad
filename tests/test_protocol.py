"""The wire protocol as a whole: every message type, with any values its fields allow, comes back from the codec
as it went in; the same bytes under another job's token, with one byte changed, with a field of the wrong type,
a malformed nested worker summary or a string outside its closed set are refused, never handed on."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpcommon import protocol as p
from dpagent.worker_link import FORWARDED

TEXT = st.text(max_size=40)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                       max_leaves=12)
SCALARS: dict[Any, st.SearchStrategy] = {
    int: st.integers(-(2**53), 2**53),
    float: st.floats(allow_nan=False, allow_infinity=False),
    str: TEXT,
    bool: st.booleans(),
    list: st.lists(JSONISH, max_size=4),  # a bare list or dict takes any JSON
    dict: st.dictionaries(TEXT, JSONISH, max_size=4),
}
WRONG_SCALARS: dict[Any, Any] = {int: "1", float: "1.5", str: 1, bool: 1, dict: [1], list: {}}
TYPES = sorted(p.message_types().values(), key=lambda cls: cls.__name__)
CODEC = p.Codec("this-job")


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def values(annotation: Any) -> st.SearchStrategy:
    """Any value a field of this type may hold."""
    if annotation in SCALARS:
        return SCALARS[annotation]
    if annotation is Any:
        return JSONISH
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(values(args[0]), max_size=6)
    if origin is dict:
        return st.dictionaries(TEXT, values(args[1]), max_size=4)
    assert dataclasses.is_dataclass(annotation), f"a new field type {annotation!r}: teach this test about it"
    return instances(annotation)


def wrong(annotation: Any) -> Any:
    """A value of the wrong type for a field of this type, as its JSON."""
    if annotation in WRONG_SCALARS:
        return WRONG_SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "none-of-these"
    if origin is list:
        return [wrong(args[0])]
    if origin is dict:
        return [1] if args[1] is Any else {"a": wrong(args[1])}  # (any JSON value is right for Any)
    return {"no_such_field": 1}  # a nested dataclass


def instances(cls: type) -> st.SearchStrategy:
    return st.builds(cls, **{name: values(annotation) for name, annotation in hints(cls).items()})


def signed(kind: str, body: Any) -> list[bytes]:
    """A message as a peer with the job's token would send it, whatever its body."""
    raw = json.dumps(body).encode()
    return [p.MAGIC, kind.encode(), raw, CODEC._mac(kind.encode(), raw)]


@pytest.mark.parametrize("cls", TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_message_round_trips_and_is_refused_once_tampered_with(cls, data):
    msg = data.draw(instances(cls))
    frames = CODEC.encode(msg, [b"payload"])
    decoded, payload = CODEC.decode(frames)
    assert decoded == msg and payload == [b"payload"]
    with pytest.raises(p.ProtocolError) as other_job:
        p.Codec("another-job").decode(frames)
    assert other_job.value.refusal == "token"
    body = bytearray(frames[2])
    at = data.draw(st.integers(0, len(body) - 1))
    body[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(p.ProtocolError):
        CODEC.decode([frames[0], frames[1], bytes(body), frames[3]])


@pytest.mark.parametrize("cls", [cls for cls in TYPES if dataclasses.fields(cls)], ids=lambda cls: cls.__name__)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_a_field_of_the_wrong_type_or_an_unknown_one_is_refused_even_when_signed(cls, data):
    body = json.loads(CODEC.encode(data.draw(instances(cls)))[2])
    name, annotation = data.draw(st.sampled_from(sorted(hints(cls).items())))
    for bad, why in (({**body, name: wrong(annotation)}, f"{cls.__name__}.{name}: "),
                     ({**body, "no_such_field": 1}, "unknown field")):
        with pytest.raises(p.ProtocolError, match=why):
            CODEC.decode(signed(cls.__name__, bad))


def heartbeat(summary: Any) -> list[bytes]:
    return signed("Heartbeat", {"node_id": "n1", "generation": 3, "workers": {"0": summary}})


def test_a_heartbeat_carries_typed_worker_summaries():
    summary = {"rank": 2, "step": 40, "activity": "collective", "age": 0.25, "room": 0, "pid": 4242}
    msg, _ = CODEC.decode(heartbeat(summary))
    assert msg.workers == {"0": p.WorkerSummary("collective", rank=2, step=40, age=0.25, pid=4242)}
    assert msg == p.Heartbeat("n1", 3, {"0": summary})  # (one built from JSON objects builds the summaries too)
    assert CODEC.decode(CODEC.encode(msg))[0] == msg


@pytest.mark.parametrize("summary", [
    {"rank": 2, "step": 40},  # no activity
    {"activity": "dancing"},
    {"activity": "collective", "rank": "2"},
    {"activity": "collective", "age": "0.25"},
    {"activity": "collective", "pid": None},
    {"activity": "collective", "colour": "blue"},
    "collective",
    [],
], ids=["no-activity", "unknown-activity", "rank-text", "age-text", "pid-null", "unknown-field", "not-an-object",
        "a-list"])
def test_a_malformed_worker_summary_refuses_its_whole_heartbeat(summary):
    with pytest.raises(p.ProtocolError, match=r"Heartbeat.workers: (WorkerSummary|bad value)"):
        CODEC.decode(heartbeat(summary))


@pytest.mark.parametrize("kind, body, field", [
    ("WorkerStatus", {"node_id": "n1", "local_rank": 0, "rank": 0, "generation": 1, "step": 5, "activity": "dancing"},
     "activity"),
    ("WorkerReady", {"node_id": "n1", "generation": 1, "rank": 0, "rebuild_s": 0.1, "restore_s": 0.2,
                     "restored_from": "sim"}, "restored_from"),
    ("Welcome", {"node_id": "n1", "role": "leader", "job_id": "j", "heartbeat_interval": 1.0,
                 "heartbeat_timeout": 5.0}, "role"),
])
def test_a_string_outside_its_closed_set_is_refused(kind, body, field):
    with pytest.raises(p.ProtocolError, match=f"{kind}.{field}: bad value"):
        CODEC.decode(signed(kind, body))
    for allowed in typing.get_args(hints(p.message_types()[kind])[field]):
        assert getattr(CODEC.decode(signed(kind, {**body, field: allowed}))[0], field) == allowed


def test_every_message_travels_on_a_channel_and_what_an_agent_relays_on_both_of_its_own():
    channels = (p.ToController, p.ToAgent, p.ToWorker, p.ToReplica)
    assert set(p.message_types().values()) == {cls for channel in channels for cls in typing.get_args(channel)}
    assert p.WorkerSummary not in p.message_types().values()  # (travels inside a Heartbeat only)
    assert set(FORWARDED) <= set(typing.get_args(p.ToAgent)) & set(typing.get_args(p.ToController))


def test_the_internals_page_lists_every_message_on_its_channels():
    page = (Path(__file__).parents[1] / "docs" / "internals.md").read_text()
    table = page[page.index("## Messages: who sends which"):]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 3 and "->" in cells[1]:
            rows[cells[1]] = set(re.findall(r"`(\w+)`", cells[2]))
    by_receiver = {"controller": p.ToController, "agent": p.ToAgent, "worker": p.ToWorker, "replica store": p.ToReplica}
    for receiver, union in by_receiver.items():
        listed = set().union(*(names for route, names in rows.items() if route.endswith(f"-> {receiver}")))
        assert listed == {cls.__name__ for cls in typing.get_args(union)}, receiver


def test_a_field_type_is_checked_outside_a_message_as_the_codec_checks_it():
    assert p.checked(p.JobTerms, {"nnodes": 2, "script": ["a"]}) == p.JobTerms(nnodes=2, script=["a"])
    for bad, said in [({"nnodes": "2"}, "JobTerms.nnodes"), ({"script": [1]}, "JobTerms.script"),
                      ({"other": 1}, "unknown field"), ([1], "not an object")]:
        with pytest.raises(p.ProtocolError, match=said):
            p.checked(p.JobTerms, bad)
