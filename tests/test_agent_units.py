"""Unit tests of the agent's pure parts: worker env and command, heartbeat timers, channel drops, event pipe,
what a failed worker's stderr is summed up as."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time

import psutil
import pytest
import zmq

from dpcommon.channel import Channel, poll_ms
from dpagent.loop_events import EventPipe
from dpagent.liveness import Liveness
from dpagent.output import crash_exception, failure_detail
from dpcommon.protocol import (
    PROTOCOL_VERSION, REFUSAL, REFUSALS, Codec, Ping, Pong, ProtocolError, Refused, Standby, WorkerExited,
    describe_end, refusal,
)
from dpagent.restart import may_be_a_peers_doing
from dpagent.workers import WorkerGroup, describe_exit, is_loopback, worker_command, worker_env


def env(base=None, nproc=2, local_addr="127.0.0.1", local_rank=1):
    return worker_env(
        base or {"PATH": "/bin"}, node_id="n1", endpoint="ipc:///tmp/x/agent-n1.sock", token="tok",
        job_id="job7", role="spare", nproc=nproc, local_rank=local_rank, local_addr=local_addr,
    )


def test_worker_env_has_the_contract_variables():
    e = env()
    assert e["PATH"] == "/bin"
    assert {k: e[k] for k in ("DP_NODE_ID", "DP_AGENT_ENDPOINT", "DP_JOB_TOKEN", "DP_JOB_ID", "DP_ROLE")} == {
        "DP_NODE_ID": "n1", "DP_AGENT_ENDPOINT": "ipc:///tmp/x/agent-n1.sock", "DP_JOB_TOKEN": "tok",
        "DP_JOB_ID": "job7", "DP_ROLE": "spare",
    }
    assert (e["DP_NPROC_PER_NODE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == ("2", "1", "2")
    assert e["TORCHELASTIC_RUN_ID"] == "job7"
    assert e["OMP_NUM_THREADS"] == "1"
    assert e["GLOO_SOCKET_IFNAME"] == "lo"
    assert "RANK" not in e and "WORLD_SIZE" not in e  # dpstate.init() sets them once the rank is known


def test_worker_env_omp_and_gloo_rules():
    assert "OMP_NUM_THREADS" not in env(nproc=1)
    assert env({"DP_TOTAL_LOCAL_WORKERS": "4"}, nproc=1)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env({"DP_TOTAL_LOCAL_WORKERS": "1"}, nproc=1)
    assert env({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"  # the user's setting wins
    assert env({"GLOO_SOCKET_IFNAME": "eth0"})["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "GLOO_SOCKET_IFNAME" not in env(local_addr="10.1.2.3")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("192.168.1.1")


def test_worker_command_and_exit_description():
    assert worker_command("train.py", ["--lr", "1"], "/usr/bin/python3") == ["/usr/bin/python3", "-u", "train.py", "--lr", "1"]
    assert worker_command("./run.sh", ["a"], None) == ["./run.sh", "a"]
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_a_workers_last_line_is_given_as_its_cause_only_where_it_ended_itself():
    """A SIGKILL comes from outside (the OOM killer, a kill -9): whatever the worker printed last is no cause."""
    said = "dpstate: snapshot interval every 3 step(s)"
    assert describe_end(-9, said) == f"killed by SIGKILL (its last line before: {said})"
    assert describe_end(-15, said) == f"killed by SIGTERM (its last line before: {said})"
    assert describe_end(1, "ValueError: bad batch") == "exit code 1: ValueError: bad batch"
    assert describe_end(-6, "terminate called") == "killed by SIGABRT: terminate called"  # its own abort
    assert describe_end(-9, "") == describe_end(-9, "killed by SIGKILL") == "killed by SIGKILL"
    assert describe_end(-9, said, oom_killed=True) == (f"killed by the kernel's OOM killer: out of memory (its last "
                                                       f"line before: {said})")
    assert describe_end(-9, "killed by SIGKILL", oom_killed=True) == "killed by the kernel's OOM killer: out of memory"


def test_liveness_beats_and_loss():
    live = Liveness(interval=1.0, timeout=3.0, now=100.0)
    assert live.beat_due(100.0)
    live.beat_sent(100.0)
    assert not live.beat_due(100.5) and live.beat_due(101.0)
    assert live.next_deadline() == 101.0
    assert not live.lost(102.9)
    live.heard(102.0)
    assert not live.lost(104.9) and live.lost(105.0)
    assert live.silent_for(104.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        Liveness(0, 1, 0)


def test_a_pause_of_the_agent_itself_is_not_counted_as_the_controllers_silence():
    """Its loop turns at least every interval; a turn 8 s late means the agent did not run (SIGSTOP, a paused
    VM): the controller, paused with it or not, is given its timeout again from the pause's end."""
    live = Liveness(interval=0.5, timeout=3.0, now=100.0)
    live.heard(100.0)
    for t in (100.5, 101.0):
        live.turned(t)
    live.turned(109.0)  # 8 s without a turn
    assert not live.lost(109.0) and live.silent_for(109.0) == pytest.approx(1.5)  # 1.0 before, 0.5 an interval
    live.turned(109.5)
    assert live.lost(110.6)  # silent since: lost at the timeout as usual
    steady = Liveness(interval=0.5, timeout=3.0, now=100.0)
    for t in (100.5, 101.0, 101.5, 102.0, 102.5, 103.0):  # turning on time: nothing credited
        steady.turned(t)
    assert steady.lost(103.0)


