"""Controller cost at scale: 4,096 active nodes x 8 ranks + 64 spares, in CPU milliseconds.

Measures, through the real decode + state machine + encode path (no sockets): one heartbeat round, one
progress round (every rank reports a step), and the decision after a node failure (failure in, probe round,
Reconfigure messages out). Usage: python benchmarks/controller_scale.py [--nodes 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dpcommon import protocol as p
from dprun.controller.state_machine import Controller, JobSpec, NodeGone, Received, Send, Tick


class Wire:
    """Agents' messages go through the codec as they would on the socket; only the controller side is timed."""

    def __init__(self):
        self.codec = p.Codec(b"benchmark-token")

    def frames(self, msg):
        return self.codec.encode(msg)

    def deliver(self, controller, sender: str, frames, now: float) -> list:
        msg, _ = self.codec.decode(frames)
        return controller.handle(Received(sender, msg), now)

    def send_all(self, actions) -> int:
        sent = 0
        for action in actions:
            if isinstance(action, Send):
                self.codec.encode(action.msg)
                sent += 1
        return sent


def build(nodes: int, spares: int, nproc: int, wire: Wire):
    spec = JobSpec(nnodes=nodes, spares=spares, nproc_per_node=nproc, store_endpoint="10.0.0.1:1",
                   heartbeat_timeout=1e9, rdzv_timeout=1e9)
    c = Controller(spec, 0.0)
    for i in range(nodes + spares):
        node = f"node{i:05d}"
        reg = p.Register(node, f"host{i}", 1000 + i, nproc, i >= nodes, i if i < nodes else -1, f"tcp://h{i}:1")
        wire.send_all(wire.deliver(c, node, wire.frames(reg), 0.0))
    assert c.timeline.generation == 0, "the first generation did not form"
    for rank in range(spec.world_size):  # every rank has replicated steps 1..3
        holder = c.timeline.layout[(rank // nproc + 1) % nodes]
        for step in (1, 2, 3):
            wire.deliver(c, holder, wire.frames(p.SnapshotStored(holder, rank, step, 0)), 0.0)
    return c


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--spares", type=int, default=64)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    wire = Wire()
    heartbeat, progress, decide, tick = [], [], [], []
    for rep in range(args.repeat):
        c = build(args.nodes, args.spares, args.nproc, wire)
        now = 1.0
        live = [n.node_id for n in c.table.live()]
        beats = [(n, wire.frames(p.Heartbeat(n, 0))) for n in live]
        heartbeat.append(cpu_ms(lambda: [wire.deliver(c, n, f, now) for n, f in beats]))
        tick.append(cpu_ms(lambda: wire.send_all(c.handle(Tick(), now))))
        layout = c.timeline.layout
        reports = [(layout[r // args.nproc], wire.frames(p.Progress(layout[r // args.nproc], 0, r, 4)))
                   for r in range(c.spec.world_size)]
        progress.append(cpu_ms(lambda: [wire.deliver(c, n, f, now) for n, f in reports]))
        victim = c.timeline.layout[len(c.timeline.layout) // 2]

        def failure_to_reconfigure():
            wire.send_all(c.handle(NodeGone(victim, "benchmark"), now))
            seq = c.reconstruction.seq  # the probe's
            pongs = [(n.node_id, wire.frames(p.Pong(n.node_id, seq))) for n in c.table.live()]
            sent = 0
            for n, f in pongs:
                sent += wire.send_all(wire.deliver(c, n, f, now))
            assert c.timeline.generation == 1 and sent >= args.nodes, "no reconfiguration"

        decide.append(cpu_ms(failure_to_reconfigure))
    result = {
        "nodes": args.nodes, "spares": args.spares, "ranks": args.nodes * args.nproc,
        "heartbeat_round_cpu_ms": statistics.median(heartbeat),
        "ping_tick_cpu_ms": statistics.median(tick),
        "progress_round_cpu_ms": statistics.median(progress),
        "decision_cpu_ms": statistics.median(decide),
    }
    print(f"controller at {args.nodes} nodes x {args.nproc} ranks + {args.spares} spares (CPU ms, median of "
          f"{args.repeat}):")
    for key in ("heartbeat_round_cpu_ms", "ping_tick_cpu_ms", "progress_round_cpu_ms", "decision_cpu_ms"):
        print(f"  {key:28s} {result[key]:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
