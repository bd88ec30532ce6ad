"""Recovery cost as the job grows: how detect, decide, rebuild and restore grow with the number of ranks and nodes,
fitted against the rank count R and projected to 512 and 4,096 ranks.

    python benchmarks/recovery_growth.py [--layouts 2x1,4x1,8x1,16x1,16x2,8x4] [--kills 2]
        [--group-sizes 2,4,8,16,32] [--group-reps 3] [--json PATH] [--quick] [--keep]

Three measurements in one run (docs/scaling.md has the method and the figures):

* jobs: real dprun jobs on loopback, NODES x NPROC ranks (--layouts; 32 ranks as 16x2 and as 8x4 to tell nodes from
  ranks), a tiny trainer (benchmarks/_state_trainer.py --mb 0.01: 1,250 parameters + SGD momentum, a one-element
  all-reduce per step and a 50 ms sleep standing in for compute, so that ranks do not compete with compute for the
  cores), OMP_NUM_THREADS=1. A node is killed (--inject kill-node:1@step=N) --kills times per job, each time at a
  later step and taken over by a spare of its own (--spares = --kills: one spare per failure, so one process
  start serves every repetition). Each recovery's phases come from its `recovery_complete` event: detect,
  decide, rebuild and restore (the slowest rank's, from WorkerReady), total (failure -> every rank stepped past
  the restore step); rest = total - the four (barrier, first step, messages). Median over the recoveries.
* groups: processes that only build groups (no agent, no controller): R ranks over one TCPStore rebuild
  generation after generation with dpstate's own GroupManager, aligned first; per build the slowest rank's wall
  time (arrive, Gloo init, connection recording) and each rank's CPU time, then the first all-reduce and a
  barrier. Variants, interleaved: `before` (dpstate before both fixes of docs/scaling.md: Gloo's default
  rendezvous keys, 8 bytes per peer, and the connections recorded from the network namespace's whole TCP
  table), `table` (the keys of now, the TCP-table recording: dpstate before dpstate/groups/severing.py recorded its own
  new sockets), `now` (dpstate as it is, every pair connected as the group is made) and `lazy` (dpstate with
  DP_GLOO_LAZY_CONNECT=1: each pair on its first use); the old recording is patched in the benchmark's processes
  only. Each rank counts the group connections it holds after the barrier; lazily, a pair costs a store read on
  each side, so their sum is the build's store reads (R x (R - 1) for the full mesh).
* decide: the controller alone (benchmarks/controller_scale.py's path: a node failure in, the probe round, the
  plan and every Reconfigure out, through the real codec), CPU time at 2 ... 4,096 ranks (1 rank per node, and
  512 nodes x 8).

Fits: each phase's median against R as a + b*R (linear), a + b*R*log2(R) and a + b*R^2 (least squares, R^2 of
each), and the exponent k of a power law y ~ R^k; the best of the three is projected to 512 and 4,096 ranks.

This host has few cores (2 where this was written): 32 ranks are 32 workers + the spares' + one agent per node on
them, so CPU contention (and not the algorithms) makes most of the growth of the jobs' figures; the groups' CPU
per rank and the controller's CPU are what a rank or the head would spend on a core of its own. Process start is
measured (startup_s) but is not part of a hot swap. A run that fails says why with its output tail, gets no
figure, and the benchmark exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

TRAINER = C.REPO / "benchmarks" / "_state_trainer.py"
PHASES = ("detect_s", "decide_s", "rebuild_s", "restore_s", "rest_s", "total_s")
LAYOUTS = "2x1,4x1,8x1,16x1,16x2,8x4"
QUICK_LAYOUTS = "2x1,4x1"
VARIANTS = ("before", "table", "now", "lazy")
DECIDE_SIZES = [(2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (128, 1), (512, 1), (4096, 1), (512, 8)]
QUICK_DECIDE_SIZES = [(2, 1), (4, 1), (64, 1)]
PROJECT_TO = (512, 4096)
MODELS = {"linear": lambda r: r, "r_log_r": lambda r: r * math.log2(r), "quadratic": lambda r: r * r}
KILL_FIRST, KILL_EVERY, TAIL_STEPS = 6, 6, 5


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        nodes, _, nproc = item.strip().partition("x")
        out.append((int(nodes), int(nproc or 1)))
    return out


# ------------------------------------------------------------------------------------------------ jobs


def job_command(nodes: int, nproc: int, kills: int, args) -> list[str]:
    kill_steps = [KILL_FIRST + KILL_EVERY * k for k in range(kills)]
    cmd = [sys.executable, "-m", "dprun", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
           "--spares", str(kills), "--no-tui", "--heartbeat-timeout", str(args.heartbeat_timeout),
           "--events-file", "events.jsonl"]
    for step in kill_steps:
        cmd += ["--inject", f"kill-node:1@step={step}"]
    return [*cmd, str(TRAINER), "--steps", str(kill_steps[-1] + TAIL_STEPS), "--mb", str(args.mb),
            "--step-s", str(args.step_s), "--timings", "timings.jsonl"]


def analyse_job(res: C.RunResult, kills: int) -> tuple[dict | None, str]:
    """Each recovery's phases and the job's normal step time; (None, why) when the run did not recover `kills`
    times (a figure from a partial run would pass for a measurement)."""
    events = res.events()
    done = [e for e in events if e.get("event") == "recovery_complete"]
    failed = [e for e in events if e.get("event") == "node_failed"]
    if len(done) < kills:
        return None, f"{len(done)} of {kills} recoveries completed ({len(failed)} node failures seen)"
    recoveries = []
    for e in done:
        ph = dict(e["phases"])
        ph["rest_s"] = round(ph["total_s"] - sum(ph[k] for k in ("detect_s", "decide_s", "rebuild_s", "restore_s")), 4)
        recoveries.append({k: ph[k] for k in PHASES} | {"generation": e["generation"], "lost_steps": e["lost_steps"]})
    timings = res.timings()
    steps = [r for r in timings if "step" in r and "event" not in r and r.get("gen", 0) == 0]
    deltas = [b["t"] - a["t"] for a, b in itertools.pairwise(steps) if b["step"] == a["step"] + 1 and a["step"] >= 2]
    launched = next((e["time"] for e in events if e.get("event") == "launched"), None)
    out = {"recoveries": recoveries, "step_s": C.median(deltas),
           "startup_s": steps[0]["t"] - launched if steps and launched else None,
           "node_failures": len(failed), "wall_s": round(res.wall_s, 1)}
    out.update({k: C.median(r[k] for r in recoveries) for k in PHASES})
    return out, ""


def run_jobs(args, work: C.Workdir, failures: C.Failures) -> list[dict]:
    rows = []
    for nodes, nproc in parse_layouts(args.layouts):
        name = f"{nodes}x{nproc}"
        folder = work.new(f"job-{name}")
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        res = C.run(f"job {name}", job_command(nodes, nproc, args.kills, args), folder=folder, env=env,
                    timeout=args.timeout)
        if not failures.check(res):
            continue
        got, why = analyse_job(res, args.kills)
        if got is None:
            failures.add(f"job {name}", why, C.tail(res.output), folder)
            continue
        row = {"layout": name, "nodes": nodes, "nproc": nproc, "ranks": nodes * nproc,
               "processes": (nodes + args.kills) * (nproc + 1) + 1, **got}
        rows.append(row)
        print(f"  job {name:5s} ({row['ranks']:2d} ranks, {row['processes']} processes): total "
              f"{C.fmt(row['total_s'], '.3f')} s (rebuild {C.fmt(row['rebuild_s'], '.3f')}), step "
              f"{C.fmt(row['step_s'], '.3f')} s, start {C.fmt(row['startup_s'], '.0f')} s, wall {res.wall_s:.0f} s",
              flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ groups


def _table_recording(connections):
    """How dpstate.groups.severing.GroupConnections.recording found the build's connections before it looked at the
    process's own new sockets only: every socket fd new since the build began, joined with the network
    namespace's whole TCP table (/proc/self/net/tcp{,6}: non-listening), which on one host holds every rank's
    connections and every leaked older generation's."""
    from dpstate.groups import severing

    def connected_inodes() -> set[str]:
        inodes: set[str] = set()
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table) as f:
                    next(f, None)
                    inodes.update(f"socket:[{fields[9]}]" for fields in map(str.split, f)
                                  if len(fields) > 9 and fields[3] != "0A")
            except OSError:
                continue
        return inodes

    @contextlib.contextmanager
    def recording():
        before = severing._socket_fds()
        yield
        connected = connected_inodes()
        new = {fd: link for fd, link in severing._socket_fds().items() if link in connected and before.get(fd) != link}
        with connections._lock:
            connections._held.update(new)

    return recording()


