"""Builds and destroys the default process group of each generation over one TCPStore client, and the groups
of its DeviceMesh (job.parallelize).

Generation G lives under PrefixStore(f"dp/gen{G}/"); ranks first meet at an abortable arrival count.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from dpcommon.gloo_connect import lazy_connect
from dpstate.steps.abort import AbortSignal
from .mesh import MeshLayout, build_mesh
from .severing import GroupConnections
from .torch_private import keep_groups_alive, name_groups_for, reset_group_names


def default_backend() -> str:
    import torch

    return os.environ.get("DP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")


def trains_on_gpu() -> bool:
    """Does this worker train on a GPU: CUDA is there and the backend is NCCL (with Gloo it trains on the CPU)."""
    import torch

    return torch.cuda.is_available() and default_backend() == "nccl"


def local_device():
    """The device this worker trains on: its CUDA device (LOCAL_RANK modulo the count) when trains_on_gpu(),
    else the CPU. Known before dpstate.init(), so a script can build its model before it (a spare then
    builds it while idle, not after its promotion)."""
    import torch

    if trains_on_gpu():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


# Gloo's full-mesh rendezvous, per rank: one store key with its address, then every peer's key read. By default the
# key also lists one 8-byte pair identifier per peer, so each of the R x R reads carries O(R) bytes: store traffic
# grows as R^3 (550 GB through the one TCPStore at 4,096 ranks). With the rank as the pair's sequence number the key
# has a fixed size (154 bytes on loopback): R^2 reads of it. Read by Gloo at each group's creation; every rank of a
# job runs this, so all agree. A value set beforehand (0 turns it off) is kept. (Not GLOO_ENABLE_STORE_V2_API: its
# batched reads wait for a key under the store's timeout, the collective one, not the connect timeout: a rank that
# arrived and died would hold the others 600 s instead of DP_CONNECT_TIMEOUT.)
COMPACT_GLOO_RENDEZVOUS = {"GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}


# Ranks waiting at an arrival count poll the one TCPStore of the job, each at most every 20 ms: 4,096 ranks would ask
# 200,000 times a second, several times what a store serves (its server thread spent ~38 us of CPU per get here:
# ~26,000 a second), and slow the Gloo rendezvous that follows. The interval grows with the world size instead, so
# that all ranks together poll at most this often (the last arrival is then seen up to world_size / this late).
ARRIVAL_POLLS_PER_S = 5000.0


def arrival_poll_cap(world_size: int) -> float:
    """The longest a rank waits between two polls of an arrival count: 20 ms, longer past 100 ranks."""
    return max(0.02, world_size / ARRIVAL_POLLS_PER_S)


def compact_gloo_rendezvous() -> None:
    """Make Gloo's rendezvous of the groups created from now on read fixed-size keys (see above)."""
    for name, value in COMPACT_GLOO_RENDEZVOUS.items():
        os.environ.setdefault(name, value)


def collective_timeout() -> float:
    """Seconds a collective may take before the backend gives up (our abort normally comes first)."""
    return float(os.environ.get("DP_COLLECTIVE_TIMEOUT", "600"))


class PeerConnectError(ConnectionError):
    """Building a generation's group failed: some rank died while everyone connected."""


class GpuPlacementError(RuntimeError):
    """NCCL refused the group: two ranks on one GPU. A setup error, not a peer failure: no recovery can mend it."""


