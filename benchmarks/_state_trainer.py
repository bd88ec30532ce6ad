"""A dpstate training script whose state size is chosen (--mb, parameters + SGD momentum) and whose step is cheap:
a small all-reduce, an optimizer step over every parameter and a sleep standing in for compute (--step-s).
For benchmarks/scaling.py: recovery time against state size, with compute that does not compete for the CPU.
Writes one JSON line per step of rank 0 (--timings), like examples/train_gpt.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dpstate  # noqa: E402

CHUNK = 16 * 2**20  # float32 elements per parameter tensor (64 MB)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0, help="state size: parameters + momentum, MB")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--timings", default=None)
    ap.add_argument("--summary", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    job = dpstate.init()
    numel = int(args.mb * 1e6 / 8)  # 4 bytes of parameter + 4 of momentum
    sizes = [CHUNK] * (numel // CHUNK) + ([numel % CHUNK] if numel % CHUNK else [])
    torch.manual_seed(0)
    model = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in sizes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    grads = [torch.full((n,), 1e-3) for n in sizes]
    job.track(model=model, optimizer=opt)
    out = open(args.timings, "a", buffering=1) if args.timings and job.rank == 0 else None
    flag = torch.zeros(1)
    for step in job.steps(args.steps):
        with step:
            time.sleep(args.step_s)
            job.all_reduce(flag)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
        if out is not None and step.failure is None:
            out.write(json.dumps({"t": time.time(), "step": step.number, "gen": job.generation}) + "\n")
    if job.rank == 0 and args.summary:
        Path(args.summary).write_text(json.dumps({"final_step": args.steps, "state_bytes": 8 * numel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