def group_worker(endpoint: str, rank: int, schedule_path: str) -> int:
    """One rank of the groups measurement (run as a process of its own by run_groups)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # old groups are leaked on purpose: their sockets stay
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sys.path.insert(0, str(C.REPO))
    import torch
    import torch.distributed as dist

    from dpstate.steps.abort import AbortSignal
    from dpstate.groups.pgroup import GroupManager
    from dpstate.groups.severing import GroupConnections, _group_connection, _socket_fds

    torch.set_num_threads(1)
    spent: dict[str, float] = {}
    table = [False]

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    original_recording = GroupConnections.recording

    @contextlib.contextmanager
    def timed_recording(self):
        cm = _table_recording(self) if table[0] else original_recording(self)
        t0 = time.perf_counter()
        cm.__enter__()
        spent["record"] = spent.get("record", 0.0) + time.perf_counter() - t0
        try:
            yield
        finally:
            t0 = time.perf_counter()
            cm.__exit__(*sys.exc_info())
            spent["record"] = spent.get("record", 0.0) + time.perf_counter() - t0

    GroupManager._arrive = timed("arrive", GroupManager._arrive)
    GroupManager._init = timed("init", GroupManager._init)
    GroupConnections.recording = timed_recording
    host, _, port = endpoint.rpartition(":")
    side = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    groups, abort = GroupManager(backend="gloo", timeout_s=120), AbortSignal()
    for generation, world, variant in json.loads(Path(schedule_path).read_text()):
        if rank >= world:
            continue
        if variant == "before":
            os.environ["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] = "0"
        else:
            os.environ.pop("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", None)  # GroupManager.build sets it
        table[0] = variant in ("before", "table")
        os.environ["DP_GLOO_LAZY_CONNECT"] = "1" if variant == "lazy" else "0"
        side.add(f"aligned/{generation}", 1)  # every rank starts the build together (not counted)
        delay = 0.001
        while side.add(f"aligned/{generation}", 0) < world:
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        spent.clear()
        sockets_before = _socket_fds()
        cpu0, t0 = time.process_time(), time.perf_counter()
        groups.build(generation, endpoint, rank, world, abort)
        t1, cpu1 = time.perf_counter(), time.process_time()
        x = torch.ones(1)
        dist.all_reduce(x)
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        if x.item() != world:
            raise RuntimeError(f"generation {generation}: all-reduce gave {x.item()}, not {world}")
        connections = sum(1 for fd, link in _socket_fds().items()
                          if sockets_before.get(fd) != link and _group_connection(fd))
        side.set(f"result/{generation}/{rank}", json.dumps({
            "build_s": t1 - t0, "build_cpu_s": cpu1 - cpu0, "allreduce_s": t2 - t1, "barrier_s": t3 - t2,
            "connections": connections,
            **{f"{k}_s": v for k, v in spent.items()}}))
    sys.stdout.flush()
    os._exit(0)  # the groups are leaked on purpose; skip their destructors


def run_groups(args, work: C.Workdir, failures: C.Failures) -> list[dict]:
    import datetime

    import torch.distributed as dist

    sizes = [int(s) for s in args.group_sizes.split(",")]
    ranks = max(sizes)
    schedule, generation = [], 1
    for world in sizes:
        for rep in range(args.group_reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for variant in order:
                schedule.append((generation, world, variant))
                generation += 1
    folder = work.new("groups")
    (folder / "schedule.json").write_text(json.dumps(schedule))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    endpoint = f"127.0.0.1:{store.port}"
    env = C.child_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    procs = []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as logs:
        for rank in range(ranks):
            log = logs.enter_context(open(folder / f"rank{rank}.log", "wb"))
            procs.append(subprocess.Popen([sys.executable, __file__, "--group-worker", endpoint, str(rank),
                                           str(folder / "schedule.json")], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            C._LIVE.add(procs[-1].pid)
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc in procs:
            C._kill_group(proc.pid)
            C._LIVE.discard(proc.pid)
    wall = time.perf_counter() - t0
    bad = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if bad:
        rank, code = bad[0]
        cause = "timed out" if code is None else C.exit_cause(code)
        failures.add("groups", f"{len(bad)} of {ranks} group-building ranks failed (rank {rank}: {cause})",
                     C.file_tail(folder / f"rank{rank}.log"), folder)
        return []
    rows = []
    for world in sizes:
        for variant in VARIANTS:
            builds = []
            for gen, w, v in schedule:
                if w == world and v == variant:
                    builds.append([json.loads(store.get(f"result/{gen}/{rank}")) for rank in range(world)])
            row = {"ranks": world, "variant": variant, "builds": len(builds)}
            for key in ("build_s", "arrive_s", "init_s", "record_s", "allreduce_s", "barrier_s"):
                row[key] = C.median(max(r.get(key, 0.0) for r in ranks_of) for ranks_of in builds)
            row["build_cpu_s"] = C.median(sum(r["build_cpu_s"] for r in b) / len(b) for b in builds)
            row["connections_per_rank"] = C.median(sum(r["connections"] for r in b) / len(b) for b in builds)
            reads = (row["connections_per_rank"] * world if variant == "lazy" else world * (world - 1))
            row["store_bytes_read"] = reads * (154 + (8 * world if variant == "before" else 0))
            rows.append(row)
    print(f"  groups: {ranks} processes, {len(schedule)} builds in {wall:.0f} s (process start included)", flush=True)
    return rows


# a rank's Gloo rendezvous key, the rank as sequence number (IPv4 loopback; dpstate.groups.pgroup)
STORE_KEY_BYTES = 154


def store_client(port: int, gets: int) -> int:
    """One client of the store measurement (a process of its own): `gets` reads of a rendezvous-sized key."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    store.add("ready", 1)
    while store.add("go", 0) == 0:
        time.sleep(0.001)
    for i in range(gets):
        store.get(f"key{i % 64}")
    os._exit(0)


