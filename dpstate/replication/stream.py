"""A snapshot sent whole while it is captured: each chunk goes to the holders (SnapshotPart) as soon as the copy
has written it, so a snapshot costs about its slower stage (copy or send), not their sum.

A holder is streamed to only once its SnapshotReserved came (it dropped its oldest copy, whose memory the parts
then take); one whose answer comes after the capture gets the snapshot as one put (dpstate.replication.send).
The checksum covers every byte, so it travels last, in the PutSnapshot that closes the stream (parts > 0).
"""

from __future__ import annotations

from typing import Any

import zmq

from dpcommon import protocol as P


class PartStream:
    """The parts of one capture on their way to the holders in `socks` (endpoint -> DEALER), which were each sent
    ReserveSnapshot. Runs on the replication thread, the only one that uses those sockets."""

    def __init__(self, codec: P.Codec, socks: dict[str, Any], rank: int, step: int, generation: int):
        self.codec, self.socks = codec, socks
        self.rank, self.step, self.generation = rank, step, generation
        self.parts: list[memoryview] = []  # the buffer cut as chunk_views cuts it, once its size is known
        self.nbytes = 0
        self.final = 0  # parts whose bytes are final
        self.sent: dict[str, int] = {}  # endpoint -> parts sent to it: the holders that made room

    def begin(self, data: Any) -> None:
        """The capture's data (the buffer's first nbytes) is laid out: its chunks will be written in order."""
        self.nbytes = memoryview(data).nbytes
        self.parts = P.chunk_views(data) if self.nbytes else []

    def ready(self, upto: int) -> None:
        """The data's first `upto` bytes are final: send the whole chunks among them to the holders that made
        room (and the last, once every byte is)."""
        if not self.parts:
            return
        self.final = len(self.parts) if upto >= self.nbytes else max(self.final, upto // P.CHUNK_BYTES)
        self._poll_reserved()
        for endpoint, sent in self.sent.items():
            sock = self.socks[endpoint]
            for index in range(sent, self.final):
                msg = P.SnapshotPart(self.rank, self.step, self.generation, index)
                sock.send_multipart(self.codec.encode(msg, [self.parts[index]]), copy=False)
            self.sent[endpoint] = self.final

    def streamed(self) -> dict[str, int]:
        """Endpoint -> parts, of the holders that got every part (each to be sent the closing PutSnapshot)."""
        return {e: n for e, n in self.sent.items() if self.parts and n == len(self.parts)}

    def _poll_reserved(self) -> None:
        """Take the SnapshotReserved answers that came, without waiting. Anything else that comes first is an
        answer for an older snapshot, which the delivery would drop as well."""
        for endpoint, sock in self.socks.items():
            while endpoint not in self.sent and sock.poll(0, zmq.POLLIN):
                try:
                    msg, _ = self.codec.decode(sock.recv_multipart(zmq.NOBLOCK))
                except (P.ProtocolError, zmq.Again):
                    continue
                if isinstance(msg, P.SnapshotReserved) and (msg.rank, msg.step) == (self.rank, self.step):
                    self.sent[endpoint] = 0
