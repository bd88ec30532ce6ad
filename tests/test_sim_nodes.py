"""The simulation's model of a replica store (dprun.sim.cluster.SimNode) against the real one (dpagent's
ReplicaStore): the same random reserves and puts, the same copies kept, refused and dropped, step by step.
A model that drifts from the store would let the simulation prove invariants of a system we do not ship."""

from __future__ import annotations

import random

import pytest

from dpcommon.protocol import PutSnapshot
from dpcommon.replica_store import ReplicaStore
from dprun.sim.cluster import SimNode

pytestmark = pytest.mark.timeout(60)

META, DATA = b"m", b"d"  # a put's payload: the store checks only its size


def held(store: ReplicaStore) -> dict:
    return {(rank, step): store.get(rank, step).generation for rank in store.ranks() for step in store.steps(rank)}


def modelled(node: SimNode) -> dict:
    return {(rank, step): node.store_gen[(rank, step)] for rank, steps in node.store.items() for step in steps}


def random_put(rng: random.Random, ranks: int, generation: int) -> tuple[int, int, int]:
    """Mostly a later step of the current generation, sometimes an old step, an old generation or a new one."""
    return rng.randrange(ranks), rng.randrange(12), max(0, generation + rng.choice([0, 0, 0, -1, 1]))


def test_the_model_keeps_refuses_and_drops_what_the_store_does():
    outcomes = {"stored": 0, "refused": 0, "made room": 0}
    for seed in range(500):
        run_one(random.Random(seed), outcomes)
    assert min(outcomes.values()) > 100, f"the random puts missed a case: {outcomes}"


def run_one(rng: random.Random, outcomes: dict) -> None:
    store, node = ReplicaStore(), SimNode("n0", 1)
    generation = 0
    for _ in range(40):
        rank, step, generation = random_put(rng, 2, generation)
        before = held(store)
        if rng.random() < 0.4:  # ReserveSnapshot ahead of the put
            real = sorted((s.rank, s.step) for s in store.make_room(rank, step, generation))
            model = sorted(node.make_room((rank, step, generation)))
            assert model == real, f"make_room{(rank, step, generation)} over {before}"
            outcomes["made room"] += bool(real)
        error = store.add(PutSnapshot(rank, step, generation, checksum=0, nbytes=len(META) + len(DATA)), META, DATA)
        stored, _ = node.add((rank, step, generation))
        assert stored == (error == ""), f"add{(rank, step, generation)} over {before}: store said {error!r}"
        outcomes["stored" if stored else "refused"] += 1
        assert modelled(node) == held(store), f"after add{(rank, step, generation)} over {before}"


def test_a_step_older_than_the_copies_kept_is_refused_and_a_newer_generation_supersedes():
    node = SimNode("n0", 1)
    assert node.add((0, 5, 1)) == (True, []) and node.add((0, 6, 1)) == (True, [])
    assert node.add((0, 4, 1)) == (False, []), "older than both copies kept"
    assert node.add((0, 7, 0)) == (False, []), "a fenced sender"
    assert node.add((0, 6, 2)) == (True, [(0, 6)]), "generation 2 replaces its timeline from step 6 on"
    assert modelled(node) == {(0, 5): 1, (0, 6): 2}
    assert node.add((0, 7, 2)) == (True, [(0, 5)]) and modelled(node) == {(0, 6): 2, (0, 7): 2}


def test_a_new_copy_replaces_a_damaged_one():
    node = SimNode("n0", 1)
    node.add((0, 1, 0))
    node.add((0, 2, 0))
    node.damage("all-but-oldest")
    assert node.corrupt == {(0, 2)}
    node.add((0, 2, 1))
    assert node.corrupt == set() and modelled(node) == {(0, 1): 0, (0, 2): 1}
