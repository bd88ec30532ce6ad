"""Scripts written for torchrun run unmodified under dprun: torchrun's environment, per-rank logs, -r/-t,
--local-ranks-filter, -m, a readable failure summary, and "restart" recovery onto the spare for a plain
DDP script that never imports dpstate (real dprun, agents and workers on loopback; a node killed by pid).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import psutil
import pytest

from conftest import REPO
from helpers.e2e import read_events, wait_for

pytestmark = pytest.mark.slow  # real dprun jobs: 20-70 s each
PLAIN_DDP = REPO / "examples" / "plain_ddp.py"

PROBE = '''
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE"]
# one write per line: unbuffered (PYTHONUNBUFFERED), print() writes each piece on its own, and the console
# merges stdout and stderr, so "ERR rank" + another line + " 0" can interleave (seen in a full run)
sys.stdout.write("OUT rank " + os.environ["RANK"] + " " + json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")
sys.stdout.flush()
sys.stderr.write("ERR rank " + os.environ["RANK"] + "\\n")
sys.stderr.flush()
if "--fail" in sys.argv and os.environ["RANK"] == "1":
    raise ValueError("boom from rank 1")
'''


class Output:
    """Reads a process's merged stdout/stderr in a thread, each line with the time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)


def dprun(procs, tmp_path, *args, env=None) -> tuple[subprocess.Popen, Output]:
    proc = procs.dprun(*args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env={"DPRUN_STATE_DIR": str(tmp_path / "state"), **(env or {})})
    return proc, Output(proc)


def finish(proc, out: Output, timeout: float) -> int:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"dprun did not finish within {timeout} s:\n{out.text()[-4000:]}") from None
    out.thread.join(timeout=5)
    return code


@pytest.mark.timeout(150)
def test_plain_ddp_script_restarts_every_worker_with_the_spare_standing_in(procs, tmp_path):
    events = tmp_path / "events.jsonl"
    proc, out = dprun(procs, tmp_path, "--nnodes", 2, "--spares", 1, "--max-restarts", 2, "--events-file", events,
                      "--log-dir", tmp_path / "logs", "--rdzv-id", "plain", PLAIN_DDP, "--steps", 30,
                      "--step-time", 0.05, "--ckpt-dir", tmp_path / "ckpt", "--ckpt-every", 5,
                      "--summary", tmp_path / "summary.json")
    wait_for(lambda: out.first(r"^step 8 "), timeout=100, what=f"step 8 of the plain script:\n{out.text()[-3000:]}")
    (victim,) = [e["pid"] for e in read_events(events) if e["event"] == "node_joined" and e["node"] == "node1"]
    killed_at = time.time()
    os.killpg(victim, signal.SIGKILL)  # node1: its agent and its worker, as a machine would die
    assert finish(proc, out, timeout=100) == 0, out.text()[-4000:]

    ev = read_events(events)
    (failed,) = [e for e in ev if e["event"] == "node_failed"]
    (promoted,) = [e for e in ev if e["event"] == "spare_promoted"]
    (done,) = [e for e in ev if e["event"] == "recovery_complete"]
    assert failed["node"] == "node1" and promoted["spare"] == "node2" and promoted["node_rank"] == 1
    assert done["mode"] == "restart" and done["generation"] == 1
    rendezvous = [e for e in ev if e["event"] == "restart_rendezvous"]
    assert rendezvous and rendezvous[0]["generation"] == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 30 and summary["restarts"] == 1
    first_after, resumed = out.first(r"^step \d+ .* restart 1 ")
    print(f"restart recovery of a plain DDP script: workers respawned {done['phases']['total_s']:.2f} s, back in "
          f"torch's rendezvous {rendezvous[0]['seconds']:.2f} s, first step after the kill "
          f"{first_after - killed_at:.2f} s after it ({resumed.split(' t ')[0]})")
    resumed_step = int(resumed.split()[1])
    reached = max(int(line.split()[1]) for _, line in out.lines if re.match(r"^step \d+ .* restart 0 ", line))
    assert (resumed_step - 1) % 5 == 0 and 6 <= resumed_step <= reached + 1, "resumes after its newest checkpoint"
    text = out.text()
    assert "recovered by restarting every worker" in text and "\x1b[" not in text, "plain line mode, no TUI"
    logs = tmp_path / "logs" / "plain"
    assert "restart 0" in (logs / "node0/attempt_0/0/stdout.log").read_text()  # rank 0 prints, per attempt
    assert "restart 1" in (logs / "node0/attempt_1/0/stdout.log").read_text()
    assert (logs / "node2/attempt_1/0/stderr.log").exists() and not (logs / "node2/attempt_0").exists()