def measure_store(work: C.Workdir, failures: C.Failures, clients: int, gets: int) -> dict | None:
    """CPU the TCPStore's server spends per read of a rendezvous key: a job's one store serves every rank's reads
    in turn (its server thread runs in this process, which does nothing else meanwhile)."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for i in range(64):
        master.set(f"key{i}", b"x" * STORE_KEY_BYTES)
    folder = work.new("store")
    env = C.child_env({"OMP_NUM_THREADS": "1"})
    with contextlib.ExitStack() as logs:
        procs = [subprocess.Popen([sys.executable, __file__, "--store-client", str(master.port), str(gets)], env=env,
                                  stdout=logs.enter_context(open(folder / f"client{i}.log", "wb")),
                                  stderr=subprocess.STDOUT, start_new_session=True) for i in range(clients)]
        for proc in procs:
            C._LIVE.add(proc.pid)
        deadline = time.monotonic() + 120
        while master.add("ready", 0) < clients and time.monotonic() < deadline and all(
                proc.poll() is None for proc in procs):
            time.sleep(0.05)
        cpu0, t0 = time.process_time(), time.perf_counter()
        master.add("go", 1)
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        for proc in procs:
            C._kill_group(proc.pid)
            C._LIVE.discard(proc.pid)
    if any(code != 0 for code in codes):
        failures.add("store", f"store clients ended {codes}", C.file_tail(folder / "client0.log"), folder)
        return None
    n = clients * gets
    return {"clients": clients, "gets": n, "server_cpu_per_get_s": cpu / n, "gets_per_s": n / wall,
            "server_bound_gets_per_s": n / cpu if cpu > 0 else None}


# ------------------------------------------------------------------------------------------------ decide


def run_decide(sizes: list[tuple[int, int]], repeat: int) -> list[dict]:
    import controller_scale as cs

    from dpcommon import protocol as p
    from dprun.controller.state_machine import NodeGone

    rows = []
    for nodes, nproc in sizes:
        cpu = []
        for _ in range(repeat):
            wire = cs.Wire()
            c = cs.build(nodes, 1, nproc, wire)
            victim = c.timeline.layout[len(c.timeline.layout) // 2]

            def failure_to_reconfigure(c=c, victim=victim, wire=wire):
                wire.send_all(c.handle(NodeGone(victim, "benchmark"), 1.0))
                seq = c.reconstruction.seq  # the probe's
                pongs = [(n.node_id, wire.frames(p.Pong(n.node_id, seq))) for n in c.table.live()]
                for node, frames in pongs:
                    wire.send_all(wire.deliver(c, node, frames, 1.0))
                assert c.timeline.generation == 1, "no reconfiguration"

            cpu.append(cs.cpu_ms(failure_to_reconfigure) / 1000)
        rows.append({"ranks": nodes * nproc, "nodes": nodes, "nproc": nproc, "decide_cpu_s": C.median(cpu)})
    return rows


# ------------------------------------------------------------------------------------------------ fits


def fit(points: list[tuple[float, float]]) -> dict | None:
    """y = a + b * f(R) for each model (least squares), the power-law exponent, the best model, projections."""
    pts = [(r, y) for r, y in points if y is not None]
    if len({r for r, _ in pts}) < 2:
        return None
    out: dict = {"points": len(pts)}
    ys = [y for _, y in pts]
    mean_y = sum(ys) / len(ys)
    total = sum((y - mean_y) ** 2 for y in ys) or 1e-30
    for name, f in MODELS.items():
        xs = [f(r) for r, _ in pts]
        n, sx, sy = len(xs), sum(xs), sum(ys)
        sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
        b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        a = (sy - b * sx) / n
        rss = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
        out[name] = {"a": a, "b": b, "r2": 1 - rss / total,
                     "at": {str(r): a + b * f(r) for r in PROJECT_TO}}
    logs = [(math.log(r), math.log(y)) for r, y in pts if y > 0]
    if len({lr for lr, _ in logs}) >= 2:
        mx, my = sum(x for x, _ in logs) / len(logs), sum(y for _, y in logs) / len(logs)
        out["exponent"] = (sum((x - mx) * (y - my) for x, y in logs) / sum((x - mx) ** 2 for x, _ in logs))
    # the best of the three that grows; none grows: the figure does not grow with R, and its largest value stands
    growing = [m for m in MODELS if out[m]["b"] > 0]
    if growing:
        out["best"] = max(growing, key=lambda m: out[m]["r2"])
        out["projected"] = out[out["best"]]["at"]
    else:
        out["best"] = "flat"
        out["projected"] = {str(r): max(ys) for r in PROJECT_TO}
    return out


def fits_of(jobs: list[dict], groups: list[dict], decide: list[dict]) -> dict:
    fits = {}
    for key in PHASES:
        fits[f"job {key}"] = fit([(row["ranks"], row[key]) for row in jobs])
    fits["job step_s"] = fit([(row["ranks"], row["step_s"]) for row in jobs])
    for variant in VARIANTS:
        rows = [g for g in groups if g["variant"] == variant]
        fits[f"group build_s ({variant})"] = fit([(g["ranks"], g["build_s"]) for g in rows])
        fits[f"group build_cpu_s ({variant})"] = fit([(g["ranks"], g["build_cpu_s"]) for g in rows])
    fits["controller decide_cpu_s"] = fit([(d["ranks"], d["decide_cpu_s"]) for d in decide if d["nproc"] == 1])
    return {k: v for k, v in fits.items() if v is not None}


def model_projection(jobs: list[dict], decide: list[dict], fits: dict, store: dict | None,
                     groups: list[dict] | None = None) -> dict:
    """A recovery at R ranks with a core per rank: the figures that do not depend on R as measured at the smallest
    job (detect, restore, rest: a barrier and one step), the controller's decision as measured at R, and the group
    build as the CPU one rank spends on it, projected linearly (on a core of its own a rank's build connects to
    R - 1 peers and reads R keys; here every rank's table of sockets is the host's, of all ranks, which adds a
    term that grows faster), plus the store's share: Gloo's full mesh has every rank read every rank's key, R^2
    reads that the one TCPStore serves one after another; lazily (`lazy`), a read per connection a rank makes, as
    many as at the largest size measured (a ring all-reduce and a barrier talk to a few peers each)."""
    if not jobs:
        return {}
    small = min(jobs, key=lambda r: r["ranks"])
    decide_fit = fits.get("controller decide_cpu_s")
    per_get = store["server_cpu_per_get_s"] if store else None
    lazy = [g for g in groups or [] if g["variant"] == "lazy"]
    lazy_reads = max(lazy, key=lambda g: g["ranks"])["connections_per_rank"] if lazy else None
    out = {}
    for r in PROJECT_TO:
        measured = [d["decide_cpu_s"] for d in decide if d["ranks"] == r and d["nproc"] == 1]
        decide_s = measured[0] if measured else (decide_fit["projected"][str(r)] if decide_fit else None)
        for variant in ("table", "now", "lazy"):
            cpu_fit = fits.get(f"group build_cpu_s ({variant})")
            reads = r * lazy_reads if variant == "lazy" and lazy_reads is not None else r * r
            parts = {"detect_s": small["detect_s"], "decide_s": decide_s,
                     "rebuild_cpu_s": cpu_fit["linear"]["at"][str(r)] if cpu_fit else None,
                     "store_s": reads * per_get if per_get else None,
                     "restore_s": small["restore_s"], "rest_s": small["rest_s"]}
            known = [v for v in parts.values() if v is not None]
            parts["total_s"] = sum(known) if len(known) == len(parts) else None
            out.setdefault(variant, {})[str(r)] = parts
    return out


def target_of(jobs: list[dict]) -> dict:
    """Total at 32 ranks against 2 ranks (limit 2x), in seconds and in steps of the job's own step time."""
    by_r: dict[int, list[dict]] = {}
    for row in jobs:
        by_r.setdefault(row["ranks"], []).append(row)
    if 2 not in by_r or 32 not in by_r:
        return {}
    base = C.median(r["total_s"] for r in by_r[2])
    base_steps = C.median(r["total_steps"] for r in by_r[2] if r.get("total_steps"))
    ratios = {r["layout"]: r["total_s"] / base for r in by_r[32]}
    in_steps = {r["layout"]: r["total_steps"] / base_steps for r in by_r[32] if r.get("total_steps") and base_steps}
    return {"total_2_s": base, "ratio_32_over_2": ratios, "limit": 2.0, "met": all(v <= 2.0 for v in ratios.values()),
            "total_2_steps": base_steps, "ratio_32_over_2_in_steps": in_steps,
            "met_in_steps": bool(in_steps) and all(v <= 2.0 for v in in_steps.values())}


