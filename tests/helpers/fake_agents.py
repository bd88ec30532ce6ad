"""Fake node agents (one ROUTER per one-worker node) and a real replica store (dpagent's ReplicaServer) in a
background thread, for dpstate workers in this process or another; with what such workers are given."""

from __future__ import annotations

import datetime
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from conftest import REPO
from dpcommon import protocol as P

TOKEN = "dpstate-test-token"


def store_master(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


def worker_env(node_id: str, endpoint: str, **extra: str) -> dict:
    env = {
        "DP_NODE_ID": node_id, "DP_AGENT_ENDPOINT": endpoint, "DP_JOB_TOKEN": TOKEN, "DP_JOB_ID": "test",
        "DP_NPROC_PER_NODE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DP_RECONFIGURE_TIMEOUT": "30",
    }
    env.update(extra)
    return env


class FakeAgents:
    """Plays the agents of several one-worker nodes and one replica store, in a background thread."""

    def __init__(self, rundir: Path, node_ids: list[str], local_pids: Callable[[], Any] = tuple):
        from dpcommon.channel import Channel
        from dpagent.replica_server import ReplicaServer
        from dpcommon.replica_store import ReplicaStore

        self.ctx = zmq.Context()
        self.codec = P.Codec(TOKEN)
        self.endpoints = {n: f"ipc://{rundir}/agent-{n}.sock" for n in node_ids}
        self.routers = {}
        for n, ep in self.endpoints.items():
            sock = self.ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.bind(ep)
            self.routers[n] = sock
        rsock = self.ctx.socket(zmq.ROUTER)
        rsock.linger = 0
        port = rsock.bind_to_random_port("tcp://127.0.0.1")
        self.replica_endpoint = f"tcp://127.0.0.1:{port}"
        self.replica_ch = Channel(rsock, self.codec, "replica", zero_copy=True)
        self.store = ReplicaStore()
        self.server = ReplicaServer(self.replica_ch, self.store, "fake", self._stored, local_pids=local_pids)
        self.log: list[tuple[str, Any]] = []  # (node_id, message) in arrival order
        self.stored: dict[int, set] = {}  # rank -> steps acked by the replica store
        self.cond = threading.Condition()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ test side

    def send(self, node_id: str, msg: Any) -> None:
        self._out.put((node_id, msg))

    def messages(self, kind: type | None = None, node: str | None = None) -> list:
        with self.cond:
            return [m for n, m in self.log if (kind is None or isinstance(m, kind)) and (node is None or n == node)]

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}; log tail: {self.log[-8:]}")
                self.cond.wait(min(left, 0.2))

    def newest_stored(self, rank: int) -> int:
        with self.cond:
            return max(self.stored.get(rank, {-1}))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.routers.values():
            sock.close(0)
        self.replica_ch.sock.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------ thread

    def _stored(self, msg: P.SnapshotStored) -> None:
        with self.cond:
            self.stored.setdefault(msg.rank, set()).add(msg.step)
            self.cond.notify_all()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_sock = {}
        for n, sock in self.routers.items():
            poller.register(sock, zmq.POLLIN)
            by_sock[sock] = n
        poller.register(self.replica_ch.sock, zmq.POLLIN)
        identities: dict[str, bytes] = {}
        while not self._stop.is_set():
            while True:
                try:
                    node, msg = self._out.get_nowait()
                except queue.Empty:
                    break
                self.routers[node].send_multipart([identities.get(node, b"0")] + self.codec.encode(msg))
            for sock, _ in poller.poll(10):
                if sock is self.replica_ch.sock:
                    for incoming in self.replica_ch.recv_ready():
                        self.server.handle(incoming)
                else:
                    frames = sock.recv_multipart()
                    try:
                        msg, _ = self.codec.decode(frames[1:])
                    except P.ProtocolError as exc:
                        msg = exc
                    node = by_sock[sock]
                    identities[node] = frames[0]
                    with self.cond:
                        self.log.append((node, msg))
                        self.cond.notify_all()
            self.server.tick(time.monotonic())


def reconfigure(generation: int, node_rank: int, world_size: int, restore_step: int, store_port: int,
                replica_to: str, restore_from: dict | None = None) -> P.Reconfigure:
    return P.Reconfigure(generation=generation, node_rank=node_rank, nnodes=world_size, nproc_per_node=1,
                         world_size=world_size, restore_step=restore_step, store_endpoint=f"127.0.0.1:{store_port}",
                         replica_to=replica_to, restore_from=restore_from or {}, reason="test")