@contextlib.contextmanager
def _router_and_peer():
    """A ROUTER and a DEALER with identity b"peer" connected to it (inproc)."""
    ctx = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind("inproc://ch")
        dealer.setsockopt(zmq.IDENTITY, b"peer")
        dealer.connect("inproc://ch")
        yield router, dealer
    finally:
        ctx.destroy(linger=0)


def test_channel_drops_and_counts_bad_messages():
    with _router_and_peer() as (router, dealer):
        drops = []
        server = Channel(router, Codec("good"), "server", on_drop=lambda ch, why: drops.append(why))
        client = Channel(dealer, Codec("good"), "client")
        dealer.send_multipart(Codec("evil").encode(Ping(1)))  # wrong token
        dealer.send_multipart([b"garbage"])
        dealer.send_multipart([b"DP" + bytes([PROTOCOL_VERSION + 1]), b"Ping", b"{}", b"x" * 32])  # another version
        client.send(Ping(2))
        got = server.recv(timeout=2.0)
        assert got.msg == Ping(2) and got.sender == b"peer"
        assert server.dropped == 3 and len(drops) == 3
        assert "MAC" in drops[0] and "version" in drops[2]
        assert client.refused == ""
        server.reply(got, Pong("n", 2))
        assert client.recv(timeout=2.0).msg == Pong("n", 2)
        with pytest.raises(ValueError):
            server.send(Pong("n", 3))  # a ROUTER needs to know whom to send to


@pytest.mark.parametrize("sizes", [["1"], [1.5], [True], "12", [[1]], [1, None]])
def test_a_standby_whose_sizes_are_not_whole_numbers_is_refused(sizes):
    codec = Codec("token")
    assert codec.decode(codec.encode(Standby([0, 5 << 30])))[0] == Standby([0, 5 << 30])
    with pytest.raises(ProtocolError, match="Standby.snapshot_bytes"):
        codec.decode(codec.encode(Standby(sizes)))


def test_a_peer_that_fails_authentication_is_told_why_by_a_refusal_only_a_known_code_makes():
    """The controller answers a message it cannot authenticate with an unsigned refusal naming why (another
    job's token, another protocol version); the agent's channel remembers its code (the agent heeds it only
    before its Welcome). A refusal of an unknown kind, or the frames of any other peer, sets nothing."""
    codec = Codec("good")
    for frames, code in ((Codec("evil").encode(Ping(1)), "token"),
                         ([b"DP" + bytes([PROTOCOL_VERSION + 1]), b"Ping", b"{}", b"x" * 32], "version")):
        with pytest.raises(ProtocolError) as caught:
            codec.decode(frames)
        assert caught.value.refusal == code and not isinstance(caught.value, Refused)
        with pytest.raises(Refused, match=re.escape(REFUSALS[code])) as told:
            Codec("evil").decode(refusal(caught.value.refusal))  # any token reads it: it is not signed
        assert told.value.code == code
    with pytest.raises(ProtocolError, match="unknown kind") as unknown:
        codec.decode([REFUSAL, b"you smell"])
    assert not isinstance(unknown.value, Refused)
    with pytest.raises(ProtocolError) as malformed:
        codec.decode([b"garbage"])
    assert malformed.value.refusal == "", "nobody is told anything for noise"
    with _router_and_peer() as (router, dealer):
        client = Channel(dealer, Codec("evil"), "client")
        router.send_multipart([b"peer", *refusal("unknown")])
        router.send_multipart([b"peer", *refusal("token")])
        assert client.recv(timeout=0.5) is None
        assert client.refused == "token" and client.dropped == 2


