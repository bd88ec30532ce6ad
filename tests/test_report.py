"""`dprun report EVENTS.jsonl` as a command (dprun.cli.main): the failure/recovery table, goodput, --json and
--plot."""

from __future__ import annotations

import json

import pytest

from dprun.monitor.report import run_report
from helpers.cli import in_process
from helpers.events import T0, hot_swap_events
from helpers.shrink_events import shrink_and_grow_events

pytestmark = pytest.mark.timeout(60)


def restart_events() -> list[dict]:
    """A plain script: node1 dies, every worker restarts; the new ones reach torch's rendezvous 6 s later."""
    return [
        {"event": "node_joined", "time": T0, "node": "node0", "host": "h", "role": "active", "pid": 1},
        {"event": "node_joined", "time": T0, "node": "node1", "host": "h", "role": "active", "pid": 2},
        {"event": "node_joined", "time": T0, "node": "node2", "host": "h", "role": "spare", "pid": 3},
        {"event": "job_started", "time": T0 + 0.1, "generation": 0, "nnodes": 2, "world_size": 2, "spares": 1,
         "layout": ["node0", "node1"]},
        {"event": "node_failed", "time": T0 + 20, "node": "node1", "node_rank": 1, "role": "active",
         "cause": "agent process exited (killed by SIGKILL)"},
        {"event": "spare_promoted", "time": T0 + 20, "spare": "node2", "node_rank": 1, "generation": 1},
        {"event": "reconfigure", "time": T0 + 20, "generation": 1, "restore_step": -1, "layout": ["node0", "node2"],
         "decide_s": 0.003},
        {"event": "recovery_complete", "time": T0 + 20.2, "mode": "restart", "generation": 1, "restore_step": -1,
         "lost_steps": 0, "failed": ["node1"], "promoted": {"1": "node2"},
         "phases": {"detect_s": 0.01, "decide_s": 0.0, "rebuild_s": 0.15, "restore_s": 0.0, "total_s": 0.2}},
        {"event": "restart_rendezvous", "time": T0 + 26, "generation": 1, "seconds": 6.0},
        {"event": "job_finished", "time": T0 + 40, "exit_code": 0, "message": "all 2 ranks finished"},
    ]


def write(path, events, garbage: bool = False):
    lines = [json.dumps(e) for e in events] + (['{"event": "progress", "ti'] if garbage else [])
    path.write_text("\n".join(lines) + "\n")
    return path


def report(path) -> tuple[int, str, str]:
    """`dprun report PATH` at 100 columns: (exit code, stdout, stderr). By dprun.cli.main in this process (a
    process spent ~4 s importing): test_cli's test_the_real_entry_point_says_what_main_says shows that `python -m
    dprun report` says the same."""
    return in_process(["report", path], path.parent)


