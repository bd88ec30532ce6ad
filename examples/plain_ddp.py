"""A plain torchrun script that knows nothing of DeadPool: torch DDP over gloo, disk checkpoints, resume.

Runs the same under `torchrun --nproc-per-node 2 examples/plain_ddp.py` and `dprun --nnodes 2 --spares 1
examples/plain_ddp.py`: on a failure dprun restarts every worker (the spare standing in for a dead node) and
the script resumes from its newest checkpoint, as it would under torchrun --max-restarts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.05, help="seconds of simulated compute per step")
    ap.add_argument("--ckpt-dir", default=None, help="rank 0 saves here every --ckpt-every steps; all resume")
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summary", default=None, help="rank 0 writes {final_step, restarts, params_sha256} here")
    return ap.parse_args(argv)


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, rank): the same whether or not the run was restarted."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(1, keepdim=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else None
    start = 0
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model)
    if rank == 0:
        print(f"plain_ddp: world {world}, restart {restart}, starting at step {start + 1}", flush=True)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} restart {restart} t {time.time():.3f}", flush=True)
            if ckpt and step % args.ckpt_every == 0:
                os.makedirs(args.ckpt_dir, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    if rank == 0 and args.summary:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        with open(args.summary, "w") as f:
            json.dump({"final_step": args.steps, "restarts": restart, "params_sha256": digest}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Exit without the interpreter's finalization. torch 2.13's backward() stashes a Python context in the
    # thread-local state that DDP's all-reduce works capture; Gloo's worker thread drops the last step's works
    # a moment after they complete, and if that falls in finalization, taking the GIL ends the thread inside
    # C++ and aborts the process ("terminate called without an active exception", exit -6; gdb on the core).
    # Seen in 3 of 50 two-rank torchrun runs on a loaded 2-core host; everything the script writes is closed.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
