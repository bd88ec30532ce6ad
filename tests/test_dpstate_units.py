"""In-process units of dpstate: the abort signal and its waits, failure classification, Step semantics,
the control thread against a ROUTER playing the agent, and the bounded wait for a Reconfigure."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import zmq

import dpstate
from dpcommon import protocol as P
from dpstate.steps.abort import ABORT_MARKER, Aborted, AbortSignal, classify, describe
from dpstate.replication.holders import HolderGone
from dpstate.steps.agent_link import Control
from dpstate.steps.metrics import MAX_METRIC_BYTES, MAX_METRICS_BYTES, sendable_metrics
from dpstate.steps.session import Job, Step
from dpstate.steps.uncaught import hint_unwrapped_steps
from helpers.fake_agents import TOKEN

pytestmark = pytest.mark.timeout(30)


def later(seconds: float, fn, *args) -> None:
    t = threading.Timer(seconds, fn, args=args)
    t.daemon = True
    t.start()


# ----------------------------------------------------------------------------- abort signal


def test_signal_follows_generations():
    sig = AbortSignal()
    sig.enter(0)
    assert not sig.is_set()
    sig.request(1, "node n1 lost")
    assert sig.is_set() and "generation 1" in sig.reason
    with pytest.raises(Aborted, match=ABORT_MARKER):
        sig.check()
    sig.enter(1)
    assert not sig.is_set()
    sig.request(1)  # the same generation again: nothing new
    sig.request(0)
    assert not sig.is_set()
    sig.request(3)
    sig.enter(2)  # entering 2 while 3 is already asked for: still aborted
    assert sig.is_set()
    sig.enter(3)
    sig.stop("end of job")
    assert sig.is_set() and sig.stopped


def test_callbacks_fire_on_every_abort_until_removed():
    sig = AbortSignal()
    fired = []
    token = sig.add_callback(lambda: fired.append(1))
    sig.request(1)
    sig.enter(1)
    sig.request(2)
    sig.remove_callback(token)
    sig.enter(2)
    sig.request(3)
    assert fired == [1, 1]


def test_waits_are_released_by_the_signal_and_time_out():
    sig = AbortSignal()
    fut = torch.futures.Future()
    later(0.1, sig.trigger, "test")
    t0 = time.monotonic()
    with pytest.raises(Aborted):
        sig.wait_future(fut)
    assert time.monotonic() - t0 < 0.5
    sig.enter(sig.target)

    done = torch.futures.Future()
    later(0.05, done.set_result, 42)
    assert sig.wait_future(done) == 42
    failed = torch.futures.Future()
    failed.set_exception(RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="reset"):
        sig.wait_future(failed)
    with pytest.raises(TimeoutError):
        sig.wait_future(torch.futures.Future(), timeout=0.1)

    cond, state = threading.Condition(), {"ok": False}
    later(0.1, sig.trigger, "again")
    with pytest.raises(Aborted):
        sig.wait_for(cond, lambda: state["ok"])
    with pytest.raises(Aborted):
        sig.sleep(10)


def test_classify_tells_aborts_and_peer_errors_from_bugs():
    sig = AbortSignal()
    assert classify(Aborted("x"), sig) == "abort"
    assert classify(RuntimeError(f"Unable to cast {ABORT_MARKER}: generation 2 to Tensor"), sig) == "abort"
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5000"
    assert classify(RuntimeError(gloo), sig) == "peer"
    assert classify(RuntimeError("Connection reset by peer"), sig) == "peer"
    assert classify(dist.DistStoreError("store gone"), sig) == "peer"
    assert classify(ValueError("bad shape"), sig) is None
    assert classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), sig) is None
    gone = HolderGone("tcp://127.0.0.1:5000", 3, 7)
    assert classify(gone, sig) == "peer"
    wrapped = RuntimeError(f"Unable to cast {gone} to Tensor")  # through a DDP comm hook's future (dpstate.groups.ddp)
    assert classify(wrapped, sig) == "peer"
    assert describe(wrapped) == str(gone) == describe(gone).removeprefix("HolderGone: ")
    assert describe(ValueError("bad shape")) == "ValueError: bad shape"
    assert classify(KeyboardInterrupt(), sig) is None
    sig.trigger("reconfigure")
    assert classify(RuntimeError("anything torch raises while aborted"), sig) == "abort"
    assert classify(ValueError("a user bug stays a bug"), sig) is None


IN_TORCH = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")


def _raised_from(filename: str, exc: Exception) -> Exception:
    """`exc` as raised by code in `filename` (its traceback's frame is there)."""
    namespace: dict = {}
    exec(compile("def throw(exc):\n    raise exc\n", filename, "exec"), namespace)
    try:
        namespace["throw"](exc)
    except Exception as raised:  # noqa: BLE001
        return raised
    raise AssertionError("not raised")


def test_a_script_error_that_reads_like_a_peer_s_is_the_script_s_unless_torch_or_dpstate_raised_it():
    """A data loader's own 'Connection reset by peer' is the script's error: before, it was taken for a peer
    failure, every rank rolled back, and the job ended saying to check the Gloo ports."""
    import dpstate

    sig, text = AbortSignal(), "fetching shard 17: Connection reset by peer"
    assert classify(_raised_from("/home/me/train.py", RuntimeError(text)), sig) is None
    assert classify(_raised_from("/home/me/train.py", ConnectionError(text)), sig) is None
    assert classify(_raised_from(IN_TORCH, RuntimeError(text)), sig) == "peer"
    in_dpstate = os.path.join(os.path.dirname(dpstate.__file__), "steps", "watch.py")
    assert classify(_raised_from(in_dpstate, RuntimeError(text)), sig) == "peer"
    assert classify(_raised_from("/home/me/train.py", dist.DistNetworkError(text)), sig) == "peer"  # its type


# ----------------------------------------------------------------------------- Step and standalone jobs


class _Stub:
    _standalone = False

    def __init__(self):
        self._abort = AbortSignal()


def test_step_swallows_only_reconfiguration_and_peer_failures():
    job = _Stub()
    with Step(job, 1) as step:
        raise _raised_from(IN_TORCH, RuntimeError("Connection closed by peer"))  # (Gloo's, through torch)
    assert isinstance(step.failure, RuntimeError)
    with pytest.raises(ValueError):
        with Step(job, 2):
            raise ValueError("user bug")
    with pytest.raises(KeyboardInterrupt):
        with Step(job, 3):
            raise KeyboardInterrupt
    job._abort.trigger("x")
    with Step(job, 4) as step:
        raise Aborted("x")
    assert step.failure is not None
    step.log(loss=torch.tensor(1.5), tokens=10)
    assert step.metrics == {"loss": torch.tensor(1.5), "tokens": 10}


def test_big_metrics_are_dropped_with_one_warning_per_name(capsys, monkeypatch):
    """A Progress must reach the agent (body limit 1 MiB) whatever step.log() was given: a metric over
    MAX_METRIC_BYTES as JSON is dropped, all of them if together over MAX_METRICS_BYTES; each name said once."""
    monkeypatch.setattr("dpstate.steps.metrics._warned_metrics", set())
    logged = {"loss": torch.tensor(1.5), "lr": 3e-4, "tokens": 10, "nan": float("nan"), "ok": True, "none": None,
              "name": "run-1", "vec": torch.tensor([1.0, 2.0]), "obj": object(),
              "big": list(range(200000)), "text": "x" * 5000, "huge": torch.zeros(1000)}
    for _ in range(2):
        kept = sendable_metrics(logged)
        assert sorted(kept) == ["loss", "lr", "name", "nan", "none", "obj", "ok", "tokens", "vec"]
        assert kept["loss"] == 1.5 and kept["vec"] == [1.0, 2.0] and kept["nan"] != kept["nan"]
        assert kept["obj"].startswith("<object object")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err  # big, text and huge: once each over the two steps
    assert err[0].startswith("dpstate: step.log(big=...) is ") and f"over {MAX_METRIC_BYTES}: not sent" in err[0]
    assert [line.split("=")[0] for line in err] == ["dpstate: step.log(big", "dpstate: step.log(text",
                                                    "dpstate: step.log(huge"]
    assert sendable_metrics({"text": "y" * 9000, "loss": 2.0}) == {"loss": 2.0}  # named before: silent
    assert capsys.readouterr().err == ""

    many = {f"m{i}": "z" * (MAX_METRIC_BYTES - 2) for i in range(MAX_METRICS_BYTES // MAX_METRIC_BYTES + 1)}
    assert sendable_metrics(many) == {} and sendable_metrics(many) == {}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dpstate: step.log(m0, m1,") and "together" in err[0], err


def test_standalone_job_is_world_one_and_lets_errors_through(monkeypatch):
    monkeypatch.delenv("DP_AGENT_ENDPOINT", raising=False)
    monkeypatch.setattr(dpstate.steps.joining, "_job", None)
    job = dpstate.init()
    try:
        assert (job.rank, job.world_size, job.generation, job.backend) == (0, 1, 0, "gloo")
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = job.data_parallel(model)
        job.track(model=model, optimizer=opt)
        seen = []
        for step in job.steps(3):
            with step:
                ddp(torch.ones(2, 3)).sum().backward()
                opt.step()
            seen.append(step.number)
        assert seen == [1, 2, 3]
        assert job.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
        job.barrier()
        with pytest.raises(RuntimeError, match="Connection"):
            for step in job.steps(2):
                with step:
                    raise RuntimeError("Connection reset by peer")  # nothing to recover with: propagates
    finally:
        dist.destroy_process_group()


def test_a_survivor_stops_computing_as_soon_as_a_reconfiguration_is_asked_for():
    """DataParallel checks the abort signal before each forward and after each gradient is accumulated, so a
    survivor leaves a step whose result is abandoned anyway at once instead of finishing its backward."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        abort = AbortSignal()
        abort.enter(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                    torch.nn.Tanh(), torch.nn.Linear(8, 1))
        ddp = dpstate.DataParallel(model, abort)
        ddp(torch.ones(2, 4)).sum().backward()  # not set: a whole step
        assert all(p.grad is not None for p in model.parameters())
        model.zero_grad(set_to_none=True)

        # the last layer's bias is the first gradient of a backward: the request arrives right after it
        model[4].bias.register_post_accumulate_grad_hook(lambda _p: abort.request(1, "node1 failed"))
        loss = ddp(torch.ones(2, 4)).sum()
        with pytest.raises(RuntimeError) as failed:
            loss.backward()
        assert classify(failed.value, abort) == "abort" and ABORT_MARKER in str(failed.value)
        assert model[0].weight.grad is None and model[0].bias.grad is None  # the rest was never computed
        with pytest.raises(Aborted):
            ddp(torch.ones(2, 4))  # nor does a next forward start
        ddp.drop()
        abort.enter(1)
        ddp(torch.ones(2, 4)).sum().backward()  # the new generation computes again
        abort.stop("job finished")  # a Stop does not break an evaluation after the last step
        with torch.no_grad():
            ddp(torch.ones(2, 4))
    finally:
        dist.destroy_process_group()


def test_the_snapshot_gate_is_passed_once_per_backward_before_its_last_bucket():
    """DataParallel calls the gate before the last gradient bucket's collective only (the other buckets'
    all-reduces overlap with the snapshot still in flight); an abort while waiting there fails the backward
    as an abort, as one in any collective would."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        abort = AbortSignal()
        abort.enter(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        buckets, gated_after = [], []
        ddp = dpstate.DataParallel(model, abort, gate=lambda: gated_after.append(len(buckets)),
                                   bucket_cap_mb=0.5)  # a weight (1 MB) fills a bucket: several per backward
        ddp.ddp  # built on first use
        hook = ddp._hook_state

        class CountingHook(type(hook)):
            def __call__(self, bucket):
                buckets.append(bucket.index())
                return super().__call__(bucket)

        hook.__class__ = CountingHook  # this instance only
        ddp(torch.ones(2, 512)).sum().backward()  # DDP's first backward has one bucket; then it rebuilds them
        for _ in range(2):
            buckets.clear()
            ddp(torch.ones(2, 512)).sum().backward()
            assert len(buckets) >= 3, buckets  # several buckets ...
            assert gated_after[-1] == len(buckets)  # ... and the gate came with the last one only
        assert len(gated_after) == 3

        def aborted_at_the_gate():
            abort.request(1, "node1 failed")
            abort.check()

        hook.gate = aborted_at_the_gate
        with pytest.raises(RuntimeError) as failed:
            ddp(torch.ones(2, 512)).sum().backward()
        assert classify(failed.value, abort) == "abort"
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- control thread


@pytest.fixture
def agent(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"ipc://{tmp_path}/agent.sock"
    router.bind(endpoint)
    yield endpoint, router
    router.close(0)
    ctx.term()


def _recv(router, codec):
    assert router.poll(5000), "nothing from the worker"
    ident, *frames = router.recv_multipart()
    return ident, codec.decode(frames)[0]


def test_control_hello_reconfigure_outbox_and_stop(agent):
    endpoint, router = agent
    codec = P.Codec(TOKEN)
    sig = AbortSignal()
    control = Control(endpoint, TOKEN, "n7", 2, sig).start()
    try:
        ident, hello = _recv(router, codec)
        assert ident == b"2" and hello == P.Hello(node_id="n7", local_rank=2, pid=hello.pid)
        assert control.wait_reconfigure(-1, timeout=0.05) is None

        router.send_multipart([ident, b"garbage", b"x", b"y", b"z"])
        reconf = P.Reconfigure(0, 1, 2, 1, 2, -1, "127.0.0.1:1", "")
        router.send_multipart([ident] + codec.encode(reconf))
        assert control.wait_reconfigure(-1, timeout=5) == reconf
        sig.enter(0)
        newer = P.Reconfigure(1, 1, 2, 1, 2, 7, "127.0.0.1:1", "", {"3": "tcp://x:1"})
        router.send_multipart([ident] + P.Codec("another job").encode(newer))  # refused: wrong token
        router.send_multipart([ident] + codec.encode(newer))
        assert control.wait_reconfigure(0, timeout=5) == newer
        assert sig.is_set() and control.dropped == 2

        threads = [threading.Thread(target=control.send, args=(P.Progress("n7", 1, 3, s),)) for s in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        steps = sorted(_recv(router, codec)[1].step for _ in range(5))
        assert steps == [0, 1, 2, 3, 4]

        control.stop_grace = 60  # the watchdog would end the process; close() cancels it
        router.send_multipart([ident] + codec.encode(P.Stop("fenced", exit_code=3)))
        with pytest.raises(SystemExit) as exc:
            control.wait_reconfigure(1, timeout=5)
        assert exc.value.code == 3 and sig.stopped
    finally:
        control.close(linger_s=0.5)


def test_a_progress_with_an_oversized_metric_still_reaches_the_agent_with_its_step(agent, monkeypatch):
    endpoint, router = agent
    codec = P.Codec(TOKEN)
    monkeypatch.setattr("dpstate.steps.metrics._warned_metrics", set())
    control = Control(endpoint, TOKEN, "n7", 0, AbortSignal()).start()
    try:
        assert isinstance(_recv(router, codec)[1], P.Hello)
        job = SimpleNamespace(node_id="n7", generation=2, _key=0, _send=control.send)
        step = Step(job, 5)
        step.log(loss=1.0, big=list(range(200000)))
        Job._report(job, step, snapshot=True)  # the body was 1.4 MB, over the agent's 1 MiB: dropped there
        progress = _recv(router, codec)[1]
        assert progress == P.Progress("n7", 2, 0, 5, {"loss": 1.0}, snapshot=True)
    finally:
        control.close(linger_s=0.5)


def test_a_spare_waits_in_init_and_a_stop_ends_it_with_its_code(agent, monkeypatch):
    endpoint, router = agent
    codec = P.Codec(TOKEN)
    for key, value in {"DP_AGENT_ENDPOINT": endpoint, "DP_JOB_TOKEN": TOKEN, "DP_NODE_ID": "spare1",
                       "DP_ROLE": "spare", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dpstate.steps.joining, "_job", None)

    def agent_side():
        ident, hello = _recv(router, codec)
        assert isinstance(hello, P.Hello) and hello.node_id == "spare1"
        time.sleep(0.2)  # the spare is waiting in init()
        router.send_multipart([ident] + codec.encode(P.Stop("job finished", exit_code=0)))

    thread = threading.Thread(target=agent_side)
    thread.start()
    try:
        with pytest.raises(SystemExit) as exc:
            dpstate.init()
        assert exc.value.code == 0
    finally:
        thread.join(10)
        job = dpstate.steps.joining._job
        if job is not None:
            job._agent.control.close(linger_s=0.2)


def test_no_reconfigure_after_a_peer_error_exits_with_a_clear_message(agent, monkeypatch):
    endpoint, router = agent
    codec = P.Codec(TOKEN)
    monkeypatch.setenv("DP_RECONFIGURE_TIMEOUT", "0.3")
    monkeypatch.setenv("DP_NODE_ID", "n1")
    sig = AbortSignal()
    control = Control(endpoint, TOKEN, "n1", 0, sig).start()
    try:
        job = Job(control, sig, None)
        ident, _ = _recv(router, codec)
        t0 = time.monotonic()
        with pytest.raises(SystemExit, match=r"no Reconfigure within 0.3 s \(DP_RECONFIGURE_TIMEOUT\)") as exc:
            job._recover(RuntimeError("Connection closed by peer"), newer_than=job.generation)
        assert 0.3 <= time.monotonic() - t0 < 2
        assert "Connection closed by peer" in str(exc.value.code)
        _, peer_error = _recv(router, codec)
        while isinstance(peer_error, P.WorkerStatus):  # the periodic status may come first
            _, peer_error = _recv(router, codec)
        assert isinstance(peer_error, P.PeerError) and "Connection closed" in peer_error.detail
    finally:
        control.close(linger_s=0.5)


class _Control:
    """Just enough of Control for a Job that is driven by hand."""

    def __init__(self):
        self.codec = P.Codec(TOKEN)
        self.sent = []
        self.finished = False
        self.stop_message = None
        self.standby = None  # no Standby came (not a spare's)

    def send(self, msg):
        self.sent.append(msg)


def _reconf(step: int, source: str | None = None) -> P.Reconfigure:
    return P.Reconfigure(4, 0, 1, 1, 1, step, "127.0.0.1:1", "", {} if source is None else {"0": source})


def test_restore_sources_local_init_fresh_and_missing():
    job = Job(_Control(), AbortSignal(), None)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    job.track(model=model, optimizer=opt)
    job._apply(_reconf(0, "init"))
    initial = model.weight.detach().clone()
    assert job._restore(_reconf(0, "init")) == "init"  # a spare keeps its fresh state as step 0
    job._agent.replicator.wait_acked(timeout=5)
    assert job._agent.replicator.local_steps() == [0]
    job._started = True
    # a process that trained never pretends to be fresh: step 0 comes back from its own copy, bit for bit
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert job._restore(_reconf(0, "init")) == "local"
    assert torch.equal(model.weight, initial)
    weights = {}
    for step in (1, 2, 3):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        if step < 3:
            job._agent.replicator.submit(step, job._tracked.capture(step))
            job._agent.replicator.wait_acked(timeout=5)
        weights[step] = model.weight.detach().clone()
    assert job._agent.replicator.local_steps() == [1, 2]  # the ring holds NSLOTS (2)
    model(torch.ones(1, 3)).sum().backward()  # live state at step 3, partly through step 4's backward

    assert job._restore(_reconf(1, "")) == "local"
    assert torch.equal(model.weight, weights[1]) and model.weight.grad is None
    assert opt.state_dict()["state"][0]["step"].item() == 1
    assert job._agent.replicator.local_steps() == [1]  # the abandoned later steps are forgotten
    with pytest.raises(dpstate.ReplicationError, match="holds no snapshot of step 3"):
        job._restore(_reconf(3, ""))
    # no store named and no local copy: reported, so that the plan knows this rank cannot come back to it
    assert [(m.step, m.source) for m in job._agent.control.sent if isinstance(m, P.RestoreFailed)] == [(3, "")]
    # step 0 has left the ring: a process that trained cannot keep its "initial" state as step 0
    with pytest.raises(RuntimeError, match="cannot keep its initial state"):
        job._restore(_reconf(0, "init"))
    job._agent.replicator.forget_after(-1)
    with pytest.raises(RuntimeError, match="cannot keep its initial state"):
        job._restore(_reconf(0, "init"))


def test_a_spare_job_makes_room_on_standby_and_reports_it_in_its_status():
    """Standby reaches a Job through its Control (even one that came before the Job was made), and what its
    worker reserved goes to the agent in WorkerStatus.room (the dashboard shows it on the spare's row)."""
    control = _Control()
    control.standby = P.Standby([3 << 20])  # came before the Job wired its handler
    job = Job(control, AbortSignal(), None)
    job._agent.room.join(timeout=10)
    assert job._status().room == 2 * (3 << 20)
    control.on_standby(P.Standby([5 << 20]))
    job._agent.room.join(timeout=10)
    assert job._status().room == 2 * (5 << 20)


# ----------------------------------------------------------------------------- saving own copies

class _Ring:
    """A worker's ring of local snapshots, as dpstate.replication.replicator.Replicator shows them to
    dpstate.replication.saving."""

    def __init__(self, snapshots: dict[int, bytes]):
        from dpcommon.checksum import checksum_chunks
        from dpstate.replication.fetch import Slot
        self.slots = {step: Slot(buffer=torch.frombuffer(bytearray(data), dtype=torch.uint8), step=step,
                                 meta=b"{}", nbytes=len(data), checksum=checksum_chunks(b"{}", [data]))
                      for step, data in snapshots.items()}

    @contextlib.contextmanager
    def holding(self, step):
        yield self.slots.get(step)

    def local_steps(self):
        return sorted(self.slots)


def test_a_worker_asked_for_every_step_it_holds_writes_each_into_its_step_folder(tmp_path):
    from dpcommon.snapshot_files import rank_file, read_snapshot, step_folder
    from dpstate.replication.saving import save_local
    ring, sent = _Ring({10: b"a" * 64, 11: b"b" * 64}), []
    save_local(ring, P.SaveSnapshots(str(tmp_path), P.NO_RANK, [3], local=True), 3, "n1", sent.append)
    assert sent == [P.SnapshotFiles("n1", P.NO_RANK, {"3": ""}, steps=[10, 11])]
    for step, byte in ((10, b"a"), (11, b"b")):
        put, _, chunks = read_snapshot(rank_file(step_folder(tmp_path, step), 3), generation=0)
        assert (put.rank, put.step) == (3, step) and b"".join(bytes(c) for c in chunks) == byte * 64
    save_local(ring, P.SaveSnapshots(str(tmp_path), P.NO_RANK, [4], local=True), 3, "n1", sent.append)
    assert len(sent) == 1, "another rank's request is not this worker's to answer"
    save_local(ring, P.SaveSnapshots(str(tmp_path), 9, [3], local=True), 3, "n1", sent.append)
    assert sent[-1] == P.SnapshotFiles("n1", 9, {"3": "rank 3 no longer holds step 9 (it holds [10, 11])"})


def test_a_complex_metric_is_sent_as_text_not_an_error_in_the_step():
    logged = {"z": torch.tensor(1 + 2j), "zs": torch.tensor([1 + 2j, 3j]), "loss": torch.tensor(0.5)}
    assert sendable_metrics(logged) == {"z": "(1+2j)", "zs": "[(1+2j), 3j]", "loss": 0.5}


def test_an_uncaught_peer_failure_gets_a_hint_about_with_step_after_its_traceback_and_a_bug_does_not(
        monkeypatch, capsys):
    shown = []
    monkeypatch.setattr("sys.excepthook", lambda *exc: shown.append(exc[1]))
    hint_unwrapped_steps(lambda: 3, AbortSignal())
    peer = RuntimeError(f"Unable to cast {ABORT_MARKER}: generation 1 requested (recovery) to Tensor")
    sys.excepthook(RuntimeError, peer, None)
    assert shown == [peer], "the traceback first, as before"
    assert "dpstate: rank 3: this error is a peer's failure" in capsys.readouterr().err
    sys.excepthook(ValueError, ValueError("bad batch"), None)
    assert capsys.readouterr().err == "" and len(shown) == 2
