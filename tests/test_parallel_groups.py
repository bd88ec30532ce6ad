"""A job's DeviceMesh with real processes over a real TCPStore: a collective waiting on a frozen peer is released
by severing the old generation's connections; a mesh's groups keep their names across generations, so that a
sub-mesh of an old generation (as DTensor's caches hold them) reaches the new group of the same ranks; sharded
state captured in one generation loads bit for bit into parts built anew in the next.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import REPO

WAITER = textwrap.dedent("""
    import os, signal, sys, threading, time, torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.mesh import MeshLayout
    from dpstate.groups.pgroup import GroupManager
    endpoint, rank, sever = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "sever"
    groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
    abort.add_callback(groups.on_abort)
    groups.sever_on_abort = sever
    abort.enter(0)
    groups.build(0, endpoint, rank, 2, abort)
    mesh = groups.build_mesh(MeshLayout.parse({"tp": 2}, 2), "cpu")
    print(f"recorded {len(groups.connections)}", flush=True)  # (0 where the groups connect lazily)
    def partial_sum():
        return DTensor.from_local(torch.ones(4), mesh["tp"], [Partial()]).redistribute(mesh["tp"], [Replicate()])
    collective = partial_sum
    collective()  # both ranks once: DTensor's first op is slow
""")

# Rank 1 freezes; rank 0 calls collective() again, which waits on it, until a newer generation is asked for
FROZEN_PEER = textwrap.dedent("""
    import datetime
    host, port = endpoint.split(":")[0], int(endpoint.split(":")[1])
    store = dist.TCPStore(host, port, is_master=False)
    store.set(f"built{rank}", "1")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its peer's collective waits on it
        os._exit(0)
    store.wait(["built1"])
    def newer_generation():  # (a client of its own: one TCPStore client serves one request at a time)
        dist.TCPStore(host, port, is_master=False).wait(["abort"], datetime.timedelta(seconds=120))
        abort.request(1, "test")
    threading.Thread(target=newer_generation, daemon=True).start()
    store.set("waiting", "1")
    t0 = time.monotonic()
    try:
        collective()
        print("completed", flush=True)
    except RuntimeError as exc:
        print(f"released after {time.monotonic() - t0:.3f} s: {str(exc)[:120]}", flush=True)
    os._exit(0)  # the groups are leaked on purpose; skip their destructors
