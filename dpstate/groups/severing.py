"""The TCP connections of a generation's process groups, recorded as they are made and severed on an abort.

Gloo has no abort that releases a waiting collective (DESIGN.md): a rank waiting in a sub-group's collective on a
frozen peer, or on a live peer that already left for the next generation, waits out the collective timeout.
shutdown(2) of the group's own connections, from any thread, fails every pending and later op on them at once
with "Connection closed by peer", and the peers at their other ends see the same (measured on torch 2.13:
a DTensor all-reduce waiting on a SIGSTOPped peer raised within a millisecond). Listening sockets are left
alone: Gloo's listener thread ends the process when its accept fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

from dpcommon import traffic_class


def _socket_fds() -> dict[int, str]:
    """fd -> "socket:[inode]" for every socket this process holds (Linux; empty elsewhere)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(name)] = link
    return found


def _group_connection(fd: int) -> bool:
    """Is `fd` a connected TCP socket (not a listener: getpeername fails on one; not a Unix socket) that is not
    snapshot traffic (a replica DEALER that connected while the groups were built: dpcommon.traffic_class)?"""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        sock.getpeername()
        return not traffic_class.is_snapshot_traffic(sock)
    except OSError:
        return False
    finally:
        sock.close()


class GroupConnections:
    """The connections recorded while groups were built (record()), until sever() shuts them down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, str] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Every TCP connection that appears while the block runs (and still exists after it) is the groups'.
        Only this process's new sockets are looked at: the namespace's TCP table, which holds every rank's
        connections on a host and every leaked generation's, made this O(R^2) per rank (docs/scaling.md)."""
        before = _socket_fds()
        yield
        new = {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link and _group_connection(fd)}
        with self._lock:
            self._held.update(new)

    def __len__(self) -> int:
        return len(self._held)

    def sever(self) -> int:
        """Shut down every recorded connection that is still the socket it was (an fd number may have been
        reused since); returns how many were shut down. The fds stay open: their groups are leaked, not closed."""
        with self._lock:
            held, self._held = self._held, {}
        severed = 0
        for fd, link in held.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue
                dup = os.dup(fd)
            except OSError:
                continue
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                severed += 1
            except OSError:  # not connected any more
                pass
            finally:
                sock.close()
        return severed
