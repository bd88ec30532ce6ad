"""The dashboard's view model (dprun.monitor.jobview) and its rendering (dprun.monitor.dashboard): pure, fast, no
processes.

Events are the ones the controller publishes; frames are rendered into a recording rich Console of a given size.
"""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from dpcommon import protocol as p
from dprun.controller.state_machine import Controller, JobSpec, NodeGone, Received
from dprun.monitor.dashboard import render, select_rows
from dprun.monitor.jobview import JobView, total_steps_from_args
from dprun.controller.phase import Phase
from dprun.controller.view import WidthView
from dprun.monitor.report import final_summary, incidents
from helpers.controller_harness import Harness, spec
from helpers.events import T0, hot_swap_events
from helpers.shrink_events import shrink_and_grow_events

pytestmark = pytest.mark.timeout(30)


def fold(events, **kw) -> JobView:
    view = JobView(job_id="dp-test", nproc_per_node=2, **kw)
    for e in events:
        view.on_event(e)
    return view


def screen(model, width=80, height=40, output=()) -> list[str]:
    console = Console(width=width, height=height, record=True, force_terminal=False, color_system=None)
    console.print(render(model, width, height, output))
    return console.export_text().splitlines()


def test_fold_follows_failure_promotion_rollback_and_recovery():
    ev = hot_swap_events()
    view = fold(ev[:28])  # up to the reconfigure
    m = view.model(T0 + 31)
    assert m["state"] == "recovering" and m["generation"] == 1 and m["step"] == 19  # rolled back
    roles = {n["node_id"]: n["role"] for n in m["nodes"]}
    assert roles == {"node0": "active", "node1": "failed", "node2": "active"}
    node2 = next(n for n in m["nodes"] if n["node_id"] == "node2")
    assert node2["promoted"] == 1 and node2["node_rank"] == 1 and node2["ranks"] == "2-3"
    assert m["nodes"][0]["node_id"] == "node1", "failed rows come first"
    view = fold(ev)
    m = view.model(T0 + 53)
    assert m["state"] == "finished" and m["finished"]["exit_code"] == 0 and m["step"] == 40
    assert [r["generation"] for r in m["recoveries"]] == [1]
    texts = [text for _, _, text in m["log"]]
    assert any("node1 (node rank 1) failed" in t for t in texts)
    assert any(t.startswith("recovered (hot-swap") and "detect 0.10s" in t and "total 2.00s" in t for t in texts)


def test_goodput_counts_kept_steps_only():
    view = fold(hot_swap_events(), started_at=T0)
    # 41 steps computed (40 kept + 1 redone) between t=11 and t=52.5, 2 s of it recovering: 1 s per step
    step_time = (52.5 - 11 - 2.0) / 40
    assert view.goodput(T0 + 53) == pytest.approx(40 * step_time / 53)
    assert view.model(T0 + 53)["tokens_per_s"] is None or view.model(T0 + 53)["tokens_per_s"] > 0


def test_throughput_and_step_time_from_progress_messages():
    view = JobView(nproc_per_node=1)
    for s in range(1, 11):
        view.on_progress("n0", s, 0, {"tokens": 100}, T0 + s * 0.5)
        view.on_progress("n1", s, 0, {"tokens": 100}, T0 + s * 0.5 + 0.01)
    m = view.model(T0 + 5.0)
    assert m["steps_per_s"] == pytest.approx(2.0, rel=0.15)
    assert m["tokens_per_s"] == pytest.approx(200, rel=0.15)
    n0 = next(n for n in m["nodes"] if n["node_id"] == "n0")
    assert n0["step"] == 10 and n0["step_s"] == pytest.approx(0.5)
    view.on_progress("n0", 3, 1, {}, T0 + 6)  # a new generation went back to step 3: no bogus pace
    assert next(n for n in view.model(T0 + 6)["nodes"] if n["node_id"] == "n0")["step_s"] == pytest.approx(0.5)


def test_a_failed_node_that_keeps_talking_is_fenced():
    view = fold(hot_swap_events()[:26])
    view.on_heard("node1", T0 + 30.7)  # in flight when it died: still "failed"
    assert next(n for n in view.model(T0 + 31)["nodes"] if n["node_id"] == "node1")["role"] == "failed"
    view.on_heard("node1", T0 + 40)
    assert next(n for n in view.model(T0 + 40)["nodes"] if n["node_id"] == "node1")["role"] == "fenced"


