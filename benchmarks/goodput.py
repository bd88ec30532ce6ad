"""Goodput: a fixed stretch of wall time (10 minutes by default) with a failure every 60 s, under DeadPool
(a node killed, a spare takes over, the scheduler brings a new spare) and under torchrun --max-restarts with
disk checkpoints every k steps (a worker killed, every worker restarts and resumes from the checkpoint).

    python benchmarks/goodput.py [--minutes 10] [--every 60] [--systems deadpool,torchrun] [--json PATH] [--quick]
                                 [--data TEXT_FILE]

Goodput = useful step time / wall time = (steps done by the end x the run's normal step time) / wall time;
the normal step time is the median time between consecutive steps of the same run. Each system runs alone,
one after the other (about 2 x --minutes in all). The job: examples/train_gpt.py, 2 nodes, 108 MB of
parameters + AdamW state per node, batch 2 x 128 tokens per rank (the job of benchmarks/recovery.py).
DeadPool runs in multi-node mode (a dprun per node on loopback) with one spare and --snapshot-interval auto
(--dp-interval to change); after each failure a new node joins as the spare, as a scheduler would replace
the machine. torchrun: --max-restarts 1000, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, checkpoints every 50 steps.

A system's run fails when its launcher ends early, when no training step (or too few to time one) is done by
the end, or on any error of the driver: it is said with its cause and the tail of its log, it gets no figure
(not a goodput of 0), and the benchmark exits 1.

JSON: {"goodput": {"deadpool", "torchrun"}, "failures": {...}, "final_step": {...}, "step_s": {...}, ...,
"failed": [{"run", "cause", "folder"}] (systems whose run failed: absent from the figures)}.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from recovery import RECOVERY_MODEL  # noqa: E402

SYSTEMS = ("deadpool", "torchrun")
LOGS = {"deadpool": "head.log", "torchrun": "torchrun.log"}  # the launcher's log: where a run's error shows


def _popen(cmd, folder: Path, env: dict, log_name: str) -> subprocess.Popen:
    log = open(folder / log_name, "ab")
    # TMPDIR in the benchmark's scratch folder: a SIGKILLed node cannot remove its run folder itself
    proc = subprocess.Popen(list(map(str, cmd)), cwd=folder, env=C.child_env(env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    C._LIVE.add(proc.pid)
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trained(folder: Path) -> bool:
    """Has the job finished a step yet? (no failure is injected before training starts)"""
    try:
        return '"step"' in (folder / "timings.jsonl").read_text()
    except OSError:
        return False


def _script(args, folder: Path) -> list[str]:
    model = C.SMALL_MODEL if args.quick else RECOVERY_MODEL
    data = ["--data", str(Path(args.data).resolve())] if args.data else []
    return [str(C.TRAIN), "--steps", "1000000", "--seed", "0", *model, *data, "--log-every", "0",
            "--timings", str(folder / "timings.jsonl")]


def run_deadpool(args, folder: Path) -> dict:
    token = folder / "token"
    token.write_text(secrets.token_hex(16))
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    common = [sys.executable, "-m", "dprun", "--rdzv-endpoint", endpoint, "--nnodes", "2", "--spares", "1",
              "--token-file", str(token), "--no-tui", "--snapshot-interval", args.dp_interval,
              "--on-spare-exhausted", "wait"]
    script = _script(args, folder)
    events = folder / "events.jsonl"
    t0 = time.time()
    members: dict[int, subprocess.Popen] = {}  # dprun member pid -> process (its node id is host-<pid>)
    head = _popen([*common, "--node-rank", "0", "--events-file", str(events), *script], folder, env, "head.log")
    for rank in (1, 2):
        p = _popen([*common, "--node-rank", str(rank), *script], folder, env, f"node{rank}.log")
        members[p.pid] = p
    failures, joined = [], 2
    deadline = t0 + args.minutes * 60
    next_fail = t0 + args.every
    try:
        while time.time() < deadline:
            if head.poll() is not None:
                raise RuntimeError(f"the head dprun ended early ({C.exit_cause(head.returncode)})")
            if time.time() < next_fail or not _trained(folder):
                time.sleep(0.2)
                continue
            next_fail += args.every
            evs = C.RunResult("", 0, 0, folder, "", {}, 0).events()
            # the node that holds node rank 1 now: the newest promotion to it, else the first node rank 1
            layout = [e for e in evs if e["event"] in ("job_started", "spare_promoted")]
            victim_node = None
            for e in layout:
                if e["event"] == "job_started":
                    victim_node = e["layout"][1]
                elif e.get("node_rank") == 1:
                    victim_node = e["spare"]
            joins = {e["node"]: e for e in evs if e["event"] == "node_joined"}
            if victim_node is None or victim_node not in joins:
                continue
            member_pid = int(victim_node.rsplit("-", 1)[1])
            t_kill = time.time()
            try:
                os.killpg(joins[victim_node]["pid"], signal.SIGKILL)  # the node's agent and workers, at once
            except (ProcessLookupError, PermissionError):
                pass
            proc = members.pop(member_pid, None)
            if proc is not None:
                proc.kill()
            failures.append({"t": t_kill - t0, "node": victim_node})
            # the scheduler replaces the machine: a new node joins the running job as the spare
            joined += 1
            p = _popen([*common, *script], folder, env, f"node{joined}.log")
            members[p.pid] = p
    finally:
        for p in [head, *members.values()]:
            C._kill_group(p.pid)
            C._LIVE.discard(p.pid)
        for proc in psutil.process_iter(["cmdline"]):  # agents / workers of our nodes that outlived their dprun
            try:
                if str(folder) in " ".join(proc.info["cmdline"] or []):
                    proc.kill()
            except psutil.Error:
                pass
    evs = C.RunResult("", 0, 0, folder, "", {}, 0).events()
    recoveries = [e for e in evs if e["event"] == "recovery_complete"]
    return {"wall_s": time.time() - t0, "failures": failures,
            "recoveries": [{"total_s": e["phases"]["total_s"], "lost_steps": e.get("lost_steps"),
                            "restore_step": e.get("restore_step")} for e in recoveries],
            "timings": C.RunResult("", 0, 0, folder, "", {}, 0).timings(), "t0": t0}


def run_torchrun(args, folder: Path) -> dict:
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    script = [*_script(args, folder), "--ckpt-dir", str(folder / "ckpt"), "--ckpt-every", str(args.ckpt_every)]
    t0 = time.time()
    proc = _popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", "1000", *script], folder, env, "torchrun.log")
    failures = []
    deadline = t0 + args.minutes * 60
    next_fail = t0 + args.every
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun ended early ({C.exit_cause(proc.returncode)})")
            if time.time() < next_fail or not _trained(folder):
                time.sleep(0.2)
                continue
            next_fail += args.every
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue  # torchrun just ended: the poll above says how
            for child in children:
                try:
                    if "train_gpt" in " ".join(child.cmdline()) and child.environ().get("RANK") == "1":
                        child.kill()
                        failures.append({"t": time.time() - t0, "pid": child.pid})
                        break
                except psutil.Error:
                    continue
    finally:
        C._kill_group(proc.pid)
        C._LIVE.discard(proc.pid)
    return {"wall_s": time.time() - t0, "failures": failures,
            "timings": C.RunResult("", 0, 0, folder, "", {}, 0).timings(), "t0": t0}


def goodput_of(run: dict, wall_s: float) -> dict:
    """The run's goodput; a RuntimeError when it has none to give: without a step, or without two consecutive
    ones to time a step by, the job did not train (it failed, or was still starting on a busy host), and a
    goodput of 0 would read as a measurement."""
    steps = [r for r in run["timings"] if "step" in r and "event" not in r]
    if not steps:
        raise RuntimeError(f"no training step done in {wall_s:.0f} s")
    deltas = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]
    step_s = C.median(deltas)
    if not step_s:
        raise RuntimeError(f"no two consecutive steps to time a step by in {wall_s:.0f} s ({len(steps)} steps)")
    final = steps[-1]["step"]
    return {"goodput": final * step_s / wall_s, "final_step": final, "step_s": step_s,
            "steps_run": len(steps), "recomputed_steps": len(steps) - final}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=None, help="wall time of each system's run (10; --quick 1)")
    ap.add_argument("--every", type=float, default=None, help="seconds between failures (60; --quick 25)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--ckpt-every", type=int, default=None, help="torchrun's checkpoint interval (50; --quick 20)")
    ap.add_argument("--dp-interval", default="auto", help="DeadPool's --snapshot-interval")
    ap.add_argument("--quick", action="store_true", help="small model, 1 minute per system, a failure every 25 s")
    ap.add_argument("--data", default=None, help="the training text (examples/train_gpt.py --data)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    for key, full, quick in (("minutes", 10.0, 1.0), ("every", 60.0, 25.0), ("ckpt_every", 50, 20)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"--systems: comma-separated, of {', '.join(SYSTEMS)}")
    C.install_cleanup()
    work = C.Workdir("goodput", keep=args.keep)
    failures = C.Failures("goodput", work)
    print(f"goodput: {args.minutes:g} min per system, a failure every {args.every:g} s; folders under {work.path}",
          flush=True)
    out: dict = {"benchmark": "goodput", "machine": C.machine(), "minutes": args.minutes, "every_s": args.every,
                 "ckpt_every": args.ckpt_every, "dp_interval": args.dp_interval, "quick": args.quick,
                 "goodput": {}, "final_step": {}, "step_s": {}, "failures": {}, "details": {}}
    try:
        for system in systems:
            folder = work.new(system)
            busy0, t_start = C.machine_busy_s(), time.time()
            try:
                run = run_deadpool(args, folder) if system == "deadpool" else run_torchrun(args, folder)
                g = goodput_of(run, run["wall_s"])
            except Exception as exc:  # said with the tail of its launcher's log; no figure for it
                log = C.file_tail(folder / LOGS[system])
                # how busy the machine was: a job on a host busy with others may still be starting at the end
                busy = max(0.0, (C.machine_busy_s() - busy0) / ((time.time() - t_start) * (os.cpu_count() or 1)))
                failures.add(system, f"{type(exc).__name__}: {exc} (the machine's CPUs {busy:.0%} busy meanwhile"
                             + ("" if log else f"; {LOGS[system]} is empty") + ")", log, folder)
                continue
            others = max(0.0, (C.machine_busy_s() - busy0) / ((time.time() - t_start) * (os.cpu_count() or 1)))
            out["goodput"][system] = g["goodput"]
            out["final_step"][system] = g["final_step"]
            out["step_s"][system] = g["step_s"]
            out["failures"][system] = len(run["failures"])
            out["details"][system] = {**g, "wall_s": run["wall_s"], "failure_times_s": [f["t"] for f in run["failures"]],
                                      "recoveries": run.get("recoveries"), "machine_cpu_busy": others}
            print(f"  {system:8s} goodput {g['goodput']:.1%}: {g['final_step']} steps in {run['wall_s']:.0f} s at "
                  f"{C.fmt(g['step_s'], '.3f')} s/step, {len(run['failures'])} failures, "
                  f"{g.get('recomputed_steps', 0)} steps recomputed", flush=True)
    finally:
        work.close()
    out["failed"] = failures.as_json()
    C.write_json(args.json, out)
    print()
    print(C.table(["system", "goodput", "final step", "s/step", "failures"],
                  [[s, f"{out['goodput'][s]:.1%}", out["final_step"][s], C.fmt(out["step_s"][s], ".3f"),
                    out["failures"][s]] if s in out["goodput"] else [s, "FAILED", "-", "-", "-"]
                   for s in systems]))
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
