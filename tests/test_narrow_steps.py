"""A narrow job (fewer processes than data-parallel ranks, each training some ranks' micro-batches) steps bitwise
as the full-width job does: same samples per rank, same RNG per rank, gradients summed in the same order."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port
from dpstate.groups.carried import Carried, PerRank
from dpstate.snapshot.rank_parts import as_own, carried_by, rank_part, with_part
from dpstate.snapshot.state import Tracked, rng_state, set_rng_state
from dpstate.steps.abort import AbortSignal
from dpstate.steps.data_ranks import DataRanks

WORKER = str(Path(__file__).parent / "data" / "narrow_worker.py")


def _run(procs, tmp_path: Path, name: str, world: int, carry: str = "") -> list[dict]:
    port, out = free_port(), tmp_path / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    ranks = [procs.popen([sys.executable, WORKER, "--out", str(out), *(["--carry", carry] if carry else [])],
                         env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                              "WORLD_SIZE": str(world), "LOCAL_RANK": "0"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    for rank in ranks:
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def _by_rank(results: list[dict], key: str) -> dict:
    return {int(rank): value for result in results for rank, value in result[key].items()}


@pytest.mark.slow  # six torch processes: 30-40 s
@pytest.mark.timeout(300)
def test_a_narrow_step_is_bitwise_the_full_width_step(procs, tmp_path):
    full = _run(procs, tmp_path, "full3", 3)
    assert len({r["params"] for r in full}) == 1, full
    losses = _by_rank(full, "losses")
    assert len({tuple(v) for v in losses.values()}) == 3, "each rank has its own samples and dropout"
    narrow = _run(procs, tmp_path, "narrow2", 2, carry="1,2;0")  # the lost rank 2 carried by process 0
    assert [r["ranks"] for r in narrow] == [[1, 2], [0]]
    assert {r["params"] for r in narrow} == {full[0]["params"]}
    assert _by_rank(narrow, "losses") == losses
    assert _by_rank(narrow, "data") == _by_rank(full, "data")
    two = _run(procs, tmp_path, "full2", 2)
    one = _run(procs, tmp_path, "narrow1", 1, carry="0,1")  # width 2 trained by a single process
    assert one[0]["params"] == two[0]["params"] != full[0]["params"]
    assert _by_rank(one, "losses") == _by_rank(two, "losses")


def test_carried_ranks_are_placed_once_each():
    carried = Carried.assigned([[1, 2], [0]], 1)
    assert carried.ranks == (0,) and carried.logical_world == 3 and carried.narrow and carried.rows == 2
    assert carried.places == ((1, 0), (0, 0), (0, 1))
    assert not Carried.full(2, 4).narrow and Carried.full(2, 4).places[3] == (3, 0)
    with pytest.raises(ValueError, match="assigned to processes 0 and 1"):
        Carried.assigned([[0, 1], [1]], 0)
    with pytest.raises(ValueError, match=r"not 0\.\.2"):
        Carried.assigned([[0, 3], [1]], 0)


class _Position:
    def __init__(self, rank: int):
        self.rank, self.at = rank, 0

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def test_per_rank_objects_follow_the_ranks_carried_and_their_state_goes_with_them():
    built = []
    per = PerRank(lambda r: built.append(r) or _Position(r), [1])
    per[1].at = 5
    per.carry([1, 2])
    assert built == [1, 2] and per[1].at == 5
    per[2].at = 9
    saved = per.state_dict()
    assert saved == {"per_rank": {"1": {"at": 5}, "2": {"at": 9}}}
    other = PerRank(_Position, [2])
    other.load_state_dict(saved)
    assert other[2].at == 9 and list(other) == [2]
    with pytest.raises(KeyError, match="trains logical ranks \\[2\\], not 1"):
        other[1]
    with pytest.raises(KeyError, match="logical ranks \\[3\\] is not in it"):
        PerRank(_Position, [3]).load_state_dict(saved)


def _process(assignment: list[list[int]], p: int, positions: dict[int, int], seeds: dict[int, int]):
    """A process's tracked state training assignment[p]: per-rank positions, and each rank's RNG seeded."""
    tracked = Tracked()
    ranks = DataRanks(tracked, [], AbortSignal())
    carried = Carried.assigned(assignment, p)
    data = ranks.per_rank(_Position, carried)
    tracked.add(data=data)
    ranks.carry(carried, {r: _seeded(seeds[r]) for r in carried.ranks[1:] if r in seeds})
    for r in carried.ranks:
        data[r].at = positions.get(r, 0)
    if carried.ranks[0] in seeds:
        set_rng_state(_seeded(seeds[carried.ranks[0]]))
    return tracked, ranks, data


def _seeded(seed: int) -> dict:
    own = rng_state()
    torch.manual_seed(seed)
    state = rng_state()
    set_rng_state(own)
    return state


def _draw(state: dict) -> float:
    own = rng_state()
    set_rng_state(state)
    value = torch.rand(1).item()
    set_rng_state(own)
    return value


def test_a_rank_moves_between_snapshots_with_its_data_position_and_its_rng():
    """Shrink: process 0 of width 3 adopts rank 2 from the snapshot of the process that trained it; grow: a
    new process takes rank 2 as its own from process 0's narrow snapshot. Each time rank 2's data position and
    RNG come along, and the snapshots say which ranks they hold."""
    tree_0 = _process([[0], [1], [2]], 0, {0: 10}, {0: 100})[0].capture(5)
    tree_2 = _process([[0], [1], [2]], 2, {2: 12}, {2: 102})[0].capture(5)
    assert carried_by(tree_2) == [2] and rank_part(tree_2, 2)["objects"] == {"data": {"at": 12}}
    with pytest.raises(KeyError, match="holds logical ranks \\[2\\], not 0"):
        rank_part(tree_2, 0)

    tracked, ranks, data = _process([[0, 2], [1]], 0, {}, {})  # after the shrink, before its restore
    merged = with_part(tree_0, 2, rank_part(tree_2, 2))
    assert carried_by(merged) == [0, 2] and carried_by(tree_0) == [0]  # (the copy is a new tree)
    tracked.restore(merged)
    assert (data[0].at, data[2].at) == (10, 12)
    assert torch.rand(1).item() == _draw(_seeded(100))  # its own RNG is rank 0's
    with ranks._rng.as_rank(2):
        assert torch.rand(1).item() == _draw(_seeded(102))  # and rank 2's is rank 2's, advanced there
    narrow_tree = tracked.capture(6)
    assert carried_by(narrow_tree) == [0, 2]

    tracked, ranks, data = _process([[0], [1], [2]], 2, {}, {})  # a joining process, rank 2 its own
    tracked.restore(as_own(narrow_tree, 2))
    assert data[2].at == 12 and list(data) == [2]
    torch.manual_seed(102)
    torch.rand(1)
    second = torch.rand(1).item()
    tracked.restore(as_own(narrow_tree, 2))
    assert torch.rand(1).item() == second  # rank 2's stream goes on from its draw in the narrow process


def test_a_new_rank_without_its_rng_restored_says_so():
    _, ranks, _ = _process([[0, 1]], 0, {}, {})
    with pytest.raises(RuntimeError, match="RNG state of logical rank 1, new to this process, was not restored"):
        with ranks._rng.as_rank(1):
            pass
