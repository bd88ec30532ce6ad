"""Groups that connect lazily (DP_GLOO_LAZY_CONNECT) make their connections after the build, in Gloo's threads:
severing finds them when it severs and again while the generation stays superseded, on real loopback sockets, and
leaves the process's other connections alone.
"""

from __future__ import annotations

import socket

import pytest

from dpcommon import gloo_connect
from dpstate.groups.severing import SEVER_AGAIN_S, GroupConnections

pytestmark = pytest.mark.timeout(30)


def _gloo_connect(address) -> socket.socket:
    """A connection as Gloo makes one to a peer's listener (SO_REUSEADDR set before the connect)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.connect(address)
    return sock


def _closed_at(end: socket.socket, within_s: float = 10.0) -> bool:
    """Does the other end of `end`'s connection get shut down within `within_s` (end reads end-of-file)?"""
    end.settimeout(within_s)
    try:
        return end.recv(1) == b""
    except TimeoutError:
        return False


@pytest.fixture
def sockets():
    made: list[socket.socket] = []

    def keep(*socks: socket.socket) -> None:
        made.extend(socks)

    yield keep
    for sock in made:
        sock.close()


def test_connections_made_after_a_lazy_build_are_severed_and_the_others_kept(sockets):
    connections = GroupConnections()
    connections.begin(lazy=True)
    with connections.recording():
        group_listener = socket.create_server(("127.0.0.1", 0))  # as Gloo's, made while the group is built
    peer_listener = socket.create_server(("127.0.0.1", 0))  # a peer rank's (here: this process's; not the group's)
    sockets(group_listener, peer_listener)
    assert len(connections) == 0  # nothing connected while built

    # lazily, on the first collective: a peer connects to this rank's listener, and this rank to a peer's
    peer_end = socket.create_connection(group_listener.getsockname())
    accepted, _ = group_listener.accept()
    made = _gloo_connect(peer_listener.getsockname())
    made_far_end, _ = peer_listener.accept()
    # the process's other connections: a client as the TCPStore's or ZeroMQ's (SO_REUSEADDR unset), and a socket
    # accepted at a listener of the process that is not the groups' (it inherits the listener's SO_REUSEADDR)
    other = socket.create_connection(peer_listener.getsockname())
    other_far_end, _ = peer_listener.accept()
    sockets(peer_end, accepted, made, made_far_end, other, other_far_end)

    assert connections.sever() == 2
    assert _closed_at(peer_end) and _closed_at(made_far_end)
    other.sendall(b"x")
    assert other_far_end.recv(1) == b"x"  # kept, both ends
    other_far_end.sendall(b"y")
    assert other.recv(1) == b"y"

    # a collective begun after the sever (the generation is superseded) connects anew: severed again
    again = _gloo_connect(peer_listener.getsockname())
    again_far_end, _ = peer_listener.accept()
    sockets(again, again_far_end)
    assert _closed_at(again_far_end)

    # the next generation begins: its connections are its own
    connections.begin(lazy=True)
    fresh = _gloo_connect(peer_listener.getsockname())
    fresh_far_end, _ = peer_listener.accept()
    sockets(fresh, fresh_far_end)
    assert not _closed_at(fresh_far_end, within_s=20 * SEVER_AGAIN_S)


def test_groups_that_connect_every_pair_when_built_sever_only_what_the_build_recorded(sockets):
    connections = GroupConnections()
    connections.begin(lazy=False)
    listener = socket.create_server(("127.0.0.1", 0))
    sockets(listener)
    with connections.recording():
        built = _gloo_connect(listener.getsockname())
        built_far_end, _ = listener.accept()
    later = _gloo_connect(listener.getsockname())
    later_far_end, _ = listener.accept()
    sockets(built, built_far_end, later, later_far_end)
    assert connections.sever() == 2  # the build's two ends
    assert _closed_at(built)
    assert not _closed_at(later_far_end, within_s=20 * SEVER_AGAIN_S)


@pytest.mark.parametrize("value, world_size, lazy", [
    (None, 2, False), (None, gloo_connect.LAZY_CONNECT_FROM - 1, False), (None, gloo_connect.LAZY_CONNECT_FROM, True),
    ("auto", 4096, True), ("1", 2, True), ("0", 4096, False), (" AUTO ", 2, False),
])
def test_when_groups_connect_lazily(monkeypatch, value, world_size, lazy):
    if value is None:
        monkeypatch.delenv("DP_GLOO_LAZY_CONNECT", raising=False)
    else:
        monkeypatch.setenv("DP_GLOO_LAZY_CONNECT", value)
    assert gloo_connect.lazy_connect(world_size) is lazy


def test_a_bad_setting_says_what_to_give(monkeypatch):
    monkeypatch.setenv("DP_GLOO_LAZY_CONNECT", "yes")
    with pytest.raises(ValueError, match="give 1 .* 0 .* or auto"):
        gloo_connect.lazy_connect(8)
