"""The physical limits the benchmarks compare with, measured on this machine in the same run:

* memcpy bandwidth (torch copy of a large buffer into a reused one, one thread);
* loopback TCP bandwidth (one process sends N bytes with sendall, another recv_into's a reused buffer), and
  the CPU time both ends spend on it (tcp_cpu_s: what moving the state costs a host whose cores are busy);
* the same N bytes over several connections at once, a thread per connection at each end (tcp_streams of
  them: whether one stream is the limit on this host, where several connections would send faster);
* time to rebuild a 2-rank Gloo process group once both processes are there (init_process_group + barrier).

`python benchmarks/_limits.py --bytes N` prints them as JSON; `measure(N)` runs it in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time


def _memcpy(nbytes: int, reps: int = 3) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def parallel_streams() -> int:
    """Connections of the several-streams test: 2 on a small host, up to 4 where there are cores for them (a
    thread at each end of each)."""
    return max(2, min(4, (os.cpu_count() or 1) // 4))


def _together(work: list) -> float:
    """Run each callable on a thread of its own, all at once; the seconds until the last is done."""
    threads = [threading.Thread(target=w) for w in work]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _recv_all(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], min(len(view) - got, 1 << 24))
        if not n:
            raise SystemExit("sender went away")
        got += n


def _slices(view: memoryview, k: int) -> list[memoryview]:
    step = -(-len(view) // k)
    return [view[i * step : (i + 1) * step] for i in range(k)]


def _peer(role: str, port: int, nbytes: int, reps: int, store_port: int) -> None:
    """Both ends of the TCP test and of the process-group test (rank = 0 for the sender)."""
    import torch
    import torch.distributed as dist

    rank = 0 if role == "send" else 1
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(3)
    view = memoryview(buf.numpy())
    out: dict = {}
    if role == "send":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(parallel_streams() + 1)
        print("ready", flush=True)
        conn, _ = srv.accept()
        times = []
        c0 = time.process_time()
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(view)
            conn.recv(1)
            times.append(time.perf_counter() - t0)
        out["send_cpu_s"] = (time.process_time() - c0) / reps
        conn.close()
        out["tcp_s"] = statistics.median(times)
        conns = [srv.accept()[0] for _ in range(parallel_streams())]
        times = []
        for _ in range(reps):  # (each end's threads start apart: the receiver's acks close every repetition)
            times.append(_together([lambda c=c, v=v: (c.sendall(v), c.recv(1)) for c, v in
                                    zip(conns, _slices(view, len(conns)))]))
        out["tcp_parallel_s"] = statistics.median(times)
        for c in conns:
            c.close()
        srv.close()
    else:
        conn = _connect(port)
        c0 = time.process_time()
        for _ in range(reps):
            _recv_all(conn, view)
            conn.sendall(b"k")
        out["recv_cpu_s"] = (time.process_time() - c0) / reps
        conn.close()
        conns = [_connect(port) for _ in range(parallel_streams())]
        for _ in range(reps):
            _together([lambda c=c, v=v: (_recv_all(c, v), c.sendall(b"k")) for c, v in
                       zip(conns, _slices(view, len(conns)))])
        for c in conns:
            c.close()
    # process group rebuilds over one TCPStore, a new prefix each time (what a recovery does)
    store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=rank == 0, wait_for_workers=True)
    pg_times = []
    for i in range(reps + 1):
        prefix = dist.PrefixStore(f"gen{i}/", store)
        store.add(f"arrive{i}", 1)
        while int(store.add(f"arrive{i}", 0)) < 2:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        dist.init_process_group("gloo", store=prefix, rank=rank, world_size=2)
        dist.barrier()
        pg_times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    out["pg_s"] = statistics.median(pg_times[1:])  # the first one also loads Gloo
    if role == "send":
        out["memcpy_Bps"] = _memcpy(nbytes)
    print(json.dumps(out), flush=True)


def _connect(port: int, timeout: float = 120) -> socket.socket:
    """The receiver's connection to the sender, which it starts beside: until the sender (importing torch too)
    listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(nbytes: int, reps: int = 3, timeout: float = 300) -> dict:
    """memcpy and loopback TCP bandwidth (bytes/s) for `nbytes`, one stream and tcp_streams at once, and a 2-rank
    Gloo group rebuild (s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    port, store_port = _free_port(), _free_port()
    me = os.path.abspath(__file__)
    args = [str(nbytes), str(port), str(reps), str(store_port)]
    sender = subprocess.Popen([sys.executable, me, "--peer", "send", *args], env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    receiver = None
    try:
        # both start at once (each imports torch: seconds of a busy host's CPU); the receiver connects once the
        # sender listens
        receiver = subprocess.Popen([sys.executable, me, "--peer", "recv", *args], env=env,
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError("limits: the sender did not start")
        out_s, _ = sender.communicate(timeout=timeout)
        out_r, _ = receiver.communicate(timeout=timeout)
        if sender.returncode or receiver.returncode:
            raise RuntimeError(f"limits: peers failed ({sender.returncode}, {receiver.returncode})")
        sent = json.loads(out_s.strip().splitlines()[-1])
        got = json.loads(out_r.strip().splitlines()[-1])
    finally:
        for p in (sender, receiver):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return {"bytes": nbytes, "memcpy_Bps": sent["memcpy_Bps"], "tcp_Bps": nbytes / sent["tcp_s"],
            "tcp_s": sent["tcp_s"], "tcp_cpu_s": sent["send_cpu_s"] + got["recv_cpu_s"],
            "tcp_parallel_Bps": nbytes / sent["tcp_parallel_s"], "tcp_streams": parallel_streams(),
            "pg_rebuild_s": max(sent["pg_s"], got["pg_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=100_000_000)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memcpy", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memcpy is not None:
        print(json.dumps({"memcpy_Bps": _memcpy(args.memcpy)}))
    elif args.peer:
        nbytes, port, reps, store_port = (int(x) for x in args.rest)
        _peer(args.peer, port, nbytes, reps, store_port)
    else:
        print(json.dumps(measure(args.bytes), indent=2))


if __name__ == "__main__":
    main()
