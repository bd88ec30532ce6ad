"""GroupManager with real processes over a real TCPStore: a failed connect must not poison the next generation.

A rank that arrived for a generation and then died leaves its peers' connect to time out (or, where the groups
connect lazily, their first collective to fail); the next generation, with a replacement, must connect (torch's
default-group counter survives a failed init_process_group).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.pgroup import GroupManager, PeerConnectError
    endpoint, rank, generations = sys.argv[1], int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")]
    groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
    for generation in generations:
        try:
            groups.build(generation, endpoint, rank, 2, abort)
        except PeerConnectError as exc:
            print(f"generation {generation} failed: {exc}", flush=True)
            continue
        total = torch.tensor([rank + 1.0])
        try:
            dist.all_reduce(total)
        except RuntimeError as exc:  # (lazily connecting groups: the dead rank is met here)
            print(f"generation {generation} all-reduce failed: {str(exc)[:200]}", flush=True)
            continue
        print(f"generation {generation} sum {total.item():g}", flush=True)
    import os; os._exit(0)  # the groups are leaked on purpose; skip their destructors
""")


@pytest.mark.slow  # Gloo rank processes with torch: 10-20 s
@pytest.mark.parametrize("lazy", [False, True])
def test_a_rank_whose_connect_timed_out_joins_the_next_generation(procs, store, lazy):
    """lazy: the groups connect each pair on its first use, so the survivor's build succeeds and its first
    collective fails instead, within the connect timeout, not the collective one (60 s here)."""
    endpoint = f"127.0.0.1:{store.port}"
    # a rank 1 that arrived for generation 1 and died before connecting
    dist.PrefixStore("dp/gen1/", store).add("arrived", 1)
    env = {"DP_CONNECT_TIMEOUT": "2", "DP_GLOO_LAZY_CONNECT": "1" if lazy else "0"}
    survivor = procs.popen([sys.executable, "-c", RANK, endpoint, "0", "1,2"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    replacement = procs.popen([sys.executable, "-c", RANK, endpoint, "1", "2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = survivor.communicate(timeout=60)
    out1, err1 = replacement.communicate(timeout=60)
    failed = ("generation 1 all-reduce failed" if lazy else
              "generation 1 failed: generation 1: could not connect to every rank within 2 s")
    assert failed in out0, out0 + err0[-2000:]
    assert "generation 2 sum 3" in out0, err0[-2000:]
    assert "generation 2 sum 3" in out1, err1[-2000:]


@pytest.mark.slow  # Gloo rank processes with torch: 10-20 s
def test_a_traceback_after_several_generations_has_one_rank_prefix(procs, store):
    """torch wraps sys.excepthook in every init_process_group: GroupManager keeps one "[rankN]: " layer."""
    script = textwrap.dedent("""
        import sys
        from dpstate.steps.abort import AbortSignal
        from dpstate.groups.pgroup import GroupManager
        groups = GroupManager(backend="gloo", timeout_s=60)
        for generation in (1, 2, 3):
            groups.build(generation, sys.argv[1], 0, 1, AbortSignal())
        raise ValueError("boom")
    """)
    proc = procs.popen([sys.executable, "-c", script, f"127.0.0.1:{store.port}"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "[rank0]: ValueError: boom" in err.splitlines(), err[-2000:]
    assert "[rank0]: [rank0]:" not in err, err[-2000:]


@pytest.mark.slow  # Gloo rank processes with torch: 10-20 s
def test_the_gloo_rendezvous_keys_keep_their_size_as_the_world_grows(procs, store):
    """Each rank's rendezvous key in the store has a fixed size (Gloo's rank as sequence number): by default it
    lists 8 bytes per peer, and with every rank reading every key the store's traffic grew as R^3. A value the
    user set (0) is kept: generation 3 goes back to the keys that grow."""
    script = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        from dpstate.steps.abort import AbortSignal
        from dpstate.groups.pgroup import GroupManager
        endpoint, rank = sys.argv[1], int(sys.argv[2])
        groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
        for generation, world in ((1, 2), (2, 3), (3, 3)):
            if rank >= world:
                continue
            if generation == 3:
                os.environ["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] = "0"
            groups.build(generation, endpoint, rank, world, abort)
            total = torch.tensor([rank + 1.0])
            dist.all_reduce(total)
            print(f"generation {generation} sum {total.item():g}", flush=True)
        os._exit(0)
    """)
    endpoint = f"127.0.0.1:{store.port}"
    ranks = [procs.popen([sys.executable, "-c", script, endpoint, str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={"DP_GLOO_LAZY_CONNECT": "0"})
             for rank in range(3)]  # (the full mesh's keys: lazily, a key lists no pair identifiers at all)
    outs = [rank.communicate(timeout=90) for rank in ranks]
    for rank, (out, err) in enumerate(outs):
        expected = ["generation 2 sum 6", "generation 3 sum 6"] + (["generation 1 sum 3"] if rank < 2 else [])
        assert all(line in out for line in expected), (out, err[-2000:])

    def key_sizes(generation: int) -> set[int]:
        keys = [k for k in store.list_keys() if k.startswith(f"dp/gen{generation}/") and "arrived" not in k]
        assert keys, store.list_keys()
        return {len(store.get(k)) for k in keys}

    (two,), (three,), (grown,) = key_sizes(1), key_sizes(2), key_sizes(3)
    assert two == three  # not 8 bytes more for the third rank
    assert grown == three + 8 * 3  # the default layout: one pair identifier per rank (its own included)


class _Count:
    """A store whose arrival count reaches the world size after `polls` reads."""

    def __init__(self, world: int, polls: int):
        self.world, self.left = world, polls

    def add(self, key: str, amount: int) -> int:
        if amount:
            return 1
        self.left -= 1
        return self.world if self.left <= 0 else 1


class _Sleeps:
    def __init__(self):
        self.delays: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)


def test_the_ranks_waiting_for_each_other_poll_the_store_within_a_budget_at_any_size():
    """Every waiting rank polls the job's one store: 20 ms apart at most in a small job; in a large one the
    interval grows so that all of them together stay within ARRIVAL_POLLS_PER_S (4,096 ranks every 20 ms: 200,000
    a second, past what one store serves)."""
    from dpstate.groups.pgroup import ARRIVAL_POLLS_PER_S, GroupManager

    for world, longest in ((8, 0.02), (100, 0.02), (4096, 4096 / ARRIVAL_POLLS_PER_S)):
        groups, sleeps = GroupManager(backend="gloo"), _Sleeps()
        groups._gen_store, groups._rank, groups._world_size = _Count(world, polls=40), 0, world
        groups._arrive("arrived", 1, sleeps)
        assert sleeps.delays[0] == 0.001 and max(sleeps.delays) == longest, (world, sleeps.delays)
        assert world / max(sleeps.delays) <= ARRIVAL_POLLS_PER_S + 1e-9
