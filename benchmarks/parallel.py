"""Sharded and 3D-parallel jobs (job.parallelize): their recovery against a data-parallel job's, the rebuild of a
mesh's groups, what snapshots cost them without failures, and the host memory a node takes.

    python benchmarks/parallel.py [--repeats 2] [--overhead-reps 3] [--generations 5] [--json PATH] [--quick]

The 3D job: examples/train_gpt_3d.py --pp 2 --dp 2 --tp 2 (n-layer 2, n-embd 32, n-head 2, block 16, batch 4,
2 micro-batches) under `dprun --nnodes 4 --nproc-per-node 2`, OMP_NUM_THREADS=1, Gloo on loopback. --quick
shrinks it to 2 nodes x 2 (pp 2 dp 1 tp 2) and fewer steps: a smoke run of the code (tests/test_benchmarks.py).

1. recovery: `--spares 1 --inject kill-node:2@step=K` on the 3D job and on examples/train_gpt.py (DDP) in the
   same dprun shape, interleaved (3D, DDP, 3D, DDP ...; --repeats). The DDP model is chosen so that a node holds
   about the 3D job's per-node state (parameters + AdamW moments of the node's ranks): a 3D node holds
   total / (pp dp tp) x nproc-per-node of it, a DDP node nproc-per-node whole copies, so the DDP model has
   ~1/8 of the 3D model's state (n-layer 1; n-embd DDP_N_EMBD), measured in the runs (state_match). The phases
   are those of the events file's recovery_complete (detect, decide, rebuild, restore, total: failure -> every
   rank finished a step after the restore step). The 3D workers run through this file (--worker3d), which
   times, without changing them, the user's build(mesh) (parallel_gpt.build_parts) and dpstate's rebuild
   steps (retire the old parts, destroy the group, build the group, build the mesh, Parts.build, restore).
2. mesh_rebuild: 8 processes (no training) with dpstate.groups.pgroup.GroupManager over one TCPStore rebuild the
   default group and the pp x dp x tp mesh for generations 1..N; each generation timed on each rank from
   destroy() to the end of a first all-reduce on each mesh dim's group (ranks start it after a store barrier).
   --quick: the quick layout's 4 processes (pp 2 dp 1 tp 2), which checks the path at half the process starts.
3. overhead: the 3D job (no spare, no failure) with --snapshot-interval off, 1 and auto (auto:0.01; decided
   early: DP_SNAPSHOT_AUTO_STEPS), interleaved, --overhead-reps times. Step times: the `step N ... ms/step` lines
   that train_gpt_3d.py prints with --log-every 1 (its reporting rank: the first of the last stage; each the wall
   time since the previous line). Steady state: the mean over steps STEADY_FROM+1..end (auto: after its first
   decision, and off over the same steps); overheads: mean / off's mean - 1, paired within a repetition,
   median over repetitions.
4. memory: from the overhead runs (process trees sampled every 0.25 s, peak RSS = VmHWM of each process): a
   node's RSS = (sum of the agents' peaks + sum of the workers' peaks) / nodes, against (1 + --replicas) x the
   node's state; the fixed overhead is that RSS with snapshots off.

A run that fails (exit code, timeout, no recovery_complete, no step times) is said with its cause and the tail
of its output, gets no figure, and the benchmark exits 1.

JSON: {"recovery": {"total_s": {"3d", "ddp"}, "phases": {...}, "ratio_total_3d_over_ddp", "build_s",
"build_share_of_rebuild", "rebuild_steps_s", "state_bytes_per_node", "snapshot_bytes_per_node", "state_match",
...}, "mesh_rebuild": {"median_s", "max_s", "per_generation_max_s", ...}, "overhead": {"step_s", "overhead",
"auto_interval", ...}, "memory": {...}, "failed": [...]}.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

TRAIN_3D = C.REPO / "examples" / "train_gpt_3d.py"
MODEL_3D = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
            "--microbatches", "2", "--max-bytes", "200000"]
# the DDP model of the same per-node state (see the docstring; train_gpt.py's GPT: V E + B E + L (12 E^2 + 13 E)
# + 2 E + V E parameters, x 12 bytes with AdamW): n-layer 1, n-embd 14 -> ~5.4 k parameters, ~65 kB a rank,
# against the 3D job's ~60 kB a rank (pp 2 dp 2 tp 2); quick (pp 2 dp 1 tp 2: ~120 kB a rank): n-embd 20
DDP_N_EMBD = {"default": 14, "quick": 20}
LAYOUT = {"default": dict(nnodes=4, nproc=2, pp=2, dp=2, tp=2),
          "quick": dict(nnodes=2, nproc=2, pp=2, dp=1, tp=2)}
STEADY_FROM = 4  # step times from step 5 on: the first steps fault in buffers and warm up the pipeline
TARGET_RATIO = 1.5  # recovery: total_3d / total_ddp
TARGET_MESH_S = 0.2  # mesh_rebuild: per generation, slowest rank
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+\S+\s+([\d.]+) ms/step\s+gen\s+(\d+)", re.M)


# ------------------------------------------------------------------------------------------ in the workers


def worker3d(argv: list[str]) -> int:
    """`parallel.py --worker3d examples/train_gpt_3d.py ARGS`: train_gpt_3d.main(ARGS), with the user's
    build(mesh) and dpstate's rebuild steps timed (each call appended as a JSON line to
    $DP_BENCH_LOG.<pid>.jsonl: what, Unix start time, seconds) and, at the end, this rank's state bytes (its
    local shards of parameters and optimizer state) and snapshot policy. Nothing of the job is changed."""
    log_base = os.environ["DP_BENCH_LOG"]
    out = open(f"{log_base}.{os.getpid()}.jsonl", "a", buffering=1)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    import dpstate
    import dpstate.groups.parallel
    import dpstate.groups.pgroup
    import dpstate.steps.session

    jobs: list = []
    made: list = []

    def write(**rec) -> None:
        rank = jobs[0].rank if jobs else None
        out.write(json.dumps({"pid": os.getpid(), "rank": rank, **rec}) + "\n")

    def timed(what: str, fn):
        def wrapper(*args, **kwargs):
            t, t0 = time.time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                write(what=what, t=t, s=time.perf_counter() - t0)
        return wrapper

    for cls, name, what in ((dpstate.steps.session.Job, "_retire_parts", "retire"),
                            (dpstate.groups.pgroup.GroupManager, "destroy", "destroy"),
                            (dpstate.groups.pgroup.GroupManager, "build", "group"),
                            (dpstate.groups.pgroup.GroupManager, "build_mesh", "mesh"),
                            (dpstate.groups.parallel.Parts, "build", "parts_build"),
                            (dpstate.steps.session.Job, "_restore", "restore")):
        if hasattr(cls, name):  # (a renamed step is left out of the breakdown, not an error)
            setattr(cls, name, timed(what, getattr(cls, name)))
    init = dpstate.init

    def init_and_keep(*args, **kwargs):
        jobs.append(init(*args, **kwargs))
        return jobs[0]

    dpstate.init = init_and_keep
    import train_gpt_3d as T

    build_parts = T.build_parts

    def build_and_keep(*args, **kwargs):
        parts = build_parts(*args, **kwargs)
        made[:] = [parts]
        return parts

    T.build_parts = timed("user_build", build_and_keep)
    code = T.main(argv[1:])
    if made:
        import torch

        def local_bytes(obj) -> int:
            if isinstance(obj, torch.Tensor):
                t = obj.to_local() if hasattr(obj, "to_local") else obj
                return t.numel() * t.element_size()
            if isinstance(obj, dict):
                return sum(local_bytes(v) for v in obj.values())
            if isinstance(obj, (list, tuple)):
                return sum(local_bytes(v) for v in obj)
            return 0

        parts = made[0]
        state = local_bytes(parts["model"].state_dict()) + local_bytes(parts["optimizer"].state_dict()["state"])
        policy = jobs[0].snapshot_policy if jobs else None
        write(what="end", state_bytes=state, **({} if policy is None else dict(
            snapshot_policy=policy.describe(), snapshot_interval=policy.interval, snapshot_cost=policy.cost,
            snapshot_decided_at=policy.decided_at)))
    out.close()
    return code


def mesh_worker(argv: list[str]) -> int:
    """`parallel.py --mesh-worker PORT RANK WORLD GENERATIONS OUT DIMS_JSON`: one rank of the mesh rebuild."""
    port, rank, world, generations, out, dims = (int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4],
                                                 json.loads(argv[5]))
    import datetime

    import torch
    import torch.distributed as dist

    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.mesh import MeshLayout
    from dpstate.groups.pgroup import GroupManager

    timeout = datetime.timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout) \
        if rank == 0 else None
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    groups, abort = GroupManager(backend="gloo", timeout_s=60), AbortSignal()
    layout = MeshLayout.parse(dims, world)
    endpoint = f"127.0.0.1:{port}"

    def barrier(key: str) -> None:
        store.add(key, 1)
        while store.add(key, 0) < world:
            time.sleep(0.001)

    rows = []
    for generation in range(1, generations + 1):
        barrier(f"bench/go{generation}")
        t0 = time.perf_counter()
        groups.destroy()
        t1 = time.perf_counter()
        groups.build(generation, endpoint, rank, world, abort)
        t2 = time.perf_counter()
        mesh = groups.build_mesh(layout, "cpu")
        t3 = time.perf_counter()
        for name in layout.names:
            dist.all_reduce(torch.ones(1), group=mesh[name].get_group())
        t4 = time.perf_counter()
        rows.append({"generation": generation, "total_s": t4 - t0, "destroy_s": t1 - t0, "group_s": t2 - t1,
                     "mesh_s": t3 - t2, "all_reduce_s": t4 - t3})
    Path(out).write_text(json.dumps({"rank": rank, "generations": rows}))
    store.add("bench/done", 1)
    while rank == 0 and store.add("bench/done", 0) < world:  # rank 0 hosts the store: it stays until every
        time.sleep(0.01)  # rank wrote its figures
    del master
    sys.stdout.flush()
    os._exit(0)  # the groups are leaked on purpose (dpstate.groups.pgroup.GroupManager.destroy): skip their destructors


def mesh_group(argv: list[str]) -> int:
    """`parallel.py --mesh-group WORLD GENERATIONS DIMS_JSON`: start the WORLD ranks of the mesh rebuild in this
    folder (each writes mesh.rank<R>.json), wait for them; exit 1 when one fails."""
    world, generations, dims = int(argv[0]), int(argv[1]), argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--mesh-worker", str(port), str(r), str(world),
                               str(generations), f"mesh.rank{r}.json", dims]) for r in range(world)]
    codes = [p.wait() for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    for r, c in bad:
        print(f"mesh rank {r}: {C.exit_cause(c)}", file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------ commands


def dims_args(lay: dict) -> list[str]:
    return ["--pp", str(lay["pp"]), "--dp", str(lay["dp"]), "--tp", str(lay["tp"])]


def dprun(lay: dict, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dprun", "--nnodes", str(lay["nnodes"]), "--nproc-per-node", str(lay["nproc"]),
            "--no-tui", "--events-file", "events.jsonl", *extra]


def script_3d(args, steps: int) -> list[str]:
    return [__file__, "--worker3d", str(TRAIN_3D), *dims_args(args.lay), *MODEL_3D, "--steps", str(steps),
            "--seed", "0", "--log-every", "1"]


def recovery_command(kind: str, args, folder: Path) -> tuple[list[str], dict[str, str]]:
    env = {**ENV, "DP_SNAPSHOT_PROFILE": str(folder / "profile"), "DP_BENCH_LOG": str(folder / "bench3d")}
    shape = dprun(args.lay, "--spares", "1", "--inject", f"kill-node:{args.kill_node}@step={args.kill_at}")
    if kind == "3d":
        return [*shape, *script_3d(args, args.steps)], env
    n_embd = str(args.ddp_n_embd)
    model = ["--n-layer", "1", "--n-embd", n_embd, "--n-head", "2", "--block-size", "16", "--batch-size", "4",
             "--max-bytes", "200000"]
    return [*shape, str(C.TRAIN), *model, "--steps", str(args.steps), "--seed", "0", "--log-every", "1",
            "--stats", "stats.json"], env


def overhead_command(config: str, args, folder: Path) -> tuple[list[str], dict[str, str]]:
    interval = {"off": "off", "per_step": "1", "auto": "auto:0.01"}[config]
    env = {**ENV, "DP_SNAPSHOT_PROFILE": str(folder / "profile"), "DP_BENCH_LOG": str(folder / "bench3d"),
           "DP_SNAPSHOT_AUTO_STEPS": args.auto_steps}
    return [*dprun(args.lay, "--snapshot-interval", interval), *script_3d(args, args.overhead_steps)], env


# ------------------------------------------------------------------------------------------ reading runs


def bench_log(res: C.RunResult) -> list[dict]:
    out = []
    for path in sorted(glob.glob(str(res.folder / "bench3d.*.jsonl"))):
        out += C.read_jsonl(Path(path))
    return out


def snapshot_bytes_per_rank(res: C.RunResult) -> float | None:
    """Median over the ranks' profiles of the bytes of one snapshot (meta + data, padding included)."""
    per = []
    for path in glob.glob(str(res.folder / "profile.rank*.json")):
        prof = json.loads(Path(path).read_text())
        if prof.get("captures"):
            per.append(prof["bytes"] / prof["captures"])
    return C.median(per)


