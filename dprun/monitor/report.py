"""`dprun report EVENTS.jsonl`: every failure and recovery of a job (phases, lost steps), its goodput, its shrinks
and grows, and with --plot a throughput timeline; also the summary that dprun prints when a job ends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.errors import ConsoleError
from rich.table import Table

from .dashboard import duration
from .events import user_json, worker_label
from .jobview import JobView, recovery_cost
from .width import report_lines

TAIL_SHOWN = 12


def read_events(path: Path) -> tuple[list[dict], int]:
    """The events of a JSON-lines file, and how many lines were not events (a torn last line, ...)."""
    events, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(event, dict) and "event" in event and isinstance(event.get("time"), (int, float)):
                events.append(event)
            else:
                bad += 1
    return events, bad


def split_runs(events: list[dict]) -> list[list[dict]]:
    """The runs of dprun in one events file, oldest first (an --events-file is appended to): a run begins
    where "seq" starts over or "job" changes, or (files from before events carried them) after a job_finished."""
    runs: list[list[dict]] = []
    prev: dict | None = None
    for event in events:
        seqs = (prev or {}).get("seq"), event.get("seq")
        if (prev is None or prev.get("job", "") != event.get("job", "")
                or (isinstance(seqs[0], int) and isinstance(seqs[1], int) and seqs[1] <= seqs[0])
                or (seqs == (None, None) and prev["event"] == "job_finished")):
            runs.append([])
        runs[-1].append(event)
        prev = event
    return runs


def fold(events: list[dict]) -> tuple[JobView, int]:
    """The job as its events tell it, and how many events made no sense to it (hand-edited values)."""
    view, odd = JobView(timeline=True), 0
    for event in events:
        try:
            view.on_event(event)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            odd += 1
    return view, odd


def incidents(model: dict) -> list[dict]:
    """One entry per recovery (with the failures it covered), then failures no recovery followed."""
    failures = [f for f in model.get("failures", []) if "exitcode" not in f]  # node failures
    used: set[int] = set()
    out = []
    for rec in model.get("recoveries", []):
        mine = [i for i, f in enumerate(failures) if f["node"] in rec.get("failed", []) and i not in used
                and f["time"] <= rec["time"]]
        used.update(mine)
        out.append({"recovery": rec, "failures": [failures[i] for i in mine],
                    "time": min([failures[i]["time"] for i in mine] or [rec["time"]])})
    for i, f in enumerate(failures):
        if i not in used:
            out.append({"recovery": None, "failures": [f], "time": f["time"]})
    return sorted(out, key=lambda x: x["time"])


def incident_table(model: dict, t0: float) -> Table:
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, title_justify="left")
    for name in ("#", "at", "failed", "mode", "detect", "rebuild", "restore", "total", "lost"):
        table.add_column(name, no_wrap=True, justify="left" if name in ("failed", "mode") else "right")
    for i, inc in enumerate(incidents(model), 1):
        rec, names = inc["recovery"], ", ".join(f["node"] for f in inc["failures"]) or "-"
        at = f"+{inc['time'] - t0:.1f}s"
        if rec is None:
            table.add_row(str(i), at, names, "[red]not recovered[/]", "-", "-", "-", "-", "-")
            continue
        ph = rec.get("phases", {})
        restart = rec.get("mode") == "restart"
        mode = "from disk" if rec.get("from_disk") else str(rec.get("mode", "?"))
        table.add_row(str(i), at, names, mode, *(f"{ph.get(k, 0):.2f}s" for k in
                      ("detect_s", "rebuild_s")), "-" if restart else f"{ph.get('restore_s', 0):.2f}s",
                      f"{recovery_cost(rec):.2f}s", "n/a" if restart else str(rec.get("lost_steps", "-")))
    return table


def print_report(model: dict, console: Console, bad_lines: int = 0) -> None:
    t0 = model["time"] - model.get("uptime_s", 0)
    fin = model.get("finished")
    state = f"finished (exit {fin['exit_code']})" if fin else f"{model.get('state')} (no job_finished event yet)"
    counts = model.get("counts", {})
    name = f"job {model['job_id']}" if model.get("job_id") else "job"
    steps = f"step {model.get('step')}; " if model.get("step") else ""
    console.print(f"[bold]{name}[/]: {state} after {duration(model.get('uptime_s'))}; {steps}"
                  f"generation {max(0, model.get('generation', 0))}; "
                  + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if fin and fin["exit_code"] != 0 and fin.get("message"):
        console.print(f"why: {fin['message']}", markup=False, highlight=False)
    recs = model.get("recoveries", [])
    goodput = model.get("goodput")
    lost = sum(int(r.get("lost_steps") or 0) for r in recs if r.get("mode") != "restart")
    console.print(f"goodput {goodput * 100:.1f}%" if goodput is not None else "goodput n/a (no steps reported)",
                  f"({len(recs)} recover{'y' if len(recs) == 1 else 'ies'}, "
                  f"{sum(recovery_cost(r) for r in recs):.2f}s recovering, "
                  f"{lost} step(s) recomputed)")
    if not incidents(model):
        console.print("no failures")
    else:
        console.print(incident_table(model, t0))
        if any(r.get("mode") == "restart" for r in recs):
            console.print("restart: rebuild = respawning the workers; total = until they were back in torch's "
                          "rendezvous; lost steps are the script's own (since its last checkpoint)", style="dim")
        for line in failure_lines(model, t0):
            console.print(line, markup=False, highlight=False)
    for line in report_lines(model, t0):
        console.print(line, markup=False, highlight=False)
    if model.get("mesh"):
        console.print(f"mesh {model['mesh']}: sharded state; each node's replicas hold its ranks' shards whole",
                      markup=False, highlight=False)
    if model.get("warnings"):
        console.print("warnings:")
        for warning in model["warnings"]:
            console.print(f"  +{warning['time'] - t0:.1f}s {warning['text']}", markup=False, highlight=False)
    if bad_lines:
        console.print(f"[yellow]{bad_lines} line(s) of the events file were not events and were skipped[/]")


def failure_lines(model: dict, t0: float | None = None) -> list[str]:
    """Each failure in words; a failed worker with its last lines of stderr (torchrun's error summary)."""
    lines = []
    failures = model.get("failures", [])
    worker_nodes = {f["node"] for f in failures if "exitcode" in f}
    for f in failures:
        at = f"+{f['time'] - t0:.1f}s" if t0 is not None else time.strftime("%H:%M:%S", time.localtime(f["time"]))
        if "exitcode" in f:
            lines.append(f"  {at} {worker_label(f)} on {f['node']} (local rank {f.get('local_rank')}, "
                         f"pid {f.get('pid')}): {f.get('cause')}")
            if f.get("log"):
                lines.append(f"      log: {f['log']}")
            tail = (f.get("tail") or "").splitlines()[-TAIL_SHOWN:]
            if tail:
                lines.append("      last lines of stderr:")
                lines += [f"      | {t}" for t in tail]
        elif f["node"] not in worker_nodes or "worker" not in f.get("cause", ""):
            where = f"node rank {f['node_rank']}" if f.get("node_rank") is not None else f.get("role", "")
            lines.append(f"  {at} node {f['node']} ({where}): {f.get('cause')}")
    return lines


def final_summary(model: dict, exit_code: int, message: str) -> list[str]:
    """What dprun prints as a job ends: the outcome in a line, then each failure (with stderr tails)."""
    recs = model.get("recoveries", [])
    if exit_code == 0:
        total = f"/{model['total_steps']}" if model.get("total_steps") else ""
        line = f"dprun: done in {duration(model.get('uptime_s'))}, step {model.get('step')}{total}"
        if model.get("mode") == "restart" and not model.get("step"):
            line = f"dprun: done in {duration(model.get('uptime_s'))}"
        if recs:
            costs = ", ".join(f"{r.get('mode')} {recovery_cost(r):.2f}s" for r in recs[-5:])
            line += f"; {len(recs)} recover{'y' if len(recs) == 1 else 'ies'} ({costs})"
        if model.get("goodput") is not None:
            line += f"; goodput {model['goodput'] * 100:.0f}%"
        out = [line]
    elif exit_code > 128:  # a signal's (Slurm's time limit, scancel, Ctrl-C): stopped as asked, not failed
        out = [f"dprun: job stopped: {message}"]
    else:
        out = [f"dprun: job failed: {message}"]
    details = failure_lines(model)
    if details and (exit_code != 0 or any("exitcode" in f for f in model.get("failures", []))):
        out += ["dprun: failures, first one first:", *details]
    return out


def plot(view: JobView, events: list[dict], path: Path) -> None:
    """Throughput over time, failures (red) and recoveries (green spans). Needs matplotlib (the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = view.started_at or (events[0]["time"] if events else 0.0)
    xs, ys = [], []
    prev = None
    for t, step, gen in view.progress_points:
        if prev is not None and prev[2] != gen:  # a recovery: nothing kept between the two generations
            xs.append(t - t0)
            ys.append(0.0)
        elif prev is not None and step > prev[1] and t > prev[0]:
            xs.append(t - t0)
            ys.append((step - prev[1]) / (t - prev[0]))
        prev = (t, step, gen)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ys, drawstyle="steps-pre", color="tab:blue", label="steps/s")
    first = True
    for e in events:
        if e["event"] == "node_failed" and e.get("role") == "active":
            ax.axvline(e["time"] - t0, color="tab:red", linestyle="--", label="node failed" if first else None)
            ax.annotate(e["node"], (e["time"] - t0, 0), rotation=90, fontsize=8, color="tab:red",
                        xytext=(3, 3), textcoords="offset points")
            first = False
    first = True
    for rec in view.recoveries:
        end = rec["time"] - t0
        start = end - float(rec.get("phases", {}).get("total_s", 0))
        ax.axvspan(start, end, color="tab:green", alpha=0.25,
                   label=f"recovery ({rec.get('mode')})" if first else None)
        first = False
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("steps / s")
    goodput = view.goodput(view.finished["time"] if view.finished else time.time())
    ax.set_title(f"{view.job_id or 'job'}: throughput" + (f", goodput {goodput * 100:.0f}%" if goodput else ""))
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_report(path: Path, plot_file: Path | None, as_json: bool, run: int = -1) -> int:
    """The `dprun report` command for one run of dprun in the file (1 = the first, -1 = the last); 0 on
    success, 2 for a missing or unreadable file, a run it does not hold, or events it cannot make sense of."""
    import sys

    try:
        events, bad = read_events(path)
    except OSError as exc:
        print(f"dprun report: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 2
    if not events:
        print(f"dprun report: {path} holds no events (is it a dprun --events-file?)", file=sys.stderr)
        return 2
    runs = split_runs(events)
    if not (1 <= run <= len(runs) or -len(runs) <= run <= -1):
        print(f"dprun report: {path} holds {len(runs)} run(s) of dprun: give --run 1 to {len(runs)} (or -1, the "
              "last)", file=sys.stderr)
        return 2
    number = run if run > 0 else len(runs) + 1 + run
    events = runs[number - 1]
    view, odd = fold(events)
    bad += odd
    try:
        end = view.finished["time"] if view.finished else events[-1]["time"]
        model = view.model(end, full=True)
        if plot_file is not None:
            plot(view, events, plot_file)
        if as_json:
            print(user_json({**model, "incidents": incidents(model), "bad_lines": bad, "run": number,
                             "runs": len(runs)}))
        else:
            if len(runs) > 1:
                begun = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(events[0]["time"]))
                print(f"{path} holds {len(runs)} runs of dprun; this is run {number} (job "
                      f"{events[0].get('job') or '?'}, begun {begun}): --run N reports another")
            print_report(model, Console(), bad)
            if plot_file is not None:
                print(f"timeline written to {plot_file}")
    except ImportError:
        print("dprun report: --plot needs matplotlib: pip install 'deadpool[plot]'", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ConsoleError) as exc:
        print(f"dprun report: cannot make sense of the events in {path} ({type(exc).__name__}: {exc}): was it "
              "edited by hand?", file=sys.stderr)
        return 2
    return 0
