"""A small character-level GPT trained data-parallel with dpstate (about a million parameters by default).

Runs under `dprun ... examples/train_gpt.py`, unmodified under `torchrun --nproc-per-node N` (torchrun's
env:// group, no snapshots), or alone (`python examples/train_gpt.py --steps 5`, world 1).
The text is the source of Python's standard library unless --data names a file; a run is deterministic for
a given --seed: the same final parameters (params_sha256 in --summary) with or without failures, under dprun
or torchrun. For the torchrun baseline of benchmarks/: --ckpt-dir/--ckpt-every save disk checkpoints with
torch.save and resume from the newest one after a restart; --kill-at-step rehearses a worker failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import signal
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import dpstate  # noqa: E402


# ----------------------------------------------------------------------------- data


def load_text(path: str | None, max_bytes: int) -> bytes:
    """The training text: a file, or the first .py files of the stdlib (sorted by name) up to max_bytes."""
    if path:
        return Path(path).read_bytes()[:max_bytes]
    parts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


class Batches:
    """Random windows of the token stream; the generator's state is the data position (state_dict)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, seed: int, rank: int):
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self._window = torch.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=self.generator)
        chunk = self.tokens[starts[:, None] + self._window].long()
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)
        self.drop = nn.Dropout(dropout)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def state_bytes(*objects) -> int:
    """Bytes of every tensor in the state dicts of `objects` (model parameters + optimizer state)."""
    total = 0

    def walk(obj) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    for obj in objects:
        walk(obj.state_dict())
    return total


# ----------------------------------------------------------------------------- disk checkpoints (torchrun baseline)


