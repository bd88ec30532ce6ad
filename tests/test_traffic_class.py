"""Snapshot traffic carries the Lower-Effort DSCP on both ends of its real loopback connections, and the
recording of a generation's group connections leaves it out (so an abort never severs a replica DEALER).
"""

from __future__ import annotations

import os
import socket

import pytest
import zmq

from dpcommon import traffic_class
from dpstate.groups.severing import GroupConnections, _socket_fds

pytestmark = pytest.mark.timeout(30)


def _tcp_sockets_to(port: int) -> list[socket.socket]:
    """Duplicates of this process's TCP sockets with `port` at either end (listeners left out)."""
    found = []
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            ends = (sock.getsockname()[1], sock.getpeername()[1])
        except OSError:
            sock.close()
            continue
        if port in ends and sock.type == socket.SOCK_STREAM:
            found.append(sock)
        else:
            sock.close()
    return found


@pytest.fixture
def replica_link(monkeypatch):
    """A holder's ROUTER and a worker's DEALER made as the agent and the replicator make them, one message
    passed so that the connection exists; yields (port, holder socket, worker context)."""
    monkeypatch.delenv("DP_REPLICA_DSCP", raising=False)
    holder_ctx, worker_ctx = zmq.Context(), zmq.Context()
    router = holder_ctx.socket(zmq.ROUTER)
    traffic_class.mark(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    traffic_class.mark(worker_ctx)
    try:
        yield port, router, worker_ctx
    finally:
        router.close(0)
        holder_ctx.term()
        worker_ctx.destroy(0)


def _connect(port: int, router, worker_ctx) -> zmq.Socket:
    dealer = worker_ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"put")
    assert router.poll(10_000), "the holder got nothing"
    assert router.recv_multipart()[-1] == b"put"
    return dealer


def test_both_ends_of_a_replica_connection_carry_the_lower_effort_dscp(replica_link):
    port, router, worker_ctx = replica_link
    dealer = _connect(port, router, worker_ctx)
    ends = _tcp_sockets_to(port)
    try:
        assert len(ends) == 2  # the DEALER's and the one the ROUTER accepted
        for end in ends:
            assert end.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == traffic_class.LOWER_EFFORT << 2
            assert traffic_class.is_snapshot_traffic(end)
    finally:
        for end in ends:
            end.close()
        dealer.close(0)


def test_unmarked_when_asked_and_bad_values_refused(monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    plain = socket.create_connection(server.getsockname())
    try:
        assert not traffic_class.is_snapshot_traffic(plain)  # a group's connection (Gloo sets no TOS)
        monkeypatch.setenv("DP_REPLICA_DSCP", "0")
        ctx = zmq.Context()
        traffic_class.mark(ctx)  # 0: nothing set
        dealer = ctx.socket(zmq.DEALER)
        assert dealer.getsockopt(zmq.TOS) == 0
        dealer.close(0)
        ctx.term()
        assert not traffic_class.is_snapshot_traffic(plain)
        monkeypatch.setenv("DP_REPLICA_DSCP", "lowest")
        with pytest.raises(ValueError, match="give a DSCP from 0 to 63"):
            traffic_class.snapshot_dscp()
    finally:
        plain.close()
        server.close()


def test_a_replica_connection_made_while_groups_are_built_is_not_recorded(replica_link):
    port, router, worker_ctx = replica_link
    server = socket.create_server(("127.0.0.1", 0))
    connections = GroupConnections()
    with connections.recording():
        group_end = socket.create_connection(server.getsockname())  # as Gloo's connect
        accepted, _ = server.accept()
        dealer = _connect(port, router, worker_ctx)  # the replicator's, at the same time
    try:
        assert len(connections) == 2  # the group connection's two ends only
        assert connections.sever() == 2
        assert group_end.recv(1) == b""  # severed: the peer sees its end closed
        dealer.send(b"after")  # the replica link still works
        assert router.poll(10_000) and router.recv_multipart()[-1] == b"after"
    finally:
        dealer.close(0)
        for sock in (group_end, accepted, server):
            sock.close()
