"""The console's line for each event: every kind the controller and its shell publish is said in words. An
events file or a console that can no longer be written (a full disk, a closed pipe) never ends the job."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import dprun
from dprun.monitor.events import EventSink, describe, write_line
from helpers.e2e import TRAIN, TRAIN_ARGS

PUBLISHED = re.compile(r'publish\("([a-z_]+)"|\{"event": "([a-z_]+)"')  # (_publish or Outbox.publish)


def test_every_event_kind_published_has_a_line_in_words_not_the_generic_key_value_one():
    sources = [path.read_text() for path in Path(dprun.__file__).parent.rglob("*.py")]
    kinds = {a or b for text in sources for a, b in PUBLISHED.findall(text)}
    assert {"node_failed", "waiting_for_spare", "message_dropped"} <= kinds, kinds  # the pattern finds both forms
    said = Path(dprun.__file__).parent.joinpath("monitor", "events.py").read_text()
    assert sorted(kind for kind in kinds if f'kind == "{kind}"' not in said) == []


def test_the_lines_of_waits_drops_and_pauses_say_what_to_do_or_why():
    lines = {kind: describe({"event": kind, "time": 0, **fields}) for kind, fields in {
        "waiting_for_spare": dict(needed=1, failed="node1 (node rank 1: no heartbeat for 2.0 s)", timeout_s=1800.0),
        "waiting_for_restore": dict(ranks=[2], nodes=["node3"], timeout_s=120.0),
        "restore_failed": dict(node="node3", rank=2, step=10, source="", reason="checksum mismatch"),
        "controller_paused": dict(seconds=12.5, nodes_left=True),
        "message_dropped": dict(sender="x", reason="bad signature", dropped_total=3),
        "message_refused": dict(node="node1", kind="WorkerExited", reason="local_rank 1 out of range"),
        "fault_skipped": dict(spec="kill-node:7@step=3", reason="no such node"),
    }.items()}
    assert "waiting up to 1800s for 1 node(s) to join as a spare" in lines["waiting_for_spare"]
    assert "--rdzv-endpoint" in lines["waiting_for_spare"]
    assert "waiting up to 120s for node3" in lines["waiting_for_restore"]
    assert "from its own copy (checksum mismatch)" in lines["restore_failed"]
    assert "did not run for 12.5s" in lines["controller_paused"] and "taken it for lost" in lines["controller_paused"]
    assert "another job's token" in lines["message_dropped"]
    assert lines["message_refused"].startswith("ignored a WorkerExited from node1: local_rank 1 out of range")
    assert lines["fault_skipped"] == "injected fault kill-node:7@step=3 skipped: no such node"


def test_an_events_file_on_a_full_disk_and_a_closed_console_are_said_once_and_dropped(capsys):
    reader, writer = os.pipe()
    os.close(reader)  # nobody reads the console any more: `dprun ... | head`
    with os.fdopen(writer, "w") as console:
        sink = EventSink("/dev/full", console=console)
        for step in range(3):
            sink.emit({"event": "a_kind", "step": step})
        sink.close()
    said = capsys.readouterr().err.splitlines()
    assert said == ["dprun: cannot write the events file /dev/full any more (No space left on device): the job goes "
                    "on without it",
                    "dprun: cannot write the console any more (Broken pipe): the job goes on without it"], said
    assert [e["step"] for e in sink.history] == [0, 1, 2], "the dashboard's view still gets every event"


@pytest.mark.slow  # a real job: ~30 s
@pytest.mark.timeout(120)
def test_a_job_whose_events_file_fills_the_disk_and_whose_console_is_closed_trains_to_its_end(procs, tmp_path):
    """Before, the first event written to a full disk raised in the controller and the job died with a traceback
    (exit 1); a closed console would have too, and Python ends with 120 when stdout cannot be flushed at exit."""
    summary = tmp_path / "summary.json"
    # (the workers' own output to files, as torchrun's --redirects: a script printing to a closed pipe dies of it)
    head = procs.dprun("--nnodes", "1", "--events-file", "/dev/full", "--log-dir", tmp_path / "logs", "--redirects",
                       "3", TRAIN, "--steps", "20", *TRAIN_ARGS,
                       "--summary", summary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert head.stdout.readline().startswith(b"dprun: job "), "its first line"
    head.stdout.close()  # as `| head -1` does
    err = head.stderr.read().decode(errors="replace")
    assert head.wait(timeout=100) == 0, err[-3000:]
    assert "cannot write the events file /dev/full any more (No space left on device)" in err, err[-3000:]
    assert "cannot write the console any more (Broken pipe)" in err and "Traceback" not in err, err[-3000:]
    assert json.loads(summary.read_text())["final_step"] == 20


def test_a_console_line_is_one_write_so_an_agents_line_cannot_land_inside_it_when_unbuffered():
    class Writes(io.RawIOBase):  # what the console's file descriptor receives, write by write
        def __init__(self):
            self.chunks: list[bytes] = []

        def writable(self):
            return True

        def write(self, data):
            self.chunks.append(bytes(data))
            return len(data)

    raw = Writes()
    console = io.TextIOWrapper(raw, write_through=True)  # sys.stdout under PYTHONUNBUFFERED=1 (python -u)
    print("[dprun] print() writes twice", file=console, flush=True)
    assert raw.chunks == [b"[dprun] print() writes twice", b"\n"], "what let a line land inside another"
    raw.chunks.clear()
    sink = EventSink(None, console=console)
    sink.emit({"event": "job_finished", "exit_code": 0, "message": "all 2 ranks finished"})
    write_line(console, "dprun: done")
    assert len(raw.chunks) == 2 and all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in raw.chunks), raw.chunks


def test_a_diverging_loss_leaves_valid_json_in_the_events_file_and_in_the_reports_json(tmp_path, capsys):
    from dprun.monitor.report import run_report

    def strict(line: str):
        return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    path = tmp_path / "events.jsonl"
    sink = EventSink(path, console=None, job_id="j")
    sink.emit({"event": "job_started", "generation": 0, "nnodes": 1, "world_size": 1, "spares": 0, "layout": ["n"]})
    sink.emit({"event": "progress", "generation": 0, "step": 3, "metrics": {"loss": float("nan"),
                                                                            "tokens": [float("inf"), 2.5]}})
    sink.close()
    lines = [strict(line) for line in path.read_text().splitlines()]
    assert lines[1]["metrics"] == {"loss": None, "tokens": [None, 2.5]}
    assert run_report(path, None, as_json=True) == 0
    strict(capsys.readouterr().out)


@pytest.mark.timeout(30)
def test_the_console_line_of_the_recovery_that_completes_a_shrink_or_grow_says_its_cost_to_the_first_step():
    """job_shrunk and job_grew are said as they are planned; what they cost is known when every process made a
    step at the new width: the recovery_complete line that follows says it (a plain recovery's says nothing more)."""
    from helpers.events import hot_swap_events
    from helpers.shrink_events import shrink_and_grow_events

    def console_lines(events: list[dict]) -> list[str]:
        console = io.StringIO()
        sink = EventSink(None, console=console)
        for e in events:
            sink.emit({k: v for k, v in e.items() if k != "time"})
        return [line.split("] ", 1)[1] for line in console.getvalue().splitlines()]

    recovered = [line for line in console_lines(shrink_and_grow_events()) if line.startswith("recovered into")]
    assert len(recovered) == 2, recovered
    assert recovered[0].endswith("total 2.70s; 2.20 s from the failure detected to the first narrow step")
    # (a grow is timed from its node's node_joined event, stamped by the sink: a few ms here)
    assert re.search(r"total 1\.50s; 0\.\d\d s from the node joined to the first full-width step$", recovered[1])
    (plain,) = [line for line in console_lines(hot_swap_events()) if line.startswith("recovered into")]
    assert plain.endswith("total 2.00s"), plain
    EventSink(None, console=None).emit({"event": "job_shrunk", "generation": "x"})  # (its cost untold, no raise)


def test_a_sharded_shrink_names_the_nodes_demoted_to_spares_and_a_refusal_its_fallback():
    shrunk = describe({"event": "job_shrunk", "generation": 1, "nodes": ["node1", "node2"], "demoted": ["node2"],
                       "processes": 2, "ranks": 4, "slowdown": 2, "carried": {"0": [2], "3": [1]}})
    assert shrunk.startswith("no spare left: the job goes on without node1, node2 (node2 of the lost data-parallel "
                             "replica too, waiting as spares), 2 processes training its 4 data-parallel "
                             "ranks (rank 0's process also trains 2; rank 3's process also trains 1)"), shrunk
    refused = describe({"event": "shrink_refused", "reason": "its mesh (pp=2 x dp=2) has pipeline-parallel dims",
                        "fallback": "wait"})
    assert refused == ("the job cannot shrink: its mesh (pp=2 x dp=2) has pipeline-parallel dims; it waits for a "
                       "node to join instead (--shrink-fallback wait)")
