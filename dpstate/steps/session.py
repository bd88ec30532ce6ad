"""Job: a worker's place in the job. steps() runs the step loop, and every reconfiguration (the first one
too, which init() in joining.py waits for) goes through one recovery sequence (group, restore, barrier, WorkerReady).

Without DP_AGENT_ENDPOINT the job takes no snapshots: a single process (world 1), or under torchrun (RANK,
WORLD_SIZE, MASTER_ADDR set) a member of torchrun's env:// process group.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist
import zmq

from dpcommon import protocol as P

from .abort import AbortSignal, classify, describe
from .agent_link import Control
from dpstate.groups.carried import Carried, PerRank
from dpstate.groups.abortable_fsdp import wait_abortably
from dpstate.groups.ddp import DataParallel
from .gate import SnapshotGate, defers_acks, stall_message
from dpstate.groups.pgroup import GroupManager, default_backend, local_device
from .interval import POLICY_NAME, SnapshotPolicy
from dpstate.groups.mesh import MeshLayout, narrow_mesh_problem
from dpstate.groups.narrow_sharded import fsdp_roots
from .metrics import sendable_metrics
from .release_watch import ReleaseWatch
from dpstate.snapshot.optim import AdamW
from dpstate.groups.parallel import Build, Parts
from dpstate.replication.replicator import Replicator, ReplicationError
from dpstate.replication.saving import save_local
from dpstate.replication.sources import SnapshotSources
from dpstate.snapshot.standby import RestoreRoom
from dpstate.snapshot.state import Tracked
from .data_ranks import DataRanks
from .restoring import UNTRACKED, Restoring
from .step import Step
from .uncaught import hint_unwrapped_steps
from .watch import WATCHER

T = TypeVar("T")

@dataclass
class UnderAgent:
    """What a worker under an agent has and a standalone one lacks."""

    control: Control
    replicator: Replicator
    gate: SnapshotGate
    sources: SnapshotSources
    room: RestoreRoom
    restoring: Restoring


class Job:
    """What dpstate.init() returns: identity of this rank in the current generation and the training helpers."""

    def __init__(self, control: Control | None, abort: AbortSignal, ctx: zmq.Context | None):
        self._abort = abort
        self._standalone = control is None
        if not self._standalone:
            hint_unwrapped_steps(lambda: self.rank, abort)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("DP_NPROC_PER_NODE", "1")))
        self.node_id = os.environ.get("DP_NODE_ID", "local")
        self.rank, self.world_size, self.node_rank = 0, 1, 0
        self.generation, self.restore_step = -1, -1
        self.restored_from: P.RestoredFrom = ""
        self.backend = default_backend()
        self.device = local_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.reconfigure_timeout = float(os.environ.get("DP_RECONFIGURE_TIMEOUT", "120"))
        self._groups = GroupManager(self.backend)
        self._tracked = Tracked()
        self._proxies: list[DataParallel] = []
        self._ranks = DataRanks(self._tracked, self._proxies, self._abort)
        self._parts: Parts | None = None  # job.parallelize(): rebuilt with every generation's groups
        self._step_hooks: dict[int, Any] = {}  # id(optimizer) -> its snapshot gate hook (see track)
        self._started = False  # steps() restored or snapshotted a state: the in-memory one is no longer fresh
        self._rebuild_s = 0.0
        self._last_step = 0  # the newest step completed in this generation's timeline
        self._step_started = 0.0  # perf_counter when the step in progress began
        self.activity: P.Activity = "idle"  # what it does now, for its WorkerStatus
        self._under: UnderAgent | None = None
        if control is not None:
            replicator = Replicator(control.codec, 0, abort, ctx)
            sources = SnapshotSources(replicator, self.node_id, self._send)
            self._under = UnderAgent(control, replicator, SnapshotGate(replicator), sources,
                                     RestoreRoom(replicator, self.local_rank),  # a spare makes room to restore
                                     Restoring(self._tracked, replicator, sources, self._proxies, abort))
            replicator.on_divergence = self._diverged  # (told to the controller: protocol.Diverged)
            if replicator.policy.mode == "auto":
                self._tracked.add(**{POLICY_NAME: replicator.policy})  # its decision travels in snapshots
            abort.add_callback(self._groups.on_abort)
            abort.add_callback(ReleaseWatch(abort, lambda: self.activity in ("compute", "collective"),
                                            lambda: f"rank {self.rank} (generation {self.generation})",
                                            lambda: self._groups.sever_on_abort).on_abort)
            control.status = self._status
            control.on_standby = self._under.room.on_message
            control.on_save = lambda msg: save_local(replicator, msg, self._key, self.node_id, self._send)
            if control.standby is not None:  # came first
                control.on_standby(control.standby)

    @property
    def _agent(self) -> UnderAgent:
        """The parts a worker under an agent has (every caller runs only under one)."""
        assert self._under is not None, "dpstate: called in a standalone job"
        return self._under

    def __repr__(self) -> str:
        return (f"Job(rank={self.rank}, world_size={self.world_size}, node_rank={self.node_rank}, "
                f"local_rank={self.local_rank}, generation={self.generation}, restore_step={self.restore_step})")

    # ------------------------------------------------------------------ user API

    def data_parallel(self, module: torch.nn.Module, deterministic: bool = True, **ddp_kwargs: Any) -> DataParallel:
        """A DDP proxy over the current generation's group, rebuilt after every reconfiguration."""
        gate = None if self._standalone else self._gate
        proxy = DataParallel(module, self._abort, deterministic=deterministic, gate=gate, **ddp_kwargs)
        self._proxies.append(proxy)
        # its DDP is over every rank: snapshots share its state (dpstate.snapshot.checks)
        self._tracked.replicate(module)
        return proxy

    def per_rank(self, factory: Callable[[int], T]) -> PerRank[T]:
        """One object per logical data-parallel rank this process trains, built by factory(rank) (a sampler, a
        data iterator): this rank's at full width, a lost replica's too while the job runs narrow. Track it
        (job.track) and index it with the ranks of step.data_ranks()."""
        return self._ranks.per_rank(factory, self.carried)

    @property
    def _key(self) -> int:
        """This process's own logical rank: the one its messages and snapshots carry (the process group's rank
        at full width)."""
        return self.carried.ranks[0]

    @property
    def carried(self) -> Carried:
        """The logical data-parallel ranks this process trains (dpstate.groups.carried)."""
        return self._ranks.carried or Carried.full(self.rank, self.world_size)

    def parallelize(self, dims: Mapping[str, int], build: Build) -> Parts:
        """A sharded or 3D-parallel job: build(mesh) makes the model, optimizer and pipeline schedule on a
        DeviceMesh of `dims` (sizes of pp, dp_replicate, dp_shard, dp, tp; their product the world size), anew in
        every generation, and the state is restored into them. Read them from the Parts returned in each step."""
        if self._parts is not None:
            raise RuntimeError("dpstate: job.parallelize() was called already: call it once, right after init()")
        layout = MeshLayout.parse(dims, self.carried.logical_world)
        warning = layout.tp_span_warning(self.local_world_size)
        if warning and self.rank == 0:
            print(warning, file=sys.stderr, flush=True)
        self._parts = Parts(layout, build)
        # (Gloo: NCCL's own sockets are not ours to cut; its communicators are aborted in destroy())
        self._groups.sever_on_abort = not self._standalone and self.backend == "gloo"
        try:
            self._build_parts(self.generation)
        except Exception as exc:
            if self._standalone or (classify(exc, self._abort) is None and not self._abort.stopped):
                raise
            self._recover(exc, newer_than=self.generation, restore=False)  # builds them in the next generation
        return self._parts

    def track(self, **objects: Any) -> None:
        """Objects (with state_dict/load_state_dict) that every snapshot holds; optimizers get a pre-step hook
        that makes sure the step passed the snapshot gate (see _gate)."""
        new = {k: v for k, v in objects.items() if self._tracked.objects.get(k) is not v}
        self._tracked.add(**new)
        for obj in new.values():
            if isinstance(obj, torch.optim.Optimizer) and not self._standalone:
                self._step_hooks[id(obj)] = obj.register_step_pre_hook(self._pre_step)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over the current generation; raises Aborted when a reconfiguration comes."""
        self._gate()
        work = dist.all_reduce(tensor, op=op, async_op=True)
        self._abort.wait_future(work.get_future())
        return tensor

    def barrier(self) -> None:
        """Barrier of the current generation; raises Aborted when a reconfiguration comes."""
        self._gate()
        self._ungated_barrier()

    def _ungated_barrier(self) -> None:
        self._abort.wait_future(dist.barrier(async_op=True).get_future())

    @property
    def last_capture_s(self) -> float:
        """Seconds the newest snapshot took to capture (copy + checksum), in the background thread."""
        return self._under.replicator.last_capture_s if self._under else 0.0

    @property
    def snapshot_policy(self) -> SnapshotPolicy | None:
        """Which steps are snapshotted (DP_SNAPSHOT_INTERVAL); None when not under dprun (no snapshots)."""
        return self._under.replicator.policy if self._under else None

    def steps(self, total_steps: int) -> Iterator[Step]:
        """Yields Step(restore_step + 1) .. Step(total_steps); returns after the final barrier of the job."""
        if self._standalone:
            for number in range(1, total_steps + 1):
                yield Step(self, number)
            return
        if not self._tracked.holds_training_state():
            warnings.warn(f"dpstate: {UNTRACKED}: a spare could not take a rank over", stacklevel=2)
        elif not any(isinstance(o, torch.optim.Optimizer) for o in self._tracked.objects.values()):
            warnings.warn("dpstate: no optimizer is tracked (job.track(optimizer=...)): a rank taken over by a spare "
                          "restores no optimizer state (momentum, Adam's moments) and drifts from its peers; and "
                          "only a tracked optimizer's step is sure to wait for the snapshot taken meanwhile",
                          stacklevel=2)
        control, replicator, gate = self._agent.control, self._agent.replicator, self._agent.gate
        if control.finished:  # (its RankFinished is sent: the job counts the rank done and waits for its exit)
            raise RuntimeError(
                f"dpstate: job.steps() called again after a loop that ran to its end (step {self._last_step}): call "
                "job.steps(total) once (warm-up steps count in it), or break out of a loop to go on in the next")
        latest = control.latest
        if self._started and latest is not None and latest.generation == self.generation:
            number = self._last_step + 1  # steps() again after a break, same generation: go on from where we are
        else:
            self._recover(None, newer_than=self.generation - 1)
            number = self._last_step + 1
            if number - 1 > total_steps:  # (--resume-from a longer run's save)
                warnings.warn(f"dpstate: the job goes on from step {number - 1}, past the {total_steps} steps asked "
                              "for: there is nothing left to train", stacklevel=2)
        lands = replicator.landing.enabled and self._parts is None and any(  # (an optimizer step writes
            isinstance(o, AdamW) and o.lands() for o in self._tracked.objects.values())  # the snapshot buffers)
        gate.defers = replicator.policy.defers = defers_acks(lands, self.device)
        while True:
            try:
                if number > total_steps:
                    self._finish(total_steps)
                    return
                step = Step(self, number)
                self.activity = "compute"
                gate.step = number
                self._step_started = time.perf_counter()
                try:
                    yield step
                except GeneratorExit:  # the script left the loop (a break): its last step still counts
                    self._left_loop(step)
                    raise
                if step.failure is not None:
                    raise step.failure
                self._abort.check()  # a reconfiguration arrived during the step: its result is abandoned
                self._after_step(step)
                self._last_step = number
                number += 1
            except Exception as exc:
                gate.step = None  # a recovery's gates wait for every ack
                if classify(exc, self._abort) is None and not self._abort.stopped:
                    raise
                self._recover(exc, newer_than=self.generation)
                gate.forget_waits()
                number = self._last_step + 1
            finally:
                gate.step = None

    # ------------------------------------------------------------------ per step

    def _micro_batches(self) -> Iterator[int]:
        """Step.data_ranks() (dpstate.steps.data_ranks)."""
        sharded = None
        if self._parts is not None and not self.carried.in_order:  # (at full width FSDP2 reduces as it is)
            layout = self._parts.layout
            narrow = layout.at_width(self.world_size)
            name = layout.data_dim or "dp"
            sharded = (fsdp_roots(self._tracked.modules()), narrow.size(name) / layout.size(name))
        return self._ranks.micro_batches(self.carried, None if self._standalone else self._gate, sharded)

    def _carry(self, carried: Carried | None, rng: dict[int, dict] | None = None) -> None:
        """Train the logical ranks of `carried` (None: this rank alone, at full width)."""
        self._ranks.carry(carried or Carried.full(self.rank, self.world_size), rng or {})

    def _gate(self) -> None:
        """The snapshot gate, passed before a collective (the last gradient bucket, all_reduce, barrier): wait
        until every snapshot submitted is captured, and acked at a snapshot step (every step where optimizer
        steps land). Every rank passes it before the last collective of its step, so no capture of snapshot
        S' reuses a buffer before every rank's snapshot before it is held by its replicas: a restore goes back
        at most one snapshot, and workers and holders keep 2 copies (DESIGN.md; dpstate.steps.gate)."""
        if self._under is None or not self._under.gate.pending:
            return
        activity, self.activity = self.activity, "snapshot"
        try:
            self._under.gate.wait()
        finally:
            self.activity = activity

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A step whose collectives did not pass the gate (no data_parallel, all_reduce or barrier of ours in
        it) passes it here, then, where acks are due, meets the other ranks at a barrier, which is what makes
        the gate global. A dpstate.AdamW is then told where its step lands (dpstate.snapshot.landing)."""
        gate, replicator = self._agent.gate, self._agent.replicator  # (hooked only under an agent)
        if gate.pending:
            if self.world_size > 1 and gate.acks_due():
                self.barrier()
            else:
                self._gate()
        # past the gate: the older buffer may take the state (not a sharded job's: its parameters are DTensors)
        if isinstance(optimizer, AdamW) and not gate.defers and self._parts is None:
            optimizer.landing = replicator.land()

    def _after_step(self, step: Step) -> None:
        replicator, gate = self._agent.replicator, self._agent.gate
        policy = replicator.policy
        if policy.after_step(step.number, gate.step_clock(policy), self.generation):  # auto: all ranks decide here
            local = torch.tensor(policy.local_measurements(), dtype=torch.float64, device=self.device)
            policy.decide_from(self.all_reduce(local, dist.ReduceOp.MAX).tolist(), step.number)
            if self.rank == 0:
                print(f"dpstate: snapshot interval {policy.describe()}", file=sys.stderr, flush=True)
        stalled = gate.stalled_share(time.perf_counter() - self._step_started)
        if stalled is not None and self.rank == 0 and policy.mode == "fixed":
            print(stall_message(stalled, policy.describe()), file=sys.stderr, flush=True)
        snapshot = policy.wants(step.number)
        if snapshot:
            replicator.submit(step.number, self._tracked.capture(step.number), self._tracked.shared_keys)
            gate.submitted()
        self._report(step, snapshot)

    def _left_loop(self, step: Step) -> None:
        """The script broke out of job.steps() after `step`: report the step if it completed, with no snapshot
        and no collective (its peers may not have left with it), so that the job's last step is not one short."""
        if not step.done or step.failure is not None or self._abort.is_set() or self._agent.control.finished:
            return
        self._last_step = step.number
        self._report(step, snapshot=False)

    def _report(self, step: Step, snapshot: bool) -> None:
        metrics = sendable_metrics(step.metrics)
        self._send(P.Progress(node_id=self.node_id, generation=self.generation, rank=self._key,
                              step=step.number, metrics=metrics, snapshot=snapshot))

    def _finish(self, last: int) -> None:
        self.activity = "finishing"  # at the final barrier: a peer still training past `last` never comes
        self.barrier()  # past the snapshot gate: every rank's last snapshot is held
        self._agent.control.finished = True
        self._send(P.RankFinished(node_id=self.node_id, generation=self.generation, rank=self._key, step=last))
        self.activity = "idle"

    def _diverged(self, rank: int, step: int, blocks: list) -> None:
        """(the replicator's thread) For the controller's events and the job's last words."""
        self._send(P.Diverged(node_id=self.node_id, generation=self.generation, rank=rank, step=step,
                              blocks=blocks[:16]))

    def _send(self, msg: Any) -> None:
        self._agent.control.send(msg)

    # ------------------------------------------------------------------ generations

    def _recover(self, error: BaseException | None, newer_than: int, restore: bool = True) -> None:
        """Enter the newest generation > newer_than; after a failure, report it and wait for one (bounded)."""
        control = self._agent.control
        self.activity = "recovering"
        while True:
            if self._abort.stopped:
                raise SystemExit(control.stop_message.exit_code if control.stop_message else 0)
            timeout = None
            if error is not None:
                timeout = self.reconfigure_timeout
                if not self._abort.is_set():
                    detail = describe(error)[:1000]
                    print(f"dpstate: rank {self.rank} generation {self.generation}: {detail}", file=sys.stderr,
                          flush=True)
                    self._send(P.PeerError(node_id=self.node_id, generation=self.generation, rank=self._key,
                                           detail=detail))
            reconf = control.wait_reconfigure(newer_than, timeout)
            if reconf is None:
                raise SystemExit(
                    f"dpstate: rank {self.rank}: no Reconfigure within {timeout:g} s (DP_RECONFIGURE_TIMEOUT) "
                    f"after a failure in generation {self.generation}: {type(error).__name__}: {error}"
                )
            try:
                self._enter(reconf, restore)
                return
            except Exception as exc:
                if not (classify(exc, self._abort) or self._abort.stopped or isinstance(exc, ReplicationError)):
                    raise
                error, newer_than = exc, reconf.generation

    def _enter(self, reconf: P.Reconfigure, restore: bool) -> None:
        replicator, sources = self._agent.replicator, self._agent.sources
        for optimizer in self._tracked.objects.values():  # out of the snapshot buffers, which recovery reuses
            if isinstance(optimizer, AdamW):
                optimizer.go_home()
        replicator.unland()
        sources.drop_stale(reconf.generation)
        self._abort.enter(reconf.generation)
        old_key = self._key
        self._apply(reconf)
        if self._groups.generation != reconf.generation:
            t0 = time.perf_counter()
            for proxy in self._proxies:
                proxy.drop()
            self._retire_parts()
            self._groups.destroy()  # first: an NCCL abort is what frees a copy stream waiting on a stuck kernel
            replicator.quiesce()
            if old_key != self._key:
                replicator.forget_after(-1)
            if not restore:  # the script runs before it restores (a spare in init): fetch meanwhile
                sources.prefetch(reconf, self._key)
            self.activity = "rendezvous"  # (the controller's hang clock runs while ranks wait here for a peer)
            try:
                self._groups.build(reconf.generation, reconf.store_endpoint, self.rank, self.world_size, self._abort)
            finally:
                self.activity = "recovering"
            if self._parts is not None:
                self._build_parts(reconf.generation)
            self._rebuild_s = time.perf_counter() - t0
        if not restore:
            return
        t0 = time.perf_counter()
        replicator.quiesce()
        replicator.configure(reconf.generation, [reconf.replica_to, *reconf.replica_also], self._key)
        self.restored_from = self._restore(reconf)
        self._started, self._last_step = True, max(reconf.restore_step, 0)
        restore_s = time.perf_counter() - t0
        # restored: said before the barrier, which a failure elsewhere can hold up (the controller, planning
        # for that failure, then knows this rank's state is here, not only on the replicas it came from)
        self._send(P.WorkerReady(node_id=self.node_id, generation=self.generation, rank=self._key,
                                 rebuild_s=self._rebuild_s, restore_s=restore_s, restored_from=self.restored_from,
                                 mesh=self._parts.layout.describe() if self._parts is not None else ""))
        self._ungated_barrier()  # a fresh start's step 0 is sent meanwhile too

    def _build_parts(self, generation: int) -> None:
        """This generation's mesh and the parts build(mesh) makes on it, tracked in place of the old ones."""
        assert self._parts is not None
        layout = self._parts.layout.at_width(self.world_size)
        self._parts.build(self._groups.build_mesh(layout, self.device.type), generation)
        if self._groups.sever_on_abort:  # (Gloo under an agent) the abort releases FSDP2's waits too
            for part in self._parts.stateful().values():
                if isinstance(part, torch.nn.Module):
                    wait_abortably(part, self._abort)
        self.track(**self._parts.stateful())

    def _retire_parts(self) -> None:
        """The parts of the generation that ends leave the snapshots and become unusable (dpstate.groups.parallel)."""
        if self._parts is None:
            return
        stateful = self._parts.stateful()
        for obj in stateful.values():
            hook = self._step_hooks.pop(id(obj), None)
            if hook is not None:
                hook.remove()
        self._tracked.remove(*stateful)
        self._parts.retire()

    def _apply(self, reconf: P.Reconfigure) -> None:
        self.generation, self.restore_step = reconf.generation, reconf.restore_step
        self.node_rank, self.world_size = reconf.node_rank, reconf.world_size
        self.local_world_size = reconf.nproc_per_node
        self.rank = reconf.node_rank * reconf.nproc_per_node + self.local_rank
        self._carry(Carried.assigned(reconf.carry, self.rank) if reconf.carry else None)
        if self._parts is not None and not self.carried.in_order:
            why = narrow_mesh_problem(self._parts.layout, self.carried, self.rank, self.world_size)
            if why:
                raise SystemExit(f"dpstate: rank {self.rank}: {why}")
        host, _, port = reconf.store_endpoint.rpartition(":")
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), GROUP_RANK=str(self.node_rank),
                          NODE_RANK=str(self.node_rank), LOCAL_RANK=str(self.local_rank),
                          LOCAL_WORLD_SIZE=str(self.local_world_size), MASTER_ADDR=host, MASTER_PORT=port)

    def _restore(self, reconf: P.Reconfigure) -> P.RestoredFrom:
        """(dpstate.steps.restoring)"""
        return self._agent.restoring.restore(reconf, self.carried, self._started, self.world_size,
                                             sharded=self._parts is not None)

    def _status(self) -> P.WorkerStatus | None:
        if self._under is None:
            return None
        activity = self.activity
        if activity == "compute" and WATCHER.pending:
            activity = "collective"  # the step waits on its peers (an all-reduce is in flight)
        slots, nbytes = self._under.room.prepared
        return P.WorkerStatus(node_id=self.node_id, local_rank=self.local_rank, rank=self._key,
                              generation=self.generation, step=self._last_step, activity=activity,
                              room=slots * nbytes)
