"""examples/train_gpt.py's model, data and step under torchft (for benchmarks/recovery.py): one replica group per
`torchrun --nproc-per-node 1` (restarted by it after a failure), torchft's Manager + DDP + Optimizer wrapper over
torchft's ProcessGroupGloo, the lighthouse at TORCHFT_LIGHTHOUSE. A restarted group heals from a live peer
(torchft's checkpoint transport) and the survivor keeps training. Needs `pip install torchft-nightly`.

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT \\
        torchrun --nproc-per-node 1 --master-port P benchmarks/_torchft_train.py --steps 80 [train_gpt's model flags]
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_gpt import GPT, Batches, load_text, parse_args  # noqa: E402


def main() -> int:
    import torchft

    args = parse_args()
    torch.set_num_threads(args.threads)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    text = load_text(args.data, args.max_bytes)
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    vocab, tokens = torch.unique(raw, return_inverse=True)
    tokens = tokens.to(torch.uint8 if len(vocab) <= 256 else torch.int64)
    torch.manual_seed(args.seed)
    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_embd, args.n_head, args.dropout)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: min(1.0, (s + 1) / max(1, args.warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    )
    batches = Batches(tokens, args.block_size, args.batch_size, args.seed, group)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])

    # torchft's Manager connects to a TCPStore at MASTER_ADDR:MASTER_PORT; with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (needed for torchrun's restarts here) torchrun hosts none: we do
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # noqa: F841 (kept alive)
                          int(os.environ.get("WORLD_SIZE", "1")), is_master=os.environ.get("RANK", "0") == "0",
                          wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = torchft.Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                              replica_id=f"gpt_{group}", timeout=timedelta(seconds=30))
    ddp = torchft.DistributedDataParallel(manager, model)
    opt = torchft.Optimizer(manager, inner)
    out = open(args.timings, "a", buffering=1) if args.timings else None

    def write(**rec):
        if out is not None:
            out.write(json.dumps({"t": time.time(), "group": group, **rec}) + "\n")

    if restart == 0:  # both groups start together (else the first quorum forms without the slower one)
        Path(f"started.group{group}").touch()
        deadline = time.time() + 120
        while not all(Path(f"started.group{g}").exists() for g in range(int(os.environ.get("NUM_REPLICA_GROUPS", "2")))):
            if time.time() > deadline:
                raise SystemExit("torchft benchmark: the other replica group did not start")
            time.sleep(0.05)
    write(event="ready", restart=restart)
    while manager.current_step() < args.steps:
        number = manager.current_step() + 1
        if args.kill_at_step == number and group == args.kill_rank and restart == 0:
            write(event="kill", step=number, rank=group)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches.next()
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        opt.step()  # commits only if every participant's step went through
        if manager.current_step() >= number:
            sched.step()
            write(step=manager.current_step(), participants=manager.num_participants(), restart=restart)
    if group == 0 and args.summary:
        Path(args.summary).write_text(json.dumps({"final_step": manager.current_step(), "loss": loss.item()}))
    manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
