"""Unit tests of a sharded job's pieces without processes: the mesh layout and its checks, Parts and their
retirement, torch's private names we rely on, and the mesh as the controller, the dashboard and the report say it.
"""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from torch import nn

from dpcommon import protocol as p
from dprun.monitor.dashboard import replica_lines
from dprun.monitor.jobview import JobView
from dprun.monitor.report import print_report
from dpstate.groups.mesh import MeshLayout
from dpstate.groups.parallel import Parts, StalePartsError
from helpers.controller_harness import formed


def test_a_layout_is_ordered_outermost_first_whatever_the_order_given():
    layout = MeshLayout.parse({"tp": 2, "dp": 2, "pp": 2}, 8)
    assert layout.names == ("pp", "dp", "tp") and layout.shape == (2, 2, 2)
    assert layout.describe() == "pp=2 x dp=2 x tp=2"
    assert MeshLayout.parse({"dp_shard": 2, "dp_replicate": 2}, 4).names == ("dp_replicate", "dp_shard")


@pytest.mark.parametrize("dims, world, said", [
    ({"dp": 2, "tp": 2}, 8, "the mesh dp=2 x tp=2 holds 4 ranks but the job has 8: make the product of the dims "
                            "the world size"),
    ({"dp": 2, "cp": 2}, 4, "unknown mesh dim(s) ['cp']"),
    ({"dp": 2, "dp_shard": 2}, 4, "give either dp or dp_replicate/dp_shard"),
    ({"dp": 0}, 1, "mesh dim dp=0 must be a whole number >= 1"),
    ({"dp": 1.5}, 1, "mesh dim dp=1.5 must be a whole number"),
    ({}, 1, "no mesh dims"),
])
def test_a_bad_layout_is_one_line_naming_the_fix(dims, world, said):
    with pytest.raises(ValueError) as err:
        MeshLayout.parse(dims, world)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_tensor_parallel_group_across_nodes_is_warned_of():
    layout = MeshLayout.parse({"dp": 2, "tp": 2}, 4)
    assert layout.tp_span_warning(2) is None and layout.tp_span_warning(4) is None
    warning = layout.tp_span_warning(1)
    assert "span nodes" in warning and "--nproc-per-node a multiple of 2" in warning
    assert MeshLayout.parse({"dp": 4}, 4).tp_span_warning(1) is None


class Schedule:
    """Stands in for a pipeline schedule (torch's have step and eval)."""

    def step(self, *args):
        return "stepped"

    def eval(self, *args):
        return "evaluated"


def _build(mesh):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), schedule=Schedule(),
                scheduler=None)


def test_retired_parts_raise_naming_what_to_read_instead():
    parts = Parts(MeshLayout.parse({"dp": 1}, 1), _build)
    parts.build("mesh of generation 0", 0)
    model, optimizer, schedule = parts.model, parts.optimizer, parts.schedule
    assert parts.mesh == "mesh of generation 0" and sorted(parts.stateful()) == ["model", "optimizer"]
    assert model(torch.ones(1, 2)).shape == (1, 1) and schedule.step() == "stepped"
    parts.retire()
    for use, name in ((lambda: model(torch.ones(1, 2)), "model"), (lambda: model[2](torch.ones(1, 2)), "model"),
                      (optimizer.step, "optimizer"), (schedule.step, "schedule"), (schedule.eval, "schedule")):
        with pytest.raises(StalePartsError) as err:
            use()
        assert f"this {name} was built for generation 0, which ended" in str(err.value)
        assert f"read parts.{name} in each step" in str(err.value)
    parts.build("mesh of generation 1", 1)
    assert parts.model is not model and parts.model(torch.ones(1, 2)).shape == (1, 1)
    assert parts.generation == 1 and "scheduler" not in parts.stateful()


def test_a_model_from_an_earlier_generation_returned_again_is_refused():
    kept = nn.Linear(2, 2)
    parts = Parts(MeshLayout.parse({"dp": 1}, 1), lambda mesh: (kept, torch.optim.SGD(kept.parameters(), lr=0.1)))
    parts.build(None, 0)
    assert parts.schedule is None
    parts.retire()
    with pytest.raises(RuntimeError, match="returned the model of an earlier generation again: make the model"):
        parts.build(None, 1)


def test_a_wrapper_applied_twice_is_explained():
    def build(mesh):
        raise AssertionError("fully_shard can only be applied to a module once")

    parts = Parts(MeshLayout.parse({"dp": 1}, 1), lambda mesh: (nn.Linear(1, 1), None))
    parts.build(None, 0)
    parts._build = build
    with pytest.raises(RuntimeError, match="make the model inside build\\(mesh\\), anew in every generation"):
        parts.build(None, 1)


