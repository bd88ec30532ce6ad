"""examples/train_gpt_3d.py whose rank 0, once (the first process to get there), waits in a torch.distributed call
that nothing releases as its UNRELEASED_AT-th step begins (before any collective of that step): what a Gloo op that never learns its
connections closed looks like from Python (dpstate.steps.release_watch ends such a survivor).

    dprun ... tests/data/unreleased_worker.py TRAIN_GPT_3D_ARGS   (UNRELEASED_AT=N, UNRELEASED_ONCE=PATH)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.utils.store import barrier  # noqa: E402

from examples import train_gpt_3d  # noqa: E402

AT, ONCE = int(os.environ["UNRELEASED_AT"]), os.environ["UNRELEASED_ONCE"]
steps_begun = 0
zero_grad = torch.optim.Optimizer.zero_grad  # the first call of each step's body


def held_zero_grad(self, *args, **kwargs):
    global steps_begun
    steps_begun += 1
    if steps_begun == AT and os.environ.get("RANK") == "0":
        try:
            os.close(os.open(ONCE, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:  # a barrier of two in a store of its own: the other never comes
            barrier(dist.HashStore(), 2, "never", barrier_timeout=600)
    return zero_grad(self, *args, **kwargs)


torch.optim.Optimizer.zero_grad = held_zero_grad  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(train_gpt_3d.main(sys.argv[1:]))
