"""Cost of a failure: the same job and the same failure (worker rank 1 SIGKILLs itself as step K begins) under
DeadPool's hot swap and under `torchrun --max-restarts 1` with disk checkpoints every k steps (torch.save,
resumed after the restart), each next to its failure-free run, interleaved.

    python benchmarks/recovery.py [--reps 2] [--steps 80] [--kill-at 75] [--ckpt-every 50] [--json PATH] [--quick]

The job: examples/train_gpt.py, 2 nodes (torchrun: 2 processes), 9.0 M parameters, 108 MB of parameters +
AdamW state per node, batch 2 x 128 tokens per rank (short steps keep the default run near 10 minutes).
DeadPool runs with one spare; torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it the restart
fails on torch 2.13 with Gloo: DESIGN.md) and its rendezvous on loopback, both with the same thread settings.

Reported per system:
* lost_s: faulty run's wall time - failure-free run's (median of the per-repetition differences). On a shared
  machine this difference carries the noise of two whole runs (seconds), so also:
* lost_timeline_s: from the faulty run's own timeline, (end of step s+1) - (end of step s) - one normal
  step, s the newest step done before the kill: what the failure added to the run, noise of one step only.
* breakdown: detect (kill -> the failure is known), restart / rebuild, restore (state loaded), recompute
  (steps done again), from DeadPool's events and the trainer's timings.
* floor_s (measured in the same run): a 2-rank Gloo group rebuild + moving the state once over loopback TCP +
  one step; deadpool_detect_to_step_s: the failure known -> every rank finished a step after it.
Extras (DeadPool only, once each; --no-extras skips them): a whole node killed (dprun --inject kill-node) and a
node frozen (freeze-node, SIGSTOP): its time from the freeze to the first step, against heartbeat timeout + 1 s.
torchft: measured when `import torchft` works here (pip install torchft-nightly); else reported as unavailable.

A run that fails (exit code, timeout) is said with the tail of its output and left out of every figure, the
failure-free step times and the floor included; the benchmark then exits 1.

JSON: {"lost_s": {"deadpool", "torchrun", "torchft"}, "lost_timeline_s": {...}, "floor_s",
"deadpool_detect_to_step_s", "breakdown": {...}, "floor": {...}, "extras": {...}, "runs": [...],
"failed": [{"run", "cause", "folder"}]}.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _limits  # noqa: E402

RECOVERY_MODEL = [*C.BIG_MODEL[:-4], "--batch-size", "2", "--max-bytes", "1000000"]


def model_args(quick: bool) -> list[str]:
    return C.SMALL_MODEL if quick else RECOVERY_MODEL


def command(system: str, fault: str, args, folder: Path) -> tuple[list[str], dict[str, str]]:
    script = [str(C.TRAIN), "--steps", str(args.steps), "--seed", "0", *model_args(args.quick), "--log-every", "0",
              "--timings", "timings.jsonl", "--summary", "summary.json", "--stats", "stats.json"]
    if fault == "kill-worker":
        script += ["--kill-at-step", str(args.kill_at), "--kill-rank", "1"]
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if system == "torchft":  # replica group 1's worker dies; torchrun restarts it and it heals from group 0
        i = script.index("--stats")
        return [args.torchft_python, str(Path(__file__).resolve().parent / "_torchft_job.py"), "--",
                *script[1:i], *script[i + 2:]], env
    if system == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        script += ["--ckpt-dir", str(folder / "ckpt"), "--ckpt-every", str(args.ckpt_every)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", *script], env
    dprun = [sys.executable, "-m", "dprun", "--nnodes", "2", "--spares", "1", "--no-tui",
             "--heartbeat-timeout", str(args.heartbeat_timeout), "--events-file", "events.jsonl"]
    if fault in ("kill-node", "freeze-node"):
        dprun += ["--inject", f"{fault}:1@step={args.kill_at - 1}"]
    return [*dprun, *script], env


def analyse_torchft(res: C.RunResult, step_s: float | None) -> dict:
    """torchft: the survivor (group 0) keeps stepping; what the failure costs is its extra time per step from the
    kill to the end (the stall until the quorum drops the dead group, the heal when it comes back)."""
    g0, g1 = res.timings(), res.timings("timings.group1.jsonl")
    out: dict = {"returncode": res.returncode, "wall_s": round(res.wall_s, 3)}
    kill = next((r for r in g1 if r.get("event") == "kill"), None)
    steps = [r for r in g0 if "step" in r and "event" not in r]
    out["final_step"] = steps[-1]["step"] if steps else None
    if kill is None or not steps or not step_s:
        return out
    t_fail = kill["t"]
    out["t_fail"] = t_fail
    before = [r for r in steps if r["t"] <= t_fail]
    after = [r for r in steps if r["t"] > t_fail]
    if not before or not after:
        return out
    prev, extra = before[-1], []
    for r in after:
        extra.append(r["t"] - prev["t"] - step_s * max(1, r["step"] - prev["step"]))
        prev = r
    out["lost_timeline_s"] = sum(extra)
    out["stall_s"] = after[0]["t"] - before[-1]["t"] - step_s
    out["steps_with_one_group"] = sum(1 for r in after if r.get("participants") == 1)
    back = next((r for r in g1 if r.get("event") == "ready" and r.get("restart") == 1), None)
    if back is not None:
        out["restart_s"] = back["t"] - t_fail
    healed = next((i for i, r in enumerate(after) if r.get("participants") == 2), None)
    if healed is not None:
        out["heal_s"] = extra[healed]
    out["recomputed_steps"] = 0
    return out


def analyse(res: C.RunResult, system: str, fault: str, step_s: float | None) -> dict:
    """The failure's cost from the run's own timeline (and DeadPool's events)."""
    if system == "torchft" and fault != "none":
        return analyse_torchft(res, step_s)
    timings = res.timings()
    out: dict = {"returncode": res.returncode, "wall_s": round(res.wall_s, 3)}
    ends = C.step_times(timings)
    out["final_step"] = max(ends) if ends else None
    if fault == "none":
        steps = sorted(ends)
        deltas = [ends[b] - ends[a] for a, b in zip(steps, steps[1:]) if b == a + 1 and a >= 5]
        out["step_s"] = C.median(deltas)
        return out
    events = res.events()
    kill = next((r for r in timings if r.get("event") == "kill"), None)
    failed = next((e for e in events if e["event"] == "node_failed"), None)
    injected = next((e for e in events if e["event"] == "fault_injected"), None)
    t_fail = kill["t"] if kill else (injected["time"] if injected else (failed["time"] if failed else None))
    out["t_fail"] = t_fail
    if t_fail is None:
        return out
    # rank 0's steps in order of completion: those of the first incarnation (generation 0 of DeadPool, restart 0
    # of torchrun: rank 0 may finish a step after its peer died) and those after the recovery
    steps = [r for r in timings if "step" in r and "event" not in r]
    before = [r for r in steps if r.get("gen", 0) == 0 and r.get("restart", 0) == 0]
    after = [r for r in steps if r.get("gen", 0) != 0 or r.get("restart", 0) != 0]
    if not before or not after:
        return out
    s_last = before[-1]["step"]
    t_last = before[-1]["t"]
    nxt = next((r for r in after if r["step"] == s_last + 1), None)
    first_after = after[0]
    out["last_step_before"] = s_last
    out["resumed_from"] = first_after["step"] - 1
    out["recomputed_steps"] = max(0, s_last - (first_after["step"] - 1))
    if nxt is not None and step_s:
        out["lost_timeline_s"] = nxt["t"] - t_last - step_s
    if system == "deadpool":
        done = next((e for e in events if e["event"] == "recovery_complete"), None)
        if failed and done:
            ph = done["phases"]
            out["detect_s"] = failed["time"] - t_fail
            out["decide_s"] = ph["decide_s"]
            out["rebuild_s"] = ph["rebuild_s"]
            out["restore_s"] = ph["restore_s"]
            out["detect_to_step_s"] = done["time"] - failed["time"]
            out["fail_to_step_s"] = done["time"] - t_fail
            out["restore_step"] = done["restore_step"]
            if nxt is not None:
                out["recompute_s"] = nxt["t"] - done["time"]
    else:
        resumed = next((r for r in timings if r.get("event") == "resumed" and r["t"] > t_fail), None)
        if resumed is not None:
            out["restart_s"] = resumed["t"] - resumed["load_s"] - t_fail  # detect + stop + respawn + import + rendezvous
            out["restore_s"] = resumed["load_s"]
            if nxt is not None:
                out["recompute_s"] = nxt["t"] - resumed["t"]
        out["ckpt_save_s"] = (res.json_file("stats.json") or {}).get("ckpt_save_s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (2; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (80; --quick 30)")
    ap.add_argument("--kill-at", type=int, default=None, help="step at which worker rank 1 is killed (75; --quick 25)")
    ap.add_argument("--ckpt-every", type=int, default=None, help="torchrun's disk checkpoint interval k (50; --quick 10)")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--no-extras", action="store_true", help="skip DeadPool's kill-node and freeze-node runs")
    ap.add_argument("--torchft-python", default=os.environ.get("DP_TORCHFT_PYTHON"),
                    help="a Python with torchft (pip install torchft-nightly) to add torchft's runs; default: this "
                         "one if it has torchft, else $DP_TORCHFT_PYTHON")
    ap.add_argument("--quick", action="store_true", help="small model, few steps: a ~1 minute smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    quick = {"reps": 1, "steps": 30, "kill_at": 25, "ckpt_every": 10}
    full = {"reps": 2, "steps": 80, "kill_at": 75, "ckpt_every": 50}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.no_extras = True
    if not args.torchft_python and importlib.util.find_spec("torchft") is not None:
        args.torchft_python = sys.executable
    torchft = bool(args.torchft_python)
    systems = ["deadpool", "torchrun"] + (["torchft"] if torchft else [])
    C.install_cleanup()
    work = C.Workdir("recovery", keep=args.keep)
    failures = C.Failures("recovery", work)
    print(f"recovery: worker rank 1 killed at step {args.kill_at} of {args.steps}; torchrun checkpoints every "
          f"{args.ckpt_every} steps; {args.reps} repetitions; folders under {work.path}", flush=True)
    plan = [(s, f) for s in systems for f in ("none", "kill-worker")]
    results: list[tuple[int, str, str, C.RunResult]] = []
    try:
        for rep in range(args.reps):
            order = plan[rep % len(plan):] + plan[: rep % len(plan)]
            for system, fault in order:
                folder = work.new(f"r{rep}-{system}-{fault}")
                cmd, env = command(system, fault, args, folder)
                res = C.run(f"{system}/{fault}#{rep}", cmd, folder=folder, env=env, timeout=args.timeout)
                print(f"  rep {rep} {system:8s} {fault:11s} rc {res.returncode} wall {res.wall_s:6.1f} s", flush=True)
                if failures.check(res):  # a failed run's partial timeline would pass for a measurement
                    results.append((rep, system, fault, res))
        extras_runs = []
        if not args.no_extras:
            for fault in ("kill-node", "freeze-node"):
                folder = work.new(f"extra-deadpool-{fault}")
                cmd, env = command("deadpool", fault, args, folder)
                res = C.run(f"deadpool/{fault}", cmd, folder=folder, env=env, timeout=args.timeout)
                print(f"  extra    deadpool {fault:11s} rc {res.returncode} wall {res.wall_s:6.1f} s", flush=True)
                if failures.check(res):
                    extras_runs.append((fault, res))
        state = None
        for *_, res in results:
            summary = res.json_file("stats.json")
            if summary and summary.get("state_bytes"):
                state = summary["state_bytes"]
                break
        limits = None  # the floor moves the state the runs reported: without one (every run failed), no floor
        if state:
            print("  measuring the floor (process group rebuild, loopback transfer of the state) ...", flush=True)
            limits = _limits.measure(int(state))
        # normal step time of each system: its failure-free runs
        step_s = {s: C.median(analyse(r, s, "none", None).get("step_s") for _, s2, f, r in results
                              if s2 == s and f == "none") for s in systems}
        runs = []
        for rep, system, fault, res in results:
            runs.append({"rep": rep, "system": system, "fault": fault, **analyse(res, system, fault, step_s[system]),
                         "peak_rss": res.peak_rss_by_role()})
        extras = {}
        for fault, res in extras_runs:
            a = analyse(res, "deadpool", fault, step_s["deadpool"])
            extras[fault] = a
    finally:
        work.close()

    def faulty(system: str) -> list[dict]:
        return [r for r in runs if r["system"] == system and r["fault"] == "kill-worker"]

    lost, lost_timeline, breakdown = {}, {}, {}
    for system in systems:
        diffs = []
        for rep in range(args.reps):
            clean = [r for r in runs if r["rep"] == rep and r["system"] == system and r["fault"] == "none"]
            bad = [r for r in runs if r["rep"] == rep and r["system"] == system and r["fault"] == "kill-worker"]
            if clean and bad:  # both succeeded (failed runs are not in runs)
                diffs.append(bad[0]["wall_s"] - clean[0]["wall_s"])
        lost[system] = C.median(diffs)
        lost_timeline[system] = C.median(r.get("lost_timeline_s") for r in faulty(system))
        keys = (["detect_s", "decide_s", "rebuild_s", "restore_s", "recompute_s", "recomputed_steps",
                 "detect_to_step_s"] if system == "deadpool" else
                ["stall_s", "restart_s", "heal_s", "steps_with_one_group"] if system == "torchft" else
                ["restart_s", "restore_s", "recompute_s", "recomputed_steps", "ckpt_save_s"])
        breakdown[system] = {k: C.median(r.get(k) for r in faulty(system)) for k in keys}
    lost.setdefault("torchft", None)
    lost_timeline.setdefault("torchft", None)
    # one step of training itself: the failure-free step without snapshots (torchrun's; DeadPool's carries the
    # per-step snapshot, which on a host whose cores are busy costs a large part of a step: benchmarks/overhead.py)
    plain_step = step_s.get("torchrun") or step_s.get("deadpool")
    floor = limits["pg_rebuild_s"] + limits["tcp_s"] + plain_step if limits and plain_step else None
    d2s = breakdown["deadpool"].get("detect_to_step_s")
    result = {
        "benchmark": "recovery", "machine": C.machine(), "steps": args.steps, "kill_at": args.kill_at,
        "ckpt_every": args.ckpt_every, "reps": args.reps, "quick": args.quick, "state_bytes_per_node": state,
        "lost_s": lost, "lost_timeline_s": lost_timeline,
        "floor_s": floor, "deadpool_detect_to_step_s": d2s,
        "ratio_torchrun_over_deadpool": (lost_timeline["torchrun"] / lost_timeline["deadpool"]
                                         if lost_timeline["torchrun"] and lost_timeline["deadpool"] else None),
        "detect_to_step_over_floor": d2s / floor if d2s and floor else None,
        "breakdown": breakdown, "step_s": step_s,
        "floor": {"pg_rebuild_s": limits["pg_rebuild_s"], "state_transfer_s": limits["tcp_s"],
                  "step_s": plain_step, "tcp_Bps": limits["tcp_Bps"], "memcpy_Bps": limits["memcpy_Bps"]}
        if limits else {},
        "torchft": (f"measured with {args.torchft_python}" if torchft else
                    "not measured: no torchft here (pip install torchft-nightly, then --torchft-python)"),
        "extras": extras, "heartbeat_timeout_s": args.heartbeat_timeout, "runs": runs,
        "failed": failures.as_json(),
    }
    if "freeze-node" in extras:
        f = extras["freeze-node"]
        result["frozen_fail_to_step_s"] = f.get("fail_to_step_s")
        result["frozen_limit_s"] = args.heartbeat_timeout + 1.0
    C.write_json(args.json, result)

    print()
    rows = []
    for system in systems:
        b = breakdown[system]
        if system == "torchft":
            parts = (f"survivor stalls {C.fmt(b['stall_s'], '.2f')}, dead group restarted after "
                     f"{C.fmt(b['restart_s'], '.2f')}, heal {C.fmt(b['heal_s'], '.2f')}; "
                     f"{C.fmt(b['steps_with_one_group'])} steps with one replica group (half the batch)")
        elif system == "deadpool":
            parts = (f"detect {C.fmt(b['detect_s'], '.2f')}, decide {C.fmt(b['decide_s'], '.2f')}, rebuild "
                     f"{C.fmt(b['rebuild_s'], '.2f')}, restore {C.fmt(b['restore_s'], '.2f')}, recompute "
                     f"{C.fmt(b['recompute_s'], '.2f')} ({C.fmt(b['recomputed_steps'])} steps)")
        else:
            parts = (f"detect+restart {C.fmt(b['restart_s'], '.2f')}, restore {C.fmt(b['restore_s'], '.2f')}, "
                     f"recompute {C.fmt(b['recompute_s'], '.2f')} ({C.fmt(b['recomputed_steps'])} steps)")
        rows.append([system, C.fmt(lost[system], ".2f"), C.fmt(lost_timeline[system], ".2f"), parts])
    if not torchft:
        rows.append(["torchft", "-", "-", result["torchft"]])
    print(C.table(["system", "lost_s", "timeline", "breakdown (s)"], rows))
    if floor is not None:
        print(f"floor {floor:.2f} s = process group {limits['pg_rebuild_s'] * 1000:.0f} ms + state "
              f"{state / 1e6:.0f} MB over loopback {limits['tcp_s'] * 1000:.0f} ms + one step "
              f"{plain_step:.2f} s (no snapshots); DeadPool detect -> first step {C.fmt(d2s, '.2f')} s "
              f"({C.fmt(result['detect_to_step_over_floor'], '.2f')} x floor)")
    if result["ratio_torchrun_over_deadpool"]:
        print(f"torchrun loses {result['ratio_torchrun_over_deadpool']:.1f}x more time per failure (timeline)")
    for fault, a in extras.items():
        print(f"extra {fault}: fail -> first step {C.fmt(a.get('fail_to_step_s'), '.2f')} s (detect "
              f"{C.fmt(a.get('detect_s'), '.2f')} s, detect -> step {C.fmt(a.get('detect_to_step_s'), '.2f')} s)"
              + (f"; limit heartbeat timeout + 1 = {args.heartbeat_timeout + 1:.1f} s" if fault == "freeze-node" else ""))
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
