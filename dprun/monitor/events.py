"""Where the controller's events go: a JSON-lines file (`--events-file`) and one readable console line each.

Each event is a dict with "event", "time" (Unix seconds), "job" (its id) and "seq" (0, 1, ... in each run of
dprun); the console line says what happened in words.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, TextIO

from .width import WidthChanges, cost_words

HISTORY_KEEP = 10_000


def worker_label(e: dict) -> str:
    """Who a worker_exited event is about: "rank 3", or "a spare's worker" (a spare has no rank yet)."""
    return "a spare's worker" if e.get("rank", "?") is None else f"rank {e.get('rank', '?')}"


def describe(event: dict) -> str:
    """One readable line for an event."""
    kind = event["event"]
    e = event
    if kind == "node_joined":
        return f"node {e['node']} joined as {e['role']} (host {e['host']}, pid {e['pid']})"
    if kind == "node_refused":
        return f"refused {e['node']}: {e['reason']}"
    if kind == "node_warning":
        return f"warning: {e['warning']}"
    if kind == "divergence":
        return (f"rank {e['rank']} on {e['node']}: its parameters or optimizer state at step {e['step']} differ from "
                "a data parallel peer's (a replica holder compared them): a faulty GPU or memory, or code that "
                "changes one rank's copy only")
    if kind == "mesh":
        return (f"mesh {e['layout']}: sharded state, each node's replicas hold its ranks' shards whole (nothing "
                "kept by reference to a peer's copy)")
    if kind == "launched":
        return f"dprun launched job {e['job']} on {e['host']} (pid {e['pid']}): {' '.join(e['argv'])}"
    if kind == "job_started":
        resumed = f", going on from step {e['step']} of {e['resumed_from']}" if e.get("resumed_from") else ""
        return (f"training started: {e['nnodes']} nodes, world size {e['world_size']}, "
                f"{e['spares']} spare(s) standing by{resumed}")
    if kind == "saving_state":
        return f"the job stops: saving the state of step {e['step']} ({e['ranks']} ranks) in {e['folder']}"
    if kind == "state_saved":
        return (f"saved step {e['step']} in {e['folder']} in the background ({e['bytes'] / 1e6:.1f} MB in "
                f"{e['seconds']:.2f} s, {e['mb_per_s']:.0f} MB/s)")
    if kind == "save_failed":
        return f"the background save of step {e['step']} in {e['folder']} failed (training goes on): {e['why']}"
    if kind == "save_skipped":
        return e["message"]
    if kind == "resume_fallback":
        return (f"cannot go on from step {e['step']} ({e['folder']}): {e['why']}; going on from step "
                f"{e['next_step']} ({e['next']}) instead")
    if kind == "save_retried":
        where = f"its worker on {e['node']}" if e.get("local") else f"the store on {e['node']}"
        return f"rank {e['rank']}'s file could not be written ({e['why']}); writing it from {where} instead"
    if kind == "fault_injected":
        return f"injected {e['spec']} on {e['node']}"
    if kind == "node_failed":
        where = f" (node rank {e['node_rank']})" if e.get("node_rank") is not None else f" ({e['role']})"
        return f"node {e['node']}{where} failed: {e['cause']}"
    if kind == "spare_lost":
        return f"spare {e['node']} lost; {e['spares_left']} spare(s) left"
    if kind == "waiting_for_nodes":
        then = ("the job fails" if e["active"] < e["nnodes"] else "it starts without the missing spares")
        return (f"waiting for nodes to register: {e['active']} of {e['nnodes']} active, {e['spares']} of "
                f"{e['spares_wanted']} spare(s); in {e['timeout_s']:g}s {then} (--rdzv-timeout)")
    if kind == "waiting_for_spare":
        return (f"no spare left for {e['failed']}: waiting up to {e['timeout_s']:g}s for {e['needed']} node(s) to "
                "join as a spare (dprun with this job's --rdzv-endpoint and token, without --node-rank)")
    if kind == "restore_failed":
        return (f"rank {e['rank']} on {e['node']} could not restore step {e['step']} from "
                f"{e['source'] or 'its own copy'} ({e['reason']}); planning without that copy")
    if kind == "controller_paused":
        left = ("; its nodes may have taken it for lost (silent past --heartbeat-timeout)" if e.get("nodes_left")
                else "; no node is blamed for that silence")
        return f"dprun itself did not run for {e['seconds']:g}s (stopped, or starved of CPU){left}"
    if kind == "fault_skipped":
        return f"injected fault {e['spec']} skipped: {e['reason']}"
    if kind == "message_refused":
        return (f"ignored a {e['kind']} from {e['node']}: {e['reason']} (a bug in that node's DeadPool: please "
                "report it with the events file)")
    if kind == "message_dropped":
        return (f"dropped a message from {e['sender']!r} ({e['reason']}); {e['dropped_total']} dropped so far: "
                "is something else talking to this port, or a node with another job's token?")
    if kind == "peer_error":
        if e.get("held"):  # restart mode: a plain script's crash, held back by its agent (dpagent.restart)
            return (f"rank {e['rank']} on {e['node']}: {e['detail']}; probing every node (a dead peer would explain "
                    "it)")
        return f"rank {e['rank']} on {e['node']} reports a peer error; probing every node"
    if kind == "job_shrunk":
        carried = "; ".join(f"rank {own}'s process also trains {', '.join(map(str, more))}"
                            for own, more in e["carried"].items())
        demoted = e.get("demoted") or []
        left = (f" ({', '.join(demoted)} of the lost data-parallel replica too, waiting as spares)"
                if demoted else "")
        return (f"no spare left: the job goes on without {', '.join(e['nodes'])}{left}, {e['processes']} processes "
                f"training its {e['ranks']} data-parallel ranks ({carried}); same samples and result, each step "
                f"about {e['slowdown']}x as long (generation {e['generation']})")
    if kind == "job_grew":
        pace = "full width" if e["processes"] == e["ranks"] else f"steps still about {e['slowdown']}x as long"
        return (f"{', '.join(e['nodes'])} joined: the job grows to {e['processes']} processes for its {e['ranks']} "
                f"data-parallel ranks ({pace}, generation {e['generation']})")
    if kind == "grow_undone":
        return (f"the grow onto {', '.join(e['nodes'])} is undone before it trained (its new processes could not reach "
                f"the snapshots holding their ranks): {e['processes']} processes train the job's {e['ranks']} "
                f"data-parallel ranks again (generation {e['generation']})")
    if kind == "shrink_refused":
        then = {"wait": "; it waits for a node to join instead (--shrink-fallback wait)",
                "fail": "; it stops instead (--shrink-fallback fail)"}.get(str(e.get("fallback")), "")
        return f"the job cannot shrink: {e['reason']}{then}"
    if kind == "spare_promoted":
        return f"spare {e['spare']} promoted to node rank {e['node_rank']} (generation {e['generation']})"
    if kind == "waiting_for_exit":
        then = (f"the job ends in {max(e['timeout_s'] - e['waited_s'], 0):g}s (--hang-timeout)" if e["timeout_s"]
                else "dprun waits for it, as torchrun does")
        return (f"{e['since']} {e['waited_s']:g}s ago; still running: {e['workers']} (work after the training "
                f"loop, or stuck: py-spy dump --pid PID on its node shows where); {then}")
    if kind == "waiting_for_restore":
        return (f"ranks {e['ranks']} have no copy left on a replica; waiting up to {e['timeout_s']:g}s for "
                f"{', '.join(e['nodes'])} to say whether they restored them before the failure")
    if kind == "reconfigure":
        return (f"generation {e['generation']}: every rank restores step {e['restore_step']} "
                f"(decided in {e['decide_s'] * 1000:.0f} ms)")
    if kind == "recovery_complete" and e.get("mode") == "restart":
        ph = e["phases"]
        return (f"recovered by restarting every worker (generation {e['generation']}): detect {ph['detect_s']:.2f}s, "
                f"decide {ph['decide_s']:.2f}s, respawn {ph['rebuild_s']:.2f}s, total {ph['total_s']:.2f}s until "
                "the new workers started (the script then starts over or loads its own checkpoint)")
    if kind == "restoring_from_disk":
        return (f"ranks {e['ranks']} have no copy left in memory ({', '.join(e['failed'])} failed together): every "
                f"rank goes back to step {e['step']}, saved in {e['folder']} ({e['lost_steps']} step(s) to recompute)")
    if kind == "recovery_complete":
        ph = e["phases"]
        disk = f" (restored from disk: {e['from_disk']})" if e.get("from_disk") else ""
        return (f"recovered into generation {e['generation']} from step {e['restore_step']}{disk}, "
                f"{e['lost_steps']} step(s) recomputed: detect {ph['detect_s']:.2f}s, decide {ph['decide_s']:.2f}s, "
                f"rebuild {ph['rebuild_s']:.2f}s, restore {ph['restore_s']:.2f}s, total {ph['total_s']:.2f}s")
    if kind == "progress":
        loss = f", loss {e['loss']:.4f}" if isinstance(e.get("loss"), (int, float)) else ""
        return f"step {e['step']} (generation {e['generation']}){loss}"
    if kind == "restart_rendezvous":
        return (f"generation {e['generation']}: the restarted workers reached torch's rendezvous "
                f"{e['seconds']:.2f}s after the failure (process start, imports, the script's own setup)")
    if kind == "worker_exited":
        return f"{worker_label(e)} (node {e['node']}, local rank {e['local_rank']}) {e['cause']}"
    if kind == "job_finished":
        return f"job finished with exit code {e['exit_code']}: {e['message']}"
    rest = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time"))
    return f"{kind}: {rest}"


def brief(e: dict) -> str:
    """A short line for the dashboard's event log (events.describe() is the long form)."""
    kind = e.get("event")
    try:
        if kind == "node_failed":
            where = f" (node rank {e['node_rank']})" if e.get("node_rank") is not None else f" ({e.get('role')})"
            return f"{e['node']}{where} failed: {e['cause']}"
        if kind == "spare_promoted":
            return f"spare {e['spare']} promoted to node rank {e['node_rank']} (generation {e['generation']})"
        if kind == "reconfigure":
            what = "every worker restarts" if e["restore_step"] < 0 else f"resume from step {e['restore_step']}"
            return f"generation {e['generation']}: {what} (decided in {e['decide_s'] * 1000:.0f} ms)"
        if kind == "recovery_complete":
            ph = e["phases"]
            if e.get("mode") == "restart":
                return (f"recovered by restart (generation {e['generation']}): detect {ph['detect_s']:.2f}s, "
                        f"respawn {ph['rebuild_s']:.2f}s, total {ph['total_s']:.2f}s to workers started")
            how = "from disk" if e.get("from_disk") else "hot-swap"
            return (f"recovered ({how}, generation {e['generation']}) from step {e['restore_step']}, "
                    f"{e['lost_steps']} step(s) lost: detect {ph['detect_s']:.2f}s, rebuild {ph['rebuild_s']:.2f}s, "
                    f"restore {ph['restore_s']:.2f}s, total {ph['total_s']:.2f}s")
        if kind == "restart_rendezvous":
            return (f"generation {e['generation']}: restarted workers back in torch's rendezvous "
                    f"{e['seconds']:.2f}s after the failure")
        if kind == "worker_exited":
            return f"{worker_label(e)} on {e['node']} (pid {e.get('pid')}): {e['cause']}"
        if kind == "job_finished":
            return f"job finished, exit code {e['exit_code']}: {e['message']}"
        return describe(e)
    except (KeyError, TypeError, ValueError):
        rest = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "time"))
        return f"{kind}: {rest}"