""")



def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def _waiting_on_a_frozen_peer(procs, store, script: str, mode: str, env: dict | None = None) -> subprocess.Popen:
    """Starts `script` as ranks 0 and 1; once rank 1 froze itself (SIGSTOP) while rank 0 waits on it in a
    collective, asks rank 0 for a newer generation. Returns rank 0's process."""
    endpoint = f"127.0.0.1:{store.port}"
    ranks = [procs.popen([sys.executable, "-c", script, endpoint, str(r), mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for r in (0, 1)]
    store.wait(["waiting"], datetime.timedelta(seconds=180))
    deadline = time.monotonic() + 60
    while not _stopped(ranks[1].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _stopped(ranks[1].pid)
    store.set("abort", "1")
    return ranks[0]


def _released(rank0: subprocess.Popen) -> tuple[str, str]:
    """(rank 0's output, what released it), having checked that it was released within 10 s."""
    out, err = rank0.communicate(timeout=60)
    match = re.search(r"released after ([\d.]+) s: (.*)", out)
    assert match, out + err[-2000:]
    assert float(match.group(1)) < 10.0, out  # (milliseconds on a quiet host)
    return out, match.group(2)


@pytest.mark.slow
@pytest.mark.parametrize("sever, lazy", [(True, False), (False, False), (True, True)])
@pytest.mark.timeout(300)  # seconds on a quiet host; minutes when it is starved
def test_a_tensor_parallel_collective_waiting_on_a_frozen_peer_is_released(procs, store, sever, lazy):
    """lazy: the groups connect each pair on its first use (after the build, in Gloo's threads), and severing
    finds that connection when it severs."""
    rank0 = _waiting_on_a_frozen_peer(procs, store, WAITER + FROZEN_PEER, "sever" if sever else "keep",
                                      env={"DP_GLOO_LAZY_CONNECT": "1" if lazy else "0"})
    if sever:
        out, why = _released(rank0)
        assert "Connection closed by peer" in why or "Connection reset" in why, out
        recorded = int(re.search(r"recorded (\d+)", out).group(1))
        assert (recorded == 0) if lazy else (recorded > 0), out
    else:  # the control: without severing nothing releases it (Gloo's abort does not)
        with pytest.raises(subprocess.TimeoutExpired):
            rank0.communicate(timeout=3)


FSDP_WAITER = textwrap.dedent("""
    import datetime, os, signal, sys, threading, time, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.abortable_fsdp import wait_abortably
    from dpstate.groups.mesh import MeshLayout
    from dpstate.groups.pgroup import GroupManager
    endpoint, rank, abortable = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "abortable"
    groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
    abort.enter(0)
    groups.build(0, endpoint, rank, 2, abort)  # (not severed: the abort alone must release the wait)
    mesh = groups.build_mesh(MeshLayout.parse({"dp": 2}, 2), "cpu")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    print("given", wait_abortably(model, abort) if abortable else 0, flush=True)
    model(torch.ones(2, 8)).sum().backward()  # both ranks once: all-gathers and reduce-scatters
    collective = lambda: model(torch.ones(2, 8))
""")


@pytest.mark.slow
@pytest.mark.parametrize("abortable", [True, False])
@pytest.mark.timeout(300)
def test_an_fsdp_all_gather_waiting_on_a_frozen_peer_is_released_by_the_abort_alone(procs, store, abortable):
    rank0 = _waiting_on_a_frozen_peer(procs, store, FSDP_WAITER + FROZEN_PEER, "abortable" if abortable else "torch")
    if abortable:
        out, why = _released(rank0)
        assert "given 3" in out, out  # the two layers and the root
        assert "dpstate: aborted: generation 1 requested" in why, out
    else:  # the control: torch's own wait stays in Gloo (no severing here either)
        with pytest.raises(subprocess.TimeoutExpired):
            rank0.communicate(timeout=3)


GENERATIONS = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.mesh import MeshLayout
    from dpstate.groups.parallel import Parts, StalePartsError
    from dpstate.groups.pgroup import GroupManager
    from dpstate.snapshot.state import Tracked
    torch.manual_seed(1)  # the state trained in generation 1 differs from a fresh build's

    def build(mesh):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
    layout = MeshLayout.parse({"dp": 1, "tp": 1}, 1)
    parts, tracked = Parts(layout, build), Tracked()
    names = {}
    for generation in (1, 2):
        if parts.generation >= 0:
            tracked.remove(*parts.stateful())
            old_model, old_mesh, old_tp = parts.model, parts.mesh, parts.mesh["tp"]
            parts.retire()
            groups.destroy()
        groups.build(generation, sys.argv[1], 0, 1, abort)
        parts.build(groups.build_mesh(layout, "cpu"), generation)
        tracked.add(**parts.stateful())
        names[generation] = sorted(parts.mesh[d].get_group().group_name for d in layout.names)
        if generation == 1:
            for _ in range(2):
                parts.model(torch.randn(4, 8)).square().mean().backward()
                parts.optimizer.step()
            tree = tracked.capture(1)
            trained = {k: v.to_local().clone() for k, v in parts.model.state_dict().items()}
            moments = [s["exp_avg"].to_local().clone() for s in parts.optimizer.state.values()]
    print("names", names[1], names[2], flush=True)
    print("old sub-mesh reaches the new group:", old_tp.get_group() is parts.mesh["tp"].get_group(), flush=True)
    fresh_equal = all(torch.equal(trained[k], v.to_local()) for k, v in parts.model.state_dict().items())
    tracked.restore(tree)
    print("fresh build equal to the trained state:", fresh_equal, flush=True)
    print("restored equal:", all(torch.equal(trained[k], v.to_local()) for k, v in parts.model.state_dict().items()),
          all(torch.equal(m, s["exp_avg"].to_local()) for m, s in zip(moments, parts.optimizer.state.values())),
          len(moments) == len(parts.optimizer.state) == 4, flush=True)
    parts.model(torch.randn(4, 8)).square().mean().backward()
    parts.optimizer.step()  # the restored optimizer state is on the new mesh
    for what, use in (("model", lambda: old_model(torch.randn(4, 8))), ("mesh", lambda: old_mesh["tp"]),
                      ("mesh", lambda: old_mesh.get_group())):
        try:
            use()
            print(f"old {what} used", flush=True)
        except StalePartsError as exc:
            print(f"old {what}: {exc}", flush=True)
    os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parts_rebuilt_in_a_new_generation_load_the_old_ones_shards(procs, store):
    proc = procs.popen([sys.executable, "-c", GENERATIONS, f"127.0.0.1:{store.port}"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    names = re.search(r"names (\[.*?\]) (\[.*?\])", out)
    assert names and eval(names.group(1)) == eval(names.group(2)), out
    assert "old sub-mesh reaches the new group: True" in out, out
    assert "fresh build equal to the trained state: False" in out, out
    assert "restored equal: True True True" in out, out + err[-3000:]
    assert "old model used" not in out and "old mesh used" not in out, out
    assert "old model: dpstate: this model was built for generation 1, which ended" in out, out
    assert out.count("old mesh: dpstate: this DeviceMesh belongs to a generation that ended") == 2, out
