"""The CUDA snapshot path exercised on CPU: the side stream, the event, page-locked shared buffers and the
backend choice with torch.cuda stood in for (tests/test_cuda_gpu.py runs the real thing where a GPU is)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from dpcommon import protocol as P
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.replication.replicator import Replicator
from helpers.fake_agents import TOKEN, FakeAgents

pytestmark = pytest.mark.timeout(60)


def test_without_cuda_the_side_stream_and_pinned_buffers_are_not_used(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the real path runs")
    agents = FakeAgents(tmp_path, [])
    try:
        rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
        assert rep.pin is False
        rep.configure(0, agents.replica_endpoint, 0)
        rep.submit(1, {"step": 1, "w": torch.arange(10.0)})
        assert rep._queue == [] or rep._queue[0].event is None  # no CUDA event recorded
        rep.wait_acked(timeout=10)
        slot = rep.fetch(agents.replica_endpoint, 0, 1)
        assert not slot.buffer.is_pinned()  # CPU: received into a plain buffer
        assert torch.equal(S.unpack(slot.meta, slot.data)["w"], torch.arange(10.0))
    finally:
        agents.close()


class _FakeEvent:
    def __init__(self):
        self.recorded = False

    def record(self):
        self.recorded = True


class _FakeStream:
    def __init__(self, device=None):
        self.calls = []
        self.device = types.SimpleNamespace(index=device)

    def wait_event(self, event):
        self.calls.append(("wait_event", event))

    def synchronize(self):
        self.calls.append(("synchronize",))


def test_cuda_capture_path_waits_for_the_step_copies_on_the_side_stream_then_checksums(monkeypatch, tmp_path):
    """The side-stream code with torch.cuda stood in for (no GPU here): the copy stream is made on the worker's
    device, waits on the event recorded after the step, copies non-blocking under that stream, synchronizes,
    then checksums the host copy."""
    streams: list[_FakeStream] = []
    copies: list[bool] = []
    devices_set: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: streams.append(_FakeStream(device)) or streams[-1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the worker's device: local rank 3
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices_set.append(d))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    real_copy = S.copy_into

    def copy_into(tensors, specs, buffer, non_blocking=False, on_copied=None):
        copies.append(non_blocking)  # (no device events here: the digests are all made at the seal)
        real_copy(tensors, specs, buffer, non_blocking=False)

    monkeypatch.setattr(S, "copy_into", copy_into)
    agents = FakeAgents(tmp_path, [])
    try:
        rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
        rep.pin = False  # pinned memory needs a real GPU
        rep.configure(0, agents.replica_endpoint, 0)
        tree = {"step": 2, "w": torch.randn(1000), "b": torch.randn(7)}
        rep.submit(2, tree)
        rep.wait_acked(timeout=10)
        (stream,) = streams
        assert stream.device.index == 3 and devices_set == [3]  # made on the worker's device, not device 0
        assert [c[0] for c in stream.calls] == ["wait_event", "synchronize"]
        assert isinstance(stream.calls[0][1], _FakeEvent) and stream.calls[0][1].recorded
        assert copies == [True]
        slot = rep.local(2)
        assert slot.checksum == S.checksum(slot.meta, slot.data)
        assert torch.equal(S.unpack(slot.meta, slot.data)["w"], tree["w"])
    finally:
        agents.close()


def test_nccl_is_the_default_backend_with_cuda(monkeypatch):
    from dpstate.groups.pgroup import default_backend

    monkeypatch.delenv("DP_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"


def test_a_cpu_job_on_a_gpu_host_keeps_plain_buffers_and_landing(monkeypatch):
    """DP_BACKEND=gloo where CUDA is there: the worker trains on the CPU, so its snapshot buffers are not
    page-locked (no CUDA context per worker) and the optimizer step still lands in them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("DP_BACKEND", "gloo")
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    assert not rep.pin and rep.landing.enabled
    monkeypatch.setenv("DP_BACKEND", "nccl")
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    assert rep.pin and not rep.landing.enabled


class _FakeCudart:
    """torch.cuda.cudart() stood in for: records cudaHostRegister / cudaHostUnregister, answers `error`."""

    def __init__(self, error: int = 0):
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, address, nbytes, flags):  # noqa: N802 (CUDA's name)
        if not self.error:
            self.registered.append((address, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, address):  # noqa: N802
        self.unregistered.append(address)
        return 0


def _stand_in_cudart(monkeypatch, error: int = 0) -> _FakeCudart:
    from dpstate.snapshot import shared

    cudart = _FakeCudart(error)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(shared, "_page_lock_works", None)  # probe again with the stand-in
    return cudart


def test_with_cuda_snapshot_buffers_are_shared_with_the_agent_and_page_locked(monkeypatch):
    """CUDA's side stream copies into a shared buffer that CUDA page-locked (so the copy is asynchronous and
    the node's agent can still hold peers' identical blocks by reference: 2 copies of the state on the host,
    not 4); the buffer is unregistered when it is dropped, before its memory is unmapped."""
    import gc

    from dpstate.snapshot import shared
    from dpstate.replication.fetch import Slot

    cudart = _stand_in_cudart(monkeypatch)
    monkeypatch.setenv("DP_LOCAL_REPLICA", "tcp://127.0.0.1:9")  # a node agent (never sent to: nothing captured)
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    assert rep.pin and rep.share
    slot = Slot()
    slot.reserve(3 * 4096 + 10, pin=True, share=True)
    assert slot.shared is not None and slot.shared.page_locked and slot.buffer is slot.shared.tensor
    address = slot.buffer.data_ptr()
    assert (address, 3 * 4096 + 10, 1) in cudart.registered and address % mmap_pagesize() == 0
    slot.reserve(100, pin=True, share=True)  # smaller: the same buffer
    assert cudart.registered.count((address, 3 * 4096 + 10, 1)) == 1
    slot.release()
    gc.collect()
    assert address in cudart.unregistered
    assert shared.can_page_lock()


def test_where_cuda_will_not_page_lock_a_shared_buffer_snapshots_stay_private(monkeypatch):
    """A driver that refuses cudaHostRegister: the probe says so, the Replicator keeps private pinned buffers
    (sent whole, as before); a refusal later, for one big buffer, leaves that slot private for good."""
    from dpstate.snapshot import shared
    from dpstate.replication.fetch import Slot

    _stand_in_cudart(monkeypatch, error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setenv("DP_LOCAL_REPLICA", "tcp://127.0.0.1:9")
    assert not shared.can_page_lock()
    rep = Replicator(P.Codec(TOKEN), 0, AbortSignal())
    assert rep.pin and not rep.share
    with pytest.raises(shared.PageLockError, match="cudaError 2"):
        shared.SharedBuffer(4096, page_locked=True)
    pinned: list[int] = []
    real_empty = torch.empty

    def empty(*size, pin_memory=False, **kw):  # pinned memory needs a real GPU: count the ask instead
        if pin_memory:
            pinned.append(size)
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    slot = Slot()
    slot.reserve(8192, pin=True, share=True)
    assert slot.shared is None and slot.share_refused and pinned == [(8192,)] and slot.buffer.numel() == 8192
    slot.reserve(8192, pin=True, share=True)  # not retried for every capture
    assert pinned == [(8192,)]


def mmap_pagesize() -> int:
    import mmap

    return mmap.PAGESIZE
