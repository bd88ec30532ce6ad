"""A snapshot taken anew after a restore that took in other ranks' parts (dpstate.steps.restoring) keeps the parts
of the ranks its process held and no longer trains: a process that adopts one of them from it finds it there."""

import pytest

from dpstate.snapshot.rank_parts import as_own, carried_by, rank_part, with_part
from test_narrow_steps import _process

pytestmark = pytest.mark.timeout(30)


def test_a_retaken_snapshot_keeps_the_part_of_a_rank_its_process_no_longer_trains():
    """Process 0 trained ranks 0 and 3 to step 5; the job changes width twice before it trains again: rank 3 to a
    joining process, rank 2 to process 0. Process 0's snapshot of step 5, taken anew with rank 2's part, still
    holds rank 3's, so the joining process adopts rank 3 from it whether it fetches it before or after."""
    held = _process([[0, 3], [1], [2]], 0, {0: 10, 3: 13}, {0: 100, 3: 103})[0].capture(5)
    tree_2 = _process([[0, 3], [1], [2]], 2, {2: 12}, {2: 102})[0].capture(5)
    tracked, _, data = _process([[0, 2], [1], [3]], 0, {}, {})
    retaken = with_part(held, 2, rank_part(tree_2, 2))
    tracked.restore(retaken)
    assert (data[0].at, data[2].at) == (10, 12) and 3 not in list(data)
    assert carried_by(retaken) == [0, 3, 2]
    assert rank_part(retaken, 3) == rank_part(held, 3)
    joining, _, joined = _process([[0, 2], [1], [3]], 2, {}, {})
    joining.restore(as_own(retaken, 3))
    assert joined[3].at == 13


def test_a_part_taken_in_again_replaces_the_stale_one():
    held = _process([[0, 2], [1]], 0, {0: 10, 2: 2}, {0: 100, 2: 102})[0].capture(5)
    fresh = _process([[0], [1], [2]], 2, {2: 12}, {2: 102})[0].capture(5)
    retaken = with_part(held, 2, rank_part(fresh, 2))
    assert carried_by(retaken) == [0, 2] and rank_part(retaken, 2)["objects"] == {"data": {"at": 12}}
