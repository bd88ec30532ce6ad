"""A torchrun-style rank training examples/train_gpt.py's GPT data parallel over logical ranks: at full width
(one per process) or narrow (--carry "0,2;1": process 0 trains logical ranks 0 and 2, process 1 rank 1).

Each logical rank has its own data stream and its own dropout RNG (seeded by its rank), so a rank computed by
another process shows up in the result unless its data and RNG followed it. Writes --out.RANK.json: the
parameters' digest, each carried logical rank's losses and data position.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dpstate  # noqa: E402
from dpstate.groups.carried import Carried  # noqa: E402
from dpstate.snapshot.state import rng_state, set_rng_state  # noqa: E402
from examples.train_gpt import GPT, Batches, load_text, params_sha256  # noqa: E402


def rank_rng(seed: int, rank: int) -> dict:
    own = rng_state()
    torch.manual_seed(seed + 1 + rank)
    state = rng_state()
    set_rng_state(own)
    return state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--carry", default="")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    seed = 7
    tokens = torch.unique(torch.frombuffer(bytearray(load_text(None, 40_000)), dtype=torch.uint8),
                          return_inverse=True)[1].to(torch.uint8)
    torch.manual_seed(seed)
    model = GPT(256, 16, 1, 32, 2, dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = dpstate.init()
    ddp = job.data_parallel(model)
    if args.carry:
        assignment = [[int(r) for r in part.split(",")] for part in args.carry.split(";")]
        carried = Carried.assigned(assignment, job.rank)
        job._carry(carried, {r: rank_rng(seed, r) for r in carried.ranks[1:]})
    set_rng_state(rank_rng(seed, job.carried.ranks[0]))
    batches = job.per_rank(lambda rank: Batches(tokens, 16, 2, seed, rank))
    losses: dict[int, list[float]] = {r: [] for r in job.carried.ranks}
    for step in job.steps(args.steps):
        with step:
            opt.zero_grad(set_to_none=True)
            for rank in step.data_ranks():
                loss = ddp(*batches[rank].next())
                loss.backward()
                losses[rank].append(loss.item())
            opt.step()
    data = {r: hashlib.sha256(batches[r].state_dict()["generator"].numpy().tobytes()).hexdigest() for r in losses}
    Path(f"{args.out}.{job.rank}.json").write_text(json.dumps(
        {"params": params_sha256(model), "losses": losses, "data": data, "ranks": list(job.carried.ranks)}))


if __name__ == "__main__":
    main()
