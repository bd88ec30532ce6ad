"""A dpstate worker for the abort tests (tests/test_dpstate_abort.py): joins a Gloo group over a TCPStore on this
host and obeys commands on stdin (see abort_worker), saying what happened on stdout.

    python tests/data/abort_worker.py STORE_PORT RANK GENERATION
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def abort_worker(port: int, rank: int, generation: int) -> None:
    """Joins `generation` (world 2) as `rank` and obeys stdin: 'ddp' (a DDP step) / 'allreduce' start a
    collective that the test freezes or kills the peer of, 'abort' (handled at once by a reader thread) sets
    the abort signal, 'join G R N [W]' builds generation G (world W, default 2) as rank R and runs N DDP
    steps, 'layouts' reports whether DDP gradients are bitwise the same under two bucket layouts (with the
    deterministic hook and with a plain all-reduce), 'exit' ends. Reports lines on stdout.
    A DDP's second step rebuilds its buckets (a broadcast), later ones do not."""
    import torch
    import torch.distributed as dist

    from dpstate.steps.abort import AbortSignal, classify
    from dpstate.groups.ddp import DataParallel
    from dpstate.groups.pgroup import GroupManager

    abort = AbortSignal()
    commands: queue.SimpleQueue = queue.SimpleQueue()
    marks = {}

    def reader() -> None:
        for line in sys.stdin:
            if line.strip() == "abort":
                marks["abort"] = time.monotonic()
                abort.trigger("test abort")
            else:
                commands.put(line.split())

    threading.Thread(target=reader, daemon=True).start()
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    groups = GroupManager("gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DataParallel(model, abort)

    def join(gen: int, r: int, iters: int, world: int = 2) -> None:
        abort.enter(gen)
        ddp.drop()
        groups.build(gen, f"127.0.0.1:{port}", r, world, abort)
        t = torch.full((4,), float(r + 1))
        abort.wait_future(dist.all_reduce(t, async_op=True).get_future(), timeout=30)
        for _ in range(iters):
            ddp(torch.randn(16, 64)).sum().backward()
        say("JOINED", gen, t[0].item())

    def same_under_two_layouts(deterministic: bool) -> bool:
        """Gradients of the same step under one big bucket and under tiny (rebuilt) buckets."""
        grads = []
        for cap_mb in (25.0, 0.0005):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
            proxy = DataParallel(net, abort, deterministic=deterministic, bucket_cap_mb=cap_mb)
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(dist.get_rank())) * 1000
            for _ in range(3):  # the second step rebuilds the buckets
                net.zero_grad()
                proxy(x).pow(2).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
            proxy.drop()
        return bool(torch.equal(grads[0], grads[1]))

    if generation >= 0:
        join(generation, rank, 2)
    while True:
        cmd = commands.get()
        if cmd[0] == "exit":
            say("EXITING")
            return
        if cmd[0] == "join":
            join(*map(int, cmd[1:]))
            continue
        if cmd[0] == "layouts":
            say("LAYOUTS", *(same_under_two_layouts(deterministic) for deterministic in (True, False)))
            continue
        say("WAITING", cmd[0])
        t0 = time.monotonic()
        try:
            if cmd[0] == "ddp":
                ddp(torch.randn(16, 64)).sum().backward()
            else:
                abort.wait_future(dist.all_reduce(torch.ones(1000), async_op=True).get_future(), timeout=30)
            say("COMPLETED")
        except Exception as exc:
            released = time.monotonic() - marks.get("abort", t0)
            msg = str(exc).replace("\n", " ")[:300]
            say("RELEASED", classify(exc, abort), type(exc).__name__, f"{released:.3f}",
                f"{time.monotonic() - t0:.3f}", msg)
            abort.enter(abort.target)  # as if the next generation began: the signal clears


if __name__ == "__main__":
    abort_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
