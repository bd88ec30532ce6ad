"""Resharding (dpstate.snapshot.reshard): a rank's parameters and optimizer state on a narrower (or wider) mesh,
filled from the snapshots that ranks of another mesh shape took, through DCP's load planner. One process: each
rank's group is torch's fake one, as test_ckpt_export builds its saved job."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dpstate.snapshot import packing as S
from dpstate.snapshot.state import Tracked

FULL = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 10
GRAD = torch.linspace(-1, 1, 48).reshape(8, 6)


def _on_mesh(rank: int, world: int, shape: tuple[int, int], with_state: bool):
    """(model, optimizer) of rank `rank` on a (dp, tp) mesh of `shape`: the weight's rows sharded over dp, its
    columns over tp; with_state: one AdamW step taken from FULL and GRAD, else zeros and no optimizer state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    start = FULL if with_state else torch.zeros_like(FULL)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(distribute_tensor(start, mesh, (Shard(0), Shard(1)), src_data_rank=None))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if with_state:
        model.weight.grad = distribute_tensor(GRAD, mesh, (Shard(0), Shard(1)), src_data_rank=None)
        opt.step()
    return model, opt


def _done() -> None:
    from dpstate.groups.torch_private import clear_dtensor_caches

    dist.destroy_process_group()
    clear_dtensor_caches()


@pytest.fixture(scope="module")
def wide_trees() -> list[dict]:
    """Step 3 of the 4 ranks of a dp=2 x tp=2 mesh, as their snapshots hold it (packed and unpacked)."""
    trees = []
    for rank in range(4):
        try:
            model, opt = _on_mesh(rank, 4, (2, 2), with_state=True)
            tracked = Tracked()
            tracked.add(model=model, optimizer=opt)
            meta, data = S.pack(tracked.capture(3))
            trees.append(S.unpack(meta, data, clone=True))
        finally:
            _done()
    return trees


def _after_one_step() -> tuple[torch.Tensor, torch.Tensor]:
    param = torch.nn.Parameter(FULL.clone())
    param.grad = GRAD.clone()
    opt = torch.optim.AdamW([param], lr=0.1)
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"]


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_narrow_rank_takes_its_whole_column_from_the_two_replicas_that_held_it(wide_trees, tp_rank):
    weight, exp_avg = _after_one_step()
    columns = slice(3 * tp_rank, 3 * tp_rank + 3)
    try:
        model, opt = _on_mesh(tp_rank, 2, (1, 2), with_state=False)
        tracked = Tracked()
        tracked.add(model=model, optimizer=opt)
        own, other = wide_trees[tp_rank], wide_trees[2 + tp_rank]  # (dp 0, tp) and (dp 1, tp)
        tracked.restore(own, reshard_from=[own, other])
        assert torch.equal(model.weight.to_local(), weight[:, columns])
        state = opt.state[model.weight]
        assert torch.equal(state["exp_avg"].to_local(), exp_avg[:, columns])
        assert state["step"] == 1, "a scalar comes from the rank's own snapshot"
    finally:
        _done()


def test_a_wide_rank_takes_its_shard_back_from_a_narrow_snapshot(wide_trees):
    """The grow: a narrow rank's snapshot holds a whole column; a rank of the full mesh cuts its quarter out."""
    weight, _ = _after_one_step()
    try:
        model, opt = _on_mesh(1, 2, (1, 2), with_state=False)
        narrow = Tracked()
        narrow.add(model=model, optimizer=opt)
        narrow.restore(wide_trees[1], reshard_from=[wide_trees[1], wide_trees[3]])
        meta, data = S.pack(narrow.capture(3))
        held = S.unpack(meta, data, clone=True)
    finally:
        _done()
    try:
        model, opt = _on_mesh(3, 4, (2, 2), with_state=False)  # dp 1, tp 1
        wide = Tracked()
        wide.add(model=model, optimizer=opt)
        wide.restore(held, reshard_from=[held])
        assert torch.equal(model.weight.to_local(), weight[4:, 3:])
    finally:
        _done()


def test_a_missing_piece_fails_saying_so_rather_than_leaving_zeros(wide_trees):
    try:
        model, opt = _on_mesh(0, 2, (1, 2), with_state=False)
        tracked = Tracked()
        tracked.add(model=model, optimizer=opt)
        with pytest.raises(RuntimeError, match=r"cannot be resharded onto this rank's 'model'.* hold 12 of the 24 "
                                               r"elements .*a rank's snapshot is missing"):
            tracked.restore(wide_trees[0], reshard_from=[wide_trees[0]])
    finally:
        _done()


class _Replicator:
    """What Restoring asks of dpstate's replicator, recorded: a local copy of one step, and what it is told to
    replicate (the slot restored, as it is, or a capture taken anew)."""

    def __init__(self, slot: SimpleNamespace):
        self.slot, self.policy = slot, SimpleNamespace(enabled=True)
        self.packed: list[SimpleNamespace] = []
        self.captured: list[dict] = []

    def local(self, step: int) -> SimpleNamespace | None:
        return self.slot if step == self.slot.step else None

    def forget_after(self, step: int) -> None:
        pass

    def forget(self, slot: SimpleNamespace) -> None:
        pass

    def submit_packed(self, slot: SimpleNamespace, held_at: object = ()) -> None:
        self.packed.append(slot)

    def submit(self, step: int, tree: dict, shared: object = None) -> None:
        self.captured.append(tree)


def test_a_sharded_carrier_that_lets_a_rank_go_replicates_the_snapshot_that_still_holds_it(wide_trees):
    """The grow: process 3 carried ranks 3 and 1 on the narrow mesh and trains rank 3 alone again. It cuts its
    shard out of its own snapshot and replicates that snapshot as it was, with rank 1's columns: the process that
    takes rank 1 cuts its shard out of that copy, whether it fetches it before this put or after (a capture of
    what process 3 now trains, replacing it, would hold rank 3 alone)."""
    from dpcommon import protocol as P
    from dpstate.groups.carried import Carried
    from dpstate.snapshot.rank_parts import carried_by
    from dpstate.steps.abort import AbortSignal
    from dpstate.steps.restoring import Restoring

    weight, _ = _after_one_step()
    try:
        model, opt = _on_mesh(1, 2, (1, 2), with_state=False)
        narrow = Tracked()
        narrow.add(model=model, optimizer=opt)
        narrow.ranks = (3, 1)
        narrow.restore(wide_trees[1], reshard_from=[wide_trees[1], wide_trees[3]])
        meta, data = S.pack(narrow.capture(3))
    finally:
        _done()
    held = SimpleNamespace(step=3, meta=meta, data=data)
    try:
        model, opt = _on_mesh(3, 4, (2, 2), with_state=False)  # dp 1, tp 1
        wide = Tracked()
        wide.add(model=model, optimizer=opt)
        wide.ranks = (3,)
        replicator = _Replicator(held)
        sources = SimpleNamespace(take_prefetched=lambda reconf, key: (None, {}))
        restoring = Restoring(wide, replicator, sources, [], AbortSignal())  # type: ignore[arg-type]
        reconf = P.Reconfigure(2, 3, 4, 1, 4, 3, "127.0.0.1:1", "", restore_from={"3": ""})
        where = restoring.restore(reconf, Carried.full(3, 4), started=True, world_size=4, sharded=True)
        assert where == "local" and torch.equal(model.weight.to_local(), weight[4:, 3:])
    finally:
        _done()
    assert replicator.captured == [] and replicator.packed == [held], "the restored snapshot is replicated as it was"
    assert carried_by(S.unpack(held.meta, held.data, clone=True)) == [3, 1]
