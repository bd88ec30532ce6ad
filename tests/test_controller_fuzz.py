"""The controller never raises on what a node may send: any sequence of messages whose fields have the types the
codec lets through (a buggy or out-of-step agent's: a rank past the world, an old generation, another node's
name, worker statuses of any values), among ticks, while the job forms, trains and recovers. A raise would end the
job. `DP_FUZZ_EXAMPLES=5000` searches longer."""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone, Tick
from helpers.controller_harness import Harness, formed, spec

NAMES = st.sampled_from(["a", "b", "s", "x", "", "tcp://a:1", "tcp://b:1", "tcp://s:1", "init"])
SMALL = st.integers(-2, 12) | st.integers(-(2**40), 2**40)
TEXT = NAMES | st.text(max_size=20)
JSONISH = st.recursive(st.none() | st.booleans() | SMALL | TEXT | st.floats(allow_nan=False),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                       max_leaves=10)
ACTIVITY = st.sampled_from(typing.get_args(p.Activity))
STATUS = st.fixed_dictionaries({"rank": SMALL, "step": SMALL, "activity": ACTIVITY, "age": st.floats(0, 100)},
                               optional={"room": SMALL, "pid": SMALL})
BY_ANNOTATION = {
    "int": SMALL,
    "float": st.floats(-10, 1e6),
    "str": TEXT,
    "bool": st.booleans(),
    "list[int]": st.lists(SMALL, max_size=4),
    "list[str]": st.lists(TEXT, max_size=3),
    "list[list[int]]": st.lists(st.lists(SMALL, max_size=3), max_size=3),
    "dict[str, int]": st.dictionaries(st.sampled_from(["0", "1", "2", "x"]), SMALL, max_size=3),
    "list": st.lists(JSONISH, max_size=3),
    "dict": st.dictionaries(st.sampled_from(["0", "1", "x"]), STATUS | JSONISH, max_size=3) | JSONISH.filter(
        lambda v: isinstance(v, dict)),
    "dict[str, str]": st.dictionaries(st.sampled_from(["0", "1", "2", "x"]), TEXT, max_size=3),
    "dict[str, list[str]]": st.dictionaries(st.sampled_from(["0", "1", "2", "x"]), st.lists(TEXT, max_size=3),
                                            max_size=3),
    "dict[str, WorkerSummary]": st.dictionaries(st.sampled_from(["0", "1", "x"]),
                                                STATUS.map(lambda status: p.WorkerSummary(**status)), max_size=3),
    "Activity": ACTIVITY,
    "RestoredFrom": st.sampled_from(typing.get_args(p.RestoredFrom)),
    "Role": st.sampled_from(typing.get_args(p.Role)),
    "FaultKind": st.sampled_from(typing.get_args(p.FaultKind)),
    "JobTerms": st.builds(p.JobTerms, nnodes=SMALL, rdzv_id=TEXT, script=st.lists(TEXT, max_size=3)),
    "dict[str, Any]": st.dictionaries(TEXT, JSONISH, max_size=3),
}
SENDERS = st.sampled_from(["a", "b", "s", "x"])


def messages():
    kinds = [cls for cls in p.message_types().values()]
    return st.sampled_from(kinds).flatmap(
        lambda cls: st.builds(cls, **{f.name: BY_ANNOTATION[f.type] for f in dataclasses.fields(cls)}))


def from_sender(sender: str, msg, own: bool):
    """Mostly (own) a message that names its sender, as every agent's does: past the controller's first check."""
    return sender, dataclasses.replace(msg, node_id=sender) if own and hasattr(msg, "node_id") else msg


INPUTS = st.one_of(
    st.builds(from_sender, SENDERS, messages(), st.integers(0, 4).map(bool)),
    st.tuples(st.just("tick"), st.floats(0, 3)),
    st.tuples(st.just("gone"), SENDERS),
)


REGISTERS = st.builds(lambda node, spare, rank, nproc: (node, p.Register(node, "h", 1, nproc, spare, rank,
                                                                     f"tcp://{node}:1")),
                      SENDERS, st.booleans(), st.integers(-2, 3), st.integers(-1, 3))
JOBS = [dict(), dict(save_dir="/saved", replicas=2), dict(restart_mode=True), dict(nproc_per_node=2),
        dict(resume_from="/saved/step-3", save_dir="/saved"), dict(on_spare_exhausted="wait"),
        dict(snapshots=False)]
EXAMPLES = int(os.environ.get("DP_FUZZ_EXAMPLES", "300"))


def feed(h, inputs) -> None:
    for first, second in inputs:
        if first == "tick":
            h.feed(Tick(), dt=second)
        elif first == "gone":
            h.feed(NodeGone(second, "gone"))
        else:
            h.msg(first, second)


@pytest.mark.slow  # EXAMPLES schedules of up to 40 inputs: 10-25 s each
@pytest.mark.parametrize("job", JOBS[:3], ids=["data-parallel", "saving", "restart-mode"])
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(inputs=st.lists(INPUTS, max_size=40), fail_first=st.booleans())
def test_no_message_a_node_may_send_makes_the_controller_raise(job, inputs, fail_first):
    h = formed(spec(**job))
    for node, rank in (("a", 0), ("b", 1)):
        h.msg(node, p.Progress(node, 0, rank, 3))
    if fail_first:  # and so during a recovery
        h.feed(NodeGone("b", "killed"))
    feed(h, inputs)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=st.lists(REGISTERS | INPUTS, max_size=40), job=st.sampled_from(JOBS))
def test_nor_while_the_job_forms_from_registrations_of_any_shape(inputs, job):
    """Nodes register in any order, with any node rank, worker count or role, for any kind of job (resuming
    from files, waiting for spares, two workers a node), among all the rest."""
    feed(Harness(spec(**job)), inputs)


def test_a_local_rank_or_a_rank_the_job_does_not_have_is_dropped_and_counted():
    """What the search above first found: a WorkerExited of local rank 1 on a node of one worker raised
    IndexError in the controller (the end of the job); now dropped, and counted as dropped."""
    h = formed()
    h.msg("b", p.WorkerExited("b", 0, 1, 11, 1, "ValueError: x"))
    h.msg("b", p.Progress("b", 0, 7, 3))
    h.msg("b", p.Progress("b", 0, 7, 4))
    assert h.c.members.dropped == {"local_rank 1 out of range": 1, "rank 7 out of range": 2}
    assert not h.named("node_failed") and h.c.timeline.rank_step.get(7) is None
    assert [(e["kind"], e["reason"]) for e in h.named("message_refused")] == [
        ("WorkerExited", "local_rank 1 out of range"), ("Progress", "rank 7 out of range")], "said once each"
