"""A job's width as the operator sees it (--on-spare-exhausted shrink): each shrink and grow folded from its events,
with the step it went on from and what it cost; the dashboard's header field and the report's lines in words. Pure.
"""

from __future__ import annotations

CHANGES = {"job_shrunk": "shrank", "job_grew": "grew", "grow_undone": "undid a grow"}


def first_step_s(rec: dict, joined: float | None = None) -> float:
    """Seconds to the first step every process made at the new width (the recovery_complete `rec`): from the node
    joined, at `joined` (a grow with no failure), else from the failure detected (its total less its detection).
    (A grow's own phases count from when it was planned, which a node that joined during a recovery waits for.)"""
    if joined is not None and not rec.get("failed"):
        return max(0.0, float(rec.get("time", 0.0)) - joined)
    phases = rec.get("phases") or {}
    return max(0.0, float(phases.get("total_s") or 0.0) - float(phases.get("detect_s") or 0.0))


def is_narrow(width: dict) -> bool:
    return int(width["processes"]) < int(width["ranks"])


def pace(width: dict) -> str:
    """'narrow, ~2x step time' or 'full width'. The busiest process trains `slowdown` ranks' micro-batches a step
    and every step waits for it, so that (not ranks / processes) is what a step costs."""
    return f"narrow, ~{width['slowdown']}x step time" if is_narrow(width) else "full width"


def width_field(width: dict | None, changed: bool) -> str:
    """The dashboard header's 'width 2/3 (narrow, ~2x step time)': processes training / data-parallel ranks asked
    for. Shown while narrow, and at full width once the job changed width (it grew back); else nothing."""
    if not width or not (is_narrow(width) or changed):
        return ""
    return f"width {width['processes']}/{width['ranks']}" + (f" ({pace(width)})" if is_narrow(width) else "")


def processes(width: dict) -> str:
    return f"{width['processes']} process{'es' if width['processes'] != 1 else ''}"


def cost_words(change: dict) -> str:
    """'2.20 s from the failure detected to the first narrow step' for a completed change."""
    since = "the node joined" if change["kind"] == "grew" and not change["failed"] else "the failure detected"
    to = "the first narrow step" if is_narrow(change) else "the first full-width step"
    return f"{change['cost_s']:.2f} s from {since} to {to}"


def change_brief(change: dict, rec: dict) -> str:
    """The dashboard's log line for the recovery_complete that completed a shrink or grow (in place of its own)."""
    return (f"job {change['kind']} to {processes(change)} for its {change['ranks']} ranks "
            f"(generation {rec['generation']}, from step {rec['restore_step']}, "
            f"{rec.get('lost_steps', 0)} step(s) lost): {cost_words(change)}")


class WidthChanges:
    """Each shrink and grow of a job, oldest first: a job_shrunk or job_grew opens one, the reconfigure of its
    generation says the step it goes on from, and the recovery_complete that follows (of that generation or a
    later one, when the generation was planned again before it trained) closes it with that step and its cost."""

    def __init__(self) -> None:
        self.changes: list[dict] = []
        self.refused: list[str] = []  # why the job could not shrink (shrink_refused), each time said
        self._open: dict | None = None
        self._joined: dict[str, float] = {}  # node -> when it last joined (what a grow onto it is timed from)

    def on_event(self, e: dict) -> dict | None:
        """Fold `e`; the change it completed (a recovery_complete after a shrink or grow), else None."""
        kind = e.get("event")
        if kind in CHANGES:
            # (an open change that another follows never trained at its width: it keeps no cost)
            self._open = {"kind": CHANGES[str(kind)], "time": float(e.get("time", 0.0)),
                          "generation": int(e["generation"]), "nodes": [str(n) for n in e.get("nodes", [])],
                          "processes": int(e["processes"]), "ranks": int(e["ranks"]),
                          "slowdown": int(e.get("slowdown", 1)), "step": None, "cost_s": None, "failed": []}
            self.changes.append(self._open)
        elif kind == "node_joined":
            self._joined[str(e.get("node"))] = float(e.get("time", 0.0))
        elif kind == "shrink_refused":
            self.refused.append(str(e.get("reason", "")))
        elif self._open is None:
            return None
        elif kind == "reconfigure" and e.get("generation") == self._open["generation"]:
            self._open["step"] = int(e["restore_step"])
        elif kind == "recovery_complete" and int(e.get("generation", -1)) >= self._open["generation"]:
            done, self._open = self._open, None
            joined = [self._joined[n] for n in done["nodes"] if n in self._joined] if done["kind"] == "grew" else []
            done.update(step=int(e["restore_step"]), cost_s=round(first_step_s(e, max(joined, default=None)), 4),
                        failed=[str(n) for n in e.get("failed") or []])
            return done
        return None


def spells(changes: list[dict], end_step: int) -> list[int | None]:
    """The steps trained at each change's width: from its step to the next change's, the last to `end_step` (the
    job's newest step); None where a step is not known (a change the job never trained at)."""
    steps: list[int | None] = []
    for i, change in enumerate(changes):
        until = changes[i + 1]["step"] if i + 1 < len(changes) else end_step
        steps.append(None if change["step"] is None or until is None else max(0, until - change["step"]))
    return steps


def report_lines(model: dict, t0: float) -> list[str]:
    """`dprun report`'s width section: every shrink and grow with its cost and the steps trained at its width,
    and each time the job could not shrink. Empty for a job that never changed width."""
    changes, refused = model.get("width_changes") or [], model.get("shrink_refused") or []
    if not changes and not refused:
        return []
    steps = spells(changes, int(model.get("step") or 0))
    narrow = sum(n for change, n in zip(changes, steps)
                 if n is not None and is_narrow(change) and change["cost_s"] is not None)
    shrank = sum(1 for change in changes if change["kind"] == "shrank")
    grew = sum(1 for change in changes if change["kind"] == "grew")
    lines = [f"width: shrank {shrank} time(s), grew {grew} time(s); {narrow} of "
             f"{model.get('step') or 0} steps trained narrow"]
    for i, (change, n) in enumerate(zip(changes, steps)):
        how = {"shrank": "lost", "grew": "joined"}.get(change["kind"], "left")
        at = f"+{change['time'] - t0:.1f}s"
        line = (f"  {at} {change['kind']} at step {change['step'] if change['step'] is not None else '?'} (node "
                f"{', '.join(change['nodes']) or '?'} {how}): {change['ranks']} ranks on {processes(change)} "
                f"({pace(change)})")
        lines.append(line)
        if change["cost_s"] is None:
            ended = "another change followed first" if i + 1 < len(changes) else "the job ended first"
            lines.append(f"  {' ' * len(at)} never trained at that width ({ended})")
            continue
        narrow_steps = f"; {n} step(s) narrow" if is_narrow(change) and n is not None else ""
        lines.append(f"  {' ' * len(at)} {cost_words(change)}{narrow_steps}")
    lines += [f"  could not shrink: {reason}" for reason in refused]
    return lines
