"""The TCP connections of a generation's process groups, recorded as they are made and severed on an abort.

Gloo has no abort that releases a waiting collective (DESIGN.md): a rank waiting in a sub-group's collective on a
frozen peer, or on a live peer that already left for the next generation, waits out the collective timeout.
shutdown(2) of the group's own connections, from any thread, fails every pending and later op on them at once
with "Connection closed by peer", and the peers at their other ends see the same (measured on torch 2.13:
a DTensor all-reduce waiting on a SIGSTOPped peer raised within a millisecond). Listening sockets are left
alone: Gloo's listener thread ends the process when its accept fails.

Groups that connect lazily (dpstate.groups.pgroup.lazy_connect) make their connections in Gloo's threads, after the
build: those are found when severing, and found again while the generation stays superseded (a collective begun
after a sever connects anew).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

from dpcommon import traffic_class

SEVER_AGAIN_S = 0.1  # lazily connected groups: how often connections made since the last sever are looked for


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


@contextlib.contextmanager
def _socket_of(fd: int) -> Iterator[socket.socket | None]:
    """A duplicate of `fd` as a socket object, closed after the block (None: the fd is gone)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        sock = None
    try:
        yield sock
    finally:
        if sock is not None:
            sock.close()


def _connected_tcp(sock: socket.socket) -> bool:
    """Is `sock` a connected TCP socket (not a listener: getpeername fails on one; not a Unix socket) that is not
    snapshot traffic (a replica DEALER that connected while the groups were built: dpcommon.traffic_class)?"""
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.getpeername()
        return not traffic_class.is_snapshot_traffic(sock)
    except OSError:
        return False


def _group_connection(fd: int) -> bool:
    """Is `fd` a connection that groups may have made (_connected_tcp)?"""
    with _socket_of(fd) as sock:
        return sock is not None and _connected_tcp(sock)


def _listening_address(fd: int) -> tuple | None:
    """The local address of `fd` where it is a listening TCP socket, else None."""
    with _socket_of(fd) as sock:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return sock.getsockname()[:2] if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) else None
        except OSError:
            return None


def _made_by_gloo(fd: int, listeners: set[tuple], listening_ports: set[int]) -> bool:
    """Is `fd` a connection that a lazily connecting Gloo group made: connected TCP, not snapshot traffic, and
    either accepted at one of the groups' `listeners` or connected by Gloo to a peer's (Gloo sets SO_REUSEADDR on
    the sockets it connects; the TCPStore client's and ZeroMQ's connecting sockets have it unset, and a socket
    accepted at another of this process's listeners, whose port is in `listening_ports`, inherits it)?"""
    with _socket_of(fd) as sock:
        if sock is None or not _connected_tcp(sock):
            return False
        try:
            local = sock.getsockname()[:2]
            return local in listeners or (bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR))
                                          and local[1] not in listening_ports)
        except OSError:
            return False


class GroupConnections:
    """The connections recorded while groups were built (record()), until sever() shuts them down; for groups
    that connect lazily (begin(lazy=True)), also those made after the build."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, str] = {}
        self._lazy = False
        self._before: dict[int, str] = {}  # (lazy) the sockets there before the generation's groups were made
        self._listeners: set[tuple] = set()  # (lazy) the groups' listening addresses
        self._again: threading.Event | None = None  # (lazy) set: the severing again after a sever ends

    def begin(self, lazy: bool) -> None:
        """A generation's groups are about to be made (`lazy`: they connect on first use). The last generation's
        connections that were never severed stay held until the next sever, as recorded ones always did."""
        with self._lock:
            if self._again is not None:
                self._again.set()
            if self._lazy:
                self._held.update(self._lazily_made())
            self._lazy, self._listeners, self._again = lazy, set(), None
            self._before = _socket_fds() if lazy else {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Every TCP connection that appears while the block runs (and still exists after it) is the groups'.
        Only this process's new sockets are looked at: the namespace's TCP table, which holds every rank's
        connections on a host and every leaked generation's, made this O(R^2) per rank (docs/scaling.md)."""
        before = _socket_fds()
        yield
        made = {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link}
        new = {fd: link for fd, link in made.items() if _group_connection(fd)}
        listeners = {address for address in map(_listening_address, made) if address is not None}
        with self._lock:
            self._held.update(new)
            self._listeners |= listeners

    def __len__(self) -> int:
        return len(self._held)

    def sever(self) -> int:
        """Shut down every recorded connection that is still the socket it was (an fd number may have been
        reused since), and every one a lazily connecting group made since; returns how many were shut down. The
        fds stay open: their groups are leaked, not closed. Lazily connecting groups: the same again every
        SEVER_AGAIN_S until the next generation's begin()."""
        with self._lock:
            severed = self._sever_held()
            if self._lazy and self._again is None:
                self._again = threading.Event()
                threading.Thread(target=self._sever_again, args=(self._again,), name="dpstate-sever-again",
                                 daemon=True).start()
        return severed

    def _sever_again(self, ended: threading.Event) -> None:
        while not ended.wait(SEVER_AGAIN_S):
            with self._lock:
                if not ended.is_set():
                    self._sever_held()

    def _lazily_made(self) -> dict[int, str]:
        """(lazy, the lock held) The groups' connections made since the generation began."""
        current = _socket_fds()
        ports = {address[1] for address in map(_listening_address, current) if address is not None}
        return {fd: link for fd, link in current.items()
                if self._before.get(fd) != link and _made_by_gloo(fd, self._listeners, ports)}

    def _sever_held(self) -> int:
        """(the lock held) Shut down the recorded connections, and the lazily made ones."""
        held, self._held = self._held, {}
        if self._lazy:
            held.update(self._lazily_made())
            self._before.update(held)  # (shut down: not looked at again)
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