def state_bytes_per_node(res: C.RunResult, kind: str, lay: dict) -> float | None:
    """Parameters + optimizer state a node holds: 3D, the sum over every rank's local shards / nodes (the ranks
    of a node hold different shards); DDP, nproc-per-node x rank 0's (--stats: every rank holds all of it)."""
    if kind == "ddp":
        stats = res.json_file("stats.json")
        return stats["state_bytes"] * lay["nproc"] if stats and stats.get("state_bytes") else None
    ends = {r["rank"]: r["state_bytes"] for r in bench_log(res) if r["what"] == "end" and r.get("rank") is not None}
    world = lay["nnodes"] * lay["nproc"]
    return sum(ends.values()) / lay["nnodes"] if len(ends) == world else None


def recovery_figures(res: C.RunResult, kind: str, lay: dict) -> dict | None:
    events = res.events()
    done = next((e for e in events if e["event"] == "recovery_complete"), None)
    injected = next((e for e in events if e["event"] == "fault_injected"), None)
    if done is None or injected is None:
        return None
    out = {"phases": done["phases"], "restore_step": done["restore_step"], "lost_steps": done["lost_steps"],
           "state_bytes_per_node": state_bytes_per_node(res, kind, lay),
           "snapshot_bytes_per_node": (lambda b: b * lay["nproc"] if b else None)(snapshot_bytes_per_rank(res)),
           "wall_s": round(res.wall_s, 2), "others_cpu_share": round(res.others_cpu_share, 3)}
    if kind == "3d":
        # the steps of the recovery on each worker process: those that began between the fault and the end of
        # the recovery. A survivor's rebuild_s (dpstate) spans retire .. parts_build; the promoted spare's holds
        # only its group: it builds its mesh and parts in job.parallelize() after its promotion
        t0, t1 = injected["time"], done["time"]
        # (survivors: the processes that had built their parts before the fault; the spare's began after it)
        per_pid: dict[int, dict[str, float]] = {}
        before: set[int] = set()
        for r in bench_log(res):
            if r["what"] == "end":
                continue
            if r["t"] < t0:
                before.add(r["pid"])
            elif r["t"] <= t1:
                steps = per_pid.setdefault(r["pid"], {})
                steps[r["what"]] = steps.get(r["what"], 0.0) + r["s"]
        survivors = {pid: s for pid, s in per_pid.items() if pid in before}
        spares = {pid: s for pid, s in per_pid.items() if pid not in before}
        names = ("retire", "destroy", "group", "mesh", "parts_build", "user_build", "restore")
        out["rebuild_steps_s"] = {"survivors_max": {n: max((s.get(n, 0.0) for s in survivors.values()), default=None)
                                                    for n in names},
                                  "survivors_median": {n: C.median(s.get(n, 0.0) for s in survivors.values())
                                                       for n in names},
                                  "spare_max": {n: max((s.get(n, 0.0) for s in spares.values()), default=None)
                                                for n in names},
                                  "survivors": len(survivors), "spares": len(spares)}
        builds = [s["user_build"] for s in survivors.values() if "user_build" in s]
        out["build_s_survivors_max"] = max(builds) if builds else None
        out["build_s_survivors_median"] = C.median(builds)
        sb = [s["user_build"] for s in spares.values() if "user_build" in s]
        out["build_s_spare"] = max(sb) if sb else None
    return out


