"""The CUDA path on a real GPU: side-stream snapshots of CUDA state into pinned buffers, their replicas, the
restore onto the GPU, and NCCL groups built, aborted and rebuilt. Skipped where no CUDA device is visible
(the CPU-runnable checks of the same code are in tests/test_cuda_stand_in.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from dpcommon import protocol as P
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.groups.pgroup import GroupManager
from dpstate.replication.replicator import Replicator
from dpstate.snapshot.state import Tracked
from helpers.fake_agents import TOKEN

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]


def cuda_state(width: int = 2048, layers: int = 6, seed: int = 0):
    """A model + AdamW on the GPU after one step: about 300 MB of state (big enough that a step's kernels are
    still running when the snapshot is submitted)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    train_step(model, opt)
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt)
    return model, opt, tracked


def train_step(model, opt, rows: int = 4096) -> None:
    x = torch.randn(rows, model[0].in_features, device="cuda")
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def expected_state(model, opt) -> dict:
    """The state as the GPU holds it once every kernel queued so far has run."""
    torch.cuda.synchronize()
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()}}


def assert_same(tree: dict, expected: dict) -> None:
    for key, value in expected["model"].items():
        assert torch.equal(tree["state"]["model"][key].cpu(), value), key
    for index, entries in expected["optimizer"].items():
        for name, value in entries.items():
            got = tree["state"]["optimizer"]["state"][index][name]
            assert torch.equal(got.cpu(), value) if isinstance(value, torch.Tensor) else got == value, (index, name)


def test_snapshot_submitted_while_the_step_runs_holds_the_state_after_the_step(replica):
    """submit() straight after opt.step(), no synchronize: the side stream waits for the step's kernels (the
    event), copies into pinned host memory, and the replica holds exactly the post-step bytes."""
    model, opt, tracked = cuda_state()
    rep = Replicator(P.Codec(TOKEN), 1, AbortSignal())
    assert rep.pin, "with CUDA the snapshot buffers are page-locked"
    rep.configure(0, replica.replica_endpoint, 1)
    for step in range(1, 4):
        rep.wait_acked(timeout=30)  # the snapshot gate, before the optimizer changes the state
        train_step(model, opt)
        rep.submit(step, tracked.capture(step))  # kernels of this step still queued on the GPU
    rep.wait_acked(timeout=30)
    expected = expected_state(model, opt)
    held = rep.local(3)
    assert held is not None and held.data.is_pinned()
    assert rep.stats.captures == 3 and rep.stats.copy_s > 0

    other = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    fetched = other.fetch(replica.replica_endpoint, 1, 3, timeout=30)
    assert fetched.checksum == held.checksum
    assert_same(S.unpack(fetched.meta, fetched.data), expected)


def test_restore_from_a_replica_lands_on_the_gpu_in_a_fresh_process_state(replica):
    """A spare's model and optimizer (no state yet) restored from the replica: parameters and AdamW state on
    the GPU, equal to the snapshot; the next step of both gives the same parameters."""
    model, opt, tracked = cuda_state(seed=0)
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    rep.configure(0, replica.replica_endpoint, 0)
    rep.submit(1, tracked.capture(1))
    rep.wait_acked(timeout=30)

    torch.manual_seed(1)  # the spare: another initialisation, an optimizer that never stepped
    spare = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    spare_opt = torch.optim.AdamW(spare.parameters(), lr=1e-3, foreach=True)
    spare_tracked = Tracked()
    spare_tracked.add(model=spare, optimizer=spare_opt)
    slot = Replicator(P.Codec(TOKEN), 0, AbortSignal()).fetch(replica.replica_endpoint, 0, 1, timeout=30)
    tree = S.unpack(slot.meta, slot.data)
    spare_tracked.restore(tree)
    assert all(s["exp_avg"].is_cuda for s in spare_opt.state.values())
    assert_same(spare_tracked.capture(1), expected_state(model, opt))

    torch.manual_seed(2)
    train_step(model, opt)
    torch.manual_seed(2)
    train_step(spare, spare_opt)
    for a, b in zip(model.parameters(), spare.parameters()):
        assert torch.equal(a, b)


def test_nccl_group_is_built_aborted_and_rebuilt_for_each_generation():
    """The communicator reconstruction path with NCCL: generation 1 all-reduces, destroy() aborts its
    communicator, generation 2 is built on the same store and all-reduces again."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    manager = GroupManager(backend="nccl", timeout_s=60)  # build() connects to the store
    abort = AbortSignal()
    try:
        for generation in (1, 2, 3):
            manager.build(generation, f"127.0.0.1:{master.port}", 0, 1, abort)
            assert dist.get_backend() == "nccl"
            t = torch.full((4,), float(generation), device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            assert t.tolist() == [float(generation)] * 4
        assert manager.leaked == 2
    finally:
        manager.destroy()
    assert not dist.is_initialized()


@pytest.mark.slow  # starts dprun
@pytest.mark.parametrize("interval", [1, 4])
def test_a_gpu_node_killed_mid_run_is_hot_swapped_onto_its_spare_with_nccl(procs, tmp_path, interval):
    """dprun end to end on the GPU: one node (NCCL, world 1) and a spare that holds its replica; the node is
    killed by SIGKILL at step 15; the spare is promoted, restores from its replica onto the GPU, rebuilds the
    NCCL group and trains to the end. Every 4th step: acks are awaited at snapshot steps only (on a GPU), so
    the restore step is one of the 2 newest snapshots (8 or 12)."""
    from conftest import HOST_CUDA_DEVICES
    from helpers.e2e import dprun

    run = dprun(procs, tmp_path, f"gpu-kill-node-{interval}", "--nnodes", "1", "--spares", "1",
                "--snapshot-interval", str(interval), "--inject", "kill-node:0@step=15", steps=40,
                env={"CUDA_VISIBLE_DEVICES": HOST_CUDA_DEVICES})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "on cuda:0" in run.stdout
    (promoted,) = run.named("spare_promoted")
    assert promoted["spare"] == "node1" and promoted["node_rank"] == 0
    (done,) = run.named("recovery_complete")
    assert done["generation"] == 1 and done["phases"]["total_s"] < 30, done
    assert done["restore_step"] % interval == 0 and 15 - 2 * interval <= done["restore_step"] <= 15, done
    assert run.summary["final_step"] == 40
