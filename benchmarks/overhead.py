"""Failure-free overhead: throughput of examples/train_gpt.py on 2 nodes with per-step snapshots + replication,
with an automatic interval, with snapshots off, and under plain torchrun (same script, same seed), interleaved;
and what one snapshot costs, paired within a run that snapshots every 2nd step (alternate).

    python benchmarks/overhead.py [--reps 2] [--steps 50] [--json overhead.json] [--quick]

Default model: 9.0 M parameters; parameters + AdamW state = 108 MB per node. Each configuration runs `--reps`
times, in rotated order (off, per_step, auto, torchrun, alternate; then per_step, auto, ..., off; ...), so
that slow phases of a shared machine hit all of them. Throughput is tokens per second from step 4 (both snapshot
buffers written once) to the end; auto's over whole snapshot intervals after its decision (each holds exactly
one snapshot), against off's over the same steps. Overheads are medians over repetitions of 1 - throughput /
throughput(off) within a repetition. Whole runs differ by several % on a shared host, more than the cost of a
snapshot; the alternate runs resolve it: the median over adjacent steps of (a step that carries a snapshot's
capture - the step before it, which carries none), over a step's time (overhead_per_step_paired); that cost
over the interval each auto run chose is what auto costs once decided (overhead_auto_paired). The
per-step runs also write dpstate's snapshot profile (DP_SNAPSHOT_PROFILE); the benchmark samples every
process's peak RSS (VmHWM) and per-thread CPU.

JSON: {"throughput": {"off", "per_step", "auto", "torchrun", "alternate"} (tokens/s, medians),
"overhead_per_step", "overhead_per_step_paired", "paired_pairs", "paired_optimizer_ms" (of the paired cost, what
the optimizer step after a snapshot takes longer), "overhead_auto", "overhead_auto_paired", "auto_interval",
"auto_max_lost_steps", "auto_cost", "auto_cost_bound", "profile", "peak_rss", "runs": [...]}.
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see DESIGN.md) and the same thread settings.
A run that fails (exit code, timeout) is said with the tail of its output and left out of every figure ("failed":
[{"run", "cause", "folder"}] in the JSON); the benchmark then exits 1.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _limits  # noqa: E402

CONFIGS = ("off", "per_step", "auto", "torchrun", "alternate")
# also on request (--configs): the same with every snapshot a copy, as before dpstate.AdamW's steps landed in
# the snapshot buffers (DP_SNAPSHOT_LANDING=0), to measure what landing saves side by side
COPY_CONFIGS = ("per_step_copy", "alternate_copy")
STEADY_FROM = 4  # from step 4 on, a snapshot goes into a buffer written before (the first two fault pages in)
AUTO_STEPS = "3,16"  # dpstate's default: 3 warm-up steps, then 16 pairs measured: decided at step 36


def command(config: str, args, folder: Path) -> tuple[list[str], dict[str, str]]:
    model = model_args(args)
    script = [str(C.TRAIN), "--steps", str(args.steps), "--seed", "0", *model, "--log-every", "0",
              "--timings", "timings.jsonl", "--summary", "summary.json", "--stats", "stats.json"]
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DP_SNAPSHOT_AUTO_STEPS": args.auto_steps}
    if config == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *script], env
    if config.endswith("_copy"):
        config, env["DP_SNAPSHOT_LANDING"] = config[: -len("_copy")], "0"
    interval = {"off": "off", "per_step": "1", "auto": f"auto:{args.budget}", "alternate": "2"}[config]
    if config in ("per_step", "off"):  # off: for its main thread's CPU (what a snapshot slows down beside it)
        env["DP_SNAPSHOT_PROFILE"] = str(folder / "profile")
    return [sys.executable, "-m", "dprun", "--nnodes", "2", "--no-tui", "--snapshot-interval", interval,
            "--events-file", "events.jsonl", *script], env


def model_args(args) -> list[str]:
    """The trainer's model flags, with --batch-size when given (more tokens per step: more compute per byte
    of state, so a snapshot costs a smaller share of a step)."""
    model = list(C.SMALL_MODEL if args.quick else C.BIG_MODEL)
    if args.batch_size:
        model[model.index("--batch-size") + 1] = str(args.batch_size)
    return model


def auto_window(summary: dict | None, steps: int, decided: int) -> tuple[int, int]:
    """Whole snapshot intervals after the first auto decision, at step `decided` (each holds one snapshot),
    else what follows it. The first decision, not the last: auto decides again every few snapshots
    (summary's snapshot_decided_at is the latest), and a window from there held 3 steps in one run."""
    interval = int(summary.get("snapshot_interval") or 1) if summary else 1
    first = (decided // interval + 1) * interval
    last = steps // interval * interval
    if last - first >= interval and last > first:
        return first, last
    return decided + 1, steps


def paired_cost(timings: list[dict], lo: int, hi: int) -> tuple[float | None, int]:
    """What one snapshot costs as a fraction of a step, from a run that snapshots every 2nd step: the median over
    adjacent pairs of (a step that follows a snapshot - the step before it, which follows none), over the median
    step that follows none; and the number of pairs. A snapshot of step S is captured during step S + 1."""
    ends = C.step_times(timings)
    took = {k: ends[k] - ends[k - 1] for k in ends if k - 1 in ends and lo < k <= hi}
    plain = {k: d for k, d in took.items() if (k - 1) % 2}
    diffs = after_snapshot_minus_before(took)
    base = C.median(plain.values())
    return (C.median(diffs) / base if diffs and base else None), len(diffs)


def after_snapshot_minus_before(per_step: dict[int, float]) -> list[float]:
    """The adjacent pairs of a run that snapshots every 2nd (even) step: per_step[k] - per_step[k - 1] for each
    step k that follows a snapshot (k - 1 even) whose predecessor, which follows none, is there too."""
    return [v - per_step[k - 1] for k, v in per_step.items() if not (k - 1) % 2 and k - 1 in per_step]


def paired_optimizer_s(timings: list[dict], lo: int, hi: int) -> float | None:
    """What a snapshot adds to the optimizer step after it (rank 0's), from a run that snapshots every 2nd step:
    the median over the same adjacent pairs as paired_cost of the difference in opt.step()'s wall time. With
    dpstate.AdamW that step writes its result out of place into the snapshot buffer (dpstate.snapshot.landing) only
    after a step that was snapshotted: this is that cost, inside the paired cost."""
    opt = {r["step"]: r["opt_s"] for r in timings if "opt_s" in r and "event" not in r and lo < r["step"] <= hi}
    return C.median(after_snapshot_minus_before(opt))


def paired_costs(runs: list[dict], config: str) -> list[float]:
    """The paired cost of one snapshot in each run of `config` (an alternate one) that measured it."""
    return [r["paired"][0] for r in runs if r["config"] == config and r.get("paired") and r["paired"][0] is not None]


def auto_paired(runs: list[dict]) -> float | None:
    """What auto costs once decided, from the paired cost of one snapshot (the alternate runs, many more pairs
    than auto's own) over the interval each auto run chose: whether auto's estimate kept the budget."""
    cost = C.median(paired_costs(runs, "alternate"))
    intervals = [r["snapshot_interval"] for r in runs if r["config"] == "auto" and r["snapshot_interval"]]
    return C.median(max(cost, 0.0) / n for n in intervals) if cost is not None and intervals else None


def main_thread_ms_per_step(result: C.RunResult, steps: int) -> float | None:
    """CPU of the training thread (MainThread) per step and rank, over the whole run (start-up included: alike
    in every configuration, so differences between them are per-step costs)."""
    files = sorted(glob.glob(str(result.folder / "profile.rank*.json")))
    cpu = [json.loads(Path(f).read_text()).get("threads_cpu_s", {}).get("MainThread") for f in files]
    cpu = [c for c in cpu if c is not None]
    return sum(cpu) / len(cpu) / steps * 1000 if cpu and steps else None


def profile_of(result: C.RunResult) -> dict | None:
    files = sorted(glob.glob(str(result.folder / "profile.rank*.json")))
    ranks = [json.loads(Path(f).read_text()) for f in files]
    n = sum(r["captures"] for r in ranks)
    if not n:
        return None
    per = lambda key: sum(r[key] for r in ranks) / n * 1000  # noqa: E731  ms per snapshot
    threads: dict[str, float] = {}
    for r in ranks:
        for name, sec in r.get("threads_cpu_s", {}).items():
            threads[name] = threads.get(name, 0.0) + sec
    return {
        "snapshots": n, "bytes_per_snapshot": sum(r["bytes"] for r in ranks) / n,
        # what dpstate.AdamW's steps had written in place already (dpstate.snapshot.landing): not copied
        "landed_bytes_per_snapshot": sum(r.get("landed_bytes", 0) for r in ranks) / n,
        "ms_per_snapshot": {"meta": per("meta_s"), "copy": per("copy_s"), "crc": per("crc_s"),
                            "capture": per("capture_s"), "send_to_ack": per("send_s"),
                            "gate_wait": per("wait_s")},
        "cpu_ms_per_snapshot": {"meta": per("meta_cpu_s"), "copy": per("copy_cpu_s"), "crc": per("crc_cpu_s")},
        # the steady cost: the mean above includes each buffer's first capture, which faults its pages in
        "capture_cpu_ms_median": C.median(ms for r in ranks for ms in r.get("capture_cpu_ms", [])),
        "worker_cpu_ms_per_snapshot": {k: v / n * 1000 for k, v in threads.items()
                                       if k in ("dpstate-replication", "ZMQbg/IO/0")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every configuration (2; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (50; --quick 30)")
    ap.add_argument("--budget", type=float, default=0.01, help="auto's budget (fraction of step time)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS + COPY_CONFIGS)} (default: all but the last two)")
    ap.add_argument("--quick", action="store_true", help="small model, few steps: a ~1 minute smoke run")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="sequences per rank and step (default 8: 1,024 tokens per rank and step)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 2)
    args.steps = args.steps or (30 if args.quick else 50)  # 5 configs x 2 reps: ~10 min here
    args.auto_steps = "2,3" if args.quick else AUTO_STEPS
    warm, pairs = (int(x) for x in args.auto_steps.split(","))
    first_decision = 1 + warm + 2 * pairs  # the step at which auto first decides (dpstate.steps.interval)
    configs = [c for c in args.configs.split(",") if c]
    C.install_cleanup()
    work = C.Workdir("overhead", keep=args.keep)
    failures = C.Failures("overhead", work)
    print(f"overhead: {len(configs)} configurations x {args.reps} repetitions, {args.steps} steps each, "
          f"{'small' if args.quick else '108 MB-state'} model, 2 nodes; folders under {work.path}", flush=True)
    runs: list[dict] = []
    results: dict[tuple[int, str], C.RunResult] = {}
    try:
        for rep in range(args.reps):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for config in order:
                folder = work.new(f"r{rep}-{config}")
                cmd, env = command(config, args, folder)
                res = C.run(f"{config}#{rep}", cmd, folder=folder, env=env, timeout=args.timeout)
                summary = res.json_file("stats.json")
                print(f"  rep {rep} {config:9s} rc {res.returncode} wall {res.wall_s:6.1f} s"
                      + (f"  ({summary.get('snapshot_policy')})" if summary and summary.get("snapshot_policy")
                         else ""), flush=True)
                if failures.check(res):  # a failed run's partial timings would pass for a measurement
                    results[(rep, config)] = res
        # the measurement windows of each repetition: auto's from its decision (the same steps in every run of
        # the repetition, compared with off's); the others' from the first step whose snapshot goes into a
        # buffer written before (both buffers' pages faulted in) to the end
        tokens = None
        for rep in range(args.reps):
            auto = results.get((rep, "auto"))
            auto_lo, auto_hi = auto_window(auto.json_file("stats.json") if auto else None, args.steps,
                                           first_decision)
            for config in configs:
                res = results.get((rep, config))
                if res is None:  # failed: no figures
                    continue
                summary = {**(res.json_file("summary.json") or {}), **(res.json_file("stats.json") or {})}
                lo, hi = (auto_lo, auto_hi) if config == "auto" else (STEADY_FROM, args.steps)
                timings = res.timings()
                rate = C.window_rate(timings, lo, hi)
                if tokens is None and summary:
                    model = model_args(args)
                    opt = dict(zip(model[::2], model[1::2]))
                    tokens = int(opt["--block-size"]) * int(opt["--batch-size"]) * int(summary.get("world_size", 2))
                steps = sorted(C.step_times(timings).items())
                step_s = C.median(b[1] - a[1] for a, b in zip(steps, steps[1:])
                                  if b[0] == a[0] + 1 and lo < b[0] <= hi)
                runs.append({
                    "rep": rep, "config": config, "returncode": res.returncode, "wall_s": round(res.wall_s, 2),
                    "others_cpu_share": round(res.others_cpu_share, 3), "median_step_s": step_s,
                    "window": [lo, hi], "steps_per_s": rate,
                    "auto_window_steps_per_s": C.window_rate(timings, auto_lo, auto_hi),
                    "state_bytes": summary.get("state_bytes"),
                    "snapshot_policy": summary.get("snapshot_policy"),
                    "snapshot_interval": summary.get("snapshot_interval"),
                    "snapshot_cost": summary.get("snapshot_cost"),
                    "snapshot_cost_bound": summary.get("snapshot_cost_bound"), "max_lost_steps": summary.get("max_lost_steps"),
                    "peak_rss": res.peak_rss_by_role(), "cpu_s": res.cpu_by_role_thread(),
                    "profile": profile_of(res) if config == "per_step" else None,
                    "main_thread_ms_per_step": main_thread_ms_per_step(res, args.steps),
                    "paired": paired_cost(timings, STEADY_FROM, args.steps) if config.startswith("alternate") else None,
                    "paired_optimizer_s": (paired_optimizer_s(timings, STEADY_FROM, args.steps)
                                           if config.startswith("alternate") else None),
                })
        # the floor is for the state the runs reported: without one (every run failed) there is none to measure
        state_guess = C.median(r["state_bytes"] for r in runs if r["state_bytes"])
        limits = None
        if state_guess:
            print("  measuring the limits (memcpy, loopback TCP) ...", flush=True)
            limits = _limits.measure(int(state_guess))
    finally:
        work.close()

    by = lambda config, key: [r[key] for r in runs if r["config"] == config and r[key] is not None]  # noqa: E731
    # None, not 0, where no run of a configuration measured a rate (or none told the tokens per step)
    rates = {c: C.median(by(c, "steps_per_s")) for c in configs}
    throughput = {c: rates[c] * tokens if rates[c] is not None and tokens else None for c in configs}

    def overhead(config: str) -> float | None:
        key = "auto_window_steps_per_s" if config == "auto" else "steps_per_s"  # off over the same steps
        ratios = []
        for rep in range(args.reps):
            base = [r for r in runs if r["rep"] == rep and r["config"] == "off"]
            this = [r for r in runs if r["rep"] == rep and r["config"] == config]
            if base and this and base[0][key] and this[0][key]:
                ratios.append(1 - this[0][key] / base[0][key])
        return C.median(ratios)

    auto_runs = [r for r in runs if r["config"] == "auto"]
    # The least a per-step snapshot can cost on this host: copy the state once and move it over loopback TCP
    # (both ends' CPU), on every node, while training keeps every core busy; as a fraction of a step.
    off_step = C.median(r["median_step_s"] for r in runs if r["config"] == "off")
    floor: dict = {}
    if limits:
        per_node_cpu = state_guess / limits["memcpy_Bps"] + limits["tcp_cpu_s"]
        floor = {"memcpy_Bps": limits["memcpy_Bps"], "tcp_Bps": limits["tcp_Bps"], "tcp_cpu_s": limits["tcp_cpu_s"],
                 "cpu_s_per_snapshot_per_node": per_node_cpu, "step_s_off": off_step,
                 "overhead_per_step_floor": (per_node_cpu * 2 / (os.cpu_count() or 1) / off_step
                                             if off_step and (os.cpu_count() or 1) <= 2 else
                                             per_node_cpu / off_step if off_step else None)}
    state = C.median(r["state_bytes"] for r in runs if r["state_bytes"])
    profiles = [r["profile"] for r in runs if r.get("profile")]
    peak = {}
    for config in configs:
        roles: dict[str, list[int]] = {}
        for r in runs:
            if r["config"] == config:
                for role, v in r["peak_rss"].items():
                    roles.setdefault(role, []).append(v)
        peak[config] = {role: max(v) for role, v in roles.items()}
    # CPU the agents spend per snapshot: (agents' CPU with per-step snapshots - without) / snapshots, per thread
    agent_cpu = {}
    for config in ("off", "per_step"):
        vals = [sum(r["cpu_s"].get("agent", {}).values()) for r in runs if r["config"] == config]
        agent_cpu[config] = C.median(vals)
    for prof in profiles:
        rep = next(r for r in runs if r.get("profile") is prof)
        base = next((r for r in runs if r["rep"] == rep["rep"] and r["config"] == "off"), None)
        threads = rep["cpu_s"].get("agent", {})
        prof["agent_cpu_ms_per_snapshot"] = {
            name: (sec - (base["cpu_s"].get("agent", {}).get(name, 0.0) if base else 0.0)) / prof["snapshots"] * 1000
            for name, sec in threads.items() if sec > 0.05}
    # the training thread's CPU per step with per-step snapshots minus without, per rank, paired within a
    # repetition: the main thread's own part of a snapshot (~1 ms) and how much the capture beside it slows it
    slowed = []
    for rep in range(args.reps):
        pair = {r["config"]: r["main_thread_ms_per_step"] for r in runs if r["rep"] == rep}
        if pair.get("off") is not None and pair.get("per_step") is not None:
            slowed.append(pair["per_step"] - pair["off"])
    result = {
        "benchmark": "overhead", "machine": C.machine(), "steps": args.steps, "reps": args.reps,
        "quick": args.quick, "state_bytes_per_node": state, "tokens_per_step": tokens,
        "throughput": throughput,
        "overhead_per_step": overhead("per_step") if "per_step" in configs else None,
        "overhead_auto": overhead("auto") if "auto" in configs else None,
        # the same cost resolved within one run: adjacent steps with and without a snapshot (every 2nd step)
        "overhead_per_step_paired": C.median(paired_costs(runs, "alternate")),
        "paired_pairs": sum(r["paired"][1] for r in runs if r.get("paired") and r["config"] == "alternate"),
        "overhead_per_step_paired_copy": C.median(paired_costs(runs, "alternate_copy")),
        # of that paired cost, what the optimizer step after a snapshot takes longer (landing's out-of-place writes)
        "paired_optimizer_ms": C.median(r["paired_optimizer_s"] * 1000 for r in runs if r["config"] == "alternate"
                                        and r.get("paired_optimizer_s") is not None),
        "overhead_torchrun": overhead("torchrun") if "torchrun" in configs else None,
        # auto's chosen interval held against that independent cost: what auto costs once it has decided
        "overhead_auto_paired": auto_paired(runs),
        "auto_interval": C.median(r["snapshot_interval"] for r in auto_runs if r["snapshot_interval"]),
        "auto_max_lost_steps": C.median(r["max_lost_steps"] for r in auto_runs if r["max_lost_steps"]),
        "auto_cost": C.median(r["snapshot_cost"] for r in auto_runs if r["snapshot_cost"] is not None),
        "auto_cost_bound": C.median(r["snapshot_cost_bound"] for r in auto_runs
                                    if r["snapshot_cost_bound"] is not None),
        "auto_budget": args.budget,
        "profile": profiles[0] if len(profiles) == 1 else ({"per_rep": profiles} if profiles else None),
        "agent_cpu_s": agent_cpu,
        "main_thread_slowed_ms_per_step": C.median(slowed),
        "others_cpu_share": {c: C.median(r["others_cpu_share"] for r in runs if r["config"] == c) for c in configs},
        "floor": floor,
        "peak_rss": peak,
        "runs": runs,
        "failed": failures.as_json(),
    }
    C.write_json(args.json, result)

    print()
    rows = []
    for config in configs:
        rates = by(config, "steps_per_s")
        lo_hi = C.spread(rates)
        ov = None if config == "off" else overhead(config)
        rows.append([config, C.fmt(throughput[config], ".0f"),
                     "-" if not lo_hi or not tokens else f"{lo_hi[0] * tokens:.0f}..{lo_hi[1] * tokens:.0f}",
                     "-" if ov is None else f"{ov:+.1%}",
                     C.mb(peak[config].get("worker")), C.mb(peak[config].get("agent"))])
    print(C.table(["config", "tokens/s", "range", "overhead", "worker MB", "agent MB"], rows))
    if state:
        print(f"state (params + AdamW) per node: {state / 1e6:.0f} MB; peak RSS is per process (max over runs)")
    if auto_runs:
        print(f"auto: interval {result['auto_interval']} (measured cost of one snapshot "
              f"{C.fmt(result['auto_cost'], '.1%')} of a step, at most {C.fmt(result['auto_cost_bound'], '.1%')} "
              f"within one standard error; budget {args.budget:.1%}); worst case "
              f"{result['auto_max_lost_steps']} steps lost")
    for prof in profiles[:1]:
        ms = prof["ms_per_snapshot"]
        print("per-step snapshot, ms per snapshot (background thread, wall): " +
              ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
        print("capture, CPU ms per snapshot (background thread): " +
              ", ".join(f"{k} {v:.1f}" for k, v in prof["cpu_ms_per_snapshot"].items())
              + f" (mean); the median capture {C.fmt(prof['capture_cpu_ms_median'], '.1f')}; "
              f"{prof['landed_bytes_per_snapshot'] / 1e6:.0f} of {prof['bytes_per_snapshot'] / 1e6:.0f} MB "
              "per snapshot landed by the optimizer step (not copied)")
        print("worker CPU ms per snapshot: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                          prof["worker_cpu_ms_per_snapshot"].items()))
        print("agent (replica holder) CPU ms per snapshot: " + ", ".join(
            f"{'Python threads (verify, store, ack)' if k == 'python' else k} {v:.1f}"
            for k, v in prof.get("agent_cpu_ms_per_snapshot", {}).items()))
    if result["main_thread_slowed_ms_per_step"] is not None:
        print(f"training thread CPU per step and rank, per-step snapshots minus off: "
              f"{result['main_thread_slowed_ms_per_step']:+.1f} ms (its own part of a snapshot, ~1 ms, and the "
              f"capture beside it slowing it: per repetition {', '.join(f'{v:+.1f}' for v in slowed)})")
    if result["overhead_per_step_paired"] is not None:
        each = ", ".join(f"{cost:+.2%}" for cost in paired_costs(runs, "alternate"))
        print(f"per-step snapshots, paired within runs (every 2nd step snapshotted, {result['paired_pairs']} pairs "
              f"of adjacent steps): one snapshot costs {result['overhead_per_step_paired']:+.2%} of a step "
              f"(per repetition: {each})")
        if result["paired_optimizer_ms"] is not None:
            step_ms = C.median(r["median_step_s"] for r in runs if r["config"] == "alternate") * 1000
            print(f"  of which the optimizer step after a snapshot (its writes land out of place): "
                  f"{result['paired_optimizer_ms']:+.1f} ms ({result['paired_optimizer_ms'] / step_ms:+.2%} of a step)")
    if result["overhead_per_step_paired_copy"] is not None:
        each = ", ".join(f"{cost:+.2%}" for cost in paired_costs(runs, "alternate_copy"))
        print(f"the same with every snapshot a copy (DP_SNAPSHOT_LANDING=0): "
              f"{result['overhead_per_step_paired_copy']:+.2%} (per repetition: {each})")
    if result["overhead_auto_paired"] is not None:
        print(f"auto, once decided: that paired cost over the interval it chose costs "
              f"{result['overhead_auto_paired']:+.2%} (budget {args.budget:.1%})")
    if floor.get("overhead_per_step_floor") is not None:
        print(f"floor: copying the state once + moving it over loopback TCP costs {per_node_cpu * 1000:.0f} ms of CPU "
              f"per node and snapshot ({floor['overhead_per_step_floor']:.1%} of a {off_step:.2f} s step with 2 "
              f"nodes on {os.cpu_count()} cores)")
    share = result["others_cpu_share"]
    print("other processes on this machine used " + ", ".join(f"{c} {C.fmt(v, '.0%')}" for c, v in share.items())
          + " of its CPUs during the runs (median)")
    if agent_cpu.get("off") is not None and agent_cpu.get("per_step") is not None:
        print(f"agents' CPU seconds per run: {agent_cpu['off']:.1f} (off) vs {agent_cpu['per_step']:.1f} (per step)")
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