def step_times(res: C.RunResult) -> dict[int, float]:
    """step -> seconds, from the `step N ... ms/step gen G` lines (the newest of a step)."""
    return {int(m.group(1)): float(m.group(2)) / 1000 for m in STEP_LINE.finditer(res.output)}


def window_mean(per_step: dict[int, float], lo: int, hi: int) -> float | None:
    vals = [per_step[k] for k in range(lo + 1, hi + 1) if k in per_step]
    return sum(vals) / len(vals) if len(vals) == hi - lo and vals else None


def node_rss(res: C.RunResult, nnodes: int) -> dict:
    """(sum of the agents' peak RSS + the workers') / nodes; the first process of the tree (dprun, whose command
    line names the script too) left out."""
    root = next(iter(res.procs), None)
    agents = [p.peak_rss for pid, p in res.procs.items() if pid != root and p.role == "agent"]
    workers = [p.peak_rss for pid, p in res.procs.items() if pid != root and p.role == "worker"]
    return {"node_rss": (sum(agents) + sum(workers)) / nnodes if agents and workers else None,
            "agents": len(agents), "workers": len(workers), "agent_max": max(agents, default=None),
            "worker_max": max(workers, default=None)}


# ------------------------------------------------------------------------------------------ the parts


def run_mesh(args, work: C.Workdir, failures: C.Failures) -> dict:
    dims = {"pp": 2, "dp": 2, "tp": 2} if not args.quick else {k: args.lay[k] for k in ("pp", "dp", "tp")}
    world = dims["pp"] * dims["dp"] * dims["tp"]
    folder = work.new("mesh-rebuild")
    res = C.run("mesh_rebuild", [sys.executable, __file__, "--mesh-group", str(world), str(args.generations),
                                 json.dumps(dims)], folder=folder, env=ENV, timeout=args.timeout)
    print(f"  mesh rebuild: {world} ranks, {args.generations} generations, rc {res.returncode} wall "
          f"{res.wall_s:.1f} s", flush=True)
    if not failures.check(res):
        return {}
    ranks = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(folder / "mesh.rank*.json")))]
    if len(ranks) != world:
        failures.add("mesh_rebuild", f"{len(ranks)} of {world} ranks wrote their figures", C.tail(res.output), folder)
        return {}
    per_gen = []
    for g in range(args.generations):
        rows = [r["generations"][g] for r in ranks]
        per_gen.append({"generation": g + 1, "max_s": max(x["total_s"] for x in rows),
                        "median_s": C.median(x["total_s"] for x in rows),
                        **{f"{k}_max": max(x[k] for x in rows) for k in ("destroy_s", "group_s", "mesh_s",
                                                                        "all_reduce_s")}})
    maxes = [g["max_s"] for g in per_gen]
    median = C.median(maxes)
    return {"ranks": world, "layout": dims, "generations": args.generations,
            "median_s": median, "max_s": max(maxes), "median_rank_median_s": C.median(g["median_s"] for g in per_gen),
            "later_median_s": C.median(maxes[1:]) if len(maxes) > 1 else None,
            "phases_median_of_max_s": {k: C.median(g[f"{k}_max"] for g in per_gen)
                                       for k in ("destroy_s", "group_s", "mesh_s", "all_reduce_s")},
            "per_generation": per_gen, "target_s": TARGET_MESH_S, "meets_target": median <= TARGET_MESH_S,
            "others_cpu_share": round(res.others_cpu_share, 3)}


