"""The report of the GPU checks (benchmarks/gpu.sh): every stage's status and figures in one summary.json, the
targets of issue 42 set against them, and a short table for a human; and the preflight that says what the
machine has. No torch here but in `preflight`: the summary is rewritten after every stage.

    python benchmarks/gpu_summary.py summary OUT [--quiet] [--budget S] [--elapsed S]
    python benchmarks/gpu_summary.py preflight --json PATH [--dry-run]

A stage is ok when its command exited 0 *and* it measured what it should: a figure that is missing, zero or
not a number (a run that failed quietly; a CPU where the GPU was meant) is named under "missing", the stage
is "incomplete", and no figure stands in for it. `summary` exits 1 when any stage did not succeed (failed,
timed out, incomplete, skipped, never reached), 0 otherwise; any other exit code means the summary broke.
Targets are reported (met or not), never failed on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import re
import shlex
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

FINE = ("ok", "not_selected", "printed")  # statuses that do not fail the run
REQUIRED_MODULES = ("torch", "numpy", "zmq", "psutil", "typer", "rich", "dprun", "dpstate", "dpagent")
OPTIONAL_MODULES = ("pytest", "pytest_timeout", "xdist")
MIN_TARGET_MB = 256  # the issue's pipeline targets hold at >= 256 MB per node


# ------------------------------------------------------------------------------------------------ helpers


def read_kv(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def number(value: Any) -> float | None:
    """A finite number, else None (a NaN or a string is no figure)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def clean(value: Any) -> Any:
    """A figure as JSON keeps it: a NaN or infinity becomes None; ints, bools, strings and containers stay."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def per(total: Any, count: Any) -> float | None:
    total, count = number(total), number(count)
    return total / count if total is not None and count else None


def gbps(nbytes: float | None, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds and seconds > 0 else None


class Check:
    """The figures of one stage, and which of those it should have measured are missing."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.missing: list[str] = []

    def need(self, name: str, value: Any, positive: bool = True) -> Any:
        """Record figure `name`; a None, NaN, or (with `positive`) a value <= 0 is listed as missing instead."""
        v = clean(value)
        if v is None or (positive and number(v) is not None and v <= 0) or (isinstance(v, (str, list, dict)) and not v):
            self.missing.append(name)
            self.figures[name] = None
            return None
        self.figures[name] = v
        return v

    def put(self, name: str, value: Any) -> None:
        """A figure that is reported where there is one (not required)."""
        self.figures[name] = clean(value)

    def load(self, path: Path) -> dict | None:
        """The JSON object a stage wrote at `path`; None, with its file name listed as missing, where there is
        none (no file, not JSON, not an object)."""
        data = load_json(path)
        if not isinstance(data, dict):
            self.missing.append(path.name)
            return None
        return data


def command_of(out: Path, name: str) -> list[str]:
    try:
        return shlex.split((out / "stages" / f"{name}.cmd").read_text())
    except (OSError, ValueError):
        return []


