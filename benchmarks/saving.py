"""Background saves (the disk tier): what `--save-every N` costs training, and how fast the agents write.

    python benchmarks/saving.py [--reps 3] [--steps 50] [--every 10] [--dir DIR] [--json saving.json] [--quick]

The job: examples/train_gpt.py on 2 nodes, overhead.py's model (9.0 M parameters: 108 MB of parameters + AdamW
state per rank), a snapshot every step (dprun's default), once without saves ("off") and once with
`--save-dir D --save-every N` ("save"), and the same saves through the page cache (DP_SAVE_DIRECT=0, "buffered";
by default they go past it, O_DIRECT), in rotated order per repetition so that slow phases of a shared host hit all.

* Throughput: tokens per second from step 4 to the end (overhead.py's window); overhead = 1 - throughput(save) /
  throughput(off) within a repetition, median over repetitions, with its spread. Target: <= 0.5 %.
* Save bandwidth: each `state_saved` event's bytes / seconds (every rank's snapshot; from the controller's request
  until the last node answered: the copy's checks (one pass of block digests), the writes, fsync, rename, the
  manifest parts and the messages), median over all saves. Its baseline, measured right after each save run in the
  same folder (so the same filesystem): a plain sequential write of the same number of bytes, 4 MiB writes, fsync,
  rename, as dpcommon.snapshot_files.write_snapshot does but without the checks or anything else, both past the
  page cache and through it (the faster is the baseline), by ONE writer (the
  target's baseline: what the disk gives one stream) and by N concurrent writers each writing its share, N = the
  nodes that wrote a save (its manifest parts; each agent writes the ranks it holds concurrently with the others,
  so that is what the save's writers could get at most). Each plain write is done 3 times; median. Target: save /
  one writer >= 0.8. The plain write runs while nothing trains; the save runs beside training, which keeps both
  cores busy. Beside it, the CPU part of one writer's share alone (copied out of the buffer it refers to, then
  digested; cpu_part_s_per_writer): not the disk.
* The control ("write"): a third run, without saves, during which the benchmark writes the save's bytes as the
  plain write does (by as many concurrent writers) each time training passes a multiple of N steps, at the save
  thread's priority: nice 19, from a session whose scheduling group (Linux's autogroup) is niced too, as a save
  thread's share of its node's group is (benchmarks/_aside_write.py): what writing that much beside training
  costs on this host, whatever writes it. Its bandwidth is the baseline the saves can be held to where training
  fills every core (bandwidth_ratio_beside = save / that), and its step cost (below) the floor of theirs.
* Step cost around a save, from the save runs' own timelines: the steps whose span overlaps a save (the
  event's [time - seconds, time]) against the median of the 2 steps before and 2 after that overlap none:
  the time they took beyond it, median over the saves after each run's first, and that over N of those steps
  (step_cost.overhead: the overhead the saves alone make, resolved within a run where whole runs differ by
  several % on a shared host). A run's first save is said apart (step_cost.first_save_added_ms): it also faults
  in the memory that its node's copy-out keeps for the rest of the job.

JSON: {"throughput": {"off", "save", "write", "buffered"} (tokens/s, medians), "overhead", "overhead_per_rep",
"overhead_spread", "save_mb_per_s", "plain_mb_per_s": {"one_writer", "n_writers", "direct_one", "buffered_one",
"direct_n", "buffered_n"}, "bandwidth_ratio", "bandwidth_ratio_n_writers",
"cpu_part_s_per_writer", "step_cost": {"added_ms_per_save", "baseline_step_ms", "overhead", "first_save_added_ms",
...},
"beside": {"mb_per_s", "bandwidth_ratio_beside", "step_cost"} (the control), "buffered": {"mb_per_s",
"overhead_per_rep", "step_cost"}, "saves", "buffered_saves",
"plain_writes", "runs", "failed"}. A run that fails (exit code, timeout, a save_failed event, no save at all) is
said with the tail of its output and has no figure; the benchmark then exits 1. Missing a target never fails it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
from _plain_write import BesideWriter, plain_write

from dpcommon.checksum import checksums_both

CONFIGS = ("off", "save", "write", "buffered")
SAVING = ("save", "buffered")  # buffered: DP_SAVE_DIRECT=0, the saves through the page cache
STEADY_FROM = 4  # as overhead.py: from step 4 on, both snapshot buffers have been written once
OVERHEAD_TARGET = 0.005
BANDWIDTH_TARGET = 0.8
PLAIN_REPEATS = 3


def command(config: str, args, folder: Path, save_dir: Path) -> tuple[list[str], dict[str, str]]:
    model = C.SMALL_MODEL if args.quick else C.BIG_MODEL
    script = [str(C.TRAIN), "--steps", str(args.steps), "--seed", "0", *model, "--log-every", "0",
              "--timings", "timings.jsonl", "--summary", "summary.json", "--stats", "stats.json"]
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DP_SAVE_DIRECT": "0" if config == "buffered" else "1"}
    saves = ["--save-dir", str(save_dir), "--save-every", str(args.every)] if config in SAVING else []
    return [sys.executable, "-m", "dprun", "--nnodes", "2", "--no-tui", "--snapshot-interval", "1",
            "--events-file", "events.jsonl", *saves, *script], env


def cpu_part_s(nbytes: int) -> float:
    """Seconds one core takes for the CPU part of writing `nbytes` of a held copy (dpcommon.snapshot_files.
    write_copies): copying it out of the worker's buffer it refers to, into memory kept for it, then one pass of
    block digests for the file's checks (dpcommon.checksum.checksums_both). With nothing else running: what of a
    save's time is not the disk, before contention."""
    data = np.frombuffer(os.urandom(nbytes), np.uint8)
    room = np.zeros(nbytes, np.uint8)
    t0 = time.perf_counter()
    np.copyto(room, data)
    checksums_both(b"{}", [memoryview(room)])
    return time.perf_counter() - t0