def test_the_view_the_controller_publishes_reads_the_real_controller():
    ctl = Controller(JobSpec(nnodes=2, spares=1, nproc_per_node=2, store_endpoint="h:1", job_id="dp-x"), 0.0)
    for i, spare in ((0, False), (1, False), (2, True)):
        ctl.handle(Received(f"n{i}", p.Register(f"n{i}", f"host{i}", 10 + i, 2, spare, -1, f"tcp://h:{i}")), 0.0)
    for rank in range(4):  # node rank r's snapshots live on node rank r+1 (a ring)
        holder = f"n{1 - rank // 2}"
        ctl.handle(Received(holder, p.SnapshotStored(holder, rank, 3, 0)), 1.0)
    ctl.handle(Received("n2", p.Heartbeat("n2", -1, {"0": p.WorkerSummary("idle", room=2 << 20),
                                                     "1": p.WorkerSummary("idle", room=3 << 20)})), 0.0)
    state = ctl.view(1.5)
    assert state.job_id == "dp-x" and state.generation == 0 and state.world_size == 4
    assert state.phase is Phase.TRAINING
    assert state.nodes["n2"].role == "spare" and state.nodes["n2"].age == pytest.approx(1.5)
    assert state.nodes["n2"].room == 5 << 20 and state.nodes["n0"].room == 0
    assert state.nodes["n0"].age == pytest.approx(0.5)
    assert state.nodes["n0"].holder == "n1" and state.nodes["n0"].replicated == 3
    assert state.restore_point == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.generation = 1  # type: ignore[misc]
    view = JobView()
    view.on_controller(state)
    m = view.model(2.0)
    assert {n["node_id"]: n["role"] for n in m["nodes"]} == {"n0": "active", "n1": "active", "n2": "spare"}
    (spare_row,) = [line for line in screen(m) if "n2" in line and "spare" in line]
    assert "5 MB reserved for a restore" in spare_row, spare_row


def test_frame_at_80_columns_shows_nodes_promotion_and_recovery():
    view = fold(hot_swap_events(), started_at=T0, total_steps=40)
    lines = screen(view.model(T0 + 53), output=["step 40 loss 2.0"])
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    for needle in ("dp-test", "step 40/40", "node0", "node1", "node2", "failed", "promoted", "killed by SIGKILL",
                   "recovered (hot-swap", "goodput", "step 40 loss 2.0"):
        assert needle in text, needle


def test_hundreds_of_nodes_are_summarised_to_fit_the_screen():
    view = JobView(job_id="big", nproc_per_node=8)
    view.on_event({"event": "job_started", "time": T0, "generation": 0, "nnodes": 512, "world_size": 4096,
                   "spares": 8, "layout": [f"n{i}" for i in range(512)]})
    for i in range(512, 520):
        view.on_event({"event": "node_joined", "time": T0, "node": f"n{i}", "host": "h", "role": "spare", "pid": i})
    for i in range(512):
        view.on_progress(f"n{i}", 100 if i != 77 else 90, 0, {}, T0 + 1)
    view.on_event({"event": "node_failed", "time": T0 + 2, "node": "n300", "node_rank": 300, "role": "active",
                   "cause": "no heartbeat for 5.0 s"})
    model = view.model(T0 + 3)
    shown, summary = select_rows(model["nodes"], 12)
    ids = [r["node_id"] for r in shown]
    assert len(shown) + len(summary) <= 12
    assert "n300" in ids and "n77" in ids, "the failed node and the straggler are shown"
    assert any("more active" in line for line in summary) and any("more spare" in line for line in summary)
    lines = screen(model, 80, 40)
    assert len(lines) <= 40 and all(len(line) <= 80 for line in lines)
    assert "n300" in "\n".join(lines)


def test_total_steps_from_script_arguments():
    assert total_steps_from_args(["--steps", "60", "--seed", "0"]) == 60
    assert total_steps_from_args(["--max-steps=900"]) == 900
    assert total_steps_from_args(["--lr", "0.1"]) is None


def test_final_summary_names_the_failed_rank_with_its_stderr():
    view = fold(hot_swap_events()[:4])
    view.on_event({"event": "worker_exited", "time": T0 + 5, "node": "node1", "local_rank": 1, "rank": 3,
                   "pid": 4242, "exitcode": 1, "cause": "exit code 1: ValueError: boom",
                   "tail": "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom",
                   "log": "/logs/j/node1/attempt_0/1/stderr.log"})
    view.on_event({"event": "node_failed", "time": T0 + 5, "node": "node1", "node_rank": 1, "role": "active",
                   "cause": "worker 1 (pid 4242) exit code 1: ValueError: boom"})
    model = view.model(T0 + 6)
    lines = final_summary(model, 1, "node failure with no spare left")
    text = "\n".join(lines)
    assert lines[0] == "dprun: job failed: node failure with no spare left"
    assert "rank 3 on node1 (local rank 1, pid 4242): exit code 1: ValueError: boom" in text
    assert "| ValueError: boom" in text and "/logs/j/node1/attempt_0/1/stderr.log" in text
    assert len(incidents(model)) == 1 and incidents(model)[0]["recovery"] is None


def test_final_summary_of_a_job_stopped_by_a_signal_says_stopped_not_failed():
    model = fold(hot_swap_events()[:4]).model(T0 + 6)
    said = "dprun received SIGTERM; stopping every node; the state of step 8 is saved in /saved/step-8"
    assert final_summary(model, 143, said)[0] == f"dprun: job stopped: {said}"


def test_a_spare_s_worker_that_ends_is_named_as_such_not_as_rank_none():
    view = fold(hot_swap_events()[:4])
    view.on_event({"event": "worker_exited", "time": T0 + 5, "node": "node2", "local_rank": 0, "rank": None,
                   "pid": 4243, "exitcode": -9, "cause": "killed by SIGKILL"})
    text = "\n".join(final_summary(view.model(T0 + 6), 1, "stopped"))
    assert "a spare's worker on node2 (local rank 0, pid 4243): killed by SIGKILL" in text and "None" not in text


