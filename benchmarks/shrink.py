"""Cost of a shrink and of a grow (dprun --on-spare-exhausted shrink) against a hot swap of the same job, and the
throughput of the narrow job against full width, each repetition's runs side by side.

    python benchmarks/shrink.py [--nnodes 3] [--repeats 3] [--kill-at 20] [--narrow-steps 20] [--json PATH]
        [--quick] [--keep]

The job: examples/train_gpt.py (the recovery benchmark's model; --quick: the small one), NNODES nodes of one
worker each, every node its own `dprun` on this host (--rdzv-endpoint on loopback, as on a cluster), node 1
killed by the head's `--inject kill-node:1@step=K`. Per repetition, in alternating order:

* hotswap: NNODES nodes + one spare node (--spares 1): the spare takes node 1's place.
* shrink: NNODES nodes, no spare (--spares 0 --on-spare-exhausted shrink): the survivors go on at NNODES - 1
  processes, one of them carrying node 1's rank; after --narrow-steps narrow steps a new node is started
  (`dprun --rdzv-endpoint ...` without --node-rank: it registers as a spare) and the job grows back onto it.

Costs come from each recovery's `recovery_complete` event: detect -> first step at the new width (total - detect:
for a grow, from the joining node's registration, its detect being 0), its phases, and total. Throughput from
rank 0's step timings in the shrink run: full width (the steps before the kill) against narrow (the shrink's
generation, its first step left out, up to the moment the new node is started: its start competes for the
cores), and after the grow. Expected narrow/full: 1 / job_shrunk's slowdown (Width.slowdown: the busiest process
computes that many ranks' micro-batches), where each process has a core of its own; with fewer cores than
processes the full-width steps share the cores too, and the figure to expect then is printed beside it.

A run that fails (exit code, timeout, a recovery missing from its events) is said with the tail of its log and
gets no figure; the benchmark then exits 1.

JSON: {"cost_s": {"hotswap", "shrink", "grow": {detect_to_step_s, total_s, detect_s, decide_s, rebuild_s,
restore_s, rest_s}}, "ratio": {"shrink_over_hotswap", "grow_over_hotswap"}, "steps_per_s": {"full", "narrow", "grown",
"hotswap"}, "narrow_over_full", "expected": {...}, "runs": [...], "failed": [...]}.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from recovery import RECOVERY_MODEL  # noqa: E402

KINDS = ("hotswap", "shrink", "grow")
PHASES = ("detect_to_step_s", "total_s", "detect_s", "decide_s", "rebuild_s", "restore_s", "rest_s")
HOTSWAP_AFTER = 10  # steps of a hot-swap run after its kill
WARM = 3  # the first steps of a generation are left out of its rate (allocations, the first snapshots)


class RunFailed(Exception):
    """A run that measured nothing: why (the tail of its log comes with it)."""


def events_of(folder: Path) -> list[dict]:
    return C.read_jsonl(folder / "events.jsonl")


def timings_of(folder: Path) -> list[dict]:
    return C.read_jsonl(folder / "timings.jsonl")


def wait_until(predicate, head, timeout: float, what: str) -> None:
    """Until `predicate()` holds; RunFailed when the head dprun ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if head.poll() is not None:
            raise RunFailed(f"the head dprun ended ({C.exit_cause(head.returncode)}) before {what}")
        if time.monotonic() > deadline:
            raise RunFailed(f"no {what} within {timeout:.0f} s")
        time.sleep(0.1)