def save_windows(events: list[dict]) -> list[tuple[float, float]]:
    """[start, end] (Unix time) of each background save: the controller publishes state_saved when the last node
    answered, `seconds` after it asked."""
    return [(e["time"] - e["seconds"], e["time"]) for e in events if e.get("event") == "state_saved"]


def step_costs(timings: list[dict], windows: list[tuple[float, float]], lo: int, hi: int) -> list[dict]:
    """Per save within steps lo+1..hi: the steps whose span overlaps it, against the (up to) 2 steps before and 2
    after that overlap no save (their median: a local baseline, as a shared host drifts by 2x within a run):
    the time the overlapping steps took beyond that baseline, and the baseline."""
    ends = C.step_times(timings)
    took = {k: ends[k] - ends[k - 1] for k in ends if k - 1 in ends and lo < k <= hi}
    overlaps = lambda k, w0, w1: ends[k - 1] < w1 and w0 < ends[k]
    clear = [k for k in took if not any(overlaps(k, *w) for w in windows)]
    out = []
    for w0, w1 in windows:
        hit = [k for k in took if overlaps(k, w0, w1)]
        if not hit:
            continue
        around = [k for k in clear if k < hit[0]][-2:] + [k for k in clear if k > hit[-1]][:2]
        base = C.median(took[k] for k in around)
        if base:
            out.append({"steps": hit, "baseline_ms": base * 1000,
                        "added_ms": (sum(took[k] for k in hit) - len(hit) * base) * 1000})
    return out


def step_cost(per_run: list[list[dict]], every: int) -> dict | None:
    """step_costs' figures over a configuration's saves (or writes), each run's in order: the median time added per
    save after each run's first, its spread, the steps' baseline, and that time over `every` steps (the overhead
    the saves' cost alone makes, resolved within runs where whole runs differ by more than that on a shared host);
    apart, the median of each run's first save, which also faults in the memory its node's copy-out keeps for the
    job (once per agent: a month-long job pays it once, a 40-step run once in 3 saves)."""
    later = [c for costs in per_run for c in costs[1:]] or [c for costs in per_run for c in costs]
    if not later:
        return None
    added, base = C.median(c["added_ms"] for c in later), C.median(c["baseline_ms"] for c in later)
    return {"added_ms_per_save": added, "added_ms_spread": C.spread(c["added_ms"] for c in later),
            "baseline_step_ms": base, "saves": len(later), "overhead": added / (every * base),
            "first_save_added_ms": C.median(costs[0]["added_ms"] for costs in per_run if costs)}


