"""The controller's I/O shell: a ZeroMQ ROUTER for agents, a clock, and the actions carried out.

Everything it decides comes from dprun.controller.Controller; this only moves bytes and time.
"""

from __future__ import annotations

import pickle
import threading
import time
import uuid

import zmq

from dpagent import protocol as p

from .controller import Controller, Finish, JobSpec, Publish, Received, Send, Shutdown, Tick
from .events import EventSink

TICK_S = 0.05


class PortInUse(RuntimeError):
    pass


class ControllerServer:
    """Binds the rendezvous socket at once (so agents can start connecting), runs the loop on `run()`."""

    def __init__(self, codec: p.Codec, host: str, port: int, sink: EventSink):
        self.codec = codec
        self.sink = sink
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 2000)
        try:
            if port == 0:
                self.port = self.router.bind_to_random_port(f"tcp://{host}")
            else:
                self.router.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self.router.close(0)
            raise PortInUse(f"cannot listen on {host}:{port} ({exc.strerror}); pick a free port") from None
        self.host = host
        self._inbox_addr = f"inproc://dprun-{uuid.uuid4().hex}"
        self._inbox = self.ctx.socket(zmq.PULL)
        self._inbox.bind(self._inbox_addr)
        self._post_lock = threading.Lock()
        self._poster = self.ctx.socket(zmq.PUSH)
        self._poster.connect(self._inbox_addr)
        self.dropped = 0
        self.controller: Controller | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def post(self, event) -> None:
        """Hand an input to the controller from any thread (NodeGone, Shutdown)."""
        with self._post_lock:
            self._poster.send(pickle.dumps(event))

    def run(self, spec: JobSpec) -> Finish:
        self.controller = controller = Controller(spec, time.monotonic())
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        next_tick = time.monotonic()
        while True:
            ready = dict(poller.poll(max(0.0, next_tick - time.monotonic()) * 1000))
            inputs = []
            if self.router in ready:
                inputs.extend(self._drain_router())
            if self._inbox in ready:
                while self._inbox.poll(0):
                    inputs.append(pickle.loads(self._inbox.recv()))
            if time.monotonic() >= next_tick:
                inputs.append(Tick())
                next_tick = time.monotonic() + TICK_S
            for event in inputs:
                finish = self._apply(controller.handle(event, time.monotonic()))
                if finish is not None:
                    return finish

    def _drain_router(self):
        while self.router.poll(0):
            frames = self.router.recv_multipart(copy=False)
            sender = frames[0].bytes.decode(errors="replace")
            try:
                msg, _ = self.codec.decode(frames[1:])
            except p.ProtocolError as exc:
                self.dropped += 1
                if self.dropped <= 10 or self.dropped % 100 == 0:
                    self.sink.emit({"event": "message_dropped", "sender": sender[:64], "reason": str(exc)[:200],
                                    "dropped_total": self.dropped})
                continue
            yield Received(sender, msg)

    def _apply(self, actions) -> Finish | None:
        finish = None
        for action in actions:
            if isinstance(action, Send):
                try:
                    self.router.send_multipart([action.node_id.encode(), *self.codec.encode(action.msg)],
                                               flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the node is gone or not connected yet: heartbeats and probes handle it
            elif isinstance(action, Publish):
                self.sink.emit(action.event)
            elif isinstance(action, Finish):
                finish = action
        return finish

    def shutdown(self, exit_code: int, reason: str) -> None:
        self.post(Shutdown(exit_code, reason))

    def close(self) -> None:
        for sock in (self._poster, self._inbox):
            sock.close(0)
        self.router.close()  # lingers up to 2 s so the final Stop messages leave