def run_recovery(args, work: C.Workdir, failures: C.Failures) -> dict:
    runs = []
    for rep in range(args.repeats):
        for kind in ("3d", "ddp"):
            folder = work.new(f"r{rep}-recovery-{kind}")
            cmd, env = recovery_command(kind, args, folder)
            res = C.run(f"recovery/{kind}#{rep}", cmd, folder=folder, env=env, timeout=args.timeout)
            print(f"  rep {rep} recovery {kind:3s} rc {res.returncode} wall {res.wall_s:6.1f} s", flush=True)
            if not failures.check(res):
                continue
            fig = recovery_figures(res, kind, args.lay)
            if fig is None:
                failures.add(res.name, "no recovery_complete (or fault_injected) event in its events file",
                             C.tail(res.output), res.folder)
                continue
            runs.append({"rep": rep, "kind": kind, **fig})
    out: dict = {"runs": runs, "kill": f"kill-node:{args.kill_node}@step={args.kill_at}", "steps": args.steps,
                 "ddp_model": f"train_gpt.py --n-layer 1 --n-embd {args.ddp_n_embd} --n-head 2 --block-size 16",
                 "target_ratio": TARGET_RATIO}
    for key in ("phases", "state_bytes_per_node", "snapshot_bytes_per_node"):
        out[key] = {}
    for kind in ("3d", "ddp"):
        mine = [r for r in runs if r["kind"] == kind]
        out["phases"][kind] = {p: C.median(r["phases"][p] for r in mine)
                               for p in ("detect_s", "decide_s", "rebuild_s", "restore_s", "total_s")} if mine else {}
        out["state_bytes_per_node"][kind] = C.median(r["state_bytes_per_node"] for r in mine)
        out["snapshot_bytes_per_node"][kind] = C.median(r["snapshot_bytes_per_node"] for r in mine)
    out["total_s"] = {k: out["phases"][k].get("total_s") for k in ("3d", "ddp")}
    t3, td = out["total_s"]["3d"], out["total_s"]["ddp"]
    out["ratio_total_3d_over_ddp"] = t3 / td if t3 and td else None
    out["meets_target"] = out["ratio_total_3d_over_ddp"] <= TARGET_RATIO if out["ratio_total_3d_over_ddp"] else None
    s3, sd = out["state_bytes_per_node"]["3d"], out["state_bytes_per_node"]["ddp"]
    out["state_match"] = sd / s3 if s3 and sd else None
    mine = [r for r in runs if r["kind"] == "3d"]
    out["build_s"] = {"survivors_max": C.median(r["build_s_survivors_max"] for r in mine),
                      "survivors_median": C.median(r["build_s_survivors_median"] for r in mine),
                      "spare": C.median(r["build_s_spare"] for r in mine)}
    shares = [r["build_s_survivors_max"] / r["phases"]["rebuild_s"] for r in mine
              if r.get("build_s_survivors_max") and r["phases"].get("rebuild_s")]
    out["build_share_of_rebuild"] = C.median(shares)
    out["rebuild_steps_s"] = {which: {n: C.median(r["rebuild_steps_s"][which][n] for r in mine)
                                      for n in ("retire", "destroy", "group", "mesh", "parts_build", "user_build",
                                                "restore")}
                              for which in ("survivors_max", "survivors_median", "spare_max")} if mine else {}
    return out


