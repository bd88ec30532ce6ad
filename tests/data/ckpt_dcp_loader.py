"""Run under torchrun by tests/test_ckpt_export.py: a fresh examples/train_gpt_3d.py model and optimizer of a layout
(pp x dp x tp) load a `dprun ckpt export --format dcp` folder as a torchtitan-style job would (dcp.load of the model
and of the optimizer's flattened state dict), then each rank compares its shards, bit for bit, with its own rank
file of the saved step. Writes RESULTS/rank-R.json.

    torchrun --nproc-per-node 8 tests/data/ckpt_dcp_loader.py DCP_FOLDER STEP_FOLDER RESULTS
        --pp 2 --dp 2 --tp 2 MODEL...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "examples"), str(REPO)]

from parallel_gpt import build_parts
from train_gpt import load_text
from train_gpt_3d import DIMS, parse_args

from dpcommon.snapshot_files import read_snapshot
from dpstate.snapshot import packing as S


def main() -> int:
    dcp_folder, step_folder, results = sys.argv[1:4]
    args = parse_args(sys.argv[4:])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=DIMS)
    vocab = len(torch.unique(torch.frombuffer(bytearray(load_text(args.data, args.max_bytes)), dtype=torch.uint8)))
    parts = build_parts(mesh, vocab=vocab, block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd,
                        n_head=args.n_head, seed=args.seed, lr=args.lr, steps=args.steps, warmup=args.warmup,
                        microbatches=args.microbatches)
    model, opt = parts["model"], parts["optimizer"]
    options = StateDictOptions(flatten_optimizer_state_dict=True)  # as torchtitan loads a pipeline stage's
    fresh = {name: p.to_local().clone() for name, p in model.named_parameters()}
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=dcp_folder)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"], options=options)

    _, meta, chunks = read_snapshot(Path(step_folder) / f"rank-{rank}.dpsnap", generation=0)
    saved = S.unpack(meta, b"".join(chunks))["state"]
    index = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    differ, changed, compared = [], 0, 0
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        compared += 1
        if not torch.equal(local.detach(), saved["model"][name]):
            differ.append(name)
        changed += not torch.equal(saved["model"][name], fresh[name])
        for key, value in saved["optimizer"]["state"][index[id(p)]].items():
            mine = opt.state[p][key]
            mine = mine.to_local() if isinstance(mine, DTensor) else mine
            compared += 1
            if not torch.equal(mine, value):
                differ.append(f"optimizer {name} {key}")
    Path(results).mkdir(parents=True, exist_ok=True)
    (Path(results) / f"rank-{rank}.json").write_text(json.dumps(
        {"compared": compared, "differ": differ, "changed_by_training": changed,
         "coordinate": list(mesh.get_coordinate() or ())}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
