"""The worker of benchmarks/gradient_log.py (started by torchrun, 2 ranks, Gloo): trains examples/train_gpt.py's
model with torch's DDP and AdamW, each step one of the modes in turn, and rank 0 writes every step's time.

Modes: plain; gradient (the all-reduced gradient copied into a ring of shared-memory slots before the optimizer
step, as a gradient log held by an agent would need), gradient_after (the same after the step); whole
(parameters and optimizer state copied into one of 2 shared buffers after the step, in the training thread);
by_reference (the gradient tensors kept alive for the ring's length, no copy). With --alone-steps: the
optimizer step and each copy timed in one process, no peers, alternating before and after the step.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, Batches, load_text  # noqa: E402


def shared_bytes(nbytes: int) -> torch.Tensor:
    """A buffer in a memfd (what an agent could map), faulted in."""
    fd = os.memfd_create("dp-gradient-log")
    os.ftruncate(fd, nbytes)
    buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    os.close(fd)
    buf.zero_()
    return buf


def copy_into(buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n


def alone(model: torch.nn.Module, vocab: int, args) -> dict:
    """In this one process, no peers: the median ms of an optimizer step and of each copy beside it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    ring, whole = [shared_bytes(grad_bytes) for _ in range(args.slots)], shared_bytes(3 * grad_bytes)
    x = torch.randint(0, vocab, (args.batch_size, args.block_size))
    took: dict[str, list[float]] = {"optimizer_step": [], "gradient": [], "gradient_after": [], "whole": []}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        took[name].append((time.perf_counter() - t0) * 1000)

    for i in range(4 + 2 * args.alone_steps):
        opt.zero_grad(set_to_none=True)
        model(x, x).backward()
        before = i % 2 == 0
        if before:
            timed("gradient", lambda: copy_into(ring[i % args.slots], [p.grad for p in params]))
        timed("optimizer_step", opt.step)
        if not before:
            timed("gradient_after", lambda: copy_into(ring[i % args.slots], [p.grad for p in params]))
            timed("whole", lambda: copy_into(whole, [t for p in params for t in (
                p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]))
    return {name: round(statistics.median(v[2:]), 2) for name, v in took.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes",  # each mode between plain steps; and 2 plain steps in a row, to compare with
                    default="plain,plain,gradient,plain,gradient_after,plain,whole,plain,by_reference,plain")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--slots", type=int, default=4, help="gradients a log keeps (steps since the whole state)")
    ap.add_argument("--n-layer", type=int, default=5)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--alone-steps", type=int, default=0, help="instead: this many steps of each in one process")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    raw = torch.frombuffer(bytearray(load_text(None, 1_000_000)), dtype=torch.uint8)
    vocab, tokens = torch.unique(raw, return_inverse=True)
    torch.manual_seed(0)
    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_embd, args.n_head, 0.0)
    if args.alone_steps:
        Path(args.out).write_text(json.dumps(alone(model, len(vocab), args)))
        return 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batches = Batches(tokens.to(torch.uint8), args.block_size, args.batch_size, 0, rank)
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    ring = [shared_bytes(grad_bytes) for _ in range(args.slots)]
    wholes = [shared_bytes(3 * grad_bytes) for _ in range(2)]
    kept: list[list[torch.Tensor]] = []
    modes = args.modes.split(",")
    steps, taken = [], dict.fromkeys(modes, 0)  # each mode's turns: its next ring slot
    for step in range(args.steps):
        mode = modes[step % len(modes)]
        turn, taken[mode] = taken[mode], taken[mode] + 1
        dist.barrier()
        t0 = time.perf_counter()
        x, y = batches.next()
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if mode == "gradient":
            copy_into(ring[turn % args.slots], [p.grad for p in params])
        elif mode == "by_reference":
            kept = (kept + [[p.grad for p in params]])[-args.slots:]
        opt.step()
        if mode == "gradient_after":
            copy_into(ring[turn % args.slots], [p.grad for p in params])
        elif mode == "whole":
            copy_into(wholes[turn % 2], [t for p in params for t in (p, opt.state[p]["exp_avg"],
                                                                    opt.state[p]["exp_avg_sq"])])
        loss.item()
        steps.append({"mode": mode, "s": time.perf_counter() - t0})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"grad_bytes": grad_bytes, "state_bytes": 3 * grad_bytes,
                                              "steps": steps}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter finalization: see examples/plain_ddp.py's end
