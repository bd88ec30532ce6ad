"""Test harness for dpstate (no tests here): fake agents (one ROUTER per node) plus a replica ROUTER served by
dpagent's ReplicaServer, a TCPStore master, and worker entry points run as `python <this file> <mode> ...`.
"""

from __future__ import annotations

import datetime
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from dpagent import protocol as P  # noqa: E402

TOKEN = "dpstate-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        from dpagent.channel import Channel
        from dpagent.replica_server import ReplicaServer
        from dpagent.replica_store import ReplicaStore

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


# ----------------------------------------------------------------------------- worker: abort mechanics


def abort_worker(port: int, rank: int, generation: int, mode: str) -> None:
    """Joins `generation` (world 2) as `rank` and obeys stdin: 'ddp' (a DDP step) / 'allreduce' start a
    collective that the test freezes or kills the peer of, 'abort' (handled at once by a reader thread) sets
    the abort signal, 'join G R N [W]' builds generation G (world W, default 2) as rank R and runs N DDP
    steps, 'layouts' reports whether DDP gradients are bitwise the same under two bucket layouts (with the
    deterministic hook and with a plain all-reduce), 'exit' ends. Reports lines on stdout.
    A DDP's second step rebuilds its buckets (a broadcast), later ones do not."""
    import torch
    import torch.distributed as dist

    from dpstate.abort import AbortSignal, classify
    from dpstate.ddp import DataParallel
    from dpstate.pgroup import GroupManager

    abort = AbortSignal()
    commands: queue.SimpleQueue = queue.SimpleQueue()
    marks = {}

    def reader() -> None:
        for line in sys.stdin:
            if line.strip() == "abort":
                marks["abort"] = time.monotonic()
                abort.trigger("test abort")
            else:
                commands.put(line.split())

    threading.Thread(target=reader, daemon=True).start()
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    groups = GroupManager("gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DataParallel(model, abort)

    def join(gen: int, r: int, iters: int, world: int = 2) -> None:
        abort.enter(gen)
        ddp.drop()
        groups.build(gen, f"127.0.0.1:{port}", r, world, abort)
        t = torch.full((4,), float(r + 1))
        abort.wait_future(dist.all_reduce(t, async_op=True).get_future(), timeout=30)
        for _ in range(iters):
            ddp(torch.randn(16, 64)).sum().backward()
        say("JOINED", gen, t[0].item())

    def same_under_two_layouts(deterministic: bool) -> bool:
        """Gradients of the same step under one big bucket and under tiny (rebuilt) buckets."""
        grads = []
        for cap_mb in (25.0, 0.0005):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
            proxy = DataParallel(net, abort, deterministic=deterministic, bucket_cap_mb=cap_mb)
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(dist.get_rank())) * 1000
            for _ in range(3):  # the second step rebuilds the buckets
                net.zero_grad()
                proxy(x).pow(2).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
            proxy.drop()
        return bool(torch.equal(grads[0], grads[1]))

    if generation >= 0:
        join(generation, rank, 2)
    while True:
        cmd = commands.get()
        if cmd[0] == "exit":
            say("EXITING")
            return
        if cmd[0] == "join":
            join(*map(int, cmd[1:]))
            continue
        if cmd[0] == "layouts":
            say("LAYOUTS", *(same_under_two_layouts(deterministic) for deterministic in (True, False)))
            continue
        say("WAITING", cmd[0])
        t0 = time.monotonic()
        try:
            if cmd[0] == "ddp":
                ddp(torch.randn(16, 64)).sum().backward()
            else:
                abort.wait_future(dist.all_reduce(torch.ones(1000), async_op=True).get_future(), timeout=30)
            say("COMPLETED")
        except Exception as exc:
            released = time.monotonic() - marks.get("abort", t0)
            msg = str(exc).replace("\n", " ")[:300]
            say("RELEASED", classify(exc, abort), type(exc).__name__, f"{released:.3f}", f"{time.monotonic() - t0:.3f}", msg)
            abort.enter(abort.target)  # as if the next generation began: the signal clears


if __name__ == "__main__":
    if sys.argv[1] == "abort-worker":
        abort_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
