"""The controller's I/O shell: a ZeroMQ ROUTER for agents, a clock, and the actions carried out.

Everything it decides comes from dprun.controller.state_machine.Controller; this only moves bytes and time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import pickle
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable

import zmq

from dpcommon import protocol as p
from dpcommon.channel import poll_ms
from dpagent.liveness import PAUSED_AFTER_S

from dprun.controller.state_machine import (
    ConnectionDropped, Controller, Finish, JobSpec, NodeGone, Paused, Publish, Received, Send, Shutdown, Tick,
    WakeNode,
)
from dprun.monitor.events import EventSink
from dprun.monitor.jobview import JobView

if TYPE_CHECKING:  # (torch is slow to import: dprun.launcher.job starts the stores)
    from torch.distributed import TCPStore

TICK_S = 0.05
VIEW_EVERY_S = 0.5  # the dashboard's model is rebuilt at most this often (less often when that gets costly)


class PortInUse(RuntimeError):
    pass


class ControllerServer:
    """Binds the rendezvous socket at once (so agents can start connecting), runs the loop on `run()`."""

    def __init__(self, codec: p.Codec, host: str, port: int, sink: EventSink, view: JobView | None = None,
                 publish: Callable[[dict], None] | None = None, wake_node: Callable[[str], bool] | None = None):
        self.codec = codec
        self.sink = sink
        self.wake_node = wake_node  # SIGCONT a frozen node whose agent runs on this machine
        self.view = view  # folds events, progress and controller state for the dashboard and `dprun status`
        self.publish = publish  # gets every new view model (the status feed)
        self.latest_model: dict | None = None
        self.fresh_store: Callable[[], tuple[TCPStore, str]] | None = None  # restart mode: a TCPStore per generation
        self._stores: dict[int, tuple[TCPStore, str]] = {}
        self._rendezvous: dict[int, float] = {}  # restart mode: generation -> wall time of the failure
        self._next_view = 0.0
        if view is not None:
            sink.listeners.append(view.on_event)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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
            why = ("address already in use: another job's controller, or this node rank started twice?"
                   if exc.errno == errno.EADDRINUSE else exc.strerror)
            raise PortInUse(f"cannot listen on {host}:{port} ({why}); pick a free port") from None
        self.host = host
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # a peer's connection closed
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
        poller.register(self._monitor, zmq.POLLIN)
        next_tick = ran = time.monotonic()
        while True:
            ready = dict(poller.poll(poll_ms(next_tick, time.monotonic())))
            inputs = []
            if self.router in ready:
                inputs.extend(self._drain_router())
            if self._inbox in ready:
                while self._inbox.poll(0):
                    inputs.append(pickle.loads(self._inbox.recv()))
            if self._monitor in ready:
                while self._monitor.poll(0):
                    self._monitor.recv_multipart()  # (which connection it was, ZeroMQ does not say)
                    inputs.append(ConnectionDropped())
            if time.monotonic() >= next_tick:
                inputs.append(Tick())
                next_tick = time.monotonic() + TICK_S
                if self._rendezvous:
                    self._watch_rendezvous(spec.world_size)
            for event in inputs:
                now = time.monotonic()
                # inputs are handed on every TICK_S or sooner: a longer gap since the last means dprun itself
                # did not run, told before this input (a stop that fell mid-turn included: a Tick handed its
                # time unannounced would fail a node for the silence)
                told = [Paused(now - ran - TICK_S), event] if now - ran > PAUSED_AFTER_S else [event]
                ran = now  # (not read after handle: a stop inside it is then seen at the next input)
                for one in told:
                    if (finish := self._apply(controller.handle(one, now))) is not None:
                        self._refresh_view(controller)
                        return finish
            if self.view is not None and time.monotonic() >= self._next_view:
                self._refresh_view(controller)

    def _refresh_view(self, controller: Controller) -> None:
        """A new model for the dashboard and the status feed; spaced out so that it costs under 5 %."""
        if self.view is None:
            return
        started = time.monotonic()
        self.view.on_controller(controller.view(started))
        self.latest_model = self.view.model(time.time())
        if self.publish is not None:
            self.publish(self.latest_model)
        self._next_view = time.monotonic() + max(VIEW_EVERY_S, 20 * (time.monotonic() - started))

    def _drain_router(self):
        while self.router.poll(0):
            frames = self.router.recv_multipart(copy=False)
            sender = frames[0].bytes.decode(errors="replace")
            try:
                msg, _ = self.codec.decode(frames[1:])
            except p.ProtocolError as exc:
                if exc.refusal:  # another job's node, or another version's: tell it why it will get no answer
                    with contextlib.suppress(zmq.ZMQError):
                        self.router.send_multipart([frames[0], *p.refusal(exc.refusal)], zmq.NOBLOCK)
                self.dropped += 1
                if self.dropped <= 10 or self.dropped % 100 == 0:
                    self.sink.emit({"event": "message_dropped", "sender": sender[:64], "reason": str(exc)[:200],
                                    "dropped_total": self.dropped})
                continue
            if isinstance(msg, p.AgentExited):  # a member's dprun speaks for its dead agent, as ours do (NodeGone)
                yield NodeGone(msg.node_id, f"agent process exited ({msg.how})")
                continue
            if self.view is not None:
                self._observe(sender, msg)
            yield Received(sender, msg)

    def _observe(self, sender: str, msg) -> None:
        """What the dashboard learns from a message before the controller handles it."""
        assert self.view is not None  # (only called with one)
        now = time.time()
        self.view.on_heard(sender, now)
        if isinstance(msg, p.Progress):
            self.view.on_progress(sender, msg.step, msg.generation, msg.metrics, now)

    def _apply(self, actions) -> Finish | None:
        finish = None
        for action in actions:
            if isinstance(action, WakeNode):
                if not (self.wake_node and self.wake_node(action.node_id)):
                    self.sink.emit({"event": "fault_skipped", "spec": action.spec,
                                    "reason": "wake-node needs the node's agent on the head's machine"})
            elif isinstance(action, Send):
                msg = action.msg
                if isinstance(msg, p.Reconfigure) and msg.restart_workers and self.fresh_store is not None:
                    msg = dataclasses.replace(msg, store_endpoint=self._store_for(msg.generation))
                try:
                    self.router.send_multipart([action.node_id.encode(), *self.codec.encode(msg)],
                                               flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the node is gone or not connected yet: heartbeats and probes handle it
            elif isinstance(action, Publish):
                event = action.event
                if event["event"] == "recovery_complete" and event.get("mode") == "restart":
                    self._rendezvous[event["generation"]] = time.time() - event["phases"]["total_s"]
                self.sink.emit(event, console=event.get("first", True))  # (a failure said once per kind)
            elif isinstance(action, Finish):
                finish = action
        return finish

    def _store_for(self, generation: int) -> str:
        """Restart mode: every generation rendezvous on a fresh TCPStore, as torchrun does (stale keys of the
        previous round would otherwise send the new workers to dead peers)."""
        if generation not in self._stores:
            assert self.fresh_store is not None  # (only called in restart mode, which sets it)
            self._stores[generation] = self.fresh_store()
            for old in [g for g in self._stores if g < generation - 1]:
                del self._stores[old]
        return self._stores[generation][1]

    def _watch_rendezvous(self, world_size: int) -> None:
        """Restart mode: the cost that matters is until the new workers are back in torch's rendezvous
        (imports, startup): seen as their keys arriving in the generation's fresh store (torch 2.x's gloo
        rendezvous writes one key per rank plus one)."""
        for generation, failed_at in list(self._rendezvous.items()):
            store = self._stores.get(generation)
            try:
                done = store is not None and store[0].num_keys() >= world_size + 1
            except RuntimeError:
                done = False
            if done or store is None or time.time() - failed_at > 600:
                del self._rendezvous[generation]
                if done:
                    self.sink.emit({"event": "restart_rendezvous", "generation": generation,
                                    "seconds": round(time.time() - failed_at, 3)})

    def shutdown(self, exit_code: int, reason: str) -> None:
        self.post(Shutdown(exit_code, reason))

    def close(self) -> None:
        self.router.disable_monitor()
        for sock in (self._poster, self._inbox, self._monitor):
            sock.close(0)
        self.router.close()  # lingers up to 2 s so the final Stop messages leave
