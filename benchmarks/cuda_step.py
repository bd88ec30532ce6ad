"""The CUDA path: step time on one GPU with vs without per-step snapshots, for a model whose state is several GB.

    python benchmarks/cuda_step.py [--gb 4] [--blocks 3] [--steps-per-block 10] [--step-s 2] [--json PATH]
    python benchmarks/cuda_step.py --device cpu --gb 0.05      # the same code on CPU (a smoke run)

The snapshot is dpstate's: after each step the tracked state (parameters + AdamW state) is captured by a
device-to-host copy on a side stream into pinned host buffers (waiting on an event recorded after the step),
checksummed and replicated from host memory to a replica store in another process
(benchmarks/_replica_holder.py: dpagent's ReplicaServer, as a peer node's agent holds it); the optimizer
pre-step hook is the only wait: dpstate's snapshot gate, which (torch's AdamW does not land its step in the
snapshot buffers) waits for a capture at every step and for its acks at the next snapshot step only. Blocks
of steps without and with snapshots alternate (--blocks each), so a drift of the machine hits both; reported
are the median step times and their ratio. Without CUDA (and without --device cpu) it says so and exits 0.
--step-s S sets the ratio of compute to state: before the blocks, the rows per step are scaled (measured, a few
rounds) until a step without snapshots takes about S seconds, in micro-batches of at most --max-rows rows whose
gradients accumulate (a 2 s step of a 4 GB model in one batch would need ~90 GB of activations).

Then, unless --no-auto, `--snapshot-interval auto` decides as in a job: dpstate's SnapshotPolicy measures
what a snapshot costs over its alternating window (steps without their waits for acks, and how long after
the next gate the acks come) and picks the interval that keeps it under --budget; blocks of snapshots at that
interval then alternate with blocks without (at least 3 intervals long), and their mean step times give the
overhead measured at auto's interval.

JSON: {"device", "state_bytes", "batch" (rows per micro-batch), "micro_batches", "step_target_s", "calibration",
"step_s": {"off", "per_step"}, "ratio", "overhead", "profile",
"auto": {"interval", "cost", "lag_steps", "overhead_estimate", "max_lost_steps", "decision", "mean_step_s":
{"off", "auto"}, "overhead_measured"}}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0, help="state size (parameters + AdamW state), GB")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8192, help="rows per step (with --step-s: the first guess)")
    ap.add_argument("--step-s", type=float, default=None,
                    help="scale the rows per step until a step without snapshots takes about this long, s")
    ap.add_argument("--max-rows", type=int, default=32768,
                    help="with --step-s: rows per micro-batch at most (more: gradients accumulate over several)")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps-per-block", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-replica", action="store_true", help="snapshot to host memory only")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="skip the auto interval's decision")
    ap.add_argument("--budget", type=float, default=0.01, help="auto's budget, a fraction of step time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    import _common as C
    from dpcommon import protocol as P
    from dpstate.steps.abort import AbortSignal
    from dpstate.steps.gate import SnapshotGate
    from dpstate.steps.interval import SnapshotPolicy
    from dpstate.replication.replicator import Replicator
    from dpstate.snapshot.state import Tracked

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_step: no CUDA device here; nothing measured (the CUDA path's CPU-runnable tests are in "
              "tests/test_cuda_stand_in.py)")
        C.write_json(args.json, {"benchmark": "cuda_step", "device": None, "skipped": "no CUDA device"})
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": set_device and get_device_name want an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    # Linear(width, width) layers: 12 bytes per parameter with AdamW (fp32 weights + exp_avg + exp_avg_sq)
    per_layer = args.width * args.width + args.width
    layers = max(1, round(args.gb * 1e9 / 12 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    shape = {"x": torch.randn(args.batch, args.width, device=device), "micro": 1}
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt)

    holder = None
    rep = Replicator(P.Codec(b"cuda-step-benchmark-token"), 0, AbortSignal())
    if not args.no_replica:
        token = "cuda-step-benchmark-token"
        holder = subprocess.Popen([sys.executable, str(HERE / "_replica_holder.py"), token, "1"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        endpoint = holder.stdout.readline().strip()
        if not endpoint.startswith("tcp://"):
            # configured with "" the replicator would keep snapshots local: figures without the replication
            holder.stdin.close()
            code = holder.wait(30)
            print(f"cuda_step: FAILED: the replica holder did not start ({C.exit_cause(code)}; its error is above); "
                  "nothing measured", file=sys.stderr)
            return 1
        rep.configure(0, endpoint, 0)
    gate = SnapshotGate(rep)
    gate.defers = True  # torch's AdamW steps in place: acks are waited for at snapshot steps (dpstate.steps.gate)
    opt.register_step_pre_hook(lambda *_: gate.wait())  # the snapshot gate (at once when none in flight)

    def step(number: int, snapshot: bool) -> float:
        """One step; `snapshot` must agree with rep.policy.wants(number), which the gate goes by."""
        t0 = time.perf_counter()
        gate.step = number
        opt.zero_grad(set_to_none=True)
        for _ in range(shape["micro"]):  # gradients accumulate: a longer step, the same activation memory
            model(shape["x"]).float().pow(2).mean().backward()
        opt.step()
        if snapshot:
            rep.submit(number, tracked.capture(number))
            gate.submitted()
        gate.step = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def settle() -> None:
        """Every snapshot in flight acked (between blocks: as a job's final barrier)."""
        gate.step = None
        gate.wait()

    state = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    print(f"cuda_step: {layers} layers of {args.width}x{args.width}, state {state / 1e9:.2f} GB on {device}", flush=True)
    times = {"off": [], "per_step": []}
    number = 0
    calibration: list[dict] = []
    try:
        if args.step_s:
            number = fit_step(step, shape, args.step_s, args.max_rows, calibration)
            print(f"cuda_step: {shape['x'].shape[0]} rows x {shape['micro']} micro-batches per step for steps of "
                  f"about {args.step_s:g} s (measured {calibration[-1]['step_s']:.4f} s)", flush=True)
        rep.policy = SnapshotPolicy("1")
        for warm in range(5):  # warm-up: AdamW state exists (2 steps), then pinned buffers allocated (3)
            number += 1
            step(number, snapshot=warm >= 2)
        settle()
        for block in range(args.blocks):
            for mode in ("off", "per_step") if block % 2 == 0 else ("per_step", "off"):
                for _ in range(args.steps_per_block):
                    number += 1
                    times[mode].append(step(number, snapshot=mode == "per_step"))
                settle()
        auto = None
        if args.auto:
            auto, number = measure_auto(step, gate, rep, number, args.budget)
            settle()
            auto.update(at_interval(step, settle, rep, number, auto.pop("policy"), args.blocks, args.steps_per_block))
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(30)
    # a step with snapshots is measured up to the end of its own kernels; the snapshot it submits is waited
    # for by the next step's optimizer: each with-step carries the previous one's snapshot wait
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"benchmark": "cuda_step", "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "state_bytes": state, "layers": layers, "batch": shape["x"].shape[0], "micro_batches": shape["micro"],
              "step_target_s": args.step_s, "calibration": calibration, "step_s": med,
              "ratio": med["per_step"] / med["off"], "overhead": med["per_step"] / med["off"] - 1,
              "profile": rep.stats.as_dict(), "replica": not args.no_replica, "auto": auto}
    C.write_json(args.json, result)
    print(C.table(["snapshots", "median step s", "steps"],
                  [["off", f"{med['off']:.4f}", len(times["off"])],
                   ["per step", f"{med['per_step']:.4f}", len(times["per_step"])]]))
    st = rep.stats
    n = max(st.captures, 1)
    print(f"ratio {result['ratio']:.3f} ({result['overhead']:+.1%}); per snapshot: D2H copy {st.copy_s / n * 1000:.1f} ms, "
          f"crc {st.crc_s / n * 1000:.1f} ms, send->ack {st.send_s / max(st.sends, 1) * 1000:.1f} ms, optimizer wait "
          f"{st.wait_s / max(st.waits, 1) * 1000:.1f} ms")
    if auto:
        print(f"auto (budget {args.budget:.0%}): {auto['decision']}; measured at that interval: "
              f"{auto['overhead_measured']:+.2%} (mean step {auto['mean_step_s']['auto']:.4f} s against "
              f"{auto['mean_step_s']['off']:.4f} s)")
    return 0


