"""Folds a job's events, per-node progress and controller state into one view model (a JSON-able dict).

Pure: no I/O and no clock (every time is passed in). The dashboard, `dprun status` and `dprun report` all read it.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from dprun.controller.view import ControllerView
from dprun.controller.nodes import Role
from .events import brief, describe
from .width import CHANGES, WidthChanges, change_brief

THROUGHPUT_WINDOW_S = 20.0
LOG_KEEP = 200  # log lines kept in memory
MODEL_LOG = 40  # log lines in a model
MODEL_KEEP = 20  # recoveries and failures in a model
FENCED_AFTER_S = 1.0  # a failed node heard from this long after its failure is alive but fenced
LEVELS = {"node_failed": "error", "worker_exited": "error", "spare_lost": "warn", "fault_injected": "fault",
          "spare_promoted": "promote", "reconfigure": "info", "recovery_complete": "ok", "peer_error": "warn",
          "message_dropped": "warn", "job_started": "info", "restart_rendezvous": "ok", "node_joined": "dim",
          "fault_skipped": "warn", "saving_state": "warn", "save_retried": "warn", "message_refused": "warn",
          "divergence": "error", "node_refused": "warn", "node_warning": "warn", "restoring_from_disk": "warn",
          "save_failed": "warn", "save_skipped": "warn", "resume_fallback": "warn", "state_saved": "dim",
          "job_shrunk": "promote", "job_grew": "promote", "shrink_refused": "warn",
          "grow_undone": "warn"}
WARNING_EVENTS = ("node_refused", "node_warning", "divergence")  # what `dprun report` lists under "warnings"
WARNINGS_KEPT = 20
STEPS_ARGS = ("--steps", "--max-steps", "--total-steps", "--num-steps", "--max-iters", "--iters", "--max_steps",
              "--total_steps", "--num_steps", "--max_iters")


class Shown(enum.StrEnum):
    """A node's role as the operator sees it (the controller's Role, plus what events alone tell): JOINING
    (registered, not placed yet) -> ACTIVE or SPARE; SPARE -> ACTIVE (promoted); ACTIVE or SPARE -> FAILED;
    FAILED -> FENCED once it is heard from a while after its failure (alive, but kept out)."""

    FAILED = "failed"
    FENCED = "fenced"
    ACTIVE = "active"
    SPARE = "spare"
    JOINING = "joining"


class JobState(enum.StrEnum):
    """The job as the dashboard heads it: STARTING -> TRAINING <-> RECOVERING; either -> FINISHED or FAILED."""

    STARTING = "starting"
    TRAINING = "training"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


ROLE_ORDER = {role: order for order, role in enumerate(Shown)}  # the nodes table's order: trouble first


def _shown(role: str) -> Shown:
    """A node_joined event's role; a spare's if it names none this version knows (an events file of another)."""
    try:
        return Shown(role)
    except ValueError:
        return Shown.SPARE


@dataclass
class NodeInfo:
    node_id: str
    host: str = ""
    pid: int = 0
    role: Shown = Shown.JOINING
    node_rank: int = -1
    heartbeat_age: float | None = None
    step: int = -1
    step_s: float | None = None  # seconds per step, smoothed
    last_step_at: float | None = None
    promoted: int | None = None  # generation it was promoted in
    cause: str = ""
    failed_at: float | None = None
    holder: str = ""  # the node that holds this node's snapshots
    replicated: int | None = None  # newest step of all its ranks held by `holder`
    generation: int = -1  # of its newest step
    room: int = 0  # a spare's: bytes its workers reserved and faulted in for a restore (Standby)


def recovery_cost(rec: dict) -> float:
    """Seconds from the failure until training could go on: for a restart, until the new workers were back
    in torch's rendezvous when that was seen, else until they were started."""
    phases = rec.get("phases", {})
    return float(phases.get("rendezvous_s") or phases.get("total_s") or 0.0)


