"""How many connections a restore's fetch of a snapshot uses (DP_FETCH_STREAMS), each with a ZeroMQ I/O thread of
its own at the fetching end. Torch-free, so that dprun checks the setting before anything starts.

One TCP stream is a limit of its own (loopback here: 2.9 GB/s over one connection, 4.8-5.1 GB/s over two at once,
benchmarks/_limits.py), but a fetch also copies and digests what it receives: on 2 cores, 2 or 3 connections
restored 1 GB no faster than one (docs/performance.md). So one by default; benchmarks/scaling.py measures both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT = 1
MOST = 16


def env_problem(env: Mapping[str, str]) -> str | None:
    """None where DP_FETCH_STREAMS is unset or a whole number from 1 to MOST, else the line that says what to give."""
    raw = env.get("DP_FETCH_STREAMS", str(DEFAULT))
    if raw.strip().isdigit() and 1 <= int(raw) <= MOST:
        return None
    return (f"DP_FETCH_STREAMS={raw!r}: give how many connections a restore's fetch uses, from 1 to {MOST} "
            f"(default {DEFAULT})")


def fetch_streams() -> int:
    """DP_FETCH_STREAMS (default DEFAULT). dprun checked it."""
    problem = env_problem(os.environ)
    if problem:
        raise ValueError(problem)
    return int(os.environ.get("DP_FETCH_STREAMS", str(DEFAULT)))