def run_job(kind: str, args, folder: Path) -> dict:
    """One multi-node job: `hotswap` (a spare node takes node 1's place) or `shrink` (no spare: narrow, then a
    node joins and the job grows back). Returns what analyse() needs."""
    token = folder / "token"
    token.write_text(secrets.token_hex(16))
    # a hot swap needs a few steps after its recovery only; a shrink, its narrow window, the grow and a few after
    steps = args.kill_at + (HOTSWAP_AFTER if kind == "hotswap" else args.narrow_steps + args.tail_steps)
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    common = [sys.executable, "-m", "dprun", "--rdzv-endpoint", f"127.0.0.1:{C.free_port()}", "--token-file", token,
              "--nnodes", str(args.nnodes), "--no-tui", "--heartbeat-timeout", str(args.heartbeat_timeout)]
    common += ["--spares", "1"] if kind == "hotswap" else ["--spares", "0", "--on-spare-exhausted", "shrink"]
    script = [C.TRAIN, "--steps", steps, "--seed", "0", *(C.SMALL_MODEL if args.quick else RECOVERY_MODEL),
              "--log-every", "0", "--timings", folder / "timings.jsonl"]
    procs = []
    t_join = None
    try:
        head = C.start([*common, "--node-rank", "0", "--inject", f"kill-node:1@step={args.kill_at}",
                        "--events-file", folder / "events.jsonl", *script], folder, env, "head.log")
        procs.append(head)
        # its controller listens before the other nodes start (their own ports could take the endpoint's)
        wait_until(lambda: events_of(folder), head, 60, "its controller listened")
        for rank in range(1, args.nnodes):
            procs.append(C.start([*common, "--node-rank", str(rank), *script], folder, env, f"node{rank}.log"))
        if kind == "hotswap":
            procs.append(C.start([*common, *script], folder, env, "spare.log"))
        else:
            def narrowed() -> bool:
                shrunk = [e for e in events_of(folder) if e["event"] == "job_shrunk"]
                gen = shrunk[0]["generation"] if shrunk else None
                return sum(1 for r in timings_of(folder) if "event" not in r and r.get("gen") == gen) \
                    >= args.narrow_steps
            wait_until(narrowed, head, args.timeout, f"{args.narrow_steps} narrow steps")
            t_join = time.time()  # the narrow window ends here: the new node's start competes for the cores
            procs.append(C.start([*common, *script], folder, env, "joined.log"))
        try:
            code = head.wait(timeout=args.timeout)
        except Exception:
            raise RunFailed(f"timed out after {args.timeout:.0f} s") from None
        if code != 0:
            raise RunFailed(f"the head dprun ended with {C.exit_cause(code)}")
    finally:
        C.stop(procs, folder)
    return {"events": events_of(folder), "timings": timings_of(folder), "t_join": t_join}


def recovery(events: list[dict], generation: int, kind: str) -> dict:
    done = [e for e in events if e["event"] == "recovery_complete" and e["generation"] == generation]
    if not done:
        raise RunFailed(f"no recovery_complete for the {kind}'s generation {generation}")
    ph = done[0]["phases"]
    # detect -> first step at the new width: a grow's detect is 0 (it starts when the new node registers)
    # rest: what the phases leave out (the new generation's barrier and first step, messages)
    rest = ph["total_s"] - sum(ph[k] for k in ("detect_s", "decide_s", "rebuild_s", "restore_s"))
    return {"detect_to_step_s": round(ph["total_s"] - ph["detect_s"], 4), "rest_s": round(rest, 4),
            **{k: ph[k] for k in PHASES if k not in ("detect_to_step_s", "rest_s")}}


def rate(timings: list[dict], generation: int, until: float | None = None, skip: int = WARM) -> float | None:
    """Steps per second of rank 0 in `generation` (its first `skip` steps left out; only steps ended by `until`)."""
    steps = [r for r in timings if "event" not in r and r.get("gen") == generation
             and (until is None or r["t"] <= until)][skip:]
    if len(steps) < 2 or steps[-1]["t"] <= steps[0]["t"]:
        return None
    return (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["t"] - steps[0]["t"])


