"""The model-parallel pieces of examples/train_gpt_3d.py: a tensor-parallel-friendly tiny character GPT and
`build_stage`, which turns it into this rank's pipeline stage, tensor parallel over mesh["tp"] (Megatron-style)
and sharded with FSDP2 over mesh["dp"], plus its optimizer, LR scheduler and pipeline schedule.

The full model is built first, identically on every rank (its own RNG, seeded: the global RNG is left alone),
then sliced into stages, then tensor parallelism and FSDP2 slice the same full tensors: each rank's shards are
the same whichever layout (pp, dp, tp) it runs in.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# At the top, not inside build(mesh): a spare imports them (~2 s here) while it idles, not after its promotion
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from train_gpt import GPT as DataParallelGPT

TP_PLAN_KEYS = ("q", "k", "v", "proj", "mlp.0", "mlp.2")


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """train_gpt.py's Block with separate q, k, v Linears (a fused qkv cannot be column-sharded over heads).

    Under tensor parallelism q, k, v and mlp.0 are column-sharded (their outputs hold n_head // tp heads,
    4 * n_embd // tp features) and proj and mlp.2 row-sharded (their outputs all-reduced over tp): forward
    works with whatever number of heads it gets (view(b, t, -1, head_dim))."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.head_dim = n_embd // n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.q, self.k, self.v = nn.Linear(n_embd, n_embd), nn.Linear(n_embd, n_embd), nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The full model (every rank builds all of it, then keeps its stage)."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)
        self.apply(DataParallelGPT._init)  # train_gpt.py's initialisation


class Stage(nn.Module):
    """Blocks [lo, hi) of a GPT; the first stage also embeds the tokens, the last also ends with ln_f and the
    head (its output: logits). Blocks keep their index in the full model as their name (blocks.3...), so a
    parameter has the same name whatever the number of stages."""

    def __init__(self, full: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = full.wte, full.wpe
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = full.ln_f, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: tokens (b, t)
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- parallelism


def check_layout(n_layer: int, n_embd: int, n_head: int, batch_size: int, microbatches: int,
                 pp: int, dp: int, tp: int) -> str | None:
    """Why this combination of model and layout cannot run (one line), or None."""
    if min(pp, dp, tp) < 1:
        return f"--pp, --dp and --tp must be at least 1 (got pp={pp} dp={dp} tp={tp})"
    if microbatches < 1:
        return f"--microbatches must be at least 1 (got {microbatches})"
    if n_embd % n_head:
        return f"--n-embd {n_embd} is not divisible by --n-head {n_head}"
    if n_layer % pp:
        return f"--n-layer {n_layer} is not divisible by --pp {pp}"
    if n_head % tp:
        return f"--n-head {n_head} is not divisible by --tp {tp}"
    if batch_size % microbatches:
        return f"--batch-size {batch_size} is not divisible by --microbatches {microbatches}"
    return None


def tp_plan() -> dict:
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def build_stage(mesh: Any, *, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int, seed: int,
                device: torch.device | str = "cpu") -> Stage:
    """This rank's stage of the model, tensor parallel over mesh["tp"] and sharded with FSDP2 over mesh["dp"].

    mesh: a DeviceMesh with the dims "pp", "dp", "tp" (size 1 allowed). The full model is built on the CPU
    from `seed` in a forked RNG (the caller's global RNG is untouched), so every rank starts from the same
    tensors before they are sliced."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = GPT(vocab, block_size, n_layer, n_embd, n_head)
    per = n_layer // pp
    stage = Stage(full, pp_rank * per, (pp_rank + 1) * per, first=pp_rank == 0, last=pp_rank == pp - 1)
    del full
    stage.to(device)
    if mesh["tp"].size() > 1:
        for block in stage.blocks.values():
            parallelize_module(block, mesh["tp"], tp_plan())
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    return stage


def build_parts(mesh: Any, *, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int, seed: int,
                lr: float, steps: int, warmup: int, microbatches: int, batch_size: int | None = None,
                device: torch.device | str = "cpu") -> dict:
    """What train_gpt_3d's build(mesh) returns: model (this rank's stage), optimizer, scheduler and schedule
    (a ScheduleGPipe over mesh["pp"], or None when pp == 1: call the model directly). With batch_size (a
    replica's sequences per step) the stage is told its shapes up front (stage_shapes)."""
    stage = build_stage(mesh, vocab=vocab, block_size=block_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        seed=seed, device=device)
    # torch's AdamW (not dpstate.AdamW: its landing path writes plain tensors, and these parameters are DTensors)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LrSchedule(steps, warmup))
    schedule = None
    pp = mesh["pp"].size()
    if pp > 1:
        pipe_stage = PipelineStage(stage, mesh["pp"].get_local_rank(), pp, torch.device(device),
                                   group=mesh["pp"].get_group(),
                                   **stage_shapes(stage, batch_size, microbatches, block_size, n_embd, vocab))
        schedule = ScheduleGPipe(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)
    return dict(model=stage, optimizer=opt, scheduler=sched, schedule=schedule)


def stage_shapes(stage: Stage, batch_size: int | None, microbatches: int, block_size: int, n_embd: int,
                 vocab: int) -> dict:
    """A stage's micro-batch input and output, as meta tensors: given them, a new PipelineStage skips its first
    step's exchange of shapes with its neighbours (which every rebuild would pay again). {} without batch_size."""
    if batch_size is None:
        return {}
    micro = batch_size // microbatches
    hidden = torch.empty(micro, block_size, n_embd, device="meta")
    return {"input_args": torch.empty(micro, block_size, dtype=torch.long, device="meta") if stage.first else hidden,
            "output_args": torch.empty(micro, block_size, vocab, device="meta") if stage.last else hidden,
            "input_grads": None if stage.first else hidden, "output_grads": None if stage.last else hidden}


class LrSchedule:
    """train_gpt.py's LR factor: linear warm-up, then a cosine down to 10 % (a class: LambdaLR's state_dict
    keeps the __dict__ of a callable object, not a lambda)."""

    def __init__(self, steps: int, warmup: int):
        self.steps, self.warmup = steps, warmup

    def __call__(self, s: int) -> float:
        warm = min(1.0, (s + 1) / max(1, self.warmup))
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, self.steps)))))


def local_shards_sha256(model: nn.Module) -> str:
    """sha256 of this rank's local shards of every parameter (sorted by name; DTensors: to_local())."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.to_local() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full_params_sha256(model: nn.Module) -> str:
    """sha256 of every parameter whole (DTensors gathered: a collective over the mesh, every rank calls it): the
    same for one stage of the model whatever mesh shape trained it."""
    h = hashlib.sha256()
    # (torch warns that gathering FSDP2 x TP shards takes two all-gathers: no matter for a hash at the end)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for name, p in sorted(model.named_parameters()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
