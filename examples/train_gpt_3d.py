"""A tiny character GPT trained 3D-parallel with dpstate: pipeline (--pp), FSDP2 data (--dp), tensor (--tp) parallel.

    python examples/train_gpt_3d.py --steps 5                        # one process, every dim 1
    torchrun --nproc-per-node 8 examples/train_gpt_3d.py --pp 2 --dp 2 --tp 2 --steps 5

The world is pp * dp * tp ranks, ordered (pp, dp, tp): tp innermost (consecutive ranks share a tensor-parallel
group). Each rank builds the same full model from --seed, keeps its pipeline stage (examples/parallel_gpt.py),
shards it Megatron-style over tp and with FSDP2 over dp. Every tp and pp rank of one data-parallel replica reads
the same batches (seeded by the dp coordinate); a replica's batch is --batch-size sequences, cut into
--microbatches for the pipeline (GPipe). The model, optimizer, LR scheduler and pipeline schedule come from
job.parallelize(dims, build), which calls build(mesh) again for each generation of the job: the loop reads them
from `parts` inside every step, and each step trains the batches of step.data_ranks() (more than one replica's
while the job runs narrow: dprun --on-spare-exhausted shrink). --summary: rank 0 writes {final_step, loss,
params_sha256, full_params_sha256, data_positions, dp, tp, pp, world_size}: params_sha256 over every rank's local
shards (equal for two runs of one layout and seed), full_params_sha256 over the whole parameters (equal too for a
run that shrank), data_positions each logical rank's data position.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # parallel_gpt, train_gpt
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import dpstate  # noqa: E402
from parallel_gpt import build_parts, check_layout, full_params_sha256, local_shards_sha256, loss_fn  # noqa: E402
from train_gpt import Batches, load_text, write_json  # noqa: E402

DIMS = ("pp", "dp", "tp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (FSDP2)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--microbatches", type=int, default=2, help="micro-batches per step of the pipeline (pp > 1)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="a text file (default: the stdlib's source)")
    ap.add_argument("--max-bytes", type=int, default=200_000, help="cap on the training text")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step of each data-parallel replica")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=0, help="steps of linear LR warm-up")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op CPU threads; results are bitwise reproducible only for the same count")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep after each step (tests that act on a running job: a longer step, "
                         "same result)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--summary", default=None,
                    help="rank 0 writes {final_step, loss, params_sha256, full_params_sha256, data_positions, dp, "
                         "tp, pp, world_size} here")
    return ap.parse_args(argv)


def data_position(batches: Batches) -> str:
    """A short hash of a data source's position (its generator's state): equal where as many batches were drawn."""
    return hashlib.sha256(batches.generator.get_state().numpy().tobytes()).hexdigest()[:16]


def fail(message: str) -> int:
    print(f"train_gpt_3d: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = check_layout(args.n_layer, args.n_embd, args.n_head, args.batch_size, args.microbatches,
                       args.pp, args.dp, args.tp)
    if why:
        return fail(why)
    torch.set_num_threads(args.threads)
    # Everything that does not depend on the mesh comes before dpstate.init() (a spare does it while it waits).
    text = load_text(args.data, args.max_bytes)
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    vocab, tokens = torch.unique(raw, return_inverse=True)
    tokens = tokens.to(torch.uint8 if len(vocab) <= 256 else torch.int64)
    dims = dict(pp=args.pp, dp=args.dp, tp=args.tp)

    job = dpstate.init()

    def build(mesh) -> dict:
        return build_parts(mesh, vocab=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                           n_embd=args.n_embd, n_head=args.n_head, seed=args.seed, lr=args.lr, steps=args.steps,
                           warmup=args.warmup, microbatches=args.microbatches, batch_size=args.batch_size,
                           device=job.device)

    parts = job.parallelize(dims, build)
    # A rank keeps its coordinates (pp, dp, tp) in every generation: a replacement takes its global rank over.
    pp_rank, dp_rank, tp_rank = (parts.mesh[d].get_local_rank() for d in DIMS)
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    # every tp and pp rank of one data-parallel replica draws the same batches: one source per logical rank this
    # process trains (its own; while the job runs narrow, a lost replica's too), seeded by its dp coordinate
    batches = job.per_rank(lambda rank: Batches(tokens, args.block_size, args.batch_size, args.seed,
                                                parts.layout.coordinates(rank)["dp"]))
    job.track(data=batches)
    # the rank that prints the loss: the first of the last stage (rank 0 unless pp > 1)
    reporter = last and dp_rank == 0 and tp_rank == 0
    if job.rank == 0:
        n_params = sum(p.numel() for p in parts.model.parameters())  # (global numel of DTensors: this stage's)
        print(f"train_gpt_3d: stage 0 of {args.pp} has {n_params / 1e6:.3f}M params, "
              f"{len(text) / 1e6:.2f} MB text, vocab {len(vocab)}, world {job.world_size} "
              f"(pp {args.pp} dp {args.dp} tp {args.tp}), "
              f"{args.microbatches if args.pp > 1 else 1} micro-batches, on {job.device}", flush=True)

    loss_value, last_step, t_last = float("nan"), 0, time.perf_counter()
    for step in job.steps(args.steps):
        with step:
            model, opt, schedule, sched = parts.model, parts.optimizer, parts.schedule, parts.scheduler
            opt.zero_grad(set_to_none=True)
            replica_losses: list[torch.Tensor] = []
            for rank in step.data_ranks():  # this replica's batch (a narrow job: each carried replica's in turn)
                x, y = batches[rank].next()
                x, y = x.to(job.device), y.to(job.device)
                if schedule is None:
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    replica_losses.append(loss.detach())
                else:
                    losses: list[torch.Tensor] = []
                    if first:
                        schedule.step(x)
                    elif last:
                        schedule.step(target=y, losses=losses)
                    else:
                        schedule.step()
                    if last:
                        replica_losses.append(torch.stack(losses).mean())
            loss = torch.stack(replica_losses).mean() if replica_losses else None
            opt.step()
            sched.step()
            if loss is not None:
                loss_value = loss.item()
                step.log(loss=loss_value, tokens=x.numel() * args.dp)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step.failure is None:
            last_step = step.number
        if reporter and args.log_every and step.number % args.log_every == 0:
            now = time.perf_counter()
            ms = (now - t_last) * 1000 / args.log_every
            print(f"step {step.number:5d}  loss {loss_value:.4f}  {ms:6.1f} ms/step  gen {job.generation}", flush=True)
            t_last = now

    # the summary: the last stage's loss (mean over the dp replicas), a hash over every rank's shards, one over
    # the whole parameters (the same whichever mesh shape trained them: a job that shrank) and each logical
    # rank's data position (how many batches it drew)
    whole = full_params_sha256(parts.model)
    reporting = last and tp_rank == 0
    mine = (local_shards_sha256(parts.model), loss_value * len(job.carried.ranks) if reporting else None,
            len(job.carried.ranks) if reporting else 0, whole if dp_rank == 0 and tp_rank == 0 else None,
            {rank: data_position(batches[rank]) for rank in batches})
    gathered: list = [None] * job.world_size
    if job.world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if job.rank == 0 and args.summary:
        weighted, replicas = sum(g[1] for g in gathered if g[1] is not None), sum(g[2] for g in gathered)
        digest = hashlib.sha256("".join(g[0] for g in gathered).encode()).hexdigest()
        stages = hashlib.sha256("".join(g[3] for g in gathered if g[3] is not None).encode()).hexdigest()
        positions = {str(rank): pos for g in gathered for rank, pos in sorted(g[4].items())}
        write_json(args.summary, {"final_step": last_step, "loss": weighted / replicas if replicas else float("nan"),
                                  "params_sha256": digest, "full_params_sha256": stages,
                                  "data_positions": dict(sorted(positions.items(), key=lambda kv: int(kv[0]))),
                                  "dp": args.dp, "tp": args.tp, "pp": args.pp, "world_size": job.world_size})
    return 0


if __name__ == "__main__":
    sys.exit(main())