def analyse(kind: str, run: dict) -> dict:
    events, timings = run["events"], run["timings"]
    by = {name: [e for e in events if e["event"] == name] for name in ("job_shrunk", "job_grew", "reconfigure")}
    if kind == "hotswap":
        if not by["reconfigure"]:
            raise RunFailed("no reconfigure event: the spare never took over")
        gen = by["reconfigure"][0]["generation"]
        return {"hotswap": recovery(events, gen, "hot swap"), "steps_per_s": {"hotswap": rate(timings, 0)}}
    if not by["job_shrunk"] or not by["job_grew"]:
        raise RunFailed(f"{len(by['job_shrunk'])} job_shrunk and {len(by['job_grew'])} job_grew events (one each "
                        "expected)")
    shrunk, grew = by["job_shrunk"][0], by["job_grew"][0]
    out = {"shrink": recovery(events, shrunk["generation"], "shrink"),
           "grow": recovery(events, grew["generation"], "grow"),
           "steps_per_s": {"full": rate(timings, 0), "narrow": rate(timings, shrunk["generation"], run["t_join"], 1),
                           "grown": rate(timings, grew["generation"])},
           "processes": shrunk["processes"], "ranks": shrunk["ranks"], "slowdown": shrunk["slowdown"]}
    joined = [e for e in events if e["event"] == "node_joined" and e["time"] >= run["t_join"]]
    if joined:  # the new node's own start, before the grow's clock starts
        out["join_start_s"] = round(joined[0]["time"] - run["t_join"], 3)
    missing = [k for k, v in out["steps_per_s"].items() if v is None]
    if missing:
        raise RunFailed(f"too few steps to time the {', '.join(missing)} rate (raise --kill-at / --narrow-steps)")
    return out


