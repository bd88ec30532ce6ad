"""dpstate.steps.watch.FutureWatcher: follow-ups run once a backend future completes, and the polling backs off
while nothing completes (it used to cost ~10 % of a core through every backward) but not after a new watch."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dpstate.steps.watch import FutureWatcher

pytestmark = pytest.mark.timeout(30)


def test_a_follow_up_runs_once_its_future_completes_and_an_unwatched_one_never_does():
    watcher = FutureWatcher()
    done, forgotten = torch.futures.Future(), torch.futures.Future()
    ran = threading.Event()
    calls: list[object] = []
    watcher.watch(done, lambda fut: (calls.append(fut.value()), ran.set()))
    token = watcher.watch(forgotten, lambda fut: calls.append("forgotten"))
    watcher.unwatch(token)
    forgotten.set_result("late")
    done.set_result(42)
    assert ran.wait(5)
    assert calls == [42]
    assert watcher.pending == 0


def test_polling_backs_off_while_nothing_completes_and_closes_in_again_on_a_new_watch():
    watcher = FutureWatcher(poll_s=0.05, max_poll_s=0.4)  # coarse, so that no scheduling delay can flip it
    pending = torch.futures.Future()
    watcher.watch(pending, lambda fut: None)
    backed_off = threading.Event()

    def check():
        while not backed_off.is_set():
            if watcher._sleep_s >= watcher.max_poll_s:
                backed_off.set()
            threading.Event().wait(0.01)

    checker = threading.Thread(target=check, daemon=True)
    checker.start()
    assert backed_off.wait(5), f"still polling every {watcher._sleep_s * 1e3:.2f} ms"
    checker.join(5)

    second = torch.futures.Future()
    ran = threading.Event()
    watcher.watch(second, lambda fut: ran.set())
    assert watcher._sleep_s <= 1.5 * watcher.poll_s  # the next bucket's op: polled closely from the start
    second.set_result(None)
    assert ran.wait(5)
    pending.set_result(None)


def test_close_waits_for_the_follow_up_in_flight_and_later_watches_start_no_thread():
    watcher = FutureWatcher()
    inside, release, finished = threading.Event(), threading.Event(), threading.Event()
    fut = torch.futures.Future()
    watcher.watch(fut, lambda f: (inside.set(), release.wait(5), finished.set()))
    fut.set_result(1)
    assert inside.wait(5)
    closer = threading.Thread(target=watcher.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not finished.is_set()  # close() waits while the follow-up runs
    release.set()
    closer.join(5)
    assert not closer.is_alive() and finished.is_set() and not watcher._thread.is_alive()
    late = torch.futures.Future()
    watcher.watch(late, lambda f: pytest.fail("a closed watcher ran a follow-up"))
    late.set_result(2)
    assert not watcher._thread.is_alive()


@pytest.mark.slow  # three torch processes: ~14 s
@pytest.mark.timeout(60)
def test_a_process_that_exits_while_a_follow_up_completes_a_future_ends_cleanly():
    """Seen in 3-4 of 20 torchrun runs of examples/train_gpt.py (gdb on the core: the watcher thread taking the
    GIL back inside set_result during finalization); tests/data/watcher_exit_race.py makes it certain (it
    aborts with exit 134 without the close at exit)."""
    repo = Path(__file__).resolve().parents[1]
    script = repo / "tests" / "data" / "watcher_exit_race.py"
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script), str(repo)], capture_output=True, text=True, timeout=50)
        assert proc.returncode == 0 and "main thread done" in proc.stdout, proc.stdout + proc.stderr



# dprun status: which records in the state dir count as running jobs, and its --json output with a NaN in it.


def _write_record(folder: Path, name: str, pid: int, started: float | None = None) -> None:
    import json

    record = {"job_id": name, "endpoint": "127.0.0.1:1", "pid": pid}
    if started is not None:
        record["started"] = started
    (folder / f"{name}.json").write_text(json.dumps(record))


@pytest.mark.slow  # starts a python process
def test_a_record_written_by_a_live_dprun_counts_and_stops_counting_once_it_is_killed(tmp_path, monkeypatch):
    """The record is written by StatusFeed.register in a real process; after its kill -9 the record is stale."""
    from dprun.monitor.status import running_jobs

    monkeypatch.setenv("DPRUN_STATE_DIR", str(tmp_path))
    code = ("import sys, time; from dprun.monitor.status import StatusFeed; feed = StatusFeed('127.0.0.1'); "
            "feed.register('sub', ['train.py']); print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert [(job["job_id"], job["pid"]) for job in running_jobs()] == [("sub", proc.pid)]
    finally:
        proc.kill()
        proc.wait(10)
    assert running_jobs() == []
    assert list(tmp_path.iterdir()) == [], "the stale record is removed"


def test_a_record_whose_pid_is_now_a_thread_or_a_later_process_does_not_count(tmp_path, monkeypatch):
    import os
    import time

    import psutil

    from dprun.monitor.status import running_jobs

    monkeypatch.setenv("DPRUN_STATE_DIR", str(tmp_path))
    me = psutil.Process()
    ready, done, tids = threading.Event(), threading.Event(), []

    def thread():
        tids.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    helper = threading.Thread(target=thread)
    helper.start()
    assert ready.wait(10)
    try:
        os.kill(tids[0], 0)  # what used to be the check: a thread's id passes it
        assert tids[0] != me.pid and not psutil.pid_exists(tids[0])
        _write_record(tmp_path, "genuine", me.pid, time.time())  # as this process would write it now
        _write_record(tmp_path, "thread", tids[0], time.time())  # a dead dprun's pid, now a thread's id
        _write_record(tmp_path, "later", me.pid, me.create_time() - 3600)  # a process started after the record
        _write_record(tmp_path, "thread-old", tids[0])  # an old record without "started"
        assert [job["job_id"] for job in running_jobs()] == ["genuine"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["genuine.json"], "stale records are removed"
    finally:
        done.set()
        helper.join(10)


@pytest.mark.slow  # starts python processes
def test_a_record_without_a_start_time_counts_only_while_its_pid_runs_dprun(tmp_path, monkeypatch):
    from dprun.monitor.status import running_jobs

    monkeypatch.setenv("DPRUN_STATE_DIR", str(tmp_path))
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    dprun_like = subprocess.Popen([*sleep, "/usr/local/bin/dprun", "train.py"])
    other = subprocess.Popen([*sleep, "something-else"])
    try:
        _write_record(tmp_path, "dprun", dprun_like.pid)
        _write_record(tmp_path, "other", other.pid)
        assert [job["job_id"] for job in running_jobs()] == ["dprun"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dprun.json"]
    finally:
        for proc in (dprun_like, other):
            proc.kill()
            proc.wait(10)


def test_dprun_status_json_is_valid_json_when_the_model_holds_nan_and_infinity(capsys):
    """A diverging loss and a rate over no time reach `dprun status --json` as null, not NaN / Infinity."""
    import json

    from dprun.monitor.status import StatusFeed, attach

    feed = StatusFeed("127.0.0.1")
    stop = threading.Event()

    def publish():
        while not stop.is_set():
            feed.publish({"job_id": "j", "metrics": {"loss": float("nan"), "tokens_per_s": float("inf")},
                          "rates": [float("-inf"), 1.5]})
            stop.wait(0.05)

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        assert attach(feed.endpoint, once=True, as_json=True, timeout=10) == 0
    finally:
        stop.set()
        publisher.join(10)
        feed.close()
    out = capsys.readouterr().out
    model = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON: {out}"))
    assert model["metrics"] == {"loss": None, "tokens_per_s": None} and model["rates"] == [None, 1.5]
