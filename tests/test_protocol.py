"""The wire protocol as a whole: every message type, with any values its fields allow, comes back from the codec
as it went in; the same bytes under another job's token, with one byte changed, or with a field of the wrong
type are refused, never handed on."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpagent import protocol as p

TEXT = st.text(max_size=40)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                       max_leaves=12)
BY_ANNOTATION = {
    "int": st.integers(-(2**53), 2**53),
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "str": TEXT,
    "bool": st.booleans(),
    "list[int]": st.lists(st.integers(-(2**31), 2**31), max_size=8),
    "list[str]": st.lists(TEXT, max_size=4),
    "list": st.lists(JSONISH, max_size=4),
    "dict": st.dictionaries(TEXT, JSONISH, max_size=4),
    "dict[str, str]": st.dictionaries(TEXT, TEXT, max_size=4),
}
WRONG = {"int": "1", "float": "1.5", "str": 1, "bool": 1, "dict": [1], "list": {}, "list[int]": [1, "2"],
         "list[str]": ["a", 2], "dict[str, str]": {"a": 1}}  # a value of each annotation's that must be refused
TYPES = sorted(p.message_types().values(), key=lambda cls: cls.__name__)
CODEC = p.Codec("this-job")


def instances(cls: type):
    return st.builds(cls, **{f.name: BY_ANNOTATION[f.type] for f in dataclasses.fields(cls)})


def test_every_field_of_every_message_has_a_type_the_codec_checks():
    unknown = {f"{cls.__name__}.{f.name}: {f.type}" for cls in TYPES for f in dataclasses.fields(cls)
               if f.type not in BY_ANNOTATION or f.type not in WRONG}
    assert not unknown, "a new field type: teach protocol._check_type and this test (BY_ANNOTATION, WRONG) about it"


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
    field = data.draw(st.sampled_from(dataclasses.fields(cls)))
    wrong = WRONG[field.type]
    kind = cls.__name__.encode()
    for bad, why in (({**body, field.name: wrong}, f"{cls.__name__}.{field.name}: bad value"),
                     ({**body, "no_such_field": 1}, "unknown field")):
        raw = json.dumps(bad).encode()
        with pytest.raises(p.ProtocolError, match=why):
            CODEC.decode([p.MAGIC, kind, raw, CODEC._mac(kind, raw)])