def test_poll_timeouts_round_up_so_that_a_loop_waiting_for_a_deadline_does_not_spin():
    assert poll_ms(100.0004, 100.0) == 1  # pyzmq truncates 0.4 ms to 0: a poll that returns at once
    assert poll_ms(100.05, 100.0) == 50 and poll_ms(99.0, 100.0) == 0
    ctx = zmq.Context()
    try:
        idle = ctx.socket(zmq.PULL)
        idle.bind("inproc://idle")
        poller = zmq.Poller()
        poller.register(idle, zmq.POLLIN)
        for _ in range(5):  # as the controller's loop waits for its next tick, with no message coming
            deadline, wakeups = time.monotonic() + 0.0207, 0
            while time.monotonic() < deadline:
                poller.poll(poll_ms(deadline, time.monotonic()))
                wakeups += 1
            assert wakeups <= 3, wakeups  # truncating, the last millisecond took hundreds of polls
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow  # starts worker processes
def test_workers_are_stopped_while_paused_and_go_on_after():
    """While the agent writes a stopping job's files its workers are stopped for real (the kernel says so
    before the block starts), also when the block fails; a worker that exited meanwhile is no error."""
    ctx = zmq.Context()
    pipe = EventPipe(ctx)
    group = WorkerGroup(pipe)
    spin = [sys.executable, "-c", "while True: pass"]
    workers = [group.spawn(i, spin, dict(os.environ)) for i in range(2)]
    try:
        with pytest.raises(OSError):
            with group.paused():
                assert [psutil.Process(w.pid).status() for w in workers] == [psutil.STATUS_STOPPED] * 2
                raise OSError("the disk is full")
        assert psutil.STATUS_STOPPED not in [psutil.Process(w.pid).status() for w in workers]
        with group.paused():
            workers[1].popen.kill()
            workers[1].popen.wait()
        assert psutil.Process(workers[0].pid).status() != psutil.STATUS_STOPPED
    finally:
        for w in workers:
            w.popen.kill()
        done, deadline = [], time.monotonic() + 10
        while len(done) < len(workers) and time.monotonic() < deadline:  # each waiter thread says so
            pipe.wake.poll(100)
            done += pipe.drain()
        pipe.close()
        ctx.destroy(linger=0)


@pytest.mark.slow  # starts worker processes
def test_workers_frozen_for_a_save_stay_stopped_past_a_pause_until_thawed():
    """A stopping job's save freezes a node's workers (but one asked to write its own copy) until the Stop: a
    pause for the files' write inside that does not let them go on; thaw does, for the ranks it names."""
    ctx = zmq.Context()
    pipe = EventPipe(ctx)
    group = WorkerGroup(pipe)
    spin = [sys.executable, "-c", "while True: pass"]
    workers = [group.spawn(i, spin, dict(os.environ)) for i in range(3)]

    def assert_stopped(expected: list[bool], why: str = "") -> None:  # (a signal's effect waited for, <= 10 s)
        deadline = time.monotonic() + 10
        while (seen := [psutil.Process(w.pid).status() == psutil.STATUS_STOPPED for w in workers]) != expected:
            assert time.monotonic() < deadline, (seen, why)
            time.sleep(0.01)

    try:
        group.freeze(spare={2})
        assert_stopped([True, True, False])
        with group.paused():
            assert_stopped([True, True, True])
        assert_stopped([True, True, False], "the pause ended, the freeze did not")
        group.thaw([1])
        assert_stopped([True, False, False])
        group.thaw()
        assert_stopped([False, False, False])
    finally:
        for w in workers:
            w.popen.kill()
        done, deadline = [], time.monotonic() + 10
        while len(done) < len(workers) and time.monotonic() < deadline:
            pipe.wake.poll(100)
            done += pipe.drain()
        pipe.close()
        ctx.destroy(linger=0)


def test_event_pipe_wakes_the_loop_from_a_thread():
    ctx = zmq.Context()
    try:
        pipe = EventPipe(ctx)
        poller = zmq.Poller()
        poller.register(pipe.wake, zmq.POLLIN)

        def post():
            time.sleep(0.05)
            with pipe.sender() as sender:
                sender.post("a")
                sender.post("b")

        threading.Thread(target=post).start()
        t0 = time.monotonic()
        assert poller.poll(2000)
        assert time.monotonic() - t0 < 1.0
        events = []
        deadline = time.monotonic() + 2
        while len(events) < 2 and time.monotonic() < deadline:
            events += pipe.drain()
        assert events == ["a", "b"]
        pipe.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow  # starts a python process
