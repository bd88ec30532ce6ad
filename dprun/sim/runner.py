"""Runs one fault schedule through the simulated cluster and judges it; a failing seed replays exactly.

`run_schedule(random_schedule(seed))` returns the outcome name or raises InvariantViolation.
"""

from __future__ import annotations

import collections
import random

from .invariants import Checker, InvariantViolation, judge_outcome
from .cluster import ScriptError
from .schedule import DISK_FULL, LEAVE, MEMORY_LOST, SCRIPT_ERRORS, Fault, Schedule
from .world import World

SIM_SECONDS = 120.0


CORRUPT = {"corrupt-replicas": "all", "corrupt-newest": "newest", "corrupt-all-but-oldest": "all-but-oldest"}
# faults armed for the next reconfiguration -> what strikes then (before the restores fetch, as dprun's
# @during-recovery); the corruptions strike the store the pick names, the kill one of the layout's nodes
ARMED = {"kill-during-recovery": "kill-node", "corrupt-during-recovery": "corrupt-all-but-oldest",
         "corrupt-all-during-recovery": "corrupt-replicas",
         "kill-silent-during-recovery": "kill-node-silent"}


class FaultDriver:
    """Applies a schedule's faults to the world at their times (or at the next reconfiguration)."""

    def __init__(self, world: World, rng: random.Random):
        self.world, self.rng = world, rng
        self.armed: list[Fault] = []
        self.after_save: list[Fault] = []  # faults that strike once the first background save completed

    def fire(self, fault: Fault) -> None:
        w = self.world
        c = w.controller
        if fault.kind in ARMED:
            self.armed.append(fault)
            return
        if fault.kind == "join-spare":
            w.join_node()
            return
        if fault.kind == "kill-with-holders-after-save":
            self.after_save.append(fault)
            if any(e["event"] == "state_saved" for e in w.events):  # (one completed before it was armed)
                self.on_saved()
            return
        if fault.kind == DISK_FULL:
            w.fill_disk()
            w.at(fault.wake_after, w.fill_disk, False)
            return
        if fault.kind in SCRIPT_ERRORS:
            self.arm(fault)
            return
        if fault.kind in CORRUPT:
            holders = [n for n in w.nodes.values() if n.running and any(n.store.values())]
            if holders:
                node = holders[int(fault.pick * len(holders)) % len(holders)]
                w.corrupt_replicas(node.node_id, CORRUPT[fault.kind])
            return
        if fault.kind == "kill-spare":
            candidates = [n for n in w.nodes.values() if n.running and n.node_id not in c.timeline.layout]
        elif fault.kind == LEAVE:
            candidates = [n for n in w.nodes.values() if n.running]
        else:
            candidates = [w.nodes[n] for n in c.timeline.layout if w.nodes[n].running]
        if not candidates:
            return
        node = candidates[int(fault.pick * len(candidates)) % len(candidates)]
        w.failures += 1
        if fault.kind in ("kill-node", "kill-spare"):
            w.kill_node(node.node_id, observed_by_parent=True)
        elif fault.kind == "kill-node-silent":  # half of them with their host's kernel up to close connections
            w.kill_node(node.node_id, observed_by_parent=False, closes_connections=(fault.pick * 1000) % 1 < 0.5)
        elif fault.kind == "kill-worker":
            w.kill_worker(node.node_id, 0)
        elif fault.kind == LEAVE:
            w.leave_node(node.node_id)
        elif fault.kind in MEMORY_LOST:  # the node and every store its snapshots go to, at once
            holders = [h for h in map(w.node_of, node.replica_to) if h is not None and h.alive and h is not node]
            w.failures += len(holders)
            for victim in [node, *holders]:
                w.kill_node(victim.node_id, observed_by_parent=True)
        elif fault.kind in ("freeze-node", "freeze-wake"):
            w.freeze_node(node.node_id)
            if fault.kind == "freeze-wake":
                w.at(fault.wake_after, w.wake_node, node.node_id)

    def arm(self, fault: Fault) -> None:
        """The script's own error, a few steps past the newest step: on the rank the pick names, or all."""
        w = self.world
        step = w.controller.timeline.max_step + fault.ahead
        rank = None if fault.kind == "script-error-all" else int(fault.pick * w.spec.world_size) % w.spec.world_size
        once = fault.kind == "one-off-error"
        detail = f"ValueError: flaky read #{len(w.errors)}" if once else f"ValueError: bad batch at step {step}"
        w.errors.append(ScriptError(rank, step, once, detail))

    def on_saved(self) -> None:
        """A background save completed (state_saved): what waited for one strikes a moment later."""
        while self.after_save:
            strike = Fault(0, "kill-with-holders", self.after_save.pop(0).pick)
            self.world.at(self.rng.uniform(0.0, 0.1), self.fire, strike)

    def on_reconfigure(self) -> None:
        while self.armed:
            fault = self.armed.pop(0)
            strike = Fault(0, ARMED[fault.kind], fault.pick)
            if strike.kind in CORRUPT:
                self.fire(strike)
            else:
                self.world.at(self.rng.uniform(0.0, 0.05), self.fire, strike)


class _Observer(Checker):
    def __init__(self, driver_ref: list):
        super().__init__()
        self.driver_ref = driver_ref

    def __call__(self, world, event, actions) -> None:
        super().__call__(world, event, actions)
        driver = self.driver_ref[0] if self.driver_ref else None
        # (a restore from disk: they strike while its files are read, before its generation's reconfiguration)
        if driver and any(getattr(a, "event", {}).get("event") in ("reconfigure", "restoring_from_disk")
                          for a in actions):
            driver.on_reconfigure()
        if driver and driver.after_save and any(getattr(a, "event", {}).get("event") == "state_saved"
                                                for a in actions):
            driver.on_saved()


# the paths through background saves and restores from disk that a soak counts (see `run_schedule`'s paths)
PATHS = ("state_saved", "save_failed", "save_skipped", "restoring_from_disk", "recovered_from_disk")


def run_schedule(schedule: Schedule, paths: collections.Counter | None = None) -> str:
    """The schedule's outcome; `paths` counts the schedules that went through each of PATHS."""
    rng = random.Random(schedule.seed * 7919 + 1)
    ref: list = []
    observer = _Observer(ref)
    world = World(schedule.spec(), schedule.nnodes + schedule.spares, schedule.steps, rng, observer=observer,
                  interval=schedule.interval, measure_until=20 if schedule.auto else 0, defer=schedule.defer,
                  fetch_timeout=schedule.fetch_timeout)
    driver = FaultDriver(world, rng)
    ref.append(driver)
    for fault in schedule.faults:
        world.at(fault.at, driver.fire, fault)
    try:
        world.run(until=SIM_SECONDS)
        outcome = judge_outcome(world)
    except InvariantViolation as exc:
        trail = "\n  ".join(world.log[-10:] + [f"{e['time']:.3f} {e['event']}" for e in world.events[-15:]])
        raise InvariantViolation(f"{exc}\n{schedule.describe()}\n  {trail}") from None
    if paths is not None:
        names = {e["event"] for e in world.events} | {"recovered_from_disk" for e in world.events if e.get("from_disk")}
        paths.update(names & set(PATHS))
    return outcome