class DiskCheckpoints:
    """What most torchrun users do: every `every` steps rank 0 torch.saves the model, optimizer and scheduler
    and every rank its data position and RNG; after a restart all resume from the newest complete step."""

    def __init__(self, folder: str, every: int, rank: int, world: int):
        self.folder, self.every, self.rank, self.world = Path(folder), every, rank, world
        self.folder.mkdir(parents=True, exist_ok=True)
        self.save_s = 0.0

    def _path(self, step: int, who: str) -> Path:
        return self.folder / f"step{step:08d}.{who}.pt"

    def _write(self, obj, path: Path) -> None:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        torch.save(obj, tmp)
        os.replace(tmp, path)

    def save(self, step: int, model, opt, sched, batches) -> None:
        t0 = time.perf_counter()
        self._write({"data": batches.state_dict(), "rng": torch.get_rng_state()}, self._path(step, f"rank{self.rank}"))
        if self.rank == 0:
            self._write({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict()}, self._path(step, "model"))
        for old in self.folder.glob("step*.pt"):  # keep this step and the one before
            if int(old.name[4:12]) < step - self.every and (old.name.endswith(f".rank{self.rank}.pt")
                                                           or (self.rank == 0 and old.name.endswith(".model.pt"))):
                old.unlink(missing_ok=True)
        self.save_s += time.perf_counter() - t0

    def newest(self) -> int:
        steps = sorted({int(p.name[4:12]) for p in self.folder.glob("step*.model.pt")}, reverse=True)
        for step in steps:
            if all(self._path(step, f"rank{r}").exists() for r in range(self.world)):
                return step
        return 0

    def load(self, step: int, model, opt, sched, batches) -> None:
        state = torch.load(self._path(step, "model"), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        mine = torch.load(self._path(step, f"rank{self.rank}"), weights_only=False)
        batches.load_state_dict(mine["data"])
        torch.set_rng_state(mine["rng"])


class Timings:
    """--timings PATH: one JSON line per step of rank 0 (and the kill of --kill-at-step), for benchmarks/."""

    def __init__(self, path: str | None):
        self.file = open(path, "a", buffering=1) if path else None

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"t": time.time(), **record}) + "\n")


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="a text file (default: the stdlib's source)")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="cap on the training text")
    ap.add_argument("--n-layer", type=int, default=5)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op CPU threads; results are bitwise reproducible only for the same count")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep after each step (tests that act on a running job: a longer step, same result)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--summary", default=None, help="rank 0 writes {final_step, loss, params_sha256} here")
    ap.add_argument("--ckpt-dir", default=None,
                    help="save a disk checkpoint (torch.save) every --ckpt-every steps and, when not under dprun, "
                         "resume from the newest one at start (torchrun --max-restarts)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--kill-at-step", type=int, default=0,
                    help="rehearsal: rank --kill-rank SIGKILLs itself as step N begins (its first incarnation only)")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--timings", default=None, help="rank 0 appends one JSON line per step here (benchmarks)")
    ap.add_argument("--stats", default=None,
                    help="rank 0 writes what differs from run to run here (peak RSS, snapshot interval chosen...)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Everything that does not depend on the rank comes before dpstate.init(): a spare waits inside init()
    # until it is promoted, so what it builds before is built while it is idle, not during a recovery.
    text = load_text(args.data, args.max_bytes)
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    vocab, tokens = torch.unique(raw, return_inverse=True)
    tokens = tokens.to(torch.uint8 if len(vocab) <= 256 else torch.int64)

    torch.manual_seed(args.seed)
    device = dpstate.local_device()
    model = GPT(len(vocab), args.block_size, args.n_layer, args.n_embd, args.n_head, args.dropout).to(device)
    # torch.optim.AdamW whose steps write into the snapshot buffers under dprun (no copy per snapshot)
    opt = dpstate.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    )
    job = dpstate.init()
    # one data stream per data-parallel rank: this rank's, and a lost replica's too while the job runs narrow
    batches = job.per_rank(lambda rank: Batches(tokens, args.block_size, args.batch_size, args.seed, rank))
    ddp_model = job.data_parallel(model)
    job.track(model=model, optimizer=opt, scheduler=sched, data=batches)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    policy = job.snapshot_policy  # None when not under dprun
    ckpt = DiskCheckpoints(args.ckpt_dir, args.ckpt_every, job.rank, job.world_size) if args.ckpt_dir else None
    timings = Timings(args.timings if job.rank == 0 or job.rank == args.kill_rank else None)
    start = 0
    if ckpt is not None and policy is None:
        start = ckpt.newest()
        if start:
            t0 = time.perf_counter()
            ckpt.load(start, model, opt, sched, batches)
            load_s = time.perf_counter() - t0
            if job.rank == 0:
                timings.write(event="resumed", step=start, load_s=load_s, restart=restart)
                print(f"train_gpt: resumed from the disk checkpoint of step {start} ({load_s:.2f} s to load)",
                      flush=True)
    if job.rank == 0:
        timings.write(event="ready", restart=restart, generation=job.generation)
    first_incarnation = restart == 0 and job.generation == 0
    if job.rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"train_gpt: {n_params / 1e6:.2f}M params, {len(text) / 1e6:.2f} MB text, vocab {len(vocab)}, "
              f"world {job.world_size}, generation {job.generation}, on {device}", flush=True)

    loss_value, last, t_last = float("nan"), 0, time.perf_counter()
    for step in job.steps(args.steps):
        if step.number <= start:
            continue  # done before the restart: the disk checkpoint holds its result
        with step:
            if args.kill_at_step == step.number and job.rank == args.kill_rank and first_incarnation:
                timings.write(event="kill", step=step.number, rank=job.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad(set_to_none=True)
            losses = []
            for rank in step.data_ranks():
                x, y = batches[rank].next()
                loss = ddp_model(x.to(job.device), y.to(job.device))
                loss.backward()
                losses.append(loss.item())
            opt_started = time.perf_counter()
            opt.step()
            opt_s = time.perf_counter() - opt_started  # for benchmarks/overhead.py: what landing adds to it
            sched.step()
            loss_value = losses[0]  # this rank's own
            step.log(loss=loss_value, tokens=x.numel() * job.carried.logical_world)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step.failure is None:
            last = step.number
            if job.rank == 0:
                timings.write(step=step.number, gen=job.generation, restart=restart, opt_s=round(opt_s, 6))
            if ckpt is not None and step.number % args.ckpt_every == 0:
                ckpt.save(step.number, model, opt, sched, batches)
        if job.rank == 0 and args.log_every and step.number % args.log_every == 0:
            now = time.perf_counter()
            print(f"step {step.number:5d}  loss {loss_value:.4f}  {(now - t_last) * 1000 / args.log_every:6.1f} ms/step  "
                  f"gen {job.generation}", flush=True)
            t_last = now

    if job.rank == 0 and args.summary:
        summary = {"final_step": last, "loss": loss_value, "params_sha256": params_sha256(model)}
        write_json(args.summary, summary)
    if job.rank == 0 and args.stats:  # what differs from run to run: for benchmarks/
        stats = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "restart": restart, "generation": job.generation, "world_size": job.world_size,
                 "state_bytes": state_bytes(model, opt)}
        if ckpt is not None:
            stats["ckpt_save_s"] = round(ckpt.save_s, 3)
        if policy is not None:
            stats.update(snapshot_policy=policy.describe(), snapshot_interval=policy.interval,
                         snapshot_cost=policy.cost, snapshot_cost_bound=policy.cost_bound,
                         max_lost_steps=policy.max_lost_steps,
                         snapshot_decided_at=policy.decided_at)
        write_json(args.stats, stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
