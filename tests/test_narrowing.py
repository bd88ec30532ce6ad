"""The job's width (dprun.controller.narrowing): shrinking hands a lost process's logical ranks to the least busy
survivors, growing gives them back to joining processes; every logical rank stays trained exactly once."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dprun.controller.narrowing import Width


def test_three_ranks_lose_one_and_grow_back():
    narrow = Width.full(3).shrink({1})
    assert narrow.assignment == ((0, 1), (2,))
    assert narrow.narrow and narrow.logical_world == 3 and narrow.processes == 2 and narrow.slowdown == 2
    assert narrow.own_ranks() == [0, 2]
    grown = narrow.grow(1)
    assert grown.assignment == ((0,), (2,), (1,)) and not grown.narrow and grown.slowdown == 1


def test_a_node_of_two_processes_lost_spreads_its_ranks_over_the_least_busy():
    assert Width.full(6).shrink({2, 3}).assignment == ((0, 2), (1, 3), (4,), (5,))
    assert Width.full(2).shrink({0}).assignment == ((1, 0),)
    assert Width.full(2).shrink({0, 1}) == "no data-parallel replica would be left"


def test_growing_stops_when_nothing_is_carried_and_keeps_the_rest():
    narrow = Width.full(4).shrink({3})
    assert narrow.grow(3).assignment == ((0,), (1,), (2,), (3,))
    assert Width.full(6).shrink({2, 3}).grow(1).assignment == ((0,), (1, 3), (4,), (5,), (2,))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.data())
def test_every_logical_rank_is_trained_exactly_once_through_shrinks_and_grows(world, data):
    width = Width.full(world)
    for _ in range(6):
        if data.draw(st.booleans()) and width.processes > 1:
            lost = set(data.draw(st.lists(st.integers(0, width.processes - 1), min_size=1,
                                          max_size=width.processes - 1)))
            shrunk = width.shrink(lost)
            assert isinstance(shrunk, Width)
            assert shrunk.processes == width.processes - len(lost)
            assert shrunk.slowdown - min(len(r) for r in shrunk.assignment) <= max(
                1, width.slowdown - min(len(r) for r in width.assignment))
            width = shrunk
        else:
            width = width.grow(data.draw(st.integers(0, 3)))
        assert sorted(r for ranks in width.assignment for r in ranks) == list(range(world))