def total_steps_from_args(args: Sequence[str]) -> int | None:
    """The step count a script was given (--steps N, --max-steps=N, ...), if any."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in STEPS_ARGS:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            if re.fullmatch(r"\d+", value):
                return int(value)
    return None


class JobView:
    """Call on_event / on_progress / on_heard / on_controller as things happen, model(now) to read."""

    def __init__(self, job_id: str = "", nproc_per_node: int = 1, total_steps: int | None = None,
                 started_at: float | None = None, mode: str = "hot-swap", nnodes: int = 0, spares: int = 0,
                 timeline: bool = False):
        self.job_id, self.nproc, self.total_steps, self.mode = job_id, nproc_per_node, total_steps, mode
        self.nnodes, self.spares = nnodes, spares
        self.started_at = started_at
        self.nodes: dict[str, NodeInfo] = {}
        self.generation = -1
        self.state = JobState.STARTING
        self.step = 0  # newest step of the job (goes back on a rollback)
        self.loss: float | None = None
        self.tokens_per_step: float | None = None
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None
        self.samples: deque = deque()  # (time, step) for throughput
        self.log: deque = deque(maxlen=LOG_KEEP)
        self.recoveries: list[dict] = []
        self.failures: list[dict] = []
        self.finished: dict | None = None
        self.mesh = ""  # a sharded or 3D-parallel job's layout (its "mesh" event)
        self.on_disk: dict | None = None  # the newest step a background save wrote whole: step, folder, time
        self.warnings: list[dict] = []  # nodes refused or joined with a warning, ranks found diverged: the first few
        self.restore_point: int | None = None
        self.world_size = 0
        self.status_endpoint = ""
        self.timeline = timeline  # keep every progress event (a report's plot); a live view does not
        self.progress_points: list[tuple[float, int, int]] = []  # (time, step, generation)
        self.width: dict | None = None  # processes, ranks, slowdown (dprun.controller.view.WidthView)
        self.widths = WidthChanges()  # each shrink and grow, with its step and cost

    # ------------------------------------------------------------------ inputs

    def on_event(self, e: dict) -> None:
        kind, t = e.get("event", "?"), float(e.get("time", 0.0))
        if self.started_at is None:
            self.started_at = t
        if not self.job_id and isinstance(e.get("job"), str):
            self.job_id = e["job"]
        handler = getattr(self, f"_ev_{kind}", None)
        if handler is not None:
            handler(e, t)
        if kind in CHANGES:
            self.width = {k: e[k] for k in ("processes", "ranks", "slowdown")}
        changed = self.widths.on_event(e)  # a recovery that completed a shrink or grow: said as one, with its cost
        if kind in WARNING_EVENTS and len(self.warnings) < WARNINGS_KEPT:
            self.warnings.append({"time": t, "event": kind, "text": describe(e)})
        if kind != "progress" and not (kind == "node_joined" and len(self.nodes) > 8):
            self.log.append((t, LEVELS.get(kind, "info"), change_brief(changed, e) if changed else brief(e)))

    def _node(self, node_id: str) -> NodeInfo:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeInfo(node_id)
        return node

    def _ev_node_joined(self, e: dict, t: float) -> None:
        node = self._node(e["node"])
        node.host, node.pid, node.role = e.get("host", ""), e.get("pid", 0), _shown(e.get("role", "spare"))

    def _ev_state_saved(self, e: dict, t: float) -> None:
        self.on_disk = {"step": e.get("step"), "folder": e.get("folder"), "time": t}

    def _ev_mesh(self, e: dict, t: float) -> None:
        self.mesh = str(e.get("layout", ""))

    def _ev_job_started(self, e: dict, t: float) -> None:
        self.generation, self.state = 0, JobState.TRAINING
        self.nnodes = e.get("nnodes", self.nnodes)
        self.world_size = e.get("world_size", self.world_size)
        if self.nnodes:
            self.nproc = max(1, self.world_size // self.nnodes)
        self._place(e.get("layout", []))

    def _place(self, layout: Iterable[str]) -> None:
        for rank, node_id in enumerate(layout):
            node = self._node(node_id)
            node.node_rank = rank
            if node.role not in (Shown.FAILED, Shown.FENCED):
                node.role = Shown.ACTIVE

    def _ev_progress(self, e: dict, t: float) -> None:
        # the last step, said as the job finished: when it was made (made_at: event files of an older dprun)
        t = min(t - float(e.get("made_before_s", 0.0)), float(e.get("made_at", t)))
        self._job_step(int(e.get("step", 0)), e, t)
        if self.timeline:
            self.progress_points.append((t, int(e.get("step", 0)), int(e.get("generation", 0))))

    def _ev_node_failed(self, e: dict, t: float) -> None:
        node = self._node(e["node"])
        node.role, node.cause, node.failed_at, node.heartbeat_age = Shown.FAILED, e.get("cause", ""), t, None
        if self.generation >= 0 and e.get("role") == "active":
            self.state = JobState.RECOVERING
        self.failures.append({"time": t, "node": node.node_id, "node_rank": e.get("node_rank"),
                              "role": e.get("role", ""), "cause": node.cause})

    def _ev_worker_exited(self, e: dict, t: float) -> None:
        entry = {k: e.get(k) for k in ("node", "local_rank", "rank", "pid", "exitcode", "cause", "tail", "log")}
        self.failures.append({"time": t, **entry})

    def _ev_spare_promoted(self, e: dict, t: float) -> None:
        node = self._node(e["spare"])
        node.role, node.node_rank, node.promoted = Shown.ACTIVE, e.get("node_rank", -1), e.get("generation")

    def _ev_reconfigure(self, e: dict, t: float) -> None:
        self.generation = e.get("generation", self.generation)
        restore = e.get("restore_step", -1)
        self.step = max(0, restore)
        self.samples.clear()
        self._place(e.get("layout", []))

    def _ev_recovery_complete(self, e: dict, t: float) -> None:
        self.state = JobState.TRAINING
        self.mode = e.get("mode", self.mode)
        self.recoveries.append({"time": t, **{k: v for k, v in e.items() if k not in ("event", "time")}})

    def _ev_restart_rendezvous(self, e: dict, t: float) -> None:
        for rec in reversed(self.recoveries):
            if rec.get("generation") == e.get("generation"):
                rec.setdefault("phases", {})["rendezvous_s"] = e.get("seconds")
                break

    def _ev_job_finished(self, e: dict, t: float) -> None:
        code = e.get("exit_code", 1)
        self.state = JobState.FINISHED if code == 0 else JobState.FAILED
        self.finished = {"time": t, "exit_code": code, "message": e.get("message", "")}

    def on_progress(self, node_id: str, step: int, generation: int, metrics: dict, t: float) -> None:
        """A rank's Progress message (every step; events only carry one a second)."""
        node = self._node(node_id)
        if generation != node.generation:  # a new generation: steps may go back, keep the pace
            node.step, node.last_step_at, node.generation = step, t, generation
        elif step > node.step:
            if node.last_step_at is not None and node.step >= 0:
                per = (t - node.last_step_at) / (step - node.step)
                node.step_s = per if node.step_s is None else 0.7 * node.step_s + 0.3 * per
            node.step, node.last_step_at = step, t
        self._job_step(step, metrics, t)

    def _job_step(self, step: int, metrics: dict, t: float) -> None:
        if isinstance(metrics.get("loss"), (int, float)):
            self.loss = float(metrics["loss"])
        if isinstance(metrics.get("tokens"), (int, float)):
            self.tokens_per_step = float(metrics["tokens"])
        if isinstance(metrics.get("total_steps"), int):
            self.total_steps = metrics["total_steps"]
        if step >= 1 and self.first_step_at is None:
            self.first_step_at = t
        if step > self.step or self.last_step_at is None:
            self.step = max(self.step, step)
            self.last_step_at = t
            if not self.samples or t - self.samples[-1][0] >= 0.2:
                self.samples.append((t, step))
            while self.samples and self.samples[0][0] < t - 3 * THROUGHPUT_WINDOW_S:
                self.samples.popleft()

    def on_heard(self, node_id: str, t: float) -> None:
        """Any message from a node: one that failed a while ago and still talks is fenced, not dead."""
        node = self.nodes.get(node_id)
        if node is not None and node.role == Shown.FAILED and node.failed_at is not None \
                and t - node.failed_at > FENCED_AFTER_S:
            node.role = Shown.FENCED

    def on_controller(self, state: ControllerView) -> None:
        """The controller's published view: heartbeat ages, pids, replica holders, the restore point, the width."""
        self.job_id, self.nproc, self.world_size = state.job_id, state.nproc_per_node, state.world_size
        self.restore_point = state.restore_point
        if state.width is not None:
            self.width = asdict(state.width)
        for node_id, s in state.nodes.items():
            node = self._node(node_id)
            node.host, node.pid = s.host, s.pid
            if s.role is Role.FAILED:
                if node.role not in (Shown.FAILED, Shown.FENCED):
                    node.role = Shown.FAILED
                node.heartbeat_age = None
                node.cause = node.cause or s.cause
            else:
                node.role, node.heartbeat_age, node.node_rank = Shown(s.role.value), s.age, s.node_rank
            if s.last_step > node.step and node.last_step_at is None:
                node.step = s.last_step
            node.holder, node.replicated, node.room = s.holder, s.replicated, s.room

    # ------------------------------------------------------------------ derived

    def steps_per_s(self, now: float) -> float | None:
        if len(self.samples) < 2 and not (self.samples and self.samples[0][0] < now - 1.0):
            return None
        base = next((s for s in self.samples if s[0] >= now - THROUGHPUT_WINDOW_S), self.samples[-1])
        latest = self.samples[-1]
        if base is latest and len(self.samples) > 1:
            base = self.samples[-2]
        elapsed = now - base[0]
        if elapsed < 0.5:
            return None
        return max(0.0, (latest[1] - base[1]) / elapsed)

    def goodput(self, now: float) -> float | None:
        """Share of wall time that produced steps that were kept (startup, recoveries and redone steps are not)."""
        if self.first_step_at is None or self.last_step_at is None or self.started_at is None:
            return None
        end = self.finished["time"] if self.finished else now
        wall = end - self.started_at
        lost = sum(int(r.get("lost_steps") or 0) for r in self.recoveries)
        recovering = sum(float(r.get("phases", {}).get("total_s") or 0) for r in self.recoveries)
        computed = self.step + lost
        if wall <= 0 or computed < 2:
            return None
        step_time = max(0.0, self.last_step_at - self.first_step_at - recovering) / (computed - 1)
        return max(0.0, min(1.0, self.step * step_time / wall))

    def model(self, now: float, full: bool = False) -> dict:
        """The view at `now`; `full` keeps every recovery and failure (a report), else the newest few."""
        keep = None if full else MODEL_KEEP
        rate = self.steps_per_s(now)
        counts: dict[str, int] = {}
        for node in self.nodes.values():
            counts[node.role] = counts.get(node.role, 0) + 1
        rows = sorted(self.nodes.values(), key=lambda n: (ROLE_ORDER.get(n.role, 9), n.node_rank, n.node_id))
        return {
            "job_id": self.job_id, "state": self.state, "generation": self.generation, "mode": self.mode,
            "step": self.step, "total_steps": self.total_steps, "loss": self.loss,
            "steps_per_s": rate,
            "tokens_per_s": rate * self.tokens_per_step if rate is not None and self.tokens_per_step else None,
            "uptime_s": (now - self.started_at) if self.started_at is not None else 0.0,
            "goodput": self.goodput(now), "nproc_per_node": self.nproc, "nnodes": self.nnodes,
            "spares": self.spares, "world_size": self.world_size or self.nnodes * self.nproc,
            "counts": counts, "nodes": [_row(n, self.nproc, now) for n in rows],
            "restore_point": self.restore_point, "status_endpoint": self.status_endpoint, "mesh": self.mesh,
            "on_disk": self.on_disk, "width": self.width, "width_changes": [dict(c) for c in self.widths.changes],
            "shrink_refused": list(self.widths.refused),
            "log": [list(entry) for entry in list(self.log)[-MODEL_LOG:]],
            "recoveries": self.recoveries[-keep:] if keep else list(self.recoveries),
            "failures": self.failures[-keep:] if keep else list(self.failures),
            "finished": self.finished, "warnings": list(self.warnings), "time": now,
        }


def _row(node: NodeInfo, nproc: int, now: float) -> dict:
    row = asdict(node)
    row.pop("failed_at", None)
    rank = node.node_rank if node.role in (Shown.ACTIVE, Shown.FAILED, Shown.FENCED) else -1
    row["ranks"] = rank_span(rank, nproc)
    row["step_age"] = (now - node.last_step_at) if node.last_step_at is not None else None
    row.pop("last_step_at", None)
    return row


def rank_span(node_rank: int, nproc: int) -> str:
    if node_rank < 0:
        return "-"
    first = node_rank * nproc
    return str(first) if nproc == 1 else f"{first}-{first + nproc - 1}"
