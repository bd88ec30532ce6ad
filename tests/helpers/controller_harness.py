"""The controller's state machine driven in this process: a Harness (a fake clock, every action recorded), the
JobSpec of the tests, and the job states several test modules start from (formed, finished_but_rank_1_lingers)."""

from __future__ import annotations

from dpcommon import protocol as p
from dprun.controller.state_machine import Controller, Finish, JobSpec, Publish, Received, Send, Tick


def spec(**kw) -> JobSpec:
    base = dict(nnodes=2, spares=1, nproc_per_node=1, store_endpoint="127.0.0.1:1", heartbeat_interval=0.5,
                heartbeat_timeout=5.0, probe_timeout=1.0, rdzv_timeout=30.0)
    base.update(kw)
    return JobSpec(**base)


class Harness:
    """Drives a Controller with a fake clock and records what it does."""

    def __init__(self, job: JobSpec):
        self.now = 0.0
        self.c = Controller(job, self.now)
        self.sent: list[Send] = []
        self.events: list[dict] = []
        self.finish: Finish | None = None

    def feed(self, event, dt: float = 0.0):
        self.now += dt
        actions = self.c.handle(event, self.now)
        for a in actions:
            if isinstance(a, Send):
                self.sent.append(a)
            elif isinstance(a, Publish):
                self.events.append(a.event)
            elif isinstance(a, Finish):
                self.finish = a
        return actions

    def msg(self, node: str, m):
        return self.feed(Received(node, m))

    def register(self, node: str, spare=False, rank=-1, nproc=1, **terms):
        return self.msg(node, p.Register(node, "h", 1, nproc, spare, rank, f"tcp://{node}:1", p.JobTerms(**terms)))

    def join_set_up(self, node: str) -> None:
        """`node` registers as a spare, then its heartbeat says its worker waits set up (idle): a grow can take it."""
        self.register(node, spare=True)
        self.msg(node, p.Heartbeat(node, -1, {"0": {"activity": "idle"}}))

    def sent_to(self, node: str, kind) -> list:
        return [s.msg for s in self.sent if s.node_id == node and isinstance(s.msg, kind)]

    def pong_all(self):
        seq = self.c.reconstruction.seq
        for node in self.c.table.live():
            self.msg(node.node_id, p.Pong(node.node_id, seq))

    def alive(self, statuses: dict[str, dict], dt: float = 0.5):
        """One heartbeat interval: these nodes heartbeat (with worker statuses) and answer probes."""
        for node, workers in statuses.items():
            self.msg(node, p.Heartbeat(node, self.c.timeline.generation, workers))
            self.msg(node, p.Pong(node, self.c.reconstruction.seq))
        self.feed(Tick(), dt=dt)

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]


def formed(job=None) -> Harness:
    h = Harness(job or spec())
    h.register("a", rank=0)
    h.register("b", rank=1)
    h.register("s", spare=True)
    return h


def finished_but_rank_1_lingers(h: Harness) -> dict:
    """Both ranks finished step 40; a's worker exited 0, b's (pid 4242) still runs: the heartbeat statuses."""
    h.msg("a", p.Progress("a", 0, 0, 40))
    for node, rank in (("a", 0), ("b", 1)):
        h.msg(node, p.RankFinished(node, 0, rank, 40))
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 0))
    return {"a": {}, "b": {"0": {"rank": 1, "step": 40, "activity": "idle", "age": 0.2, "pid": 4242}}, "s": {}}