def test_report_tables_every_failure_and_recovery(tmp_path, capsys):
    hot = write(tmp_path / "hot.jsonl", hot_swap_events(), garbage=True)
    restart = write(tmp_path / "restart.jsonl", restart_events())
    (code, text, err), (rcode, rtext, rerr) = report(hot), report(restart)
    assert [code, rcode] == [0, 0], err + rerr
    assert "finished (exit 0)" in text
    for needle in ("node1", "hot-swap", "0.10s", "0.30s", "0.50s", "2.00s", "goodput", "1 step(s) recomputed",
                   "agent process exited (killed by SIGKILL)", "1 line(s) of the events file were not events"):
        assert needle in text, needle
    assert "restart" in rtext and "6.00s" in rtext and "n/a" in rtext, rtext
    assert run_report(hot, None, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    (incident,) = data["incidents"]
    assert incident["recovery"]["lost_steps"] == 1 and incident["failures"][0]["node"] == "node1"
    assert data["goodput"] == pytest.approx((52.5 - 11 - 2.0) / 40 * 40 / 52.9, rel=0.05)


def test_report_plot_draws_a_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    events = write(tmp_path / "hot.jsonl", hot_swap_events())
    assert run_report(events, tmp_path / "timeline.png", as_json=False) == 0
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_of_a_failed_job_says_why_it_ended(tmp_path):
    why = "node failure with no spare left: node1 (node rank 1: agent process exited); rerun with more --spares"
    events = restart_events()[:5] + [{"event": "job_finished", "time": T0 + 21, "exit_code": 1, "message": why}]
    code, text, err = report(write(tmp_path / "failed.jsonl", events))
    assert code == 0, err
    assert "finished (exit 1)" in text and f"why: {why}" in " ".join(text.split()), text


def test_report_lists_nodes_refused_or_warned_of_and_ranks_found_diverged(tmp_path):
    warned = [
        {"event": "node_refused", "time": T0 + 0.5, "node": "n9", "host": "h9",
         "reason": "node n9 (host h9) was started with --nnodes 3, the job has 2: give every node the same --nnodes"},
        {"event": "node_warning", "time": T0 + 0.6, "node": "node1",
         "warning": "node node1 (host h) runs `t.py --steps 50`, the head `t.py --steps 40`: ..."},
        {"event": "divergence", "time": T0 + 9, "node": "node1", "rank": 1, "step": 7, "blocks": [0]},
    ]
    code, text, err = report(write(tmp_path / "warned.jsonl", restart_events()[:4] + warned + restart_events()[-1:]))
    assert code == 0, err
    said = " ".join(text.split())
    assert "warnings: +0.5s refused n9: node n9 (host h9) was started with --nnodes 3" in said, text
    assert "+0.6s warning: node node1 (host h) runs `t.py --steps 50`" in said, text
    assert "+9.0s rank 1 on node1: its parameters or optimizer state at step 7 differ from a data parallel peer's" \
        in said, text


def stamped(events: list[dict], job: str) -> list[dict]:
    """Events as dprun now writes them: with the job's id and a sequence number per run."""
    return [{**e, "job": job, "seq": i} for i, e in enumerate(events)]


def test_a_file_that_several_runs_appended_to_reports_one_run_the_last_unless_told(tmp_path, capsys):
    first = [e for e in restart_events() if e["event"] != "job_finished"]  # killed: it never said it finished
    again = [{**e, "time": e["time"] + 100} for e in restart_events()]  # the same --rdzv-id, run again
    other = [{**e, "time": e["time"] + 200} for e in hot_swap_events()]
    older = restart_events() + [{**e, "time": e["time"] + 50} for e in restart_events()]  # before runs were stamped
    path = write(tmp_path / "events.jsonl", older + stamped(first, "j1") + stamped(again, "j1") + stamped(other, "j2"))
    answers = {}
    for run in (1, 2, 3, 4, 5, -1):
        assert run_report(path, None, as_json=True, run=run) == 0
        data = json.loads(capsys.readouterr().out)
        answers[run] = (data["run"], data["runs"], data["finished"] is not None,
                        data["incidents"][0]["recovery"]["mode"])
    assert answers == {1: (1, 5, True, "restart"), 2: (2, 5, True, "restart"), 3: (3, 5, False, "restart"),
                       4: (4, 5, True, "restart"), 5: (5, 5, True, "hot-swap"), -1: (5, 5, True, "hot-swap")}
    assert run_report(path, None, as_json=False) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path} holds 5 runs of dprun; this is run 5 (job j2, begun ") and "job j2:" in out
    assert out.count("finished (exit 0)") == 1 and "hot-swap" in out
    assert run_report(path, None, as_json=False, run=6) == 2
    assert "holds 5 run(s) of dprun: give --run 1 to 5" in capsys.readouterr().err
    assert run_report(write(tmp_path / "one.jsonl", stamped(other, "j2")), None, as_json=False) == 0
    assert "runs of dprun" not in capsys.readouterr().out, "one run: no word about runs"


def test_hand_edited_events_are_skipped_or_refused_in_a_line_never_a_traceback(tmp_path, capsys):
    import random

    rng = random.Random(5)
    odd = ["x", None, -1, [], {}, 1e300, {"a": 1}, [1, 2], True, "[bold]x[/", 10 ** 30]
    answers = set()
    for trial in range(180):
        events = [dict(e) for e in (restart_events, hot_swap_events, shrink_and_grow_events)[trial % 3]()]
        for _ in range(3):
            event = rng.choice(events)
            event[rng.choice([k for k in event if k != "event"])] = rng.choice(odd)
        path = write(tmp_path / f"odd{trial}.jsonl", events)
        for as_json in (False, True):
            code = run_report(path, None, as_json=as_json)  # (an exception fails the test)
            err = capsys.readouterr().err
            assert code == 0 or (code == 2 and err.startswith("dprun report: ") and err.count("\n") == 1), err
            answers.add(code)
    assert answers == {0, 2}, "some edits are skipped, some make the file make no sense"


def test_report_lists_each_shrink_and_grow_with_its_cost_and_the_steps_trained_narrow(tmp_path, capsys):
    path = write(tmp_path / "shrink.jsonl", shrink_and_grow_events())
    code, text, err = report(path)
    assert code == 0, err
    lines = text.splitlines()
    at = lines.index("width: shrank 1 time(s), grew 1 time(s); 13 of 40 steps trained narrow")
    assert lines[at + 1:at + 5] == [
        "  +22.9s shrank at step 12 (node b lost): 3 ranks on 2 processes (narrow, ~2x step time)",
        "         2.20 s from the failure detected to the first narrow step; 13 step(s) narrow",
        "  +50.0s grew at step 25 (node d joined): 3 ranks on 3 processes (full width)",
        "         2.10 s from the node joined to the first full-width step"], text
    assert run_report(path, None, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(c["kind"], c["step"], c["cost_s"]) for c in data["width_changes"]] == [("shrank", 12, 2.2),
                                                                                   ("grew", 25, 2.1)]
    code, text, err = report(write(tmp_path / "hot.jsonl", hot_swap_events()))
    assert code == 0 and "width" not in text, "a job that never changed width has no such section"


def test_a_shrink_planned_again_before_it_trained_and_a_job_that_ends_narrow_are_said_so(tmp_path):
    """b lost, then c before the narrow job's first step: a carries all 3 ranks (the first shrink never trained);
    the job ends narrow at step 30 (its steps narrow count to there); a sharded job's refusal is listed too."""
    ev = shrink_and_grow_events()
    cut = next(i for i, e in enumerate(ev) if e["event"] == "progress" and e.get("generation") == 1)
    ev = ev[:cut] + [
        {"event": "node_failed", "time": T0 + 24.0, "node": "c", "node_rank": 1, "role": "active", "cause": "killed"},
        {"event": "job_shrunk", "time": T0 + 24.5, "generation": 2, "nodes": ["c"], "processes": 1, "ranks": 3,
         "slowdown": 3, "carried": {"0": [1, 2]}},
        {"event": "reconfigure", "time": T0 + 24.5, "generation": 2, "restore_step": 11, "layout": ["a"],
         "decide_s": 0.01},
        {"event": "recovery_complete", "time": T0 + 27.5, "mode": "hot-swap", "generation": 2, "restore_step": 11,
         "lost_steps": 1, "failed": ["b", "c"], "promoted": {},
         "phases": {"detect_s": 0.5, "decide_s": 0.01, "rebuild_s": 0.3, "restore_s": 0.6, "total_s": 5.0}},
        {"event": "progress", "time": T0 + 60, "generation": 2, "step": 30},
        {"event": "shrink_refused", "time": T0 + 61, "reason": "no data-parallel replica would be left"},
        {"event": "job_finished", "time": T0 + 62, "exit_code": 1, "message": "node failure with no spare left"},
    ]
    code, text, err = report(write(tmp_path / "twice.jsonl", ev))
    assert code == 0, err
    lines = text.splitlines()
    at = lines.index("width: shrank 2 time(s), grew 0 time(s); 19 of 30 steps trained narrow")
    assert lines[at + 1:at + 6] == [
        "  +22.9s shrank at step 12 (node b lost): 3 ranks on 2 processes (narrow, ~2x step time)",
        "         never trained at that width (another change followed first)",
        "  +24.4s shrank at step 11 (node c lost): 3 ranks on 1 process (narrow, ~3x step time)",
        "         4.50 s from the failure detected to the first narrow step; 19 step(s) narrow",
        "  could not shrink: no data-parallel replica would be left"], text