def fit_step(step, shape: dict, target: float, max_rows: int, log: list) -> int:
    """Scale the rows per step (shape["x"]: one micro-batch; shape["micro"] of them per step) until a step without
    snapshots takes `target` s within 10 %: up to 4 rounds of a warm step (new shapes: the BLAS picks its
    kernels; AdamW's state at the first) and 2 timed ones. The first guess scales the rows by target / time;
    then a line through the last two rounds (a step's fixed cost, the optimizer's, plus a cost per row), so a
    round or two after the first is enough. Returns the steps taken."""
    import torch

    x, number = shape["x"], 0
    width, device = x.shape[1], x.device
    for attempt in range(4):
        number += 1
        step(number, False)
        took = statistics.median([step(number + 1, False), step(number + 2, False)])
        number += 2
        total = x.shape[0] * shape["micro"]
        log.append({"rows": x.shape[0], "micro_batches": shape["micro"], "step_s": took})
        if abs(took / target - 1) <= 0.1 or attempt == 3:
            break
        rows = guess = round(total * target / took)
        if len(log) >= 2:
            (r0, t0), (r1, t1) = [(e["rows"] * e["micro_batches"], e["step_s"]) for e in log[-2:]]
            if r1 != r0 and (t1 - t0) / (r1 - r0) > 0:
                per_row = (t1 - t0) / (r1 - r0)
                rows = min(round((target - (t1 - per_row * r1)) / per_row), 4 * guess)  # (noise: not 100x)
        if rows < 1:  # the fixed cost alone takes longer than the target: the shortest step there is
            break
        micro = -(-rows // max_rows)
        shape["x"] = x = None  # freed before the next is made (device memory)
        shape["x"] = x = torch.randn(-(-rows // micro), width, device=device)
        shape["micro"] = micro
    return number


def measure_auto(step, gate, rep, number: int, budget: float) -> tuple[dict, int]:
    """--snapshot-interval auto on this GPU: dpstate's SnapshotPolicy measures the cost of a snapshot over
    its alternating window (as the session does, here for one rank) and picks the interval."""
    from dpstate.steps.interval import SnapshotPolicy

    window = SnapshotPolicy.from_env()  # its warm-up and pairs: DP_SNAPSHOT_AUTO_STEPS, as in a job
    policy = rep.policy = SnapshotPolicy("auto", budget, window.warmup, window.pairs)
    policy.defers = gate.defers
    while not policy.decided:
        number += 1
        step(number, policy.wants(number))
        if policy.after_step(number, gate.step_clock(policy)):  # as Job._after_step
            policy.decide_from(policy.local_measurements(), number)
    cost = max(policy.cost or 0.0, policy.cost_bound or 0.0)
    return {"interval": policy.interval, "cost": policy.cost, "cost_bound": policy.cost_bound,
            "lag_steps": policy.lag_steps,
            "overhead_estimate": (cost + max(0.0, policy.lag_steps - policy.interval + 1)) / policy.interval,
            "max_lost_steps": policy.max_lost_steps, "decision": policy.describe(), "policy": policy}, number


def at_interval(step, settle, rep, number: int, policy, blocks: int, steps_per_block: int) -> dict:
    """Blocks snapshotted at auto's interval alternating with blocks without: mean step times (a snapshot's
    cost falls on a few steps of each interval) and the overhead they give."""
    length = max(steps_per_block, 3 * policy.interval)
    times: dict[str, list] = {"off": [], "auto": []}
    for block in range(blocks):
        for mode in ("off", "auto") if block % 2 == 0 else ("auto", "off"):
            for _ in range(length):
                number += 1
                times[mode].append(step(number, mode == "auto" and policy.wants(number)))
            settle()
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    return {"mean_step_s": mean, "overhead_measured": mean["auto"] / mean["off"] - 1}


if __name__ == "__main__":
    sys.exit(main())