def option(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd and cmd.index(flag) + 1 < len(cmd) else None


# ------------------------------------------------------------------------------------------------ stages


def preflight_figures(out: Path, name: str, gpu: bool) -> Check:
    c = Check()
    info = c.load(out / "preflight.json")
    if info is None:
        return c
    c.need("torch", info.get("torch"))
    c.put("python", info.get("python"))
    c.put("cuda_available", info.get("cuda_available"))
    if gpu:
        c.need("device_name", info.get("device_name"))
        c.need("device_memory_gb", info.get("device_memory_gb"))
    else:
        c.put("device_name", info.get("device_name"))
    for key in ("device_count", "cuda_version", "nccl", "cpus", "host_memory_gb", "dprun_from"):
        c.put(key, info.get(key))
    c.put("missing_modules", [m for m, v in info.get("modules", {}).items() if v is None])
    return c


def tests_figures(out: Path, name: str, gpu: bool) -> Check:
    c = Check()
    try:
        root = ET.parse(out / "tests.junit.xml").getroot()
    except (OSError, ET.ParseError):
        c.missing.append("tests.junit.xml")
        return c
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (found.get("message") or "").strip()
                break
        else:
            message = ""
        entry = {"test": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                 "seconds": float(case.get("time") or 0)}
        if message:
            entry["message"] = message[:300]
        cases.append(entry)
    counts = {k: sum(1 for e in cases if e["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    c.need("collected", len(cases))
    c.figures.update(counts)
    c.figures["cases"] = cases
    if gpu and counts["skipped"]:  # on the GPU nothing should skip: a skip there is a check that did not run
        c.missing.append(f"{counts['skipped']} test(s) skipped on the GPU")
    return c


def cuda_step_figures(out: Path, name: str, gpu: bool) -> Check:
    c = Check()
    data = c.load(out / f"{name}.json")
    if data is None:
        return c
    if data.get("skipped"):
        c.missing.append(f"everything: {data['skipped']}")
        return c
    device = str(data.get("device") or "")
    c.put("device", device)
    c.put("device_name", data.get("device_name"))
    if gpu and not device.startswith("cuda"):
        c.missing.append(f"a GPU figure (ran on {device or 'nothing'})")
    state = number(data.get("state_bytes"))
    c.need("state_gb", state / 1e9 if state else None)
    c.put("rows_per_micro_batch", data.get("batch"))
    c.put("micro_batches", data.get("micro_batches"))
    c.put("step_target_s", data.get("step_target_s"))
    steps = data.get("step_s") or {}
    off = c.need("step_s_off", steps.get("off"))
    per_step = c.need("step_s_per_step", steps.get("per_step"))
    c.need("overhead_per_step", per_step / off - 1 if off and per_step else None, positive=False)
    prof = data.get("profile") or {}
    captures = number(prof.get("captures"))
    snap_bytes = per(prof.get("bytes"), captures)
    c.need("snapshot_gb", snap_bytes / 1e9 if snap_bytes else None)
    for stage, total, count in (("copy", "copy_s", "captures"), ("crc", "crc_s", "captures"),
                                ("send", "send_s", "sends"), ("wait", "wait_s", "waits")):
        seconds = per(prof.get(total), prof.get(count))
        if stage == "wait":  # the optimizer's wait at the gate: 0 where the pipeline kept up
            c.put("wait_ms", seconds * 1000 if seconds is not None else None)
            continue
        c.need(f"{stage}_ms", seconds * 1000 if seconds is not None else None)
        c.put(f"{stage}_GBps", gbps(snap_bytes, seconds))
    if "--no-auto" not in command_of(out, name):
        auto = data.get("auto")
        if not isinstance(auto, dict):
            c.missing.append("auto")
        else:
            c.need("auto_interval", auto.get("interval"))
            c.need("auto_max_lost_steps", auto.get("max_lost_steps"))
            c.need("auto_lag_steps", auto.get("lag_steps"), positive=False)
            c.need("auto_cost", auto.get("cost"), positive=False)
            c.put("auto_cost_bound", auto.get("cost_bound"))
            c.need("auto_overhead_estimate", auto.get("overhead_estimate"), positive=False)
            c.need("auto_overhead_measured", auto.get("overhead_measured"), positive=False)
            mean = auto.get("mean_step_s") or {}
            c.put("auto_mean_step_s", {k: number(v) for k, v in mean.items()})
            c.put("auto_decision", auto.get("decision"))
    return c


PIPELINE_RATES = ("copy", "crc", "replicate", "fetch", "verify", "load", "capture", "restore")


def pipeline_figures(out: Path, name: str, gpu: bool) -> Check:
    c = Check()
    data = c.load(out / f"{name}.json")
    if data is None:
        return c
    for failed in data.get("failed") or []:
        c.missing.append(f"{failed.get('run')}: {failed.get('cause')}")
    for skipped in data.get("skipped") or []:
        c.missing.append(f"{skipped.get('mb')} MB skipped: {skipped.get('why')}")
    sizes = []
    for row in data.get("sizes") or []:
        one = Check()
        mb = row.get("mb")
        one.put("mb", mb)
        one.need("snapshot_s", row.get("snapshot_s"))
        one.need("restore_s", row.get("restore_s"))
        for key in PIPELINE_RATES:
            one.need(f"{key}_GBps", row.get(f"{key}_GBps"))
        for key in ("memcpy_GBps", "tcp_GBps") + (("d2h_GBps", "h2d_GBps") if gpu else ()):
            one.need(key, row.get(key))
        if not gpu:
            one.put("d2h_GBps", row.get("d2h_GBps"))
        for key in ("copy_ratio", "crc_ratio", "pipeline_ratio", "replicate_ratio", "restore_ratio"):
            one.need(key, row.get(key))
        for key in ("whole_snapshot_s", "whole_pipeline_ratio", "cpu_bound_s"):  # the same snapshot sent after it
            one.put(key, row.get(key))
        # the restore over several connections beside the setting's, and TCP's limit over as many
        for key in ("fetch_streams", "parallel_streams", "restore_streams_s", "restore_streams_ratio",
                    "tcp_parallel_GBps"):
            one.put(key, row.get(key))
        sizes.append(one.figures)
        c.missing.extend(f"{mb:g} MB {m}" if isinstance(mb, (int, float)) else m for m in one.missing)
    c.need("sizes", sizes)
    c.put("device", data.get("device"))
    return c


def hotswap_figures(out: Path, name: str, gpu: bool) -> Check:
    c = Check()
    folder = out / "hotswap"
    events = []
    try:
        for line in (folder / "events.jsonl").read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    except (OSError, ValueError):
        c.missing.append("hotswap/events.jsonl")
    done = [e for e in events if e.get("event") == "recovery_complete"]
    if not done:
        c.missing.append("a recovery (no recovery_complete event)")
    else:
        last = done[-1]
        for key, value in (last.get("phases") or {}).items():
            c.need(key, value, positive=key == "total_s")
        for key in ("detect_s", "decide_s", "rebuild_s", "restore_s", "total_s"):
            if key not in c.figures:
                c.need(key, None)
        c.put("restore_step", last.get("restore_step"))
        c.put("lost_steps", last.get("lost_steps"))
        c.put("generation", last.get("generation"))
    c.put("spare_promoted", any(e.get("event") == "spare_promoted" for e in events))
    summary = load_json(folder / "summary.json") or {}
    steps = option(command_of(out, name), "--steps")
    final = summary.get("final_step")
    c.put("final_step", final)
    if steps is None or final != int(steps):
        c.missing.append(f"final step {steps} (the job ended at {final})")
    stats = load_json(folder / "stats.json") or {}
    state = number(stats.get("state_bytes"))
    c.put("state_gb", state / 1e9 if state else None)
    profiles = [load_json(p) or {} for p in folder.glob("profile.*.json")]  # each worker's (the killed node's: none)
    sizes = [per(prof.get("bytes"), prof.get("captures")) for prof in profiles]
    snap = max([s for s in sizes if s], default=None)
    c.put("snapshot_gb", snap / 1e9 if snap else None)
    c.put("restore_GBps", gbps(snap, c.figures.get("restore_s")))
    log = tail(out / "logs" / f"{name}.log", 100000)
    on = re.search(r"\bon (cuda(?::\d+)?|cpu)\b", log)
    c.put("trained_on", on.group(1) if on else None)
    if gpu and not (on and on.group(1).startswith("cuda")):
        c.missing.append(f"training on the GPU (it said: on {on.group(1) if on else 'nothing'})")
    return c


def kind_of(name: str):
    if name.startswith("cuda_step"):
        return cuda_step_figures
    return {"preflight": preflight_figures, "tests": tests_figures, "pipeline": pipeline_figures,
            "hotswap": hotswap_figures}.get(name)


# ------------------------------------------------------------------------------------------------ targets


def target(text: str, stage: str, value: float | None, op: str, limit: float, dry: bool, **context) -> dict:
    met = None if value is None else (value <= limit if op == "<=" else value >= limit)
    entry = {"target": text, "stage": stage, "value": value, "limit": limit, "op": op, "met": met}
    entry.update({k: v for k, v in context.items() if v is not None})
    if value is None:
        entry["note"] = "not measured (see the stage)"
    elif dry:
        entry["note"] = "dry run: a CPU stand-in, not a GPU figure"
    return entry


def targets(stages: dict, dry: bool) -> list[dict]:
    def fig(stage: str, key: str) -> Any:
        return (stages.get(stage, {}).get("figures") or {}).get(key)

    out = [
        target("per-step snapshots of 4 GB at 2 s steps cost <= 5 %", "cuda_step_2s",
               fig("cuda_step_2s", "overhead_per_step"), "<=", 0.05, dry, state_gb=fig("cuda_step_2s", "state_gb"),
               step_s=fig("cuda_step_2s", "step_s_off")),
        target("auto (deferred acks) at 67 ms steps costs <= 1 %", "cuda_step_67ms",
               fig("cuda_step_67ms", "auto_overhead_measured"), "<=", 0.01, dry,
               interval=fig("cuda_step_67ms", "auto_interval"),
               max_lost_steps=fig("cuda_step_67ms", "auto_max_lost_steps"),
               lag_steps=fig("cuda_step_67ms", "auto_lag_steps"),
               overhead_estimate=fig("cuda_step_67ms", "auto_overhead_estimate"),
               state_gb=fig("cuda_step_67ms", "state_gb"), step_s=fig("cuda_step_67ms", "step_s_off")),
    ]
    rows = [r for r in fig("pipeline", "sizes") or [] if dry or (r.get("mb") or 0) >= MIN_TARGET_MB]

    def worst(key: str, pick) -> float | None:
        values = [r.get(key) for r in rows if r.get(key) is not None]
        return pick(values) if values else None

    sizes = [r.get("mb") for r in rows] or None
    out += [
        target(f"snapshot pipeline <= 1.2x its slowest stage (>= {MIN_TARGET_MB} MB)", "pipeline",
               worst("pipeline_ratio", max), "<=", 1.2, dry, sizes_mb=sizes),
        target("replication >= 0.8x loopback TCP", "pipeline", worst("replicate_ratio", min), ">=", 0.8, dry,
               sizes_mb=sizes),
        target("restore >= 0.8x loopback TCP", "pipeline", worst("restore_ratio", min), ">=", 0.8, dry,
               sizes_mb=sizes),
    ]
    return out


# ------------------------------------------------------------------------------------------------ summary


def summarize(out: Path, budget: float | None, elapsed: float | None) -> tuple[dict, bool]:
    run = read_kv(out / "stages" / "RUN")
    dry = run.get("dry_run", "0")
    gpu = dry in ("", "0")  # figures must come from the GPU
    stages: dict[str, dict] = {}
    files = sorted((out / "stages").glob("*.status"), key=lambda p: (int(read_kv(p).get("index", 99)), p.stem))
    for path in files:
        name, st = path.stem, read_kv(path)
        entry: dict[str, Any] = {"status": st.get("status", "unknown")}
        for key in ("rc", "seconds", "timeout_s"):
            try:
                entry[key] = (int if key == "rc" else float)(st[key])
            except (KeyError, ValueError):
                pass
        if st.get("reason"):
            entry["reason"] = st["reason"]
        if st.get("reaped"):
            entry["reaped_pids"] = st["reaped"].split()
        cmd = command_of(out, name)
        if cmd:
            entry["command"] = shlex.join(cmd)
        entry["log"] = f"logs/{name}.log"
        extract = kind_of(name)
        if extract is not None and entry["status"] in ("ok", "failed", "timeout"):
            check = extract(out, name, gpu)
            entry["figures"] = check.figures
            if check.missing:
                entry["missing"] = check.missing
                if entry["status"] == "ok":
                    entry["status"] = "incomplete"
                    entry["reason"] = "exit 0, but nothing measured for: " + "; ".join(check.missing)[:500]
        if entry["status"] not in FINE and entry["status"] not in ("pending", "skipped"):
            entry["log_tail"] = tail(out / "logs" / f"{name}.log")
        stages[name] = entry
    failed = [n for n, e in stages.items() if e["status"] not in FINE]
    result = {"benchmark": "gpu.sh", "dry_run": dry, "budget_s": budget, "elapsed_s": elapsed,
              "started": number(float(run["started"])) if run.get("started") else None, "host": run.get("host"),
              "only": run.get("only") or None, "ok": not failed, "failed": failed, "stages": stages,
              "targets": targets(stages, not gpu) if dry != "print" else []}
    return result, not failed


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f} %"


def num(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def note(name: str, entry: dict) -> str:
    f = entry.get("figures") or {}
    if entry["status"] not in ("ok",):
        return (entry.get("reason") or "")[:90]
    if name == "preflight":
        return f"{f.get('device_name') or 'no GPU'}, torch {f.get('torch')}"
    if name == "tests":
        return ", ".join(f"{f[k]} {k}" for k in ("passed", "failed", "error", "skipped") if f.get(k))
    if name.startswith("cuda_step"):
        text = (f"{num(f.get('state_gb'), '.3g')} GB, step {num(f.get('step_s_off'), '.3f')} s: per-step "
                f"{pct(f.get('overhead_per_step'))} (copy {num(f.get('copy_ms'), '.0f')} ms, crc "
                f"{num(f.get('crc_ms'), '.0f')} ms, send {num(f.get('send_ms'), '.0f')} ms)")
        if f.get("auto_interval") is not None:
            text += f"; auto every {f['auto_interval']}: {pct(f.get('auto_overhead_measured'))}"
        return text
    if name == "pipeline":
        last = (f.get("sizes") or [{}])[-1]
        return (f"{num(last.get('mb'), 'g')} MB: copy {num(last.get('copy_GBps'))} GB/s (d2h "
                f"{num(last.get('d2h_GBps'))}), crc {num(last.get('crc_GBps'))}, send {num(last.get('replicate_GBps'))}"
                f" (TCP {num(last.get('tcp_GBps'))}); {num(last.get('pipeline_ratio'))}x slowest")
    if name == "hotswap":
        return (f"on {f.get('trained_on')}, recovery {num(f.get('total_s'))} s (restore {num(f.get('restore_s'))} s"
                f", {num(f.get('restore_GBps'))} GB/s), {f.get('lost_steps')} steps lost")
    return ""


def report(result: dict) -> str:
    dry = result["dry_run"]
    head = "GPU checks (benchmarks/gpu.sh)" + ("" if dry in ("", "0") else f", dry run ({dry})")
    if result.get("elapsed_s") is not None:
        head += f": {result['elapsed_s']:.0f} s of a {num(result.get('budget_s'), '.0f')} s budget"
    lines = [head, ""]
    width = max([len(n) for n in result["stages"]] + [5])
    for name, entry in result["stages"].items():
        seconds = f"{entry['seconds']:.0f} s" if entry.get("seconds") is not None else "-"
        lines.append(f"  {name:<{width}}  {entry['status']:<12} {seconds:>6}  {note(name, entry)}")
    if result["targets"]:
        lines += ["", "targets (reported, not failed on):"]
        for t in result["targets"]:
            shown = pct(t["value"]) if t["limit"] < 0.5 else num(t["value"])
            verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            extra = ", ".join(f"{k} {num(t[k], '.3g') if isinstance(t[k], float) else t[k]}"
                              for k in ("interval", "max_lost_steps", "lag_steps") if k in t)
            lines.append(f"  {t['target']}: {shown} {verdict}" + (f" ({extra})" if extra else "")
                         + (f" [{t['note']}]" if t.get("note") and t["met"] is not None else ""))
    if result["failed"]:
        lines += ["", "NOT OK: " + ", ".join(f"{n} ({result['stages'][n]['status']})" for n in result["failed"])
                  + " (summary.json: reason, log_tail; logs/)"]
    else:
        lines += ["", "all stages ok"]
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ preflight


def preflight(path: Path, dry: bool) -> int:
    """What this machine has (python, torch, CUDA, the GPU, the project's modules), as JSON; exit 1 where a
    stage could not run: a module the project needs is missing, or (not a dry run) no CUDA device."""
    info: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                            "platform": platform.platform(), "cpus": os.cpu_count(), "dry_run": dry, "modules": {}}
    kb = read_kv_colon("/proc/meminfo").get("MemTotal", "0 kB").split()[0]
    info["host_memory_gb"] = round(int(kb) * 1024 / 1e9, 1) if kb.isdigit() else None
    problems = []
    for name in REQUIRED_MODULES + OPTIONAL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (any import error: said, and the module counted missing)
            info["modules"][name] = None
            if name in REQUIRED_MODULES:
                problems.append(f"{name} is not importable ({type(exc).__name__}: {exc})")
            continue
        info["modules"][name] = str(getattr(mod, "__version__", "ok"))
    if info["modules"].get("torch"):
        import torch

        info["torch"] = torch.__version__
        info["cuda_version"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            info.update(device_count=torch.cuda.device_count(), device_name=props.name,
                        device_memory_gb=round(props.total_memory / 1e9, 1))
            try:
                info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # noqa: BLE001 (a torch without NCCL: reported as None)
                info["nccl"] = None
        elif not dry:
            problems.append("torch sees no CUDA device")
    if info["modules"].get("dprun"):
        info["dprun_from"] = str(Path(sys.modules["dprun"].__file__).parent)
    info["problems"] = problems
    write_json(path, info)
    print(f"python {info['python']}, torch {info.get('torch')} (CUDA {info.get('cuda_version')}), "
          f"{info.get('device_name') or 'no GPU'}, {info['cpus']} CPUs, {info['host_memory_gb']} GB; dprun from "
          f"{info.get('dprun_from')}; missing: {[m for m, v in info['modules'].items() if v is None] or 'nothing'}")
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    return 1 if problems else 0


def read_kv_colon(path: str) -> dict[str, str]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary")
    s.add_argument("out")
    s.add_argument("--quiet", action="store_true")
    s.add_argument("--budget", type=float, default=None)
    s.add_argument("--elapsed", type=float, default=None)
    p = sub.add_parser("preflight")
    p.add_argument("--json", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "preflight":
        return preflight(Path(args.json), args.dry_run)
    out = Path(args.out)
    result, ok = summarize(out, args.budget, args.elapsed)
    write_json(out / "summary.json", result)
    if not args.quiet:
        print(report(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