def test_the_agent_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dpagent.__main__, dpagent.agent; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


KEEPS_FREED_MEMORY = r'''
import ctypes, ctypes.util, os, sys
from dpcommon.memory import reuse_freed_memory
if not reuse_freed_memory():
    print("skip"); sys.exit(0)
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
statm = os.open("/proc/self/statm", os.O_RDONLY)  # read without malloc: nothing lands above the block
rss = lambda: int(os.pread(statm, 100, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = libc.malloc(200 << 20)  # a received snapshot: from the heap (no mmap), every page touched
libc.memset(block, 1, 200 << 20)
held = rss()
libc.free(block)
print(held - rss())
'''


@pytest.mark.slow  # starts a python process
@pytest.mark.timeout(60)
def test_a_holder_keeps_the_memory_of_a_dropped_snapshot_for_the_next_one():
    """glibc: a freed snapshot at the top of the heap stays with the process (no trim), so the next one is
    received into pages already faulted in. (A threshold of 1 << 62 was masked to 0 by ctypes: trim always.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KEEPS_FREED_MEMORY], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("this C library has no mallopt")
    assert int(out.stdout) < 20 << 20, f"{int(out.stdout) >> 20} MB went back to the OS"


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (always / madvise / never), "" where there is none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def _vma_fields(address: int) -> dict[str, str]:
    """/proc/self/smaps's fields for the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            if inside:
                fields["range"] = head
        elif inside:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.timeout(30)
def test_a_fresh_snapshot_buffer_is_private_and_asks_for_huge_pages():
    """A restore's fetch writes a new buffer end to end: private anonymous memory (Python's default anonymous
    mmap is shared, which THP's usual "madvise" mode leaves at 4 KB pages) that the kernel may back with 2 MB
    pages."""
    import ctypes

    from dpcommon.memory import huge_page_buffer

    buf = huge_page_buffer(8 << 20)
    assert len(buf) == 8 << 20
    buf[:4] = b"abcd"
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps here")
    vma = _vma_fields(address)
    assert int(vma["Shared_Dirty"].split()[0]) == 0 and int(vma["Private_Dirty"].split()[0]) > 0, vma
    if _thp_mode() in ("always", "madvise") and "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma


@pytest.mark.timeout(30)
def test_a_plain_host_slot_lives_in_a_huge_page_buffer_and_lets_it_go():
    """Slot.reserve without pinning or sharing: the tensor is a view of a huge_page_buffer of the size asked,
    writable, and the mapping goes away once the slot is released."""
    import gc

    from dpstate.replication.fetch import Slot

    slot = Slot()
    slot.reserve(8 << 20, pin=False)
    assert slot.buffer.numel() == 8 << 20
    slot.buffer.fill_(7)
    address = slot.buffer.data_ptr()
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps here")
    vma = _vma_fields(address)
    assert int(vma["Size"].split()[0]) * 1024 >= 8 << 20 and int(vma["Shared_Dirty"].split()[0]) == 0, vma
    if _thp_mode() in ("always", "madvise") and "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma
    slot.release()
    gc.collect()
    assert _vma_fields(address).get("range") != vma["range"], "the buffer stayed mapped"


CRASH_AFTER_RAISE = """step 4 loss 0.31
[rank0]: Traceback (most recent call last):
[rank0]:   File "/job/bug.py", line 12, in <module>
[rank0]:     raise ValueError("bad batch at step 5")
[rank0]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: ValueError: bad batch at step 5
terminate called without an active exception
"""


def summary(tail: str, exitcode: int) -> str:
    """What the agent reports as a failed worker's detail (dpagent.worker_link)."""
    return failure_detail(tail, crash_exception(tail, exitcode))


def test_a_worker_that_crashed_while_exiting_on_an_exception_is_summed_up_by_the_exception():
    assert summary(CRASH_AFTER_RAISE, -6) == (
        "[rank0]: ValueError: bad batch at step 5 (then: terminate called without an active exception)")
    assert summary(CRASH_AFTER_RAISE, -11).startswith("[rank0]: ValueError: bad batch at step 5 (then: ")
    assert crash_exception(CRASH_AFTER_RAISE, -6) == "[rank0]: ValueError: bad batch at step 5"
    assert crash_exception(CRASH_AFTER_RAISE, 1) == crash_exception(CRASH_AFTER_RAISE, -9) == "", \
        "an exit code says itself that the script raised; a kill came from outside"


