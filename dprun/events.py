"""Where the controller's events go: a JSON-lines file (`--events-file`) and one readable console line each.

Each event is a dict with "event" and "time" (Unix seconds); the console line says what happened in words.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO


def describe(event: dict) -> str:
    """One readable line for an event."""
    kind = event["event"]
    e = event
    if kind == "node_joined":
        return f"node {e['node']} joined as {e['role']} (host {e['host']}, pid {e['pid']})"
    if kind == "job_started":
        return (f"training started: {e['nnodes']} nodes, world size {e['world_size']}, "
                f"{e['spares']} spare(s) standing by")
    if kind == "fault_injected":
        return f"injected {e['spec']} on {e['node']}"
    if kind == "node_failed":
        where = f" (node rank {e['node_rank']})" if e.get("node_rank") is not None else f" ({e['role']})"
        return f"node {e['node']}{where} failed: {e['cause']}"
    if kind == "spare_lost":
        return f"spare {e['node']} lost; {e['spares_left']} spare(s) left"
    if kind == "peer_error":
        return f"rank {e['rank']} on {e['node']} reports a peer error; probing every node"
    if kind == "spare_promoted":
        return f"spare {e['spare']} promoted to node rank {e['node_rank']} (generation {e['generation']})"
    if kind == "reconfigure":
        return (f"generation {e['generation']}: every rank restores step {e['restore_step']} "
                f"(decided in {e['decide_s'] * 1000:.0f} ms)")
    if kind == "recovery_complete":
        ph = e["phases"]
        return (f"recovered into generation {e['generation']} from step {e['restore_step']}, "
                f"{e['lost_steps']} step(s) recomputed: detect {ph['detect_s']:.2f}s, decide {ph['decide_s']:.2f}s, "
                f"rebuild {ph['rebuild_s']:.2f}s, restore {ph['restore_s']:.2f}s, total {ph['total_s']:.2f}s")
    if kind == "progress":
        loss = f", loss {e['loss']:.4f}" if isinstance(e.get("loss"), (int, float)) else ""
        return f"step {e['step']} (generation {e['generation']}){loss}"
    if kind == "job_finished":
        return f"job finished with exit code {e['exit_code']}: {e['message']}"
    rest = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time"))
    return f"{kind}: {rest}"


class EventSink:
    def __init__(self, path: str | Path | None = None, console: TextIO | None = sys.stdout):
        self._file = open(path, "a", encoding="utf-8") if path else None
        self._console = console
        self._t0 = time.time()
        self.history: list[dict] = []

    def emit(self, event: dict) -> dict:
        event = {"event": event["event"], "time": round(time.time(), 6),
                 **{k: v for k, v in event.items() if k != "event"}}
        self.history.append(event)
        if self._file:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()
        if self._console:
            print(f"[dprun +{event['time'] - self._t0:7.2f}s] {describe(event)}", file=self._console, flush=True)
        return event

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