def expected(slowdown: int, ranks: int, processes: int, nnodes: int, cores: int) -> dict:
    """narrow/full when compute sets the pace: a step lasts as long as its busiest process's micro-batches, or,
    where the processes outnumber the cores, as long as the cores take for all of them."""
    def step(busiest: int, procs: int) -> float:
        return max(busiest, ranks / min(cores, procs))
    return {"one_core_per_process": 1 / slowdown, "on_these_cores": step(1, nnodes) / step(slowdown, processes),
            "cores": cores}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nnodes", type=int, default=None, help="nodes of one worker each (3; --quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions of each run (3; --quick 1)")
    ap.add_argument("--kill-at", type=int, default=None, help="step at which node 1 is killed (20; --quick 8)")
    ap.add_argument("--narrow-steps", type=int, default=None,
                    help="narrow steps before a node joins (20; --quick 8)")
    ap.add_argument("--tail-steps", type=int, default=None,
                    help="steps left for the grow and after it (30; --quick 100): the job must not end first (a grow "
                         "waits for the joining node's workers to be set up, up to 3 s after it registered)")
    ap.add_argument("--heartbeat-timeout", type=float, default=20.0,
                    help="high: a busy host must not fail nodes that are only slow (a kill is seen at once)")
    ap.add_argument("--quick", action="store_true", help="small model, 2 nodes, 1 repetition: a smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = ap.parse_args(argv)
    defaults = ({"nnodes": 2, "repeats": 1, "kill_at": 8, "narrow_steps": 8, "tail_steps": 100} if args.quick else
                {"nnodes": 3, "repeats": 3, "kill_at": 20, "narrow_steps": 20, "tail_steps": 30})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nnodes < 2 or args.kill_at <= WARM + 2:
        ap.error("--nnodes 2 or more, --kill-at above 5")
    C.install_cleanup()
    work = C.Workdir("shrink", keep=args.keep)
    failures = C.Failures("shrink", work)
    cores = os.cpu_count() or 1
    print(f"shrink: {args.nnodes} nodes, node 1 killed at step {args.kill_at}; hot swap (1 spare) vs shrink (none), "
          f"then a node joins after {args.narrow_steps} narrow steps; {args.repeats} repetition(s), {cores} cores "
          f"(load {os.getloadavg()[0]:.1f}); folders under {work.path}", flush=True)
    runs: list[dict] = []
    t0 = time.perf_counter()
    try:
        for rep in range(args.repeats):
            for job in (("hotswap", "shrink") if rep % 2 == 0 else ("shrink", "hotswap")):
                folder = work.new(f"r{rep}-{job}")
                t_run = time.perf_counter()
                try:
                    got = analyse(job, run_job(job, args, folder))
                except RunFailed as exc:
                    log = C.file_tail(folder / "head.log")
                    failures.add(f"{job}#{rep}", str(exc), log, folder)
                    continue
                runs.append({"rep": rep, "job": job, "wall_s": round(time.perf_counter() - t_run, 1), **got})
                parts = [f"{k} detect->step {got[k]['detect_to_step_s']:.2f} s" for k in KINDS if k in got]
                print(f"  rep {rep} {job:7s} " + ", ".join(parts) + ", steps/s " +
                      ", ".join(f"{k} {v:.2f}" for k, v in got["steps_per_s"].items()), flush=True)
    finally:
        work.close()

    medians: dict[str, dict[str, Any]] = {k: {p: C.median(r[k][p] for r in runs if k in r) for p in PHASES}
                                          for k in KINDS}
    cost = {k: v for k, v in medians.items() if v["total_s"] is not None}
    hot = cost.get("hotswap", {}).get("detect_to_step_s")
    ratio = {f"{k}_over_hotswap": cost[k]["detect_to_step_s"] / hot for k in ("shrink", "grow")
             if k in cost and hot and cost[k]["detect_to_step_s"] is not None}
    names = ("full", "narrow", "grown", "hotswap")
    sps = {k: C.median(r["steps_per_s"][k] for r in runs if k in r["steps_per_s"]) for k in names}
    shrinks = [r for r in runs if r["job"] == "shrink"]
    # paired within each run: its full-width and narrow windows are seconds apart
    narrow_over_full = C.median([r["steps_per_s"]["narrow"] / r["steps_per_s"]["full"] for r in shrinks])
    exp = expected(shrinks[0]["slowdown"], shrinks[0]["ranks"], shrinks[0]["processes"], args.nnodes, cores) \
        if shrinks else {}
    result = {"benchmark": "shrink", "machine": C.machine(), "quick": args.quick, "nnodes": args.nnodes,
              "repeats": args.repeats, "kill_at": args.kill_at, "narrow_steps": args.narrow_steps,
              "cost_s": cost, "ratio": ratio, "steps_per_s": sps, "narrow_over_full": narrow_over_full,
              "expected": exp, "join_start_s": C.median([r["join_start_s"] for r in shrinks if "join_start_s" in r]),
              "elapsed_s": round(time.perf_counter() - t0, 1), "runs": runs, "failed": failures.as_json()}
    C.write_json(args.json, result)

    print()
    if cost:
        print("cost (median over repetitions; s): detect -> first step at the new width, its phases (rest: the "
              "new generation's barrier, first step, messages), and total (failure or join -> first step)")
        print(C.table(["recovery", "detect->step", "detect", "decide", "rebuild", "restore", "rest", "total",
                       "x hot swap"],
                      [[k, C.fmt(c["detect_to_step_s"]), C.fmt(c["detect_s"]), C.fmt(c["decide_s"]),
                        C.fmt(c["rebuild_s"]), C.fmt(c["restore_s"]), C.fmt(c["rest_s"]), C.fmt(c["total_s"]),
                        C.fmt(ratio.get(f"{k}_over_hotswap", 1.0 if k == "hotswap" else None), ".2f")]
                       for k, c in cost.items()]))
    if ratio:
        print("ratio " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    if result["join_start_s"] is not None:
        print(f"the joining node's own start (dprun started -> registered, before the grow's clock): "
              f"{result['join_start_s']:.2f} s")
    if narrow_over_full is not None:
        r0 = shrinks[0]
        print(f"\nthroughput (steps/s, median): full width {C.fmt(sps['full'], '.2f')}, narrow "
              f"{C.fmt(sps['narrow'], '.2f')} ({r0['ranks']} ranks on {r0['processes']} processes), grown back "
              f"{C.fmt(sps['grown'], '.2f')}; hot swap's full width {C.fmt(sps['hotswap'], '.2f')}")
        print(f"narrow/full measured {narrow_over_full:.2f}; expected {exp['one_core_per_process']:.2f} (1 / slowdown "
              f"{r0['slowdown']}, a core per process), {exp['on_these_cores']:.2f} on {cores} cores shared by "
              f"{args.nnodes} processes at full width")
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