def test_otherwise_a_failed_worker_is_summed_up_by_its_last_line():
    assert summary(CRASH_AFTER_RAISE, -9) == "terminate called without an active exception", \
        "a SIGKILL came from outside: its last line is what it was doing"
    raised = CRASH_AFTER_RAISE.replace("terminate called without an active exception\n", "")
    assert summary(raised, 1) == "[rank0]: ValueError: bad batch at step 5"
    assert summary(raised, -6) == "[rank0]: ValueError: bad batch at step 5", "said once"
    chained = "Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 1\n\nDuring handling " \
              "of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n" \
              "  File \"a.py\", line 3\nRuntimeError: two\nSegmentation fault\n"
    assert summary(chained, -11) == "RuntimeError: two (then: Segmentation fault)", "the last traceback's"
    assert summary("free(): invalid pointer\n\n", -6) == "free(): invalid pointer"
    assert summary("", -6) == ""


WARMED = "dpstate: spare worker 0 faulted in 4 MB of heap for its first step while idle (heap 120 MB)"


@pytest.mark.parametrize("prefix", ["", "[rank1]: ", "[rank1]: [rank1]:  "])
def test_dpstate_notices_are_passed_over_for_the_detail_but_kept_in_the_tail(prefix):
    """A spare prints notices its predecessor did not: the same sys.exit(3) must read alike on both nodes."""
    notices = f"{prefix}{WARMED}\n{prefix}dpstate: snapshot interval every 3 step(s)\n"
    assert summary(notices, 3) == summary("", 3) == "", "as with nothing printed: the agent says 'exit code 3'"
    assert summary(f"step 4 loss 0.31\n{prefix}bad config, quitting\n{notices}\n", 3) == \
        f"{prefix}bad config, quitting"
    assert summary(f"{prefix}bad config, quitting\n", 3) == summary(f"{prefix}bad config, quitting\n{notices}", 3)
    error = f"{prefix}RuntimeError: dpstate: rank 0 cannot be restored to step 5: snapshots are off"
    assert summary(f"{error}\n{notices}", 1) == error, "dpstate's errors are exception lines: kept"
    crashed = CRASH_AFTER_RAISE.replace("terminate called without an active exception\n", notices)
    assert summary(crashed, -6) == "[rank0]: ValueError: bad batch at step 5", "said once"


def test_the_lines_dpstate_ends_a_worker_with_are_its_detail():
    ended = "dpstate: rank 1: no Reconfigure within 60 s (DP_RECONFIGURE_TIMEOUT) after a failure in generation 2"
    assert summary(f"{WARMED}\n{ended}\n", 1) == ended, "a SystemExit's message (dpstate.steps.session)"
    stop = "dpstate: Stop (the job stops) and the main thread did not exit in 30 s; exiting with 143"
    assert summary(f"{stop}\n", 143) == stop, "os._exit's notice (dpstate.steps.agent_link)"


def test_a_plain_scripts_crash_is_held_for_a_dead_peer_only_where_one_could_have_caused_it():
    def exited(code, tail="", oom=False):
        return WorkerExited("n", 0, 0, 1, code, "x", stderr_tail=tail, oom_killed=oom)

    gloo = "Traceback (most recent call last):\n  File \"t.py\"\n[rank0]: RuntimeError: Connection closed by peer"
    assert may_be_a_peers_doing(exited(1, gloo), world_size=2)
    assert may_be_a_peers_doing(exited(1), world_size=2), "no traceback: it may be"
    assert may_be_a_peers_doing(exited(-6), world_size=2), "SIGABRT: NCCL's watchdog"
    assert not may_be_a_peers_doing(exited(1, gloo), world_size=1), "no peer"
    assert not may_be_a_peers_doing(exited(-9), world_size=2), "a signal from outside"
    assert not may_be_a_peers_doing(exited(-15), world_size=2)
    assert not may_be_a_peers_doing(exited(-9, oom=True), world_size=2)
    for own in ("ModuleNotFoundError: No module named 'x'", "[rank1]: SyntaxError: invalid syntax",
                "NameError: name 'y' is not defined"):
        assert not may_be_a_peers_doing(exited(1, "Traceback (most recent call last):\n  File \"t\"\n" + own), 2)
