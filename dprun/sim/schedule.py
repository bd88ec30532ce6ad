"""Random fault schedules for the simulator, reproducible from one seed.

A schedule is a job shape plus timed faults: kills, freezes, wake-ups, worker kills, spare kills, bit rot
in a replica store, faults armed to strike while a recovery is under way, the script's own errors, and
agents that leave on a signal of their own; with background saves, every copy of some ranks in memory lost at
once (a restore from disk follows) and a full disk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dprun.controller.state_machine import JobSpec
from dprun.controller.vocabulary import OnSpareExhausted

# dpstate's fetch gives up on a store that sends nothing after 60 s (Replicator.fetch): 12 of dprun's default 5 s
# heartbeat timeouts; the same ratio to the simulated job's 2 s
FETCH_TIMEOUT_S = 24.0

KINDS = ["kill-node", "kill-node-silent", "kill-worker", "freeze-node", "freeze-wake", "kill-spare",
         "kill-during-recovery", "join-spare"]
# bit rot in one store, now or armed for the next recovery (every copy there, or all but the oldest)
CORRUPTIONS = ["corrupt-replicas", "corrupt-newest", "corrupt-during-recovery", "corrupt-all-during-recovery"]
# the training script raises a few steps ahead: on one rank every time it gets there (a bug: it follows the rank
# to the spare that replaces its node), on every rank every time, or on one rank once (a flaky error)
SCRIPT_ERRORS = ["script-error", "script-error-all", "one-off-error"]
# an agent, active or spare, stops on a signal of its own (the job does not): it says Leaving, then exits
LEAVE = "leave-node"
# every copy of a node's ranks in memory lost at once: the node and each store holding its snapshots (two adjacent
# nodes with --replicas 1), at a time or just after the first background save completes; then a restore from disk
MEMORY_LOST = ["kill-with-holders", "kill-with-holders-after-save"]
SHRINK_SHARE = 0.25  # of a soak's schedules (python -m dprun.sim --shrink): --on-spare-exhausted shrink
# how a node is lost in a shrink schedule (a frozen one is failed by its heartbeats, and may wake fenced)
KILLS = ["kill-node", "kill-node", "kill-node-silent", "kill-worker", "freeze-wake", "leave-node"]
DISK_FULL = "disk-full"  # the save_dir's disk refuses every file (ENOSPC) for a while


@dataclass
class Fault:
    at: float
    kind: str
    pick: float  # which node, as a fraction of the candidates at fire time
    wake_after: float = 0.0
    ahead: int = 0  # a script error: steps past the newest step that it strikes in


@dataclass
class Schedule:
    seed: int
    nnodes: int
    spares: int
    nproc: int
    steps: int
    faults: list = field(default_factory=list)
    replicas: int = 1
    wait_for_spares: bool = False
    interval: int = 1  # snapshots at step 0 and every multiple of it (dprun --snapshot-interval N)
    auto: bool = False  # before that, an irregular measuring window as --snapshot-interval auto has
    defer: bool = False  # gates wait for acks at snapshot steps only (optimizer steps that do not land)
    save: bool = False  # a job that stops has its newest complete step written to files (--save-dir)
    fetch_timeout: float = FETCH_TIMEOUT_S  # a restore gives up on a store that sends nothing after this long
    save_every: int = 0  # background saves every N steps (--save-every) ...
    save_interval: float = 0.0  # ... and / or every so many seconds (--save-interval)
    save_keep: int = 2  # complete steps the background saves keep (--save-keep)
    shrink: bool = False  # --on-spare-exhausted shrink: with no spare left the job goes on narrow, grows back later

    @property
    def background(self) -> bool:
        return self.save_every > 0 or self.save_interval > 0

    def spec(self) -> JobSpec:
        return JobSpec(nnodes=self.nnodes, spares=self.spares, nproc_per_node=self.nproc, store_endpoint="sim:0",
                       heartbeat_interval=0.5, heartbeat_timeout=2.0, probe_timeout=0.5, rdzv_timeout=5.0,
                       replicas=self.replicas, on_spare_exhausted=self.on_spare_exhausted,
                       spare_wait_timeout=8.0, save_dir="/saved" if self.save or self.background else "",
                       files_timeout=5.0, restore_wait=5.0, save_every=self.save_every,
                       save_interval=self.save_interval, save_keep=self.save_keep)

    @property
    def on_spare_exhausted(self) -> OnSpareExhausted:
        return "shrink" if self.shrink else "wait" if self.wait_for_spares else "fail"

    def describe(self) -> str:
        faults = ", ".join(f"{f.kind}@{f.at:.2f}" for f in self.faults) or "no faults"
        timeout = f", fetches time out after {self.fetch_timeout:.2f} s" if self.fetch_timeout < FETCH_TIMEOUT_S else ""
        if self.background:
            timeout += (f", background saves every {self.save_every} steps / {self.save_interval:.2f} s keeping "
                        f"{self.save_keep}")
        return (f"seed {self.seed}: {self.nnodes} nodes x {self.nproc} + {self.spares} spares, "
                f"{self.replicas} replica(s), {self.on_spare_exhausted} when out of spares, "
                f"{self.steps} steps, snapshots every {self.interval}"
                f"{' after a measuring window' if self.auto else ''}"
                f"{', acks awaited at snapshot steps' if self.defer else ''}"
                f"{', the state saved when it stops' if self.save else ''}{timeout}; {faults}")


def random_schedule(seed: int, max_nodes: int = 4, extended: bool = True, errors: bool = True,
                    background: bool = True, shrink: float = 0.0) -> Schedule:
    """extended=False: the schedule as it was before snapshot intervals and corrupt replicas were drawn too
    (what the regression seeds name); errors=False: before the script's own errors, saving and agents that
    leave were drawn; background=False: before background saves (and the faults that test them) were.
    shrink: the fraction of schedules made --on-spare-exhausted shrink (`with_shrink`)."""
    rng = random.Random(seed)
    nnodes = rng.randint(1, max_nodes)
    spares = rng.randint(0, 3)
    nproc = rng.choice([1, 1, 2])
    steps = rng.randint(10, 40)
    faults = [Fault(at=rng.uniform(0.2, 3.0), kind=rng.choice(KINDS), pick=rng.random(),
                    wake_after=rng.uniform(0.5, 6.0))
              for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4]))]
    replicas = rng.choice([1, 1, 2])
    wait = rng.random() < 0.3
    # drawn last: the earlier draws, and so the schedules regression seeds name, are unchanged
    interval = rng.choice([1, 1, 2, 3, 5]) if extended else 1
    auto = extended and rng.random() < 0.3
    if extended and rng.random() < 0.3:  # bit rot in one store: a restore finds it, reports it, falls back
        faults.append(Fault(at=rng.uniform(0.2, 3.0), kind=rng.choice(CORRUPTIONS), pick=rng.random()))
    defer = extended and rng.random() < 0.5  # drawn after the rest: earlier schedules keep their draws
    if errors and rng.random() < 0.2:  # drawn last, as the regression seeds were found without them
        faults.append(Fault(at=rng.uniform(0.05, 0.5), kind=rng.choice(SCRIPT_ERRORS), pick=rng.random(),
                            ahead=rng.randint(1, 3)))
    save = errors and rng.random() < 0.5
    if errors and rng.random() < 0.15:  # drawn last: the schedules earlier seeds name are unchanged
        faults.append(Fault(at=rng.uniform(0.2, 3.0), kind=LEAVE, pick=rng.random()))
    fetch_timeout = FETCH_TIMEOUT_S
    if errors and rng.random() < 0.3:  # a --heartbeat-timeout past dpstate's 60 s fetch timeout: a restore
        fetch_timeout = rng.uniform(0.3, 3.0)  # gives up on a silent dead store before the controller fails it
        if rng.random() < 0.5:  # ... where a store a restore may name dies without a word as a recovery starts
            faults.append(Fault(at=rng.uniform(0.2, 3.0), kind="kill-silent-during-recovery", pick=rng.random()))
    save_every, save_interval, save_keep = 0, 0.0, 2
    if errors and background and rng.random() < 0.35:  # drawn last: the schedules earlier seeds name are unchanged
        save_every = rng.choice([0, 2, 3, 4, 5, 6])  # (a job's steps take about 20 ms each)
        if not save_every or rng.random() < 0.2:
            save_interval = rng.uniform(0.05, 0.5)
        save_keep = rng.choice([1, 1, 2, 3])  # (1: a prune may race a restore's read)
        if rng.random() < 0.5:  # every copy of some ranks in memory lost: the disk is all that is left
            kind = MEMORY_LOST[rng.random() < 0.7]  # (mostly once a save completed: that path is the one tested)
            faults.append(Fault(at=rng.uniform(0.1, 0.8), kind=kind, pick=rng.random()))
            replicas = 1
            if rng.random() < 0.8:  # (else no spare left, often)
                spares = max(spares, 2)
        if rng.random() < 0.15:
            faults.append(Fault(at=rng.uniform(0.05, 1.0), kind=DISK_FULL, pick=rng.random(),
                                wake_after=rng.uniform(0.1, 2.0)))
    schedule = Schedule(seed, nnodes, spares, nproc, steps, sorted(faults, key=lambda f: f.at), replicas, wait,
                        interval, auto, defer, save, fetch_timeout, save_every, save_interval, save_keep)
    # drawn from a generator of its own: the draws above, and so the schedules earlier seeds name, are unchanged
    return with_shrink(schedule, random.Random(seed * 104729 + 7)) if shrink and rng.random() < shrink else schedule


def with_shrink(schedule: Schedule, rng: random.Random) -> Schedule:
    """The schedule made --on-spare-exhausted shrink: 2 or more nodes, few spares or none (so that a loss
    shrinks the job), often a node that joins later (the job grows back), sometimes two; no save_dir (a narrow
    job's saves are not modelled: a file per logical rank would come from its carrier's snapshot) and so none of
    the faults that test saves."""
    s = schedule
    s.shrink, s.wait_for_spares = True, False
    s.nnodes = max(s.nnodes, 2)
    s.spares = rng.choice([0, 0, 0, 1, 2])
    s.save, s.save_every, s.save_interval = False, 0, 0.0
    s.faults = [f for f in s.faults if f.kind not in (*MEMORY_LOST, DISK_FULL)]
    s.steps = rng.randint(20, 80)  # (about 20 ms a step: time for a loss, a shrink and a grow)
    if rng.random() < 0.7:  # a node lost early: with no spare the job shrinks
        s.faults.append(Fault(at=rng.uniform(0.05, 0.6), kind=rng.choice(KILLS), pick=rng.random(),
                              wake_after=rng.uniform(0.5, 4.0)))
    for _ in range(rng.choice([0, 1, 1, 1, 2])):  # a node joins later: a narrow job grows back
        s.faults.append(Fault(at=rng.uniform(0.1, 1.5), kind="join-spare", pick=0.0))
    s.faults.sort(key=lambda f: f.at)
    return s
