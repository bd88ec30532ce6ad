"""A narrow job (fewer processes than data-parallel ranks, each training some ranks' micro-batches) steps bitwise
as the full-width job does: same samples per rank, same RNG per rank, gradients summed in the same order."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from dpstate.groups.carried import Carried, PerRank

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