def overheads_per_rep(runs: list[dict], config: str, reps: int) -> list[float]:
    """1 - steps/s of `config` / steps/s of off, within each repetition that has both."""
    out = []
    for rep in range(reps):
        pair = {r["config"]: r["steps_per_s"] for r in runs if r["rep"] == rep}
        if pair.get("off") and pair.get(config):
            out.append(1 - pair[config] / pair["off"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each configuration (3; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (50; --quick 15)")
    ap.add_argument("--every", type=int, default=None, help="--save-every of the save runs (10; --quick 5)")
    ap.add_argument("--dir", default=None, help="where the saves (and the plain writes) go: a temporary folder "
                    "made inside it, removed after (default: under the benchmark's work folder)")
    ap.add_argument("--quick", action="store_true", help="small model, few steps, 1 repetition: a smoke run")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the run folders and the saves")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.steps = args.steps or (15 if args.quick else 50)
    args.every = args.every or (5 if args.quick else 10)
    C.install_cleanup()
    work = C.Workdir("saving", keep=args.keep)
    failures = C.Failures("saving", work)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    saves_root = Path(tempfile.mkdtemp(prefix="dpbench-saves-", dir=args.dir or work.path))
    print(f"saving: off / save every {args.every} x {args.reps} repetitions, {args.steps} steps each, "
          f"{'small' if args.quick else '108 MB-state'} model, 2 nodes; saves under {saves_root}; "
          f"folders under {work.path}", flush=True)
    runs: list[dict] = []
    saves: list[dict] = []
    buffered_saves: list[dict] = []
    plains: list[dict] = []
    tokens = None
    try:
        for rep in range(args.reps):
            order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[: rep % len(CONFIGS)]
            for config in order:
                folder = work.new(f"r{rep}-{config}")
                save_dir = saves_root / f"r{rep}-{config}"
                cmd, env = command(config, args, folder, save_dir)
                beside: BesideWriter | contextlib.nullcontext = contextlib.nullcontext()
                if config == "write":
                    if not saves:  # (rep 0 runs it after its save run; later reps have saves to size it by)
                        print(f"  rep {rep} write: skipped, no save measured yet to give its size", flush=True)
                        continue
                    beside = BesideWriter(folder, saves_root / f"beside-r{rep}",
                                          int(C.median(e["bytes"] for e in saves)),
                                          int(C.median(r["writers"] for r in runs if r["writers"]) or 1), args.every,
                                          args.steps, direct=True)
                with beside:
                    res = C.run(f"{config}#{rep}", cmd, folder=folder, env=env, timeout=args.timeout)
                events = res.events()
                done = [e for e in events if e.get("event") == "state_saved"]
                print(f"  rep {rep} {config:8s} rc {res.returncode} wall {res.wall_s:6.1f} s"
                      + (f"  {len(done)} saves" if config in SAVING else "")
                      + (f"  {len(beside.windows)} plain writes beside" if isinstance(beside, BesideWriter) else ""),
                      flush=True)
                if not failures.check(res):  # a failed run's partial timings would pass for a measurement
                    continue
                if isinstance(beside, BesideWriter) and (beside.error or not beside.windows):
                    failures.add(res.name, f"the plain write beside training: {beside.error or 'none was done'}")
                    continue
                bad = [e for e in events if e.get("event") == "save_failed"]
                if config in SAVING and (bad or not done):
                    why = f"save_failed: {bad[0].get('why')}" if bad else "no state_saved event"
                    failures.add(res.name, why, C.file_tail(folder / "output.log"), folder)
                    continue
                summary = {**(res.json_file("summary.json") or {}), **(res.json_file("stats.json") or {})}
                if tokens is None and summary:
                    model = dict(zip(*[iter(C.SMALL_MODEL if args.quick else C.BIG_MODEL)] * 2))
                    tokens = int(model["--block-size"]) * int(model["--batch-size"]) * int(summary.get("world_size", 2))
                timings = res.timings()
                last_end = C.step_times(timings).get(args.steps)
                for e in done:
                    (saves if config == "save" else buffered_saves).append({
                                  "rep": rep, "step": e["step"], "bytes": e["bytes"], "seconds": e["seconds"],
                                  "mb_per_s": e["bytes"] / 1e6 / e["seconds"] if e["seconds"] > 0 else None,
                                  # begun before the last step ended: written beside training
                                  "beside_training": bool(last_end and e["time"] - e["seconds"] < last_end)})
                # the nodes that wrote a step: the most manifest parts of a step folder (the save on stop may be
                # written by fewer: the node that holds every rank's newest copy)
                writers = max((len(list(d.glob("manifest.*.json"))) for d in save_dir.glob("step-*")),
                              default=None) if config in SAVING else None
                runs.append({"rep": rep, "config": config, "wall_s": round(res.wall_s, 2),
                             "others_cpu_share": round(res.others_cpu_share, 3),
                             "steps_per_s": C.window_rate(timings, STEADY_FROM, args.steps),
                             "state_bytes": summary.get("state_bytes"), "saves": len(done), "writers": writers,
                             # CPU seconds per role (threads alive at the last sample): where a slower run's went
                             "cpu_s": {role: round(sum(t.values()), 2) for role, t in res.cpu_by_role_thread().items()},
                             "machine_busy_s": round(res.machine_busy_s, 1),
                             "step_costs": (step_costs(timings, save_windows(events), STEADY_FROM, args.steps)
                                            if config in SAVING else None)})
                if isinstance(beside, BesideWriter):
                    runs[-1].update(beside_mb_per_s=beside.mb_per_s, beside_bytes=beside.nbytes,
                                    beside_writers=beside.writers,
                                    beside_costs=step_costs(timings, beside.windows, STEADY_FROM, args.steps))
                if config == "save":
                    # the baseline in the same phase of the host, into the same filesystem, of the same size
                    nbytes = int(C.median(e["bytes"] for e in done))
                    if not args.keep:
                        shutil.rmtree(save_dir, ignore_errors=True)
                    plain_dir = saves_root / f"plain-r{rep}"
                    plain_dir.mkdir()
                    for n in sorted({1, writers or 1}):
                        for direct in (True, False):
                            try:
                                took = [plain_write(plain_dir, nbytes, n, direct) for _ in range(PLAIN_REPEATS)]
                            except OSError as exc:
                                failures.add(f"plain write #{rep} ({n} writers)", f"{type(exc).__name__}: {exc}")
                                continue
                            plains.append({"rep": rep, "writers": n, "direct": direct, "bytes": nbytes,
                                           "seconds": took, "mb_per_s": nbytes / 1e6 / C.median(took)})
                            print(f"  rep {rep} plain write of {nbytes / 1e6:.0f} MB by {n} writer(s), "
                                  f"{'O_DIRECT' if direct else 'page cache'}: {nbytes / 1e6 / C.median(took):.0f} MB/s",
                                  flush=True)
                    shutil.rmtree(plain_dir, ignore_errors=True)
                    runs[-1]["cpu_part_s"] = C.median(cpu_part_s(nbytes // (writers or 1)) for _ in range(3))
    finally:
        if not args.keep:
            shutil.rmtree(saves_root, ignore_errors=True)
        work.close()

    rate = {c: C.median(r["steps_per_s"] for r in runs if r["config"] == c) for c in CONFIGS}
    throughput = {c: rate[c] * tokens if rate[c] and tokens else None for c in CONFIGS}
    spreads = {c: C.spread(r["steps_per_s"] * tokens for r in runs if r["config"] == c and r["steps_per_s"]
                           and tokens) for c in CONFIGS}
    per_rep = overheads_per_rep(runs, "save", args.reps)
    overhead = C.median(per_rep)
    writers = C.median(r["writers"] for r in runs if r["writers"])
    save_bw = C.median(s["mb_per_s"] for s in saves)
    # the disk's best for one stream: through the page cache or past it, whichever was faster
    plain = {f"{method}_{n}": C.median(p["mb_per_s"] for p in plains if p["direct"] == (method == "direct")
                                       and p["writers"] == (1 if n == "one" else writers))
             for method in ("direct", "buffered") for n in ("one", "n")}
    one = max(filter(None, (plain["direct_one"], plain["buffered_one"])), default=None)
    many = max(filter(None, (plain["direct_n"], plain["buffered_n"])), default=None)
    ratio = save_bw / one if save_bw and one else None
    ratio_n = save_bw / many if save_bw and many else None
    cpu_part = C.median(r.get("cpu_part_s") for r in runs)
    cost = step_cost([r["step_costs"] or [] for r in runs if r["config"] == "save"], args.every)
    if cost:
        cost["overhead_target_met"] = cost["overhead"] <= OVERHEAD_TARGET
    buffered_bw = C.median(s["mb_per_s"] for s in buffered_saves)
    buffered = {"mb_per_s": buffered_bw, "overhead_per_rep": overheads_per_rep(runs, "buffered", args.reps),
                "step_cost": step_cost([r["step_costs"] or [] for r in runs if r["config"] == "buffered"], args.every)}
    beside_bw = C.median(v for r in runs for v in r.get("beside_mb_per_s") or [])
    beside = {"mb_per_s": beside_bw, "writers": C.median(r["beside_writers"] for r in runs if "beside_writers" in r),
              "bandwidth_ratio_beside": save_bw / beside_bw if save_bw and beside_bw else None,
              "step_cost": step_cost([r.get("beside_costs") or [] for r in runs if "beside_costs" in r], args.every)}
    result = {
        "benchmark": "saving", "machine": C.machine(), "steps": args.steps, "reps": args.reps, "every": args.every,
        "quick": args.quick, "dir": args.dir, "tokens_per_step": tokens,
        "state_bytes_per_node": C.median(r["state_bytes"] for r in runs if r["state_bytes"]),
        "throughput": throughput, "throughput_spread": spreads,
        "overhead": overhead, "overhead_per_rep": per_rep, "overhead_spread": C.spread(per_rep),
        "overhead_target": OVERHEAD_TARGET,
        "overhead_target_met": overhead <= OVERHEAD_TARGET if overhead is not None else None,
        "save_bytes": C.median(s["bytes"] for s in saves), "save_writers": writers,
        "save_seconds": C.median(s["seconds"] for s in saves), "save_mb_per_s": save_bw,
        "save_mb_per_s_spread": C.spread(s["mb_per_s"] for s in saves),
        "plain_mb_per_s": {"one_writer": one, "n_writers": many, **plain},
        "bandwidth_ratio": ratio, "bandwidth_ratio_n_writers": ratio_n, "bandwidth_target": BANDWIDTH_TARGET,
        "bandwidth_target_met": ratio >= BANDWIDTH_TARGET if ratio is not None else None,
        "cpu_part_s_per_writer": cpu_part,
        "step_cost": cost, "beside": beside, "buffered": buffered,
        "others_cpu_share": {c: C.median(r["others_cpu_share"] for r in runs if r["config"] == c) for c in CONFIGS},
        "saves": saves, "buffered_saves": buffered_saves, "plain_writes": plains, "runs": runs,
        "failed": failures.as_json(),
    }
    C.write_json(args.json, result)

    print()
    rows = []
    of_config = {"save": overhead, "buffered": C.median(buffered["overhead_per_rep"])}
    for c in CONFIGS:
        lo_hi = spreads[c]
        label = {"off": "off", "save": f"save every {args.every}", "write": f"plain write every {args.every}",
                 "buffered": f"save every {args.every}, page cache"}[c]
        rows.append([label, C.fmt(throughput[c], ".0f"),
                     f"{lo_hi[0]:.0f}..{lo_hi[1]:.0f}" if lo_hi else "-",
                     C.fmt(of_config.get(c), "+.2%"),
                     C.fmt(result["others_cpu_share"][c], ".0%")])
    print(C.table(["config", "tokens/s", "range", "overhead", "others' CPU"], rows))
    if overhead is not None:
        print(f"overhead of saving every {args.every} steps: {overhead:+.2%} (median of {len(per_rep)}: "
              + ", ".join(f"{v:+.2%}" for v in per_rep) + f"); target <= {OVERHEAD_TARGET:.1%}: "
              + ("met" if result["overhead_target_met"] else "NOT met")
              + (" (whole runs cannot resolve it here: see the steps around a save below)"
                 if len(per_rep) > 1 and max(per_rep) - min(per_rep) > 2 * OVERHEAD_TARGET else ""))
    if save_bw is not None:
        lo, hi = result["save_mb_per_s_spread"]
        print(f"saves: {len(saves)} of {result['save_bytes'] / 1e6:.0f} MB each by {C.fmt(writers, '.0f')} "
              f"writer(s), {result['save_seconds']:.2f} s: {save_bw:.0f} MB/s median ({lo:.0f}..{hi:.0f})")
    if one is not None:
        print(f"plain write of the same size, same filesystem (the faster of O_DIRECT "
              f"{C.fmt(plain['direct_one'], '.0f')} and page cache {C.fmt(plain['buffered_one'], '.0f')} MB/s): "
              f"one writer {one:.0f} MB/s"
              + (f", {writers:.0f} concurrent writers {many:.0f} MB/s" if many and writers != 1 else ""))
    if ratio is not None:
        print(f"save / plain write (one writer): {ratio:.2f}"
              + (f"; / {writers:.0f} writers: {ratio_n:.2f}" if ratio_n is not None and writers != 1 else "")
              + f"; target >= {BANDWIDTH_TARGET}: " + ("met" if result["bandwidth_target_met"] else "NOT met")
              + " (the plain write ran with nothing training; the saves beside training)")
    if cpu_part is not None and many:
        print(f"of a save's {result['save_seconds']:.2f} s: one writer's share copied and digested alone on one core "
              f"{cpu_part:.2f} s, the plain write by {writers:.0f} writer(s) {result['save_bytes'] / 1e6 / many:.2f} s")
    if cost:
        lo, hi = cost["added_ms_spread"]
        print(f"steps overlapping a save took {cost['added_ms_per_save']:+.0f} ms per save (median of {cost['saves']} "
              f"after each run's first; {lo:+.0f}..{hi:+.0f}) beyond the steps around them "
              f"({cost['baseline_step_ms']:.0f} ms): {cost['overhead']:+.2%} of the {args.every} steps between saves "
              f"(target <= {OVERHEAD_TARGET:.1%}: " + ("met)" if cost["overhead"] <= OVERHEAD_TARGET else "NOT met)")
              + f"; a run's first save: {C.fmt(cost['first_save_added_ms'], '+.0f')} ms (its copy-out's memory "
                "faulted in, once per agent)")
    bufc = buffered["step_cost"]
    if bufc:
        lo, hi = bufc["added_ms_spread"]
        print(f"the same saves through the page cache (DP_SAVE_DIRECT=0): {C.fmt(buffered_bw, '.0f')} MB/s; steps "
              f"overlapping one took {bufc['added_ms_per_save']:+.0f} ms per save (median of {bufc['saves']}; "
              f"{lo:+.0f}..{hi:+.0f}): {bufc['overhead']:+.2%} of the {args.every} steps between"
              + (f"; O_DIRECT's / that: {cost['added_ms_per_save'] / bufc['added_ms_per_save']:.2f}"
                 if cost and bufc["added_ms_per_save"] > 0 else ""))
    if beside_bw is not None:
        bc = beside["step_cost"]
        ratio_b = beside["bandwidth_ratio_beside"]
        print(f"the control, a plain write (O_DIRECT) of the same bytes at nice 19 beside training every "
              f"{args.every} steps: "
              f"{beside_bw:.0f} MB/s" + (f"; save / that: {ratio_b:.2f}" if ratio_b is not None else "")
              + (f"; the steps overlapping it took {bc['added_ms_per_save']:+.0f} ms per write "
                 f"({bc['overhead']:+.2%} of the {args.every} steps between)" if bc else ""))
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
