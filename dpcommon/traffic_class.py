"""The network class of snapshot traffic: its connections carry the Lower-Effort DSCP (RFC 8622), so that a
fabric that honours it lets training's own collectives go first, and a worker can tell them from its groups'.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import zmq

LOWER_EFFORT = 1  # RFC 8622's DSCP; CS1 (8) on fabrics that know only the older scavenger class


def env_problem(env: Mapping[str, str]) -> str | None:
    """None where DP_REPLICA_DSCP is unset or a DSCP, else the one line that says what to give."""
    raw = env.get("DP_REPLICA_DSCP", str(LOWER_EFFORT))
    if raw.strip().isdigit() and 0 <= int(raw) <= 63:
        return None
    return (f"DP_REPLICA_DSCP={raw!r}: give a DSCP from 0 to 63 (1: Lower-Effort, the default; 0: snapshot "
            "traffic unmarked)")


def snapshot_dscp() -> int:
    """DP_REPLICA_DSCP (default 1, Lower-Effort; 0: unmarked, as any other traffic). dprun checked it."""
    problem = env_problem(os.environ)
    if problem:
        raise ValueError(problem)
    return int(os.environ.get("DP_REPLICA_DSCP", str(LOWER_EFFORT)))


def mark(owner: zmq.Context | zmq.Socket) -> None:
    """Every connection of this socket (or of every socket this context makes from now on), those it accepts
    too, carries the snapshot DSCP: ZeroMQ's TOS option sets IP_TOS, and IPV6_TCLASS on IPv6."""
    dscp = snapshot_dscp()
    if dscp:
        owner.setsockopt(zmq.TOS, dscp << 2)


def is_snapshot_traffic(sock: socket.socket) -> bool:
    """Does this TCP socket carry the snapshot DSCP (never, where it is 0: nothing tells such traffic apart)?"""
    dscp = snapshot_dscp()
    if not dscp:
        return False
    try:
        if sock.family == socket.AF_INET6:
            tclass = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
        else:
            tclass = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    except OSError:
        return False
    return tclass >> 2 == dscp
