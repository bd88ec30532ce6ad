"""A sharded job's shrink, planned (dprun.controller.mesh_narrowing) and followed by its workers
(dpstate.groups.mesh): whole data-parallel replicas leave, each tensor-parallel place carries a block of their
ranks, nodes go on or leave whole, and the narrow mesh puts every process where its ranks are."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpcommon.mesh_dims import MeshDims
from dprun.controller.mesh_narrowing import shrink_mesh
from dprun.controller.narrowing import Width
from dpstate.groups.carried import Carried
from dpstate.groups.mesh import MeshLayout, narrow_mesh_problem


def test_a_lost_replica_s_ranks_go_to_the_survivors_of_their_place():
    shrunk = shrink_mesh(Width.full(4), {1}, MeshDims.described("dp=2 x tp=2"), nproc=1, anchored={0})
    assert not isinstance(shrunk, str)
    assert shrunk.width.assignment == ((0, 2), (3, 1)) and shrunk.kept == (0, 3)


def test_a_node_holding_a_whole_replica_leaves_whole():
    shrunk = shrink_mesh(Width.full(4), {3}, MeshDims.described("dp=2 x tp=2"), nproc=2, anchored=set())
    assert not isinstance(shrunk, str)
    assert shrunk.width.assignment == ((0, 2), (1, 3)) and shrunk.kept == (0, 1)


def test_a_width_that_does_not_divide_the_replicas_narrows_further():
    """dp=4 loses one replica: three cannot carry four evenly, so two carry two each."""
    shrunk = shrink_mesh(Width.full(8), {2}, MeshDims.described("dp=4 x tp=2"), nproc=1, anchored=set())
    assert not isinstance(shrunk, str)
    assert shrunk.width.assignment == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_a_process_whose_state_only_it_holds_goes_on_even_out_of_its_row():
    shrunk = shrink_mesh(Width.full(8), {2, 3}, MeshDims.described("dp=4 x tp=2"), nproc=1, anchored={6})
    assert not isinstance(shrunk, str)
    assert shrunk.kept == (0, 1, 6, 5) and shrunk.width.assignment[2] == (6, 4)


@pytest.mark.parametrize("mesh, lost, nproc, why", [
    ("pp=2 x dp=2", {1}, 1, "has pipeline-parallel or replicated (HSDP) dims"),
    ("dp_replicate=2 x dp_shard=2", {1}, 1, "has pipeline-parallel or replicated (HSDP) dims"),
    ("dp=1 x tp=4", {1}, 1, "its data-parallel dim is of size 1"),
    ("tp=4", {1}, 1, "has no data-parallel dim"),
    ("dp=2 x tp=2", {0, 1, 2, 3}, 1, "no data-parallel replica would be left"),
    ("dp=2 x tp=3", {0, 1}, 2, "no narrower mesh keeps whole nodes and tensor-parallel groups"),
])
def test_a_mesh_that_cannot_shrink_says_why(mesh, lost, nproc, why):
    shrunk = shrink_mesh(Width.full(MeshDims.described(mesh).total), lost, MeshDims.described(mesh), nproc, set())
    assert isinstance(shrunk, str) and why in shrunk


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 2, 2), (3, 1, 1), (4, 1, 2), (6, 2, 2)]),
       st.data())
def test_every_shrink_the_controller_plans_is_one_its_workers_accept(shape, data):
    dp, tp, nproc = shape
    mesh = MeshDims.described(f"dp={dp} x tp={tp}")
    world = dp * tp
    lost_nodes = data.draw(st.sets(st.integers(0, world // nproc - 1), min_size=1, max_size=world // nproc - 1))
    lost = {p for node in lost_nodes for p in range(node * nproc, (node + 1) * nproc)}
    shrunk = shrink_mesh(Width.full(world), lost, mesh, nproc, set())
    if isinstance(shrunk, str):
        return
    assert not lost & set(shrunk.kept)
    assert sorted(r for ranks in shrunk.width.assignment for r in ranks) == list(range(world))
    layout = MeshLayout.parse({"dp": dp, "tp": tp}, world)
    for process in range(shrunk.width.processes):
        carried = Carried.assigned(shrunk.width.assignment, process)
        assert narrow_mesh_problem(layout, carried, process, shrunk.width.processes) is None


def test_the_worker_refuses_ranks_that_are_not_in_its_place():
    layout = MeshLayout.parse({"dp": 2, "tp": 2}, 4)
    assert "not in this process's place" in narrow_mesh_problem(
        layout, Carried.assigned(((0, 3), (2, 1)), 0), 0, 2)
    assert "not at its place in the narrow mesh" in narrow_mesh_problem(
        layout, Carried.assigned(((1, 3), (0, 2)), 0), 0, 2)
    assert "cannot run narrow" in narrow_mesh_problem(
        MeshLayout.parse({"pp": 2, "dp": 2}, 4), Carried.assigned(((0, 1), (2, 3)), 0), 0, 2)


def test_a_layout_narrows_along_its_data_dim_only():
    layout = MeshLayout.parse({"dp": 4, "tp": 2}, 8)
    assert layout.at_width(8) is layout and layout.at_width(4).describe() == "dp=2 x tp=2"
    assert layout.coordinates(5) == {"dp": 2, "tp": 1}
    with pytest.raises(ValueError, match="only its data-parallel dim"):
        layout.at_width(3)
    with pytest.raises(ValueError, match="only its data-parallel dim"):
        MeshLayout.parse({"tp": 4}, 4).at_width(2)