def run_overhead(args, work: C.Workdir, failures: C.Failures) -> tuple[dict, dict]:
    configs = ("off", "per_step", "auto")
    warm, pairs = (int(x) for x in args.auto_steps.split(","))
    first_decision = 1 + warm + 2 * pairs  # the step at which auto decides first (dpstate.steps.interval)
    results: dict[tuple[int, str], C.RunResult] = {}
    for rep in range(args.overhead_reps):
        order = configs[rep % 3:] + configs[: rep % 3]
        for config in order:
            folder = work.new(f"r{rep}-overhead-{config}")
            cmd, env = overhead_command(config, args, folder)
            res = C.run(f"overhead/{config}#{rep}", cmd, folder=folder, env=env, timeout=args.timeout)
            print(f"  rep {rep} overhead {config:8s} rc {res.returncode} wall {res.wall_s:6.1f} s", flush=True)
            if not failures.check(res):
                continue
            if len(step_times(res)) < args.overhead_steps:
                failures.add(res.name, f"{len(step_times(res))} of {args.overhead_steps} `step N ... ms/step` lines "
                             "in its output", C.tail(res.output), res.folder)
                continue
            results[(rep, config)] = res
    runs = []
    for (rep, config), res in sorted(results.items()):
        per = step_times(res)
        end = next((r for r in bench_log(res) if r["what"] == "end" and r.get("snapshot_policy")), None)
        lo = STEADY_FROM
        runs.append({"rep": rep, "config": config, "wall_s": round(res.wall_s, 2),
                     "others_cpu_share": round(res.others_cpu_share, 3),
                     "mean_step_s": window_mean(per, lo, args.overhead_steps),
                     "median_step_s": C.median(v for k, v in per.items() if k > lo),
                     "auto_window_mean_step_s": window_mean(per, first_decision, args.overhead_steps),
                     "snapshot_policy": end.get("snapshot_policy") if end else None,
                     "snapshot_interval": end.get("snapshot_interval") if end else None,
                     "state_bytes_per_node": state_bytes_per_node(res, "3d", args.lay),
                     "snapshot_bytes_per_rank": snapshot_bytes_per_rank(res),
                     **node_rss(res, args.lay["nnodes"])})

    def ratio(config: str) -> float | None:
        key = "auto_window_mean_step_s" if config == "auto" else "mean_step_s"
        vals = []
        for rep in range(args.overhead_reps):
            base = next((r for r in runs if r["rep"] == rep and r["config"] == "off"), None)
            this = next((r for r in runs if r["rep"] == rep and r["config"] == config), None)
            if base and this and base[key] and this[key]:
                vals.append(this[key] / base[key] - 1)
        return C.median(vals)

    by = lambda c, k: [r[k] for r in runs if r["config"] == c and r[k] is not None]  # noqa: E731
    overhead = {
        "source": "`step N ... ms/step` lines of train_gpt_3d.py --log-every 1 (its reporting rank)",
        "steps": args.overhead_steps, "reps": args.overhead_reps, "steady_from": STEADY_FROM,
        "auto_decided_at": first_decision, "auto_steps": args.auto_steps,
        "step_s": {c: C.median(by(c, "mean_step_s")) for c in configs},
        "median_step_s": {c: C.median(by(c, "median_step_s")) for c in configs},
        "overhead": {"per_step": ratio("per_step"), "auto": ratio("auto")},
        "auto_interval": C.median(by("auto", "snapshot_interval")),
        "auto_policy": next(iter(by("auto", "snapshot_policy")), None),
        "others_cpu_share": {c: C.median(by(c, "others_cpu_share")) for c in configs},
        "runs": runs,
    }
    state = C.median(r["state_bytes_per_node"] for r in runs)
    snap = C.median(r["snapshot_bytes_per_rank"] for r in runs if r["config"] == "per_step")
    rss = {c: C.median(by(c, "node_rss")) for c in configs}
    replicas = args.replicas
    memory = {
        "what": "a node's RSS = (sum of the agents' peak RSS + sum of the workers' peak RSS) / nodes, VmHWM "
                "sampled every 0.25 s, median over the overhead runs of each configuration (no spare)",
        "node_rss_bytes": rss, "fixed_overhead_bytes": rss["off"],
        "state_bytes_per_node": state,
        "snapshot_bytes_per_node": snap * args.lay["nproc"] if snap else None,
        "replicas": replicas,
        "expected_extra_bytes": (1 + replicas) * state if state else None,
        "extra_bytes": {c: rss[c] - rss["off"] for c in ("per_step", "auto") if rss[c] and rss["off"]},
        "agent_peak_bytes": {c: C.median(by(c, "agent_max")) for c in configs},
        "worker_peak_bytes": {c: C.median(by(c, "worker_max")) for c in configs},
    }
    return overhead, memory


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=None, help="recovery repetitions of each job (2; --quick 1)")
    ap.add_argument("--overhead-reps", type=int, default=None, help="overhead repetitions (3; --quick 1)")
    ap.add_argument("--generations", type=int, default=None, help="mesh rebuild generations (5; --quick 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps of a recovery run (24; --quick 10)")
    ap.add_argument("--kill-at", type=int, default=None, help="recovery: step of the kill-node (14; --quick 6)")
    ap.add_argument("--overhead-steps", type=int, default=None, help="steps of an overhead run (30; --quick 12)")
    ap.add_argument("--ddp-n-embd", type=int, default=None, help="the DDP model's n-embd (matched: 14; --quick 20)")
    ap.add_argument("--parts", default="mesh,recovery,overhead", help="which to run (memory comes with overhead)")
    ap.add_argument("--quick", action="store_true", help="2 nodes x 2 (pp 2 dp 1 tp 2), few steps: a smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=420)
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "default"
    defaults = {"repeats": (2, 1), "overhead_reps": (3, 1), "generations": (5, 3), "steps": (24, 10),
                "kill_at": (14, 6), "overhead_steps": (30, 12), "ddp_n_embd": (DDP_N_EMBD["default"],
                                                                             DDP_N_EMBD["quick"])}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.lay = LAYOUT[size]
    args.kill_node = args.lay["nnodes"] // 2
    args.replicas = 1  # dprun's default --replicas
    args.auto_steps = "1,2" if args.quick else "2,3"
    parts = set(args.parts.split(","))
    C.install_cleanup()
    work = C.Workdir("parallel", keep=args.keep)
    failures = C.Failures("parallel", work)
    lay = args.lay
    print(f"parallel: {lay['nnodes']} nodes x {lay['nproc']}, pp {lay['pp']} dp {lay['dp']} tp {lay['tp']}; "
          f"folders under {work.path}", flush=True)
    t_start = time.time()
    mesh, recovery, overhead, memory = {}, {}, {}, {}
    try:
        if "mesh" in parts:
            mesh = run_mesh(args, work, failures)
        if "recovery" in parts:
            recovery = run_recovery(args, work, failures)
        if "overhead" in parts:
            overhead, memory = run_overhead(args, work, failures)
    finally:
        work.close()
    result = {"benchmark": "parallel", "machine": C.machine(), "quick": args.quick, "layout": lay,
              "model_3d": " ".join(MODEL_3D), "wall_s": round(time.time() - t_start, 1),
              "recovery": recovery, "mesh_rebuild": mesh, "overhead": overhead, "memory": memory,
              "failed": failures.as_json()}
    C.write_json(args.json, result)

    print()
    if recovery:
        ph = recovery["phases"]
        rows = [[k, *(C.fmt(ph[k].get(p), ".2f") for p in ("detect_s", "decide_s", "rebuild_s", "restore_s",
                                                           "total_s")),
                 C.fmt(recovery["state_bytes_per_node"][k] / 1e3 if recovery["state_bytes_per_node"][k] else None,
                       ".0f"),
                 C.fmt(recovery["snapshot_bytes_per_node"][k] / 1e3 if recovery["snapshot_bytes_per_node"][k]
                       else None, ".0f")] for k in ("3d", "ddp") if ph.get(k)]
        print(C.table(["recovery", "detect", "decide", "rebuild", "restore", "total", "state kB/node",
                       "snapshot kB/node"], rows))
        r = recovery["ratio_total_3d_over_ddp"]
        print(f"total 3D / DDP: {C.fmt(r, '.2f')} (target <= {TARGET_RATIO}); DDP state / 3D state per node "
              f"{C.fmt(recovery['state_match'], '.2f')}")
        b = recovery["build_s"]
        print(f"3D build(mesh) during the recovery: survivors max {C.fmt(b['survivors_max'], '.2f')} s = "
              f"{C.fmt(recovery['build_share_of_rebuild'], '.0%')} of rebuild_s; the promoted spare's "
              f"{C.fmt(b['spare'], '.2f')} s")
        steps = recovery.get("rebuild_steps_s", {}).get("survivors_max")
        if steps:
            print("3D rebuild steps, slowest survivor each (s): " + ", ".join(f"{k} {C.fmt(v, '.2f')}"
                                                                          for k, v in steps.items()))
    if mesh:
        dims = " ".join(f"{k} {v}" for k, v in mesh["layout"].items())
        print(f"mesh rebuild ({mesh['ranks']} ranks, {dims}): per generation (slowest rank) median "
              f"{mesh['median_s']:.3f} s, max {mesh['max_s']:.3f} s (target <= {TARGET_MESH_S} s); phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in mesh["phases_median_of_max_s"].items()))
    if overhead:
        st, ov = overhead["step_s"], overhead["overhead"]
        print(C.table(["snapshots", "step ms", "overhead", "node RSS MB"],
                      [[c, C.fmt(st[c] * 1000 if st[c] else None, ".0f"),
                        "-" if c == "off" or ov.get(c) is None else f"{ov[c]:+.1%}",
                        C.mb(memory["node_rss_bytes"][c])] for c in ("off", "per_step", "auto")]))
        print(f"auto: {overhead['auto_policy']}; state per node {C.fmt(memory['state_bytes_per_node'], '.0f')} B, "
              f"(1 + replicas) x state = {C.fmt(memory['expected_extra_bytes'], '.0f')} B; fixed overhead (off) "
              f"{C.mb(memory['fixed_overhead_bytes'])} MB per node")
    print(f"wall {result['wall_s']:.0f} s")
    return failures.exit_code()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker3d":
        sys.exit(worker3d(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--mesh-worker":
        mesh_worker(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--mesh-group":
        sys.exit(mesh_group(sys.argv[2:]))
    sys.exit(main())