class EventSink:
    """Every event to the events file (a JSON line), the listeners and the console. A file or console that can
    no longer be written (a full disk, a closed pipe) is said once on stderr and dropped: never the job's end."""

    def __init__(self, path: str | Path | None = None, console: TextIO | None = sys.stdout, job_id: str = ""):
        self._path = path
        # with seq, what tells runs apart in a file that several appended to (dprun.monitor.report)
        self._job_id = job_id
        self._seq = 0
        self._file = open(path, "a", encoding="utf-8") if path else None
        self._console = console
        self._t0 = time.time()
        self.history: deque = deque(maxlen=HISTORY_KEEP)  # the newest events (a days-long job has many)
        self.listeners: list[Callable[[dict], None]] = []  # called with every event (the dashboard's view)
        self._widths = WidthChanges()  # the shrink or grow that the next recovery_complete's line gives the cost of

    def emit(self, event: dict, console: bool = True) -> dict:
        event = {"event": event["event"], "time": round(time.time(), 6), "job": self._job_id, "seq": self._seq,
                 **{k: v for k, v in event.items() if k != "event"}}
        self._seq += 1
        self.history.append(event)
        if self._file:
            try:
                self._file.write(user_json(event) + "\n")
                self._file.flush()
            except OSError as exc:
                self.close()
                _say_dropped(f"the events file {self._path}", exc)
        for listener in self.listeners:
            listener(event)
        try:
            changed = self._widths.on_event(event)
        except (KeyError, TypeError, ValueError):  # (an event of a shape it does not know: its line without the cost)
            changed = None
        if self._console and console:
            try:
                said = describe(event) + (f"; {cost_words(changed)}" if changed else "")
                write_line(self._console, f"[dprun +{event['time'] - self._t0:7.2f}s] {said}")
            except OSError as exc:  # (a closed pipe: `dprun ... | head`)
                _say_dropped("the console", exc)
                _point_at_devnull(self._console)
                self._console = None
        return event

    def close(self) -> None:
        if self._file:
            with contextlib.suppress(OSError):  # (what is left to flush may not fit either)
                self._file.close()
            self._file = None


def user_json(value: Any) -> str:
    """JSON for others to read (the events file, --json): a NaN or infinite float (a diverging loss) is null, as
    JSON has no such numbers and json.dumps' NaN / Infinity break other parsers."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_line(stream: TextIO, text: str) -> None:
    """Write a line in one write, flushed: print() writes the text and its newline apart, which unbuffered
    (PYTHONUNBUFFERED, as Slurm scripts often set) lets an agent's line land between them on a shared console."""
    stream.write(text + "\n")
    stream.flush()


def _point_at_devnull(stream: TextIO) -> None:
    """Send what else is written to `stream` (and its unflushed rest) to /dev/null, as Python's docs advise for a
    closed pipe: else flushing it at exit fails again and Python ends with 120, not the job's exit code."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (no file descriptor: nothing to redirect)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _say_dropped(what: str, exc: OSError) -> None:
    """Say on stderr (once: the caller drops `what`) that it can no longer be written and the job goes on."""
    with contextlib.suppress(OSError):
        print(f"dprun: cannot write {what} any more ({exc.strerror or exc}): the job goes on without it",
              file=sys.stderr, flush=True)
