"""One torchft job for benchmarks/recovery.py: its lighthouse and 2 replica groups, each under
`torchrun --nproc-per-node 1 --max-restarts 1` (which restarts a group whose worker died), on loopback.
Exits when both groups have finished (with the first non-zero exit code, if any).

    PYTHON benchmarks/_torchft_job.py -- [benchmarks/_torchft_train.py arguments]

PYTHON must have torchft (pip install torchft-nightly; a venv made with --system-site-packages reuses torch).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    args = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    bindir = Path(sys.executable).parent
    lighthouse_bin = bindir / "torchft_lighthouse"
    port = free_port()
    lighthouse = subprocess.Popen([str(lighthouse_bin), "--min_replicas", "1", "--quorum_tick_ms", "100",
                                   "--join_timeout_ms", "2000", "--bind", f"127.0.0.1:{port}"])
    time.sleep(0.5)
    groups = []
    for group in range(2):
        env = dict(os.environ, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                   TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        timings = []
        rest = list(args)
        if "--timings" in rest and group:
            i = rest.index("--timings") + 1
            rest[i] = rest[i].replace(".jsonl", f".group{group}.jsonl")
        groups.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", "1", "--max-restarts", "1",
                                        str(HERE / "_torchft_train.py"), *rest, *timings], env=env))
    code = 0
    try:
        for g in groups:
            rc = g.wait()
            code = code or rc
    finally:
        for g in groups:
            if g.poll() is None:
                g.kill()
        lighthouse.kill()
        lighthouse.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
