"""A tiny torch-free worker for the agent tests: speaks to its agent like dpstate would, and obeys argv.

Hello -> waits for Reconfigure -> Progress(step: its restore_step, or 0; metrics={"generation": G}) -> exits 0
(or --stop-exit) on Stop.
A Standby is echoed as Progress(generation -1, rank = local rank, metrics={"standby": its sizes}).
A save of every step held (SaveSnapshots of NO_RANK, its agent having lost the controller) is ignored, or with
--answer-save answered as if step 5 had been written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zmq  # noqa: E402

from dpcommon.protocol import (  # noqa: E402
    NO_RANK, Codec, Hello, Progress, ProtocolError, Reconfigure, SaveSnapshots, SnapshotFiles, Standby, Stop,
)

ENV_KEYS = (
    "DP_NODE_ID", "DP_AGENT_ENDPOINT", "DP_JOB_TOKEN", "DP_JOB_ID", "DP_ROLE", "DP_NPROC_PER_NODE",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--report-dir", help="write <local_rank>.json with pid and env here")
    p.add_argument("--stop-exit", type=int, default=0, help="exit code on Stop")
    p.add_argument("--ignore-stop", action="store_true", help="do not exit on Stop")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM")
    p.add_argument("--spawn-child", action="store_true",
                   help="start a sleeping grandchild, in a session of its own (out of the agent's process group)")
    p.add_argument("--answer-save", action="store_true",
                   help="answer a SaveSnapshots of every step held as if it had written step 5")
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    local_rank = int(os.environ["LOCAL_RANK"])
    node_id = os.environ["DP_NODE_ID"]
    child_pid = None
    if args.spawn_child:
        import subprocess

        child_pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                     start_new_session=True).pid
    if args.report_dir:
        report = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "child": child_pid,
                  "env": {k: os.environ.get(k) for k in ENV_KEYS}}
        path = Path(args.report_dir) / f"{local_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(report))
        path.with_suffix(".tmp").rename(path)

    codec = Codec(os.environ["DP_JOB_TOKEN"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(local_rank).encode())
    sock.linger = 1000
    sock.connect(os.environ["DP_AGENT_ENDPOINT"])
    sock.send_multipart(codec.encode(Hello(node_id, local_rank, os.getpid())))
    rank = -1
    while True:
        try:
            msg, _ = codec.decode(sock.recv_multipart())
        except ProtocolError:
            continue
        if isinstance(msg, SaveSnapshots) and msg.step == NO_RANK and rank in msg.ranks and args.answer_save:
            sock.send_multipart(codec.encode(SnapshotFiles(node_id, NO_RANK, {str(rank): ""}, steps=[5])))
        elif isinstance(msg, Reconfigure):
            rank = msg.node_rank * msg.nproc_per_node + local_rank
            step = max(msg.restore_step, 0)
            progress = Progress(node_id, msg.generation, rank, step, {"generation": msg.generation})
            sock.send_multipart(codec.encode(progress))
        elif isinstance(msg, Standby):
            sock.send_multipart(codec.encode(Progress(node_id, -1, local_rank, 0, {"standby": msg.snapshot_bytes})))
        elif isinstance(msg, Stop) and not args.ignore_stop:
            sock.close()
            return args.stop_exit


if __name__ == "__main__":
    sys.exit(main())
