"""`dprun ckpt export`: a saved step in torch's own formats. A data-parallel job's step as torch.save files, which
resume the job under torchrun (train_gpt.py's own disk checkpoints) to the very parameters of a run never stopped;
a 3D-parallel (pp x dp x tp) job's step as a torch.distributed.checkpoint folder, which a fresh model of the same
layout loads under torchrun with each rank's shards as saved, and one process loads whole (resharded). The fast
tests place sharded state of 8 ranks made in this process (a fake process group: real DTensors, no peers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import REPO, free_port

from dpcommon.save_manifest import write_manifest
from dpcommon.snapshot_files import read_snapshot, write_snapshot
from dpstate.snapshot import packing as S
from dpstate.snapshot.state import Tracked
from helpers.cli import run
from helpers.e2e import TRAIN, TRAIN_ARGS, dprun, the_save
from helpers.mesh_jobs import LAYOUTS, MODEL

# dcp.load in this one process (no_dist): torch says it assumes so
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def saved_tree(folder: Path, rank: int) -> dict:
    """A rank's state tree as a resume decodes it (dpagent's reader, dpstate's unpack): what exports must equal."""
    _, meta, chunks = read_snapshot(folder / f"rank-{rank}.dpsnap", generation=0)
    return S.unpack(meta, b"".join(chunks))