def analyse(result: dict) -> dict:
    """Fits, the model and the target from the measurements in `result` (a new run's, or --from-json's)."""
    jobs, groups, decide, store = result["jobs"], result["groups"], result["decide"], result.get("store")
    for row in jobs:
        row["total_steps"] = row["total_s"] / row["step_s"] if row.get("step_s") else None
    fits = fits_of(jobs, groups, decide)
    return {**result, "fits": fits, "projection": model_projection(jobs, decide, fits, store, groups),
            "target": target_of(jobs)}


def report(result: dict) -> None:
    jobs, groups, decide, store = result["jobs"], result["groups"], result["decide"], result.get("store")
    fits, model, target = result["fits"], result["projection"], result["target"]
    print()
    if jobs:
        print("jobs (median over the recoveries of each job; seconds; in steps: total / the job's step):")
        print(C.table(["layout", "ranks", "procs", *[k[:-2] for k in PHASES], "in steps", "step", "start"],
                      [[r["layout"], r["ranks"], r["processes"], *[C.fmt(r[k]) for k in PHASES],
                        C.fmt(r.get("total_steps"), ".1f"), C.fmt(r["step_s"]), C.fmt(r["startup_s"], ".0f")]
                       for r in jobs]))

    def ms(v):
        return C.fmt(v * 1000 if v is not None else None, ".1f")

    if groups:
        print("\ngroups only (slowest rank's wall, median over builds; cpu: CPU seconds per rank; ms):")
        print(C.table(["ranks", "variant", "build", "arrive", "init", "record", "cpu/rank", "allreduce", "barrier",
                       "conns/rank", "store read"],
                      [[g["ranks"], g["variant"], ms(g["build_s"]), ms(g["arrive_s"]), ms(g["init_s"]),
                        ms(g["record_s"]), ms(g["build_cpu_s"]), ms(g["allreduce_s"]), ms(g["barrier_s"]),
                        C.fmt(g.get('connections_per_rank'), '.1f'), f"{g['store_bytes_read'] / 1e3:.0f} kB"]
                       for g in groups]))
    if decide:
        print("\ncontroller alone (failure -> probe round -> plan -> Reconfigure out; CPU ms):")
        print(C.table(["ranks", "nodes x nproc", "decide cpu"],
                      [[d["ranks"], f"{d['nodes']}x{d['nproc']}", ms(d["decide_cpu_s"])] for d in decide]))
    if fits:
        print("\nfits against R (R^2 of each; k: y ~ R^k) and the best one projected:")
        rows = []
        for name, f in fits.items():
            rows.append([name, *[f"{f[m]['r2']:.2f}" for m in MODELS], C.fmt(f.get("exponent"), ".2f"), f["best"],
                         *[C.fmt(f["projected"][str(r)], ".3g") for r in PROJECT_TO],
                         *[C.fmt(f["linear"]["at"][str(r)], ".3g") for r in PROJECT_TO]])
        print(C.table(["series", "linear", "RlogR", "R^2", "k", "best", "@512", "@4096", "lin@512", "lin@4096"], rows))
    if store:
        print(f"\nstore: {store['server_cpu_per_get_s'] * 1e6:.0f} us of the TCPStore server's CPU per read of a "
              f"{STORE_KEY_BYTES}-byte key ({store['gets_per_s']:.0f} reads/s from {store['clients']} clients)")
    if model:
        print("\nmodel of a recovery with a core per rank (detect, restore, rest as at the smallest job; decide as the "
              "controller measured; rebuild: the per-rank CPU, linear fit; store: R^2 key reads at the one store):")
        for variant, by_r in model.items():
            for r, parts in by_r.items():
                print(f"  {variant:8s} {r:>5s} ranks: " +
                      ", ".join(f"{k[:-2]} {C.fmt(v, '.2f')}" for k, v in parts.items()) + " s")
    if target:
        verdict = "met" if target["met"] else "NOT met"
        print(f"\ntarget: total at 32 ranks within 2x of 2 ranks ({target['total_2_s']:.3f} s): " +
              ", ".join(f"{k} {v:.1f}x" for k, v in target["ratio_32_over_2"].items()) + f": {verdict}")
        if target["ratio_32_over_2_in_steps"]:
            print(f"  in steps of each job's own step time ({C.fmt(target['total_2_steps'], '.1f')} at 2 ranks): " +
                  ", ".join(f"{k} {v:.1f}x" for k, v in target["ratio_32_over_2_in_steps"].items()))
    print(f"\n{result['host_note']}")


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--group-worker"]:
        return group_worker(argv[1], int(argv[2]), argv[3])
    if argv[:1] == ["--store-client"]:
        return store_client(int(argv[1]), int(argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=None, help=f"NODESxNPROC,... ({LAYOUTS}; --quick {QUICK_LAYOUTS})")
    ap.add_argument("--kills", type=int, default=None, help="node failures per job, one spare each (2; --quick 1)")
    ap.add_argument("--group-sizes", default=None, help="ranks of the groups-only builds (2,4,8,16,32; --quick 2,4)")
    ap.add_argument("--group-reps", type=int, default=None, help="builds per size and variant (3; --quick 1)")
    ap.add_argument("--decide-repeat", type=int, default=3)
    ap.add_argument("--mb", type=float, default=0.01, help="state per rank, MB (the tiny trainer)")
    ap.add_argument("--step-s", type=float, default=0.05, help="the trainer's stand-in for compute per step")
    ap.add_argument("--heartbeat-timeout", type=float, default=20.0,
                    help="high: a busy host must not fail nodes that are only slow (a kill is seen at once)")
    ap.add_argument("--skip", default="", help="parts to leave out: jobs,groups,decide")
    ap.add_argument("--quick", action="store_true", help="2 and 4 ranks, one failure each: a smoke run")
    ap.add_argument("--from-json", default=None, help="measure nothing: analyse and print a previous run's JSON")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per job")
    args = ap.parse_args(argv)
    if args.from_json:
        result = analyse(json.loads(Path(args.from_json).read_text()))
        C.write_json(args.json, result)
        report(result)
        return 1 if result.get("failed") else 0
    defaults = ({"layouts": QUICK_LAYOUTS, "kills": 1, "group_sizes": "2,4", "group_reps": 1} if args.quick else
                {"layouts": LAYOUTS, "kills": 2, "group_sizes": "2,4,8,16,32", "group_reps": 3})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    skip = set(filter(None, args.skip.split(",")))
    C.install_cleanup()
    work = C.Workdir("recovery-growth", keep=args.keep)
    failures = C.Failures("recovery_growth", work)
    cores = os.cpu_count() or 1
    host = (f"this host has {cores} cores (load {os.getloadavg()[0]:.1f} at the start): every rank, spare and agent "
            "shares them, so process start and CPU contention inflate the large sizes; the groups' CPU per rank "
            "and the controller's CPU are what a rank or the head spends on a core of its own")
    print(f"recovery_growth: layouts {args.layouts}, {args.kills} failure(s) per job; group builds at "
          f"{args.group_sizes} ranks; {host}; folders under {work.path}", flush=True)
    t_start = time.perf_counter()
    try:
        jobs = run_jobs(args, work, failures) if "jobs" not in skip else []
        groups = run_groups(args, work, failures) if "groups" not in skip else []
        store = (measure_store(work, failures, clients=2, gets=2000 if args.quick else 20000)
                 if "groups" not in skip else None)
        decide = (run_decide(QUICK_DECIDE_SIZES if args.quick else DECIDE_SIZES, 1 if args.quick else args.decide_repeat)
                  if "decide" not in skip else [])
    finally:
        work.close()
    result = analyse({
        "benchmark": "recovery_growth", "machine": C.machine(), "host_note": host, "quick": args.quick,
        "layouts": args.layouts, "kills_per_job": args.kills,
        "trainer": {"script": TRAINER.name, "mb": args.mb, "step_s": args.step_s},
        "jobs": jobs, "groups": groups, "store": store, "decide": decide,
        "elapsed_s": round(time.perf_counter() - t_start, 1), "failed": failures.as_json()})
    C.write_json(args.json, result)
    report(result)
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
