"""A dpstate worker whose steps use no collective of dpstate's: gradients are averaged with a plain
torch.distributed.all_reduce, so the snapshot gate is passed in the optimizer's pre-step hook (+ a barrier).

    python tests/data/raw_collective_worker.py STEPS
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dpstate  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = dpstate.init()
    job.track(model=model, optimizer=opt)
    for step in job.steps(int(sys.argv[1])):
        with step:
            opt.zero_grad()
            model(torch.ones(4, 8)).sum().backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)  # not job.all_reduce: no gate on the way
            opt.step()


if __name__ == "__main__":
    main()
