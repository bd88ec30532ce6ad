"""Scaling with state size: snapshot (capture into the host buffer), replication (to a replica store in another
process, as a node agent holds it) and restore (fetch from it + verify + load), from 10 MB to 4 GB per node,
against memcpy and loopback TCP bandwidth measured in the same run; then real recoveries (dprun, a node
killed, a spare takes over) against state size.

    python benchmarks/scaling.py [--sizes 10,100,1000,4000] [--recovery-sizes 10,100,500] [--json PATH] [--quick]
    python benchmarks/scaling.py --device cuda --sizes 256,4000 --recovery-sizes ""   # part 1 on a GPU

Part 1 runs dpstate's Replicator in a worker process against benchmarks/_replica_holder.py (dpagent's
ReplicaServer + ReplicaStore, keeping one snapshot): the state is float32 tensors of 64 MB (a model's
parameters + optimizer state); each size is captured, replicated and restored --reps times against one
holder. As in training, each snapshot is announced (ReserveSnapshot) and lands in the memory of the copy the
holder drops: repetitions 2.. are the steady state (medians, *_s); the first, into memory new to both
processes, is reported apart (*_s_cold: this VM backs a page on its first touch, slowly). A restore's fetch
lands in the buffer the capture used, as a spare's lands in the buffer it reserved while idle; the first
repetition's, on the CPU, in a buffer new to the process (its cold figure). Memory stays within about 3 x the
state (live state + one host buffer + the holder's copy); a size that does not fit in the free memory is
skipped and reported.
The limits are measured at min(size, 512 MB): memcpy (one thread) and loopback TCP (sendall / recv_into).
Ratios: capture / memcpy, replication / TCP, restore / TCP (achieved bandwidth over the limit). The stages'
own throughputs (copy, checksum, send; fetch, verify, load) are reported too, and the pipeline's time over
its slowest stage (pipeline_ratio: 1 where the stages overlap completely, their sum over the slowest where
they run one after the other). Each repetition restores twice, side by side: with the DP_FETCH_STREAMS
setting (restore_s) and over several connections (restore_streams_s, as many as the TCP limit's parallel test
uses: tcp_parallel_GBps). Each repetition snapshots twice, side by side: once sent whole after its
capture (DP_SNAPSHOT_STREAM=0: the stages one after the other, which gives each stage's own time and
replicate_s, the send alone) and once streamed as it is captured (what training does: snapshot_s;
whole_snapshot_s and whole_pipeline_ratio are the former's). cpu_bound_s: the streamed snapshot's CPU seconds
(worker and holder, every thread) over the host's cores, the least it can take where CPU is the limit.
With --device cuda the live state is on the GPU, as a GPU job's: the copy is the side stream's device-to-host
copy into page-locked memory and the load a host-to-device copy, against the device-to-host and host-to-device
limits measured in the worker (a copy of min(size, 512 MB) between the GPU and page-locked memory; d2h_GBps,
h2d_GBps). Its buffers stay page-locked from one repetition to the next (a spare reserves them ahead while
idle): the fetch lands in the buffer the capture used.

Part 2 runs benchmarks/_state_trainer.py under `dprun --nnodes 2 --spares 1 --inject kill-node:1@step=K`:
cheap steps (a sleep stands in for compute) and a state of the given size; reported are the recovery phases
from dprun's events (restore_s: the spare fetching and loading the dead node's state) and restore_s against
state / loopback TCP bandwidth.

JSON: {"device", "sizes": [{"mb", "capture_s", "replicate_s", "restore_s", "capture_GBps", "replicate_GBps",
"restore_GBps", "memcpy_GBps", "tcp_GBps", "capture_ratio", "replicate_ratio", "restore_ratio", "copy_GBps",
"crc_GBps", "fetch_GBps", "verify_GBps", "load_GBps", "d2h_GBps", "h2d_GBps" (None on the CPU), "copy_ratio"
(over d2h on a GPU, memcpy on the CPU), "crc_ratio" (over memcpy), "pipeline_ratio", "whole_snapshot_s",
"whole_pipeline_ratio", "cpu_bound_s", "cpu_bound_ratio", "streamed_reps", "fetch_streams" (DP_FETCH_STREAMS),
"parallel_streams", "restore_streams_s", "restore_streams_GBps", "restore_streams_ratio", "tcp_parallel_GBps", and the
first repetition's "replicate_s_cold", "restore_s_cold", "replicate_cold_ratio", "restore_cold_ratio"}],
"recovery": [{"mb", "detect_s", "rebuild_s", "restore_s", "total_s", "restore_at_tcp_s"}], "skipped": [...],
"failed": [{"run", "cause"}]}. A size whose run fails (the worker's or holder's exit, a recovery's exit code) is
said with the tail of its output and has no row; the benchmark then exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _limits  # noqa: E402

HERE = Path(__file__).resolve().parent
CHUNK = 16 * 2**20  # float32 elements per tensor (64 MB)
PHASES = ("capture_s", "copy_s", "crc_s", "replicate_s", "snapshot_s", "whole_snapshot_s", "cpu_bound_s", "fetch_s",
          "verify_s", "load_s", "restore_s", "restore_streams_s")


# ------------------------------------------------------------------------------------------ worker process


def device_limits(nbytes: int, device) -> dict:
    """Device-to-host and host-to-device bandwidth (bytes/s) of one copy of `nbytes` between the GPU and
    page-locked memory, the medians of 3 after a warm one: the limits of a GPU snapshot's copy and load."""
    import torch

    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for key, dst, frm in (("d2h_Bps", host, src), ("h2d_Bps", src, host)):
        times = []
        for _ in range(4):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(frm, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[key] = nbytes / statistics.median(times[1:])
    return out


def worker(mb: float, endpoint: str, token: str, reps: int, device_name: str = "cpu", holder_pid: int = 0) -> dict:
    """Capture + replicate + restore a state of `mb` MB with dpstate's Replicator; timings as JSON."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from dpcommon import protocol as P
    from dpcommon.fetch_streams import fetch_streams
    from dpcommon.thread_cpu import thread_cpu_times
    from dpstate.steps.abort import AbortSignal
    from dpstate.replication.replicator import Replicator

    torch.set_num_threads(1)
    device = torch.device(device_name)
    limits = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the Replicator: its copy stream goes on the current device
        limits = device_limits(int(min(mb, 512) * 1e6), device)
    numel = int(mb * 1e6 / 4)
    sizes = [CHUNK] * (numel // CHUNK) + ([numel % CHUNK] if numel % CHUNK else [])
    live = {f"t{i}": torch.full((n,), float(i), device=device) for i, n in enumerate(sizes)}
    # the setting's fetches (DP_FETCH_STREAMS) and, side by side, fetches over `parallel` connections: the
    # Replicator's context gets an I/O thread for each of those (it takes one per connection of the setting)
    setting, parallel = fetch_streams(), _limits.parallel_streams()
    os.environ["DP_FETCH_STREAMS"] = str(max(setting, parallel))
    rep = Replicator(P.Codec(token.encode()), 0, AbortSignal())
    os.environ["DP_FETCH_STREAMS"], rep.fetch_streams = str(setting), setting
    rep.slots = rep.slots[:1]  # one host buffer (memory: a 4 GB state), warm like a training run's after a few steps
    rep.configure(0, "", 0)
    rep.submit(0, {"step": 0, "state": live})  # warm-up capture, kept local: the buffer's pages exist
    rep.wait_acked()
    rep.configure(0, endpoint, 0)
    out: dict = {"mb": mb, "bytes": 4 * numel, "device": str(device), "fetch_streams": setting,
                 "parallel_streams": parallel, **limits, **{key: [] for key in PHASES}}
    st = rep.stats

    def cpu_s() -> float:  # both processes' CPU seconds, every thread (/proc, 10 ms ticks)
        return sum(thread_cpu_times("self").values()) + sum(thread_cpu_times(holder_pid).values())

    def snapshot(step: int, streamed: bool) -> dict:
        rep.stream = streamed
        c0, s0, copy0, crc0, cpu0 = st.capture_s, st.send_s, st.copy_s, st.crc_s, cpu_s()
        t0 = time.perf_counter()
        rep.submit(step, {"step": step, "state": live})
        rep.wait_acked()
        return {"snapshot_s": time.perf_counter() - t0, "capture_s": st.capture_s - c0,
                "replicate_s": st.send_s - s0, "copy_s": st.copy_s - copy0, "crc_s": st.crc_s - crc0,
                "cpu_s": cpu_s() - cpu0}

    def restore(step: int, streams: int) -> dict:
        return restore_into(rep, live, endpoint, step, streams, device)

    for r in range(reps):
        # each repetition snapshots twice: sent whole after the capture (the stages one after the other: each
        # stage's own time), then streamed as it is captured (what training does); the restore fetches the latter
        whole = snapshot(2 * r + 1, streamed=False)
        for key in ("capture_s", "replicate_s", "copy_s", "crc_s"):
            out[key].append(whole[key])
        out["whole_snapshot_s"].append(whole["snapshot_s"])
        streamed = snapshot(2 * r + 2, streamed=True)
        out["snapshot_s"].append(streamed["snapshot_s"])
        out["cpu_bound_s"].append(streamed["cpu_s"] / (os.cpu_count() or 1))
        out["streamed_reps"] = st.streamed  # (a holder that answered its reservation after the capture: sent whole)
        # restore: the local copy is forgotten, its buffer kept, and the fetch lands there, as a spare's restore
        # lands in the buffer it reserved and faulted in while it idled (Replicator.reserve_ahead). The first
        # repetition on the CPU fetches into memory new to the process instead (dpstate outside dprun, or a spare
        # that had not reserved yet): the cold figure
        rep.quiesce()
        for slot in rep.slots:
            slot.release() if r == 0 and device.type == "cpu" else rep.forget(slot)
        # the setting's restore and one over `parallel` connections (dpcommon.fetch_streams), in turns first (the
        # setting's first in the first repetition: its cold figure); once where the two are the same
        for streams in dict.fromkeys((setting, parallel) if r % 2 == 0 else (parallel, setting)):
            timed = restore(2 * r + 2, streams)
            if streams == setting:
                for key in ("fetch_s", "verify_s", "load_s", "restore_s"):
                    out[key].append(timed[key])
            if streams == parallel:
                out["restore_streams_s"].append(timed["restore_s"])
    return out


def restore_into(rep, live: dict, endpoint: str, step: int, streams: int, device) -> dict:
    """Fetch the holder's snapshot of `step` over `streams` connections and load it into `live`, timed; its slot
    is let go after (the next capture or fetch writes there)."""
    import torch

    from dpstate.snapshot import packing as S

    st = rep.stats
    rep.fetch_streams = streams
    f0, v0 = st.fetch_s, st.fetch_verify_s
    t0 = time.perf_counter()
    slot = rep.fetch(endpoint, 0, step, timeout=600)
    t1 = time.perf_counter()
    tree = S.unpack(slot.meta, slot.data, clone=False)
    for k, t in tree["state"].items():
        live[k].copy_(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    del tree
    rep.forget(slot)
    return {"fetch_s": st.fetch_s - f0, "verify_s": st.fetch_verify_s - v0, "load_s": t2 - t1, "restore_s": t2 - t0}


# ------------------------------------------------------------------------------------------ driver


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def part1(mb: float, reps: int, timeout: float, device: str = "cpu") -> dict:
    """All repetitions against one holder, as in training: the worker's ReserveSnapshot makes the holder drop
    the copy it keeps before the next arrives, so from the second repetition on the snapshot lands in memory
    the holder has used before. The first repetition (every page new to both processes) is reported apart,
    as *_cold_s; the others' medians are the steady state (*_s)."""
    runs = part1_once(mb, timeout, reps, device)
    out = {k: v for k, v in runs.items() if not isinstance(v, list)}
    for key in PHASES:
        out[f"{key}_cold"] = runs[key][0]
        out[key] = statistics.median(runs[key][1:] or runs[key][:1])
    return out


def part1_once(mb: float, timeout: float, reps: int, device: str = "cpu") -> dict:
    token = secrets.token_hex(16)
    holder = subprocess.Popen([sys.executable, str(HERE / "_replica_holder.py"), token, "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    C._LIVE.add(holder.pid)
    try:
        endpoint = holder.stdout.readline().strip()
        if not endpoint.startswith("tcp://"):
            time.sleep(0.5)  # an empty line: it is exiting (its error went to stderr)
            code = holder.poll()
            raise RuntimeError("the replica holder did not start"
                               + (f" ({C.exit_cause(code)})" if code is not None else f": it printed {endpoint!r}"))
        peak: dict[int, int] = {}
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(mb), endpoint, token, str(reps), device,
                                 str(holder.pid)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        C._LIVE.add(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            for pid in (proc.pid, holder.pid):
                peak[pid] = C._status_kb(pid, "VmHWM:") * 1024 if pid == holder.pid else 0
            C._kill_group(proc.pid)
            C._LIVE.discard(proc.pid)
        if proc.returncode != 0:
            raise RuntimeError(f"the scaling worker failed ({C.exit_cause(proc.returncode)}):\n{C.tail(err)}")
        result = json.loads(out.strip().splitlines()[-1])
        result["holder_peak_rss"] = peak[holder.pid]
        return result
    finally:
        try:
            holder.stdin.close()
            holder.wait(10)
        except Exception:
            pass
        C._kill_group(holder.pid)
        C._LIVE.discard(holder.pid)


def part2(mb: float, work: C.Workdir, steps: int, kill_at: int, timeout: float,
          failures: C.Failures) -> dict | None:
    """A real recovery at `mb` MB per node; None when the run failed (said, and recorded in `failures`)."""
    folder = work.new(f"recovery-{mb:g}MB")
    cmd = [sys.executable, "-m", "dprun", "--nnodes", "2", "--spares", "1", "--no-tui", "--events-file",
           "events.jsonl", "--inject", f"kill-node:1@step={kill_at}", str(HERE / "_state_trainer.py"),
           "--mb", str(mb), "--steps", str(steps), "--timings", "timings.jsonl", "--summary", "summary.json"]
    res = C.run(f"recovery {mb:g} MB", cmd, folder=folder, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    if not failures.check(res):  # its events may hold a recovery, but not one of a run that worked
        return None
    out: dict = {"mb": mb, "returncode": res.returncode, "peak_rss": res.peak_rss_by_role()}
    done = next((e for e in res.events() if e["event"] == "recovery_complete"), None)
    failed = next((e for e in res.events() if e["event"] == "node_failed"), None)
    if done:
        ph = done["phases"]
        out.update(detect_s=ph["detect_s"], decide_s=ph["decide_s"], rebuild_s=ph["rebuild_s"],
                   restore_s=ph["restore_s"], total_s=ph["total_s"], lost_steps=done.get("lost_steps"))
        if failed:
            out["detect_to_step_s"] = done["time"] - failed["time"]
    return out


def rate(nbytes: int, seconds: float) -> float | None:
    """GB/s, None where no time was measured (not an infinite or zero rate)."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


def ratio(value: float | None, limit: float | None) -> float | None:
    return value / limit if value is not None and limit else None


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mb, endpoint, token, reps, device, holder_pid = sys.argv[2:8]
        print(json.dumps(worker(float(mb), endpoint, token, int(reps), device, int(holder_pid))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,1000,4000", help="state sizes per node, MB (part 1)")
    ap.add_argument("--recovery-sizes", default="10,100,500", help="state sizes for real recoveries, MB (part 2)")
    ap.add_argument("--reps", type=int, default=4, help="per size; the first is reported apart (cold)")
    ap.add_argument("--recovery-steps", type=int, default=30,
                    help="steps of each recovery run (part 2), the node killed halfway")
    ap.add_argument("--quick", action="store_true", help="10 and 50 MB only, one recovery: about a minute")
    ap.add_argument("--device", default="cpu", help="where part 1's live state is: cpu, or cuda (a GPU job's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.recovery_sizes, args.reps = "10,50", "10", 2
    sizes = [float(x) for x in args.sizes.split(",") if x]
    rec_sizes = [float(x) for x in args.recovery_sizes.split(",") if x]
    C.install_cleanup()
    work = C.Workdir("scaling", keep=args.keep)
    failures = C.Failures("scaling", work)
    print(f"scaling: sizes {sizes} MB ({args.reps} repetitions each), recoveries at {rec_sizes} MB", flush=True)
    rows, skipped, recoveries = [], [], []
    try:
        for mb in sizes:
            need = 3.3 * mb * 1e6 + 1.5e9
            if mem_available() < need:
                skipped.append({"mb": mb, "why": f"needs about {need / 1e9:.1f} GB free, "
                                                 f"{mem_available() / 1e9:.1f} GB available"})
                print(f"  {mb:g} MB: skipped ({skipped[-1]['why']})", flush=True)
                continue
            try:
                limits = _limits.measure(int(min(mb, 512) * 1e6))
                r = part1(mb, args.reps, args.timeout, args.device)
            except Exception as exc:  # this size measured nothing: said, no row; the other sizes go on
                cause, _, output = f"{type(exc).__name__}: {exc}".partition("\n")
                failures.add(f"{mb:g} MB", cause, output)
                continue
            nbytes = r["bytes"]
            r.update(memcpy_GBps=limits["memcpy_Bps"] / 1e9, tcp_GBps=limits["tcp_Bps"] / 1e9,
                     capture_GBps=nbytes / r["capture_s"] / 1e9, replicate_GBps=nbytes / r["replicate_s"] / 1e9,
                     restore_GBps=nbytes / r["restore_s"] / 1e9)
            r.update(restore_streams_GBps=nbytes / r["restore_streams_s"] / 1e9,
                     tcp_parallel_GBps=limits["tcp_parallel_Bps"] / 1e9)
            r.update(replicate_cold_GBps=nbytes / r["replicate_s_cold"] / 1e9,
                     restore_cold_GBps=nbytes / r["restore_s_cold"] / 1e9)
            r.update(capture_ratio=r["capture_GBps"] / r["memcpy_GBps"],
                     **{f"{k}_ratio": r[f"{k}_GBps"] / r["tcp_GBps"]
                        for k in ("replicate", "restore", "restore_streams", "replicate_cold", "restore_cold")})
            r.update({f"{k}_GBps": rate(nbytes, r[f"{k}_s"]) for k in ("copy", "crc", "fetch", "verify", "load")})
            r.update(d2h_GBps=r.pop("d2h_Bps", 0) / 1e9 or None, h2d_GBps=r.pop("h2d_Bps", 0) / 1e9 or None)
            copy_limit = r["d2h_GBps"] if args.device.startswith("cuda") else r["memcpy_GBps"]
            r.update(copy_ratio=ratio(r["copy_GBps"], copy_limit), crc_ratio=ratio(r["crc_GBps"], r["memcpy_GBps"]),
                     pipeline_ratio=ratio(r["snapshot_s"], max(r["copy_s"], r["crc_s"], r["replicate_s"])),
                     whole_pipeline_ratio=ratio(r["whole_snapshot_s"], max(r["copy_s"], r["crc_s"], r["replicate_s"])),
                     cpu_bound_ratio=ratio(r["snapshot_s"], r["cpu_bound_s"]))
            rows.append(r)
            print(f"  {mb:6g} MB: capture {r['capture_s']:.3f} s ({r['capture_GBps']:.2f} GB/s, memcpy "
                  f"{r['memcpy_GBps']:.2f}), replicate {r['replicate_s']:.3f} s ({r['replicate_GBps']:.2f} GB/s, "
                  f"TCP {r['tcp_GBps']:.2f}), restore {r['restore_s']:.3f} s ({r['restore_GBps']:.2f} GB/s); first "
                  f"repetition: replicate {r['replicate_s_cold']:.3f} s, restore {r['restore_s_cold']:.3f} s", flush=True)
            print(f"           stages GB/s: copy {C.fmt(r['copy_GBps'], '.2f')} (limit {C.fmt(copy_limit, '.2f')}), "
                  f"checksum {C.fmt(r['crc_GBps'], '.2f')}, send {r['replicate_GBps']:.2f}, fetch "
                  f"{C.fmt(r['fetch_GBps'], '.2f')}, verify {C.fmt(r['verify_GBps'], '.2f')}, load "
                  f"{C.fmt(r['load_GBps'], '.2f')}; snapshot {r['snapshot_s']:.3f} s streamed, "
                  f"{r['whole_snapshot_s']:.3f} s sent after the capture: {C.fmt(r['pipeline_ratio'], '.2f')}x and "
                  f"{C.fmt(r['whole_pipeline_ratio'], '.2f')}x its slowest stage ({r['streamed_reps']} of "
                  f"{args.reps} streamed); the streamed one's CPU (both processes) over the cores: "
                  f"{r['cpu_bound_s']:.3f} s", flush=True)
            print(f"           restore over {r['fetch_streams']} connection(s) {r['restore_s']:.3f} s, over "
                  f"{r['parallel_streams']} {r['restore_streams_s']:.3f} s ({r['restore_streams_ratio']:.2f} of TCP; "
                  f"TCP over {r['parallel_streams']} connections {r['tcp_parallel_GBps']:.2f} GB/s)", flush=True)
        tcp = C.median(r["tcp_GBps"] for r in rows)  # None without a row of part 1: no bandwidth measured
        for mb in rec_sizes:
            rec = part2(mb, work, steps=args.recovery_steps, kill_at=args.recovery_steps // 2, timeout=args.timeout,
                        failures=failures)
            if rec is None:
                continue
            rec["restore_at_tcp_s"] = mb * 1e6 / (tcp * 1e9) if tcp else None
            recoveries.append(rec)
            print(f"  recovery {mb:6g} MB: rc {rec['returncode']}, restore {C.fmt(rec.get('restore_s'), '.3f')} s "
                  f"(state over loopback TCP alone: {C.fmt(rec['restore_at_tcp_s'], '.3f')} s), total "
                  f"{C.fmt(rec.get('total_s'), '.2f')} s", flush=True)
    finally:
        work.close()
    result = {"benchmark": "scaling", "machine": C.machine(), "device": args.device, "reps": args.reps,
              "quick": args.quick, "sizes": rows, "skipped": skipped, "recovery": recoveries, "failed": failures.as_json()}
    C.write_json(args.json, result)
    print()
    print(C.table(["MB", "capture s", "GB/s", "/memcpy", "replicate s", "GB/s", "/TCP", "restore s", "GB/s", "/TCP"],
                  [[f"{r['mb']:g}", f"{r['capture_s']:.3f}", f"{r['capture_GBps']:.2f}", f"{r['capture_ratio']:.2f}",
                    f"{r['replicate_s']:.3f}", f"{r['replicate_GBps']:.2f}", f"{r['replicate_ratio']:.2f}",
                    f"{r['restore_s']:.3f}", f"{r['restore_GBps']:.2f}", f"{r['restore_ratio']:.2f}"] for r in rows]))
    print("first repetition (memory new to both processes):")
    print(C.table(["MB", "replicate s", "/TCP", "restore s", "/TCP"],
                  [[f"{r['mb']:g}", f"{r['replicate_s_cold']:.3f}", f"{r['replicate_cold_ratio']:.2f}",
                    f"{r['restore_s_cold']:.3f}", f"{r['restore_cold_ratio']:.2f}"] for r in rows]))
    if recoveries:
        print()
        print(C.table(["MB", "detect s", "rebuild s", "restore s", "at TCP limit s", "total s"],
                      [[f"{r['mb']:g}", C.fmt(r.get("detect_s"), ".3f"), C.fmt(r.get("rebuild_s"), ".3f"),
                        C.fmt(r.get("restore_s"), ".3f"), C.fmt(r["restore_at_tcp_s"], ".3f"),
                        C.fmt(r.get("total_s"), ".3f")] for r in recoveries]))
    return failures.exit_code()


if __name__ == "__main__":
    sys.exit(main())