def test_a_workers_progress_bar_and_cursor_moves_show_as_a_terminal_would_and_move_nothing_of_the_dashboard():
    import io

    out = io.StringIO()
    console = Console(file=out, width=100, height=40, force_terminal=True, color_system="standard")
    tqdm = "\r 10%|#         | 1/10\r 20%|##        | 2/10\x1b[A\x1b[2K"  # what tqdm writes to stderr
    console.print(render(fold(hot_swap_events()).model(T0 + 53), 100, 40, ["\x1b[31mred\x1b[0m warning", tqdm]))
    drawn = out.getvalue()
    assert " 20%|##        | 2/10" in drawn and " 10%" not in drawn
    assert "\r" not in drawn and "\x1b[A" not in drawn and "\x1b[2K" not in drawn
    assert "\x1b[31m" in drawn or "\x1b[2;31m" in drawn, "colours are kept"


def title(model, width=80) -> str:
    return screen(model, width)[0]


def test_a_narrow_job_heads_its_width_and_logs_each_shrink_and_grow_with_its_cost_to_the_first_step():
    ev = shrink_and_grow_events()
    narrow = fold(ev[:30])  # trained narrow up to step 16
    m = narrow.model(T0 + 32)
    assert m["width"] == {"processes": 2, "ranks": 3, "slowdown": 2}
    assert "width 2/3 (narrow, ~2x step time)" in title(m), title(m)
    texts = [text for _, _, text in m["log"]]
    assert ("job shrank to 2 processes for its 3 ranks (generation 1, from step 12, 0 step(s) lost): 2.20 s from "
            "the failure detected to the first narrow step") in texts, texts
    assert not any(t.startswith("recovered (") for t in texts), "the recovery is said as the shrink it completed"
    whole = fold(ev).model(T0 + 66)
    assert "width 3/3" in title(whole) and "narrow" not in title(whole), "grown back: full width, still shown"
    texts = [text for _, _, text in whole["log"]]
    assert ("job grew to 3 processes for its 3 ranks (generation 2, from step 25, 0 step(s) lost): 2.10 s from the "
            "node joined to the first full-width step") in texts, texts
    lines = screen(whole)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)


def test_a_job_that_never_changed_width_heads_no_width():
    view = fold(hot_swap_events())
    view.width = {"processes": 4, "ranks": 4, "slowdown": 1}  # (as the controller's view says it)
    assert "width" not in title(view.model(T0 + 53))


def test_the_controller_s_view_says_the_width_that_the_dashboard_heads():
    """The real controller: b lost with no spare, the job trains on 2 processes; d joins, it grows back."""
    h = Harness(spec(nnodes=3, spares=0, on_spare_exhausted="shrink"))
    for rank, node in enumerate("abc"):
        h.register(node, rank=rank)
    assert h.c.view(h.now).width == WidthView(processes=3, ranks=3, slowdown=1)
    for step in range(5):
        for rank, holder in ((0, "b"), (1, "c"), (2, "a")):
            h.msg(holder, p.SnapshotStored(holder, rank, step, 0))
    h.msg("a", p.Progress("a", 0, 0, 5))
    h.feed(NodeGone("b", "killed"), dt=1)
    h.pong_all()
    state = h.c.view(h.now)
    assert state.width == WidthView(processes=2, ranks=3, slowdown=2) and state.width.narrow
    view = JobView(job_id="dp-x")
    view.on_controller(state)
    assert "width 2/3 (narrow, ~2x step time)" in title(view.model(h.now)), title(view.model(h.now))
    for node, rank in (("a", 0), ("c", 2)):
        h.msg(node, p.WorkerReady(node, 1, rank, 0.02, 0.02, "local"))
    h.msg("c", p.SnapshotStored("c", 0, 5, 1))  # (step 5 held by each other: what a grow restores from)
    h.msg("a", p.SnapshotStored("a", 2, 5, 1))
    for node, rank in (("a", 0), ("c", 2)):
        h.msg(node, p.Progress(node, 1, rank, 6))
    h.join_set_up("d")
    h.pong_all()
    assert h.c.view(h.now).width == WidthView(processes=3, ranks=3, slowdown=1)
    for i, e in enumerate(h.events):  # the events it published, as the dashboard's view folds them
        view.on_event({**e, "time": T0 + i})
    texts = [text for _, _, text in view.model(T0 + 99)["log"]]
    assert any(t.startswith("job shrank to 2 processes for its 3 ranks (generation 1, from step 4") for t in texts)
    view.on_controller(h.c.view(h.now))
    assert "width 3/3" in title(view.model(T0 + 99)) and "narrow" not in title(view.model(T0 + 99))


def test_the_controller_s_view_has_no_width_before_the_job_formed():
    ctl = Controller(JobSpec(nnodes=2, spares=0, nproc_per_node=1, store_endpoint="h:1"), 0.0)
    assert ctl.view(0.0).width is None
