"""The live terminal dashboard (rich): header, nodes table, replica map, event log, recent output.

render(model) draws one frame of a dprun.monitor.jobview model for any terminal size; LiveDashboard keeps it redrawn.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .jobview import ROLE_ORDER, recovery_cost
from .width import width_field

ROLE_STYLE = {"active": "green", "spare": "cyan", "failed": "bold red", "fenced": "bold magenta",
              "joining": "dim", "promoted": "bold yellow"}
LEVEL_STYLE = {"error": "red", "warn": "yellow", "fault": "magenta", "promote": "bold yellow", "ok": "green",
               "info": "", "dim": "dim"}
LEVEL_MARK = {"error": "x", "warn": "!", "fault": "~", "promote": "^", "ok": "+", "info": "-", "dim": "-"}
STALE_HEARTBEAT_S = 2.0  # an active node this long silent is shown even among hundreds
STATE_STYLE = {"training": "green", "recovering": "bold yellow", "finished": "bold green", "failed": "bold red",
               "starting": "cyan", "forming": "cyan"}


# ----------------------------------------------------------------------------- formatting


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 10 else duration(seconds)


def per_step(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else duration(seconds)


def count(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# ----------------------------------------------------------------------------- choosing rows


def select_rows(rows: list[dict], limit: int) -> tuple[list[dict], list[str]]:
    """At most `limit` rows: the ones that need attention first; the rest summarised in a few lines."""
    if len(rows) <= limit:
        return rows, []
    limit = max(1, limit - 2)  # room for the summary lines
    steps = sorted(r["step"] for r in rows if r["role"] == "active" and r["step"] >= 0)
    top = steps[-1] if steps else -1
    times = sorted(r["step_s"] for r in rows if r["role"] == "active" and r["step_s"])
    median = times[len(times) // 2] if times else None

    def attention(r: dict) -> int:
        if r["role"] in ("failed", "fenced"):
            return 0
        if r.get("promoted") is not None:
            return 1
        if r["role"] == "active" and ((r.get("heartbeat_age") or 0) > STALE_HEARTBEAT_S
                                      or (top >= 0 and r["step"] < top - 1)
                                      or (median and (r.get("step_s") or 0) > 1.5 * median)):
            return 2
        return 9

    ranked = sorted(range(len(rows)), key=lambda i: (attention(rows[i]), i))
    urgent = [i for i in ranked if attention(rows[i]) < 9][:limit]
    rest = [i for i in ranked if attention(rows[i]) == 9]
    chosen = set(urgent + rest[: max(0, limit - len(urgent))])
    shown = [rows[i] for i in sorted(chosen)]
    hidden = [rows[i] for i in range(len(rows)) if i not in chosen]
    return shown, summarise(hidden)


def summarise(rows: list[dict]) -> list[str]:
    """'+ 498 active: step 1200-1201, heartbeat <= 0.6 s' lines, one per role."""
    lines = []
    for role in sorted({r["role"] for r in rows}, key=lambda x: ROLE_ORDER.get(x, 9)):
        group = [r for r in rows if r["role"] == role]
        text = f"+ {len(group)} more {role}"
        steps = [r["step"] for r in group if r["step"] >= 0]
        if role == "active" and steps:
            lo, hi = min(steps), max(steps)
            text += f": step {lo}" + (f"-{hi}" if hi != lo else "")
        ages = [r["heartbeat_age"] for r in group if r.get("heartbeat_age") is not None]
        if ages:
            text += f", heartbeat <= {max(ages):.1f}s"
        lines.append(text)
    return lines


# ----------------------------------------------------------------------------- parts


def header(m: dict, width: int) -> RenderableType:
    state = m.get("state", "?")
    if m.get("finished"):
        state = f"{state} (exit {m['finished']['exit_code']})"
    title = Text.assemble(("DeadPool ", "bold"), (m.get("job_id") or "", "bold cyan"),
                          f"  gen {max(m.get('generation', -1), 0)}  ",
                          (state, STATE_STYLE.get(m.get("state", ""), "")))
    if shown := width_field(m.get("width"), bool(m.get("width_changes"))):  # (a narrow job's state, as gen is)
        title.append(f"  {shown}", style="yellow" if "narrow" in shown else "")
    step, total = m.get("step", 0), m.get("total_steps")
    grid = Table.grid(expand=True, padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_column(no_wrap=True, justify="right")
    label = f"step {step}" + (f"/{total}" if total else "")
    if m.get("mode") == "restart" and not step:
        grid.add_row("steps: not reported by the script (restart mode)", Text(""), "")
    elif total:
        pct = f"{100 * min(step, total) / total:3.0f}%"
        grid.add_row(label, ProgressBar(total=total, completed=min(step, total)), pct)
    else:
        grid.add_row(label, Text(""), "")
    rate, tokens, goodput = m.get("steps_per_s"), m.get("tokens_per_s"), m.get("goodput")
    parts = [f"{rate:.2f} steps/s" if rate is not None else "- steps/s"]
    if tokens is not None:
        parts.append(f"{count(tokens)} tok/s")
    if isinstance(m.get("loss"), (int, float)):
        parts.append(f"loss {m['loss']:.4f}")
    parts.append(f"up {duration(m.get('uptime_s'))}")
    parts.append(f"goodput {goodput * 100:.0f}%" if goodput is not None else "goodput -")
    counts = m.get("counts", {})
    nodes = [f"{counts.get(r, 0)} {r}" for r in ("active", "spare", "failed", "fenced") if counts.get(r)]
    recs = m.get("recoveries", [])
    line3 = ", ".join(nodes) or "no nodes yet"
    if recs:
        last = recs[-1]
        line3 += f" | {len(recs)} recover{'y' if len(recs) == 1 else 'ies'} ({last.get('mode', '?')}, last " \
                 f"{recovery_cost(last):.2f}s)"
    if m.get("status_endpoint"):
        line3 += f" | status {m['status_endpoint']}"
    body = Group(grid, Text("  ".join(parts), overflow="ellipsis", no_wrap=True),
                 Text(line3, overflow="ellipsis", no_wrap=True, style="dim"))
    return Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


COLUMNS = ("node", "host", "role", "nr", "ranks", "pid", "hb", "step", "t/step", "note")
DROP_ORDER = ("host", "ranks", "pid", "t/step")  # dropped in this order when the terminal is narrow
RIGHT = {"nr", "ranks", "pid", "hb", "step", "t/step"}


def node_cells(r: dict) -> tuple[dict, str]:
    """The cells of one node row (strings) and its style."""
    role = "promoted" if r["role"] == "active" and r.get("promoted") is not None else r["role"]
    note = r.get("cause", "") if r["role"] in ("failed", "fenced") else ""
    if role == "promoted":
        note = f"was spare; node rank {r['node_rank']} since gen {r['promoted']}"
    elif role == "spare" and r.get("room"):
        note = f"{r['room'] / 1e6:,.0f} MB reserved for a restore"
    idle = r["role"] in ("failed", "fenced", "spare", "joining")
    cells = {
        "node": r["node_id"][:16], "host": (r.get("host") or "")[:12], "role": role,
        "nr": str(r["node_rank"]) if r["node_rank"] >= 0 else "-", "ranks": r.get("ranks", "-"),
        "pid": str(r.get("pid") or "-"), "hb": age(r.get("heartbeat_age")),
        "step": str(r["step"]) if r["step"] >= 0 and r["role"] != "spare" else "-",
        "t/step": "-" if idle else per_step(r.get("step_s")), "note": note,
    }
    return cells, ROLE_STYLE.get(role, "")


def nodes_table(m: dict, limit: int, width: int = 80) -> RenderableType:
    rows, summary = select_rows(m.get("nodes", []), limit)
    cells = [node_cells(r) for r in rows]
    widths = {c: max([len(c)] + [len(row[c]) for row, _ in cells]) for c in COLUMNS}
    columns = list(COLUMNS)
    for drop in DROP_ORDER:  # each column costs its width + 1 space; keep at least 12 for the note
        if sum(widths[c] + 1 for c in columns if c != "note") + 12 <= width:
            break
        columns.remove(drop)
    note_width = max(4, width - sum(widths[c] + 1 for c in columns if c != "note"))
    table = Table(box=box.SIMPLE_HEAD, expand=False, padding=0, pad_edge=False, show_edge=False, collapse_padding=True)
    for c in columns:
        table.add_column(c, no_wrap=True, overflow="ellipsis", justify="right" if c in RIGHT else "left",
                         max_width=note_width if c == "note" else None)
    for row, style in cells:
        marked = row["role"] in ("failed", "fenced", "promoted")
        values = [Text(row[c], style=style if c in ("role", "note") or (c == "node" and marked) else "")
                  for c in columns]
        table.add_row(*values)
    parts: list[RenderableType] = [table]
    parts += [Text(line, style="dim", overflow="ellipsis", no_wrap=True) for line in summary]
    return Group(*parts)


def replica_lines(m: dict, width: int) -> list[Text]:
    """Who holds whose snapshot, and the newest step complete on every rank."""
    if m.get("mode") == "restart":
        return [Text("replicas: none (restart mode: the script keeps its own checkpoints)", style="dim")]
    actives = sorted((r for r in m.get("nodes", []) if r["role"] == "active" and r.get("holder")),
                     key=lambda r: r["node_rank"])
    point = m.get("restore_point")
    head = Text("replicas ", style="bold")
    head.append(f"restore point: step {point} on all {m.get('world_size', '?')} ranks" if point is not None
                else "restore point: - (no complete snapshot yet)")
    if m.get("mesh"):
        head.append(f"; mesh {m['mesh']}: shards held whole", style="dim")
    if m.get("on_disk"):
        disk = m["on_disk"]
        head.append(f"; on disk: step {disk['step']} ({duration(m.get('time', disk['time']) - disk['time'])} ago)",
                    style="dim")
    lines = [head]
    if not actives:
        return lines
    newest = max((r["replicated"] for r in actives if r.get("replicated") is not None), default=None)
    pairs = [f"{r['node_id']}->{r['holder']} @{r['replicated'] if r.get('replicated') is not None else '-'}"
             for r in actives]
    if len(actives) <= 8 and sum(len(p) + 3 for p in pairs) <= 3 * width:
        text = Text("  " + " | ".join(pairs), style="dim", overflow="fold")
        lines.append(text)
    else:
        lagging = [r for r in actives if newest is not None and (r.get("replicated") or -1) < newest - 1]
        ring = f"  ring: each node's snapshots on the next node rank, newest @{newest}"
        if lagging:
            ring += "; lagging: " + ", ".join(f"{r['node_id']}@{r.get('replicated')}" for r in lagging[:3])
            if len(lagging) > 3:
                ring += f" +{len(lagging) - 3}"
        lines.append(Text(ring, style="dim", overflow="ellipsis", no_wrap=True))
    return lines


def event_lines(m: dict, width: int, max_lines: int) -> list[Text]:
    out: list[Text] = []
    used = 0
    for t, level, text in reversed(m.get("log", [])):
        line = Text(f"{clock(t)} {LEVEL_MARK.get(level, '-')} ", style="dim")
        line.append(text, style=LEVEL_STYLE.get(level, ""))
        need = max(1, math.ceil(len(line.plain) / max(20, width)))
        if used + need > max_lines:
            if not out and max_lines > 0:
                line.truncate(max_lines * width - 1, overflow="ellipsis")
                out.append(line)
            break
        out.append(line)
        used += need
    return list(reversed(out))


# ----------------------------------------------------------------------------- a frame


def render(m: dict | None, width: int = 80, height: int = 40, output: Sequence[str] = ()) -> RenderableType:
    """One frame for a width x height terminal; the nodes table gives way to the event log on small screens."""
    if m is None:
        return Text("waiting for the job's first update ...", style="dim")
    head = header(m, width)
    replicas = replica_lines(m, width)
    out_lines = list(output)[-4:] if height >= 30 else list(output)[-2:] if height >= 20 else []
    fixed = 5 + len(replicas) + 1 + (len(out_lines) + 1 if out_lines else 0)
    room = max(6, height - fixed - 1)
    n_nodes = len(m.get("nodes", []))
    node_rows = min(n_nodes, max(3, room - 6))
    log_room = max(3, room - node_rows - 3)
    parts: list[RenderableType] = [head, nodes_table(m, node_rows, width), *replicas,
                                   Text("events", style="bold"), *event_lines(m, width, log_room)]
    if out_lines:
        parts.append(Text("output (latest)", style="bold"))
        # (as a terminal shows it: a progress bar's \r and cursor moves would otherwise move the dashboard's own)
        parts += [Text.from_ansi(line, style="dim", overflow="ellipsis", no_wrap=True) for line in out_lines]
    return Group(*parts)


class LiveDashboard:
    """Redraws render(source()) a few times a second on the terminal until closed."""

    def __init__(self, source: Callable[[], dict | None], output: Callable[[], Sequence[str]] | None = None,
                 console: Console | None = None, refresh_per_second: float = 4.0):
        self.source, self.output = source, output or (lambda: ())
        self.console = console or Console()
        self.live = Live(get_renderable=self._frame, console=self.console, refresh_per_second=refresh_per_second,
                         transient=False, redirect_stdout=False, redirect_stderr=False, vertical_overflow="crop")

    def _frame(self) -> RenderableType:
        width, height = self.console.size
        try:
            return render(self.source(), width, height - 1, self.output())
        except Exception as exc:  # a bad frame must never take the job down
            return Text(f"dashboard error: {exc!r}", style="red")

    def __enter__(self) -> "LiveDashboard":
        self.live.start(refresh=True)
        return self

    def __exit__(self, *exc) -> None:
        self.live.refresh()
        self.live.stop()