@pytest.mark.parametrize("made, said", [(nn.Linear(1, 1), "must return a dict of parts"),
                                        ({"optimizer": None}, "returned no model")])
def test_build_returning_something_else_is_a_type_error(made, said):
    with pytest.raises(TypeError, match=said):
        Parts(MeshLayout.parse({"dp": 1}, 1), lambda mesh: made).build(None, 0)


def test_an_unknown_part_is_an_attribute_error_listing_the_parts():
    parts = Parts(MeshLayout.parse({"dp": 1}, 1), _build)
    parts.build(None, 0)
    with pytest.raises(AttributeError, match=r"no part named 'critic' \(it returned \['model', 'optimizer', "):
        parts.critic


def test_the_pinned_torch_has_the_private_names_we_use():
    import torch.distributed as dist
    import torch.distributed.tensor  # noqa: F401  (the caches exist once DTensor is imported)

    from dpstate.groups import torch_private

    torch_private.clear_dtensor_caches()
    before = dist.distributed_c10d._world.group_count
    torch_private.name_groups_for(3)
    assert dist.distributed_c10d._world.group_count == 3 * torch_private.GROUP_NAMES_PER_GENERATION + 1
    dist.distributed_c10d._world.group_count = before


def test_mesh_groups_are_named_by_layout_a_name_never_changes_its_ranks_and_caches_follow_the_rank(monkeypatch):
    import torch.distributed as dist

    from dpstate.groups import torch_private

    world = dist.distributed_c10d._world
    before = world.group_count
    names = []
    for layout in ("pp=2 x tp=2", "pp=2 x tp=2", "dp=4"):
        with torch_private.mesh_group_names(layout):
            names.append(world.group_count)
        assert world.group_count == before
    assert names[0] == names[1] != names[2] and min(names) > 10**6 * torch_private.GROUP_NAMES_PER_GENERATION

    class Group:
        def __init__(self, name, ranks):
            self.group_name, self.ranks = name, ranks

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: group.ranks)
    monkeypatch.setattr(torch_private, "_MESH_GROUP_RANKS", {})
    torch_private.check_mesh_group_ranks([Group("7", [2, 3]), Group("8", [1, 3])])
    torch_private.check_mesh_group_ranks([Group("7", [2, 3])])
    cleared = []
    monkeypatch.setattr(torch_private, "clear_dtensor_caches", lambda: cleared.append(True))
    monkeypatch.setattr(torch_private, "_CACHES_RANK", [])
    for rank in (3, 3, 5, 5):  # a process that plays another rank: its cached sub-meshes hold the old one's
        torch_private.dtensor_caches_for(rank)
    assert cleared == [True]
    with pytest.raises(RuntimeError, match=r"named 7 holds ranks \[1, 3\] in this generation but held \[2, 3\]"):
        torch_private.check_mesh_group_ranks([Group("7", [1, 3])])


def test_the_mesh_is_an_event_once_and_shows_in_the_dashboard_and_the_report():
    h = formed()
    for rank, node in enumerate(("a", "b")):
        h.msg(node, p.WorkerReady(node, 0, rank, 0.1, 0.0, "", mesh="dp=2"))
    (event,) = h.named("mesh")
    assert event["layout"] == "dp=2"
    view = JobView()
    for e in h.events:
        view.on_event(e)
    model = view.model(h.now)
    assert model["mesh"] == "dp=2"
    assert "mesh dp=2: shards held whole" in replica_lines(model, 120)[0].plain
    out = io.StringIO()
    print_report(model, Console(file=out, width=200))
    assert "mesh dp=2: sharded state; each node's replicas hold its ranks' shards whole" in out.getvalue()


def test_an_error_that_pipelining_wraps_is_classified_by_what_it_wraps():
    """torch.distributed.pipelining raises RuntimeError("[Stage 0] failed to run forward: ...") from the
    collective's error: a peer's failure all the same (it once ended a survivor's script)."""
    import torch.distributed as dist

    from dpstate.steps.abort import classify, describe

    try:
        try:
            raise dist.DistNetworkError("Connection reset by peer")
        except Exception as inner:
            raise RuntimeError("\n            [Stage 0] failed to run forward:\n            args: ()") from inner
    except RuntimeError as wrapped:
        assert classify(wrapped) == "peer"
        assert describe(wrapped) == "DistNetworkError: Connection reset by peer"
    assert classify(RuntimeError("[Stage 0] failed to run forward")) is None
    assert classify(StalePartsError("dpstate: this model was built for generation 0 ...")) is None