def export(folder: Path, out: Path, fmt: str) -> str:
    """`dprun ckpt export FOLDER OUT --format FMT` as a user runs it; its output line."""
    proc = subprocess.run([sys.executable, "-m", "dprun", "ckpt", "export", str(folder), str(out), "--format", fmt],
                          capture_output=True, text=True, cwd=REPO, timeout=100, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


# ----------------------------------------------------------------------------- sharded state, made in this process

G = torch.Generator().manual_seed(0)
FULL = {"a": torch.randn(8, 6, generator=G), "b": torch.randn(8, 4, generator=G), "c": torch.randn(6, 3, generator=G),
        "u": torch.randn(5, 3, generator=G)}
GRAD = {k: torch.randn(v.shape, generator=G) for k, v in FULL.items()}


def _placements() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # a: both dims sharded; b: FSDP2 over tensor parallelism (_StridedShard); c: replicated over dp (written once);
    # u: 5 rows over 2 ranks (an uneven split)
    return {"a": [Shard(0), Shard(1)], "b": [_StridedShard(0, split_factor=2), Shard(0)], "c": [Replicate(), Shard(0)],
            "u": [Shard(0), Replicate()]}


def _full_name(stage: int, key: str) -> str:
    return key if key == "c" else f"s{stage}_{key}"  # each pipeline stage its own parameters, but "c" shared


class Position:
    """A data sampler's position: tracked state that is neither a model nor an optimizer."""

    def __init__(self, at: int):
        self.at = torch.tensor([at])

    def state_dict(self) -> dict:
        return {"position": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["position"]


def save_sharded_step(save_dir: Path, step: int = 3) -> Path:
    """Step `step` of 8 ranks (mesh pp=2 x dp=2 x tp=2) captured as a job captures it: a model of DTensor
    parameters on mesh["dp", "tp"], each stage its own, one AdamW step taken, and a per-rank data position."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dpstate.groups.torch_private import clear_dtensor_caches

    folder = save_dir / f"step-{step}"
    placements = _placements()
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            sub, stage = mesh["dp", "tp"], mesh.get_coordinate()[0]
            model = torch.nn.Module()
            for key, full in FULL.items():
                local = full + (stage if key != "c" else 0)
                param = torch.nn.Parameter(distribute_tensor(local, sub, placements[key], src_data_rank=None))
                param.grad = distribute_tensor(GRAD[key], sub, placements[key], src_data_rank=None)
                model.register_parameter(_full_name(stage, key), param)
            model.register_buffer("plain", torch.arange(4.0))
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            opt.step()
            data = Position(rank // 2)  # as a data sampler's: one per data-parallel rank
            tracked = Tracked()
            tracked.add(model=model, optimizer=opt, data=data)
            meta, buf = S.pack(tracked.capture(step))
            write_snapshot(folder, rank, step, S.checksum(meta, buf), meta, [buf.numpy()])
        finally:
            dist.destroy_process_group()
            clear_dtensor_caches()  # its sharding cache would hand the next rank's DTensors this rank's mesh
    write_manifest(folder, step, 8, list(range(8)), "node-0")
    return folder


def expected_after_one_step() -> dict:
    """Each global parameter and its AdamW exp_avg after the step, computed whole in one process."""
    out = {}
    for stage in (0, 1):
        for key, full in FULL.items():
            param = torch.nn.Parameter((full + (stage if key != "c" else 0)).clone())
            param.grad = GRAD[key].clone()
            opt = torch.optim.AdamW([param], lr=0.1)
            opt.step()
            out[_full_name(stage, key)] = (param.detach(), opt.state[param]["exp_avg"])
    return out


def test_sharded_state_of_8_ranks_is_placed_whole_in_a_dcp_export(tmp_path, capsys):
    folder = save_sharded_step(tmp_path / "save")
    layout = saved_tree(folder, 3)["layout"]
    assert layout["modules"] == ["model"] and layout["optimizers"]["optimizer"][1] == ["model", "s0_b"]
    assert layout["shards"]["model"][0] == [["s0_a"], [8, 6], [4, 3], ["S(0)", "S(1)"], ["dp", "tp"], [1, 1]]
    out = tmp_path / "dcp"
    code, said, err = run(capsys, "ckpt", "export", str(folder), str(out), "--format", "dcp")
    assert code == 0 and err == "", err
    assert "(step 3, 8 ranks) as a torch.distributed.checkpoint folder" in said and "tensors in" in said

    expected = expected_after_one_step()
    state = {"step": 0, "model": {name: torch.empty(p.shape) for name, (p, _) in expected.items()},
             "optimizer": {"state": {name: {"exp_avg": torch.empty(p.shape)} for name, (p, _) in expected.items()}}}
    state["model"]["plain"] = torch.empty(4)
    dcp.load(state, storage_reader=dcp.FileSystemReader(out), no_dist=True)
    assert state["step"] == 3 and torch.equal(state["model"]["plain"], torch.arange(4.0))
    for name, (param, exp_avg) in expected.items():
        assert torch.equal(state["model"][name], param), name
        assert torch.equal(state["optimizer"]["state"][name]["exp_avg"], exp_avg), name

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(whole["model"]["s1_b"], expected["s1_b"][0])
    assert whole["optimizer"]["param_groups"][0]["params"] == ["s0_a", "s0_b", "c", "s0_u", "s1_a", "s1_b", "s1_u"]
    assert whole["optimizer"]["param_groups.s1_u.lr"] == 0.1, "flattened as torchtitan reads a pipeline stage's"
    assert [int(whole["data"][f"rank_{r}"]["position"]) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_torch_export_holds_each_rank_s_own_state_and_loads_with_weights_only(tmp_path, capsys):
    folder = save_sharded_step(tmp_path / "save")
    code, said, _ = run(capsys, "ckpt", "export", str(folder), str(tmp_path / "pt"), "--format", "torch")
    assert code == 0 and "as 8 torch.save files (rank-R.pt)" in said
    for rank in (0, 5):
        doc = torch.load(tmp_path / "pt" / f"rank-{rank}.pt", weights_only=True)
        saved = saved_tree(folder, rank)
        assert list(doc) == ["step", "model", "optimizer", "data", "deadpool"] and doc["step"] == 3
        assert doc["deadpool"]["rank"] == rank and doc["deadpool"]["world_size"] == 8
        for name, tensor in saved["state"]["model"].items():  # local shards, as the rank held them
            assert torch.equal(doc["model"][name], tensor), name
        assert doc["deadpool"]["layout"] == saved["layout"]
        fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1)) for _ in range(4)])
        fresh.load_state_dict(doc["optimizer"])  # torch's own optimizer state dict: indices, param_groups
        assert isinstance(doc["deadpool"]["rng"]["torch"], torch.Tensor)


def test_a_step_saved_before_shards_were_placed_is_refused_as_dcp_and_said_why(tmp_path, capsys):
    folder = tmp_path / "step-2"
    for rank in range(2):
        tracked = Tracked()
        tracked.add(model=torch.nn.Linear(2, 2))
        tree = tracked.capture(2)
        del tree["layout"]  # as dpstate wrote snapshots before it recorded one
        meta, buf = S.pack(tree)
        write_snapshot(folder, rank, 2, S.checksum(meta, buf), meta, [buf.numpy()])
    write_manifest(folder, 2, 2, [0, 1], "n")
    code, _, err = run(capsys, "ckpt", "export", str(folder), str(tmp_path / "out"), "--format", "dcp")
    assert code == 1 and err == ("dprun ckpt: rank 0's file was saved before DeadPool recorded where each shard lies "
                                 "(dpstate's snapshot \"layout\"): it can be exported --format torch, not as DCP\n")
    assert not (tmp_path / "out").exists()
    assert run(capsys, "ckpt", "export", str(folder), str(tmp_path / "pt"), "--format", "torch")[0] == 0


# ----------------------------------------------------------------------------- real jobs


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_data_parallel_step_exported_as_torch_resumes_under_torchrun_to_the_unbroken_run(procs, tmp_path,
                                                                                          unbroken):
    steps = 12
    stop = dprun(procs, tmp_path, "stop", "--nnodes", "2", "--spares", "0", "--save-dir", tmp_path / "saved",
                 "--inject", "kill-node:1@step=6", steps=steps)
    assert stop.returncode == 1, stop.stderr[-3000:]
    folder = Path(the_save(stop.events, stop.stderr[-3000:])["folder"])
    step = int(folder.name[5:])
    assert "as 2 torch.save files" in export(folder, tmp_path / "pt", "torch")
    docs = [torch.load(tmp_path / "pt" / f"rank-{r}.pt", weights_only=True) for r in (0, 1)]

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT, load_text, params_sha256, parse_args

    args = parse_args(TRAIN_ARGS)
    vocab = len(torch.unique(torch.frombuffer(bytearray(load_text(None, args.max_bytes)), dtype=torch.uint8)))
    model = GPT(vocab, args.block_size, args.n_layer, args.n_embd, args.n_head)
    initial = params_sha256(model)
    model.load_state_dict(docs[0]["model"])  # the example's own model, strict: every name and shape fits
    saved = [saved_tree(folder, r)["state"]["model"] for r in (0, 1)]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[0][name]) and torch.equal(docs[1]["model"][name], saved[1][name])
    assert params_sha256(model) != initial and docs[0]["step"] == step

    # train_gpt.py's own torch.save checkpoints (--ckpt-dir, as a torchrun user keeps them), from the export
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"step": step, "model": docs[0]["model"], "opt": docs[0]["optimizer"], "sched": docs[0]["scheduler"]},
               ckpt / f"step{step:08d}.model.pt")
    for rank, doc in enumerate(docs):
        torch.save({"data": doc["data"], "rng": doc["deadpool"]["rng"]["torch"]}, ckpt / f"step{step:08d}.rank{rank}.pt")
    summary = tmp_path / "torchrun.json"
    proc = procs.popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), TRAIN, "--steps", str(steps), *TRAIN_ARGS,
                        "--ckpt-dir", ckpt, "--ckpt-every", "1000", "--summary", summary],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from the disk checkpoint of step {step}" in out, out[-2000:]
    assert json.loads(summary.read_text())["params_sha256"] == unbroken(2, steps).summary["params_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # the shared 8-rank job (if first) and then 8 torchrun ranks: 200 s on a busy 2-core host
def test_a_3d_step_exported_as_dcp_loads_into_a_fresh_model_of_the_same_layout_and_whole(procs, tmp_path, saved_3d):
    """The step is one that conftest's saved_3d job (test_e2e_parallel's 3D recovery) saved in the background after
    its recovery: 4 nodes of 2 ranks, the shards placed by the generation that a spare joined."""
    (saved,) = [e for e in saved_3d.run.named("state_saved") if e["step"] == 20] or [None]
    assert saved, saved_3d.run.stderr[-3000:]
    folder = Path(saved["folder"])
    said = export(folder, tmp_path / "dcp", "dcp")
    assert "8 ranks) as a torch.distributed.checkpoint folder" in said
    assert "'data' differs between ranks: kept per rank as data.rank_R (8 ranks)" in said  # seeded by dp rank

    results = tmp_path / "results"
    loader = REPO / "tests" / "data" / "ckpt_dcp_loader.py"
    proc = procs.popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(loader),
                        tmp_path / "dcp", folder, results, *MODEL, *LAYOUTS["3d"][0], "--steps", "20"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    found = {int(p.stem[5:]): json.loads(p.read_text()) for p in results.glob("rank-*.json")}
    assert sorted(found) == list(range(8))
    for rank, result in found.items():
        assert result["differ"] == [] and result["compared"] > 20, (rank, result)
        assert result["changed_by_training"] > 0, "the saved state is not the model's initial one"

    # the same folder resharded to one process: the full tensors, which every rank's shard is a block of
    sys.path.insert(0, str(REPO / "examples"))
    from parallel_gpt import GPT, Stage

    whole = {}
    trees = [saved_tree(folder, r) for r in range(8)]
    for rank, tree in enumerate(trees):
        for (name,), shape, offset, *_ in tree["layout"]["shards"]["model"]:
            whole.setdefault(name, torch.full(shape, float("nan")))
    state = {"model": whole}
    dcp.load(state, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)
    for tree in trees:
        for (name,), shape, offset, *_ in tree["layout"]["shards"]["model"]:
            shard = tree["state"]["model"][name]
            block = whole[name][tuple(slice(o, o + s) for o, s in zip(offset, shard.shape))]
            assert torch.equal(block, shard), name
    assert not any(t.isnan().any() for t in whole.values()), "every element came from a rank's shard"
    assert len(whole) == len(dict(Stage(GPT(40, 16, 2, 32, 2), 0, 2, True, True).named_parameters()))