class GroupManager:
    """Owns the TCPStore client (made once), the default group of the current generation and the sub-groups of
    its DeviceMesh, and the connections of them all: severed when a newer generation is asked for, where
    sever_on_abort is set (a job with a mesh: dpstate.groups.severing says why)."""

    def __init__(self, backend: str | None = None, timeout_s: float | None = None):
        self.backend = backend or default_backend()
        self.timeout = datetime.timedelta(seconds=timeout_s or collective_timeout())
        self.connect_timeout = datetime.timedelta(seconds=float(os.environ.get("DP_CONNECT_TIMEOUT", "10")))
        self.generation: int | None = None
        self.leaked = 0  # old groups kept alive on purpose (see destroy)
        self.connections = GroupConnections()
        self.sever_on_abort = False
        self._abort: AbortSignal | None = None
        self._gen_store: dist.Store | None = None  # the current generation's prefix (see build); None: local
        self._rank, self._world_size = 0, 1
        self._store: dist.Store | None = None
        self._endpoint: str | None = None
        self._hooks: tuple = (None, None)  # sys.excepthook before the last init_process_group, and torch's after

    def _store_for(self, endpoint: str) -> dist.Store:
        if self._store is None or endpoint != self._endpoint:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bad store endpoint {endpoint!r}, expected host:port")
            self._store = dist.TCPStore(
                host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=self.timeout
            )
            self._endpoint = endpoint
        return self._store

    def build(self, generation: int, store_endpoint: str, rank: int, world_size: int, abort: AbortSignal) -> None:
        """Destroy the old group, wait (abortably) until every rank of `generation` arrived, build the new one."""
        self.destroy()
        lazy = self.backend == "gloo" and lazy_connect(world_size)
        self.connections.begin(lazy)
        # torch reads it at each group's creation: the mesh's groups, made later, connect the same way
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy else "0"
        self._abort = abort
        store = dist.PrefixStore(f"dp/gen{generation}/", self._store_for(store_endpoint))
        # Every rank checks in; init_process_group only starts once all are there, so a rank that died
        # before arriving leaves us in this abortable loop rather than in Gloo's blocking rendezvous.
        self._gen_store, self._rank, self._world_size = store, rank, world_size
        self._arrive("arrived", generation, abort)
        # Connecting cannot be aborted, and a rank that arrived then died (a failure during recovery) would
        # hold everyone here for the whole collective timeout: connect under a short timeout, then set the
        # long one. A failed connect is a peer failure: the caller reports it and waits for the next plan.
        # torch names the default group by a process-wide counter that a failed init_process_group leaves
        # incremented (measured, torch 2.13), and the name is part of every connect key: without this reset
        # a rank whose last connect failed waits for keys its peers never write.
        reset_group_names()
        compact_gloo_rendezvous()
        # NCCL with the device named connects its communicator here (eagerly) rather than in the first collective
        device = local_device()
        eager = {"device_id": device} if self.backend == "nccl" and device.type == "cuda" else {}
        try:
            with self.connections.recording():
                self._init(self.backend, store=store, rank=rank, world_size=world_size,
                           timeout=min(self.connect_timeout, self.timeout), **eager)
        except Exception as exc:
            if abort.is_set():
                raise abort.error() from exc
            if "Duplicate GPU detected" in str(exc):
                raise GpuPlacementError("NCCL refuses two ranks on one GPU (Duplicate GPU detected): give each "
                                        "worker a GPU of its own (CUDA_VISIBLE_DEVICES, --nproc-per-node) or set "
                                        "DP_BACKEND=gloo") from None
            raise PeerConnectError(f"generation {generation}: could not connect to every rank within "
                                   f"{self.connect_timeout.total_seconds():g} s (DP_CONNECT_TIMEOUT): {exc}") from exc
        dist.distributed_c10d._set_pg_timeout(self.timeout)
        name_groups_for(generation)
        self.generation = generation

    def _arrive(self, key: str, generation: int, abort: AbortSignal) -> None:
        """Count this rank in under `key` of the generation's store and wait, abortably, for every other."""
        store, rank, world_size = self._gen_store, self._rank, self._world_size
        assert store is not None
        if store.add(f"{key}/{rank}", 1) != 1:
            raise RuntimeError(f"rank {rank} arrived twice at {key} for generation {generation}")
        arrived = store.add(key, 1)
        delay, cap = 0.001, arrival_poll_cap(world_size)
        while arrived < world_size:
            abort.sleep(delay)
            delay = min(delay * 2, cap)
            arrived = store.add(key, 0)
        if arrived > world_size:
            raise RuntimeError(f"{arrived} ranks arrived at {key} for generation {generation} of world size "
                               f"{world_size}")

    def build_mesh(self, layout: MeshLayout, device_type: str):
        """The DeviceMesh of `layout` over this generation's group (dpstate.groups.mesh), its connections recorded.
        Ranks first meet at an abortable count, as for the group: a promoted spare reaches its
        job.parallelize() only after its script went on from init(), later than the survivors by any time."""
        if self._gen_store is not None and self._abort is not None and self.generation is not None:
            self._arrive("mesh-arrived", self.generation, self._abort)
        try:
            with self.connections.recording():
                mesh = build_mesh(layout, device_type, self.backend, min(self.connect_timeout, self.timeout),
                                  self.timeout)
        except Exception as exc:
            if self._abort is not None and self._abort.is_set():
                raise self._abort.error() from exc
            raise PeerConnectError(f"generation {self.generation}: could not build the mesh {layout.describe()} "
                                   f"within {self.connect_timeout.total_seconds():g} s (DP_CONNECT_TIMEOUT): "
                                   f"{exc}") from exc
        self.on_abort()  # asked for while the mesh was built: its connections too
        return mesh

    def on_abort(self) -> None:
        """(any thread; an AbortSignal callback) A newer generation was asked for: sever the connections of the
        current one, which releases a collective that waits on them."""
        if self.sever_on_abort and self._abort is not None and self._abort.superseded():
            self.connections.sever()

    def build_local(self) -> None:
        """A one-process group (no agent): lets DDP and torch.distributed calls work unchanged."""
        self.destroy()
        self._gen_store = None
        self._init(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
        self.generation = 0

    def _init(self, backend: str, **kwargs) -> None:
        """init_process_group, with one "[rankN]: " before each line of a traceback: torch wraps sys.excepthook in
        every init, and a survivor's traceback after 3 recoveries had it 4 times. A hook set since stays."""
        before, wrapped = self._hooks
        if wrapped is not None and sys.excepthook is wrapped:
            sys.excepthook = before
        before = sys.excepthook
        dist.init_process_group(backend, **kwargs)
        self._hooks = (before, sys.excepthook)

    def destroy(self) -> None:
        """Drop the default group; returns at once even when its Gloo thread is stuck on a frozen peer.

        The old groups (the mesh's too) are deliberately leaked (their Python handles made immortal): measured
        with torch 2.13, ProcessGroupGloo's destructor joins its worker threads, so destroying a group with an
        op stuck on a frozen peer blocks until that peer exits or the op times out, and a destructor that runs
        after the peer closed its sockets (e.g. at interpreter exit) aborts the process ("terminate called after
        throwing an instance of 'gloo::IoException'", exit -6). A leaked group costs its threads and sockets.
        NCCL: its communicators are aborted first, as a stuck kernel would block (tests/test_cuda_gpu.py builds,
        aborts and rebuilds NCCL groups on a GPU).
        """
        if dist.is_initialized():
            pg = dist.group.WORLD
            if self.backend == "nccl":
                try:
                    dist.distributed_c10d._abort_process_group()
                except Exception:
                    pass
            if pg is not None:
                self.leaked += keep_groups_alive()
            if dist.is_initialized():
                dist.destroy_process_group()
        self.generation = None

