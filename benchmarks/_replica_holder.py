"""A replica store in its own process, as a node agent holds it: dpagent's Channel + ReplicaServer + ReplicaStore
on a ROUTER socket (the same receive, verify, store and serve code). Prints its endpoint; ends when stdin closes.

    python benchmarks/_replica_holder.py TOKEN [KEEP]
"""

from __future__ import annotations

import sys
import threading

import zmq

from dpcommon import protocol as P
from dpcommon.channel import Channel
from dpcommon.memory import reuse_freed_memory
from dpagent.replica_server import ReplicaServer
from dpcommon.replica_store import ReplicaStore


def main() -> None:
    token = sys.argv[1].encode()
    keep = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    reuse_freed_memory()  # as the agent does
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(sock, P.Codec(token), "replica", zero_copy=True)
    store = ReplicaStore(keep=keep)
    server = ReplicaServer(channel, store, "holder", lambda _msg: None)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(f"tcp://127.0.0.1:{port}", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not done.is_set():
        for s, _ in poller.poll(50):
            for incoming in channel.recv_ready():
                server.handle(incoming)
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