@pytest.mark.timeout(90)
def test_torchrun_env_logs_console_filter_module_and_failure_summary(procs, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    # a short heartbeat timeout: a crash in restart mode is held that long (a dead peer may be to blame)
    common = ["--nproc-per-node", 2, "--heartbeat-interval", 0.3, "--heartbeat-timeout", 2.5, "--probe-timeout", 3,
              "-m"]
    ok, ok_out = dprun(procs, tmp_path, "--log-dir", tmp_path / "logs", "-t", 3, "--local-ranks-filter", 0,
                       "--max-restarts", 2, "--rdzv-id", "probe", *common, "probe")
    bad, bad_out = dprun(procs, tmp_path, "--log-dir", tmp_path / "badlogs", "--rdzv-id", "bad", *common,
                         "probe", "--fail")
    assert finish(ok, ok_out, timeout=80) == 0, ok_out.text()[-3000:]
    assert finish(bad, bad_out, timeout=80) == 1, bad_out.text()[-3000:]

    text = ok_out.text()
    assert "recovery by restart" in text
    assert "OUT rank 0" in text and "ERR rank 0" in text
    assert "OUT rank 1" not in text and "ERR rank 1" not in text, "--local-ranks-filter 0 keeps rank 1 off"
    for rank in (0, 1):
        folder = tmp_path / "logs" / "probe" / "node0" / "attempt_0" / str(rank)
        line = (folder / "stdout.log").read_text().strip()
        assert line.startswith(f"OUT rank {rank}") and f"ERR rank {rank}" in (folder / "stderr.log").read_text()
        env = json.loads(line.split(" ", 3)[3])
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == \
            ("2", "2", "0", "1")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "2")
        assert env["TORCHELASTIC_RUN_ID"] == "probe" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"

    failure = bad_out.text()
    summary = failure[failure.index("dprun: job failed"):]
    assert "rank 1 on node0 (local rank 1" in summary and "exit code 1: ValueError: boom from rank 1" in summary
    assert "| Traceback (most recent call last):" in summary and "| ValueError: boom from rank 1" in summary
    assert str(tmp_path / "badlogs" / "bad" / "node0" / "attempt_0" / "1" / "stderr.log") in summary


@pytest.mark.timeout(120)
def test_a_plain_workers_own_death_fails_its_node_at_once_not_after_the_heartbeat_timeout(procs, tmp_path):
    # its agent holds back a crash that a dead peer may explain for --heartbeat-timeout; a SIGKILL it is not
    events = tmp_path / "events.jsonl"
    proc, out = dprun(procs, tmp_path, "--nnodes", 2, "--spares", 1, "--heartbeat-timeout", 60, "--events-file",
                      events, "--rdzv-id", "own", PLAIN_DDP, "--steps", 40, "--step-time", 0.05)
    wait_for(lambda: out.first(r"^step 5 "), timeout=60, what=f"step 5 of the plain script:\n{out.text()[-3000:]}")
    (agent,) = [e["pid"] for e in read_events(events) if e["event"] == "node_joined" and e["node"] == "node1"]
    (worker,) = psutil.Process(agent).children()
    worker.kill()
    assert finish(proc, out, timeout=90) == 0, out.text()[-4000:]

    ev = read_events(events)
    (failed,) = [e for e in ev if e["event"] == "node_failed"]
    (done,) = [e for e in ev if e["event"] == "recovery_complete"]
    assert failed["node"] == "node1" and "killed by SIGKILL" in failed["cause"]
    assert done["phases"]["detect_s"] < 10, done
    assert "stands on its own" not in out.text()
    assert {e["job"] for e in ev} == {"own"} and [e["seq"] for e in ev] == list(range(len(ev))), "stamped per run"
    for held in (e for e in ev if e["event"] == "peer_error"):  # a survivor's crash, held: it may be the peer's doing
        assert held["node"] == "node0" and held["held"], held
