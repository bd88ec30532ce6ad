"""Reconstruction: the recovery part of the controller: failures collected into a pending recovery, every live node
probed, then the next generation planned (spares promoted, restore step and sources) or the reason the job ends.

A part that the controller composes: it owns the recovery pending and the one in flight, the probe round, and the
recoveries completed; it is handed the spec, the node table, the ledger, the timeline, the outbox, and how to enter
a phase. What a plan means for the job (a generation sent out, a read from disk, the end) it returns as a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dpcommon import protocol as p

from .vocabulary import Flush, JobSpec, Outbox, Recovery
from .ledger import ReplicaLedger, RestorePlan
from .nodes import ACTIVE, FAILED, SPARE, Node, NodeTable, Role
from .phase import Phase
from .narrowing import Narrowing
from .reshaping import Reshaping
from .timeline import StepHolding, Timeline

GROWS = "a node joined: the job grows back"  # the reason of a generation planned to grow, no node lost
MAX_REPLANS = 3  # generations planned again in a row with no node lost before the job gives up


@dataclass(frozen=True)
class Unchanged:
    """No node to replace and no plan to change: training goes on as it is."""


@dataclass(frozen=True)
class AfterExits:
    """Ranks had exited 0 already: they cannot join a new generation (the end says why)."""


@dataclass(frozen=True)
class GiveUp:
    """The job ends with exit 1 and this message."""

    message: str


@dataclass(frozen=True)
class NextGeneration:
    """Spares take `failed_slots`, every rank goes back to `step` from `sources`; the nodes of `shrink` leave
    the layout, their ranks trained by the others (--on-spare-exhausted shrink: dprun.controller.narrowing), and
    the spares of `grow` join it, taking back ranks that others trained (a narrow job grows)."""

    failed_slots: list[int]
    spares: list[Node]
    step: int
    sources: dict[int, str]
    shrink: Narrowing | None = None
    grow: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class FromDisk:
    """Some ranks have no copy left in memory, but a step of every rank is safe on disk (background saves, or the
    step this job resumed from): every rank goes back to it. Spares take `failed_slots`, each node reads its ranks'
    files from `folder` into its store (dprun.controller.files), then the generation starts from them."""

    failed_slots: list[int]
    spares: list[Node]
    folder: str
    step: int


Decision = Unchanged | AfterExits | GiveUp | NextGeneration | FromDisk | None  # None: the plan waits (pending)


class Reconstruction:
    def __init__(self, spec: JobSpec, table: NodeTable, ledger: ReplicaLedger, timeline: Timeline, out: Outbox,
                 enter: Callable[[Phase], None]):
        self.spec, self.table, self.ledger, self.timeline, self.out = spec, table, ledger, timeline, out
        self.enter = enter
        self.recovery: Recovery | None = None  # decided, waiting for its first step
        self.pending: Recovery | None = None  # failures known, decision waiting for the flush
        self.flush: Flush | None = None
        self.seq = 0  # the probes' sequence number (flushes and the periodic pings)
        self.crashed_at: dict[str, float] = {}  # restart mode: node -> its first held-back crash, this generation
        self.recoveries: list[Recovery] = []
        self.restarts = 0
        self.reshaping = Reshaping(spec, table, ledger, timeline, out)

    @property
    def idle(self) -> bool:
        """No failure is being decided and no probe round is out."""
        return self.pending is None and self.flush is None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def open_pending(self, now: float) -> bool:
        """Make sure a recovery is pending: a new one, or one that carries on the recovery under way (not
        complete yet). True if it carries one on."""
        if self.pending is not None:
            return False
        self.enter(Phase.DECIDING)
        if self.recovery is None:
            self.pending = Recovery(failed=[], t_fail=now, t_detect=now, peak_step=self.timeline.max_step)
            return False
        prior, self.recovery = self.recovery, None
        self.pending = prior.continued()
        return True

    def replan(self, now: float, why: str) -> Recovery:
        """A new generation is needed even if no node failed: probe every node, then plan it."""
        self.open_pending(now)
        assert self.pending is not None
        self.pending.replan, self.pending.why = True, why
        if self.flush is None:
            self.start_flush(now)
        return self.pending

    def replanned_for_a_loss(self) -> None:
        """A node or a store was lost: planning again is progress, not a retry, and a new situation to probe."""
        if self.pending is not None:
            self.pending.retries, self.pending.probed_for_lost = 0, False

    def node_lost(self, node_id: str, was: Role, cause: str, now: float, began: list[float], forming: bool,
                  training_over: bool) -> str | None:
        """A node (in role `was`) was fenced: its loss joins the pending recovery, where it needs one (the job's
        end message where nothing can recover its ranks). `began`: when it may have failed (injected, last
        heard); a held-back crash of this generation began no later either. `training_over`: every rank finished
        (its peers' exits end the job)."""
        self.node_fenced(node_id)
        if was == SPARE:
            self.out.publish("spare_lost", node=node_id, spares_left=len(self.table.with_role(SPARE)))
            finishing = any(self.table.nodes[n].exited_ok for n in self.timeline.layout)
            if forming or finishing or not any(node_id in held for held in self.timeline.holders.values()):
                return None
        elif forming:  # still forming: the slot opens for the next node to register
            return None
        elif not (self.spec.snapshots or self.spec.restart_mode or training_over):
            return (f"{node_id} failed ({cause}) and snapshots are off (--snapshot-interval off): there is no "
                    "state to recover its ranks from, so no spare can take over; rerun without it")
        if self.open_pending(now):  # a failure during recovery: one recovery covers both
            self.replanned_for_a_loss()
        rec = self.pending
        assert rec is not None
        if not rec.failed:  # (one opened by a peer's error, then this node found by the probe: its
            rec.t_detect = now  # detection took the probe, not the planning)
        rec.failed.append(node_id)
        rec.replan |= was == SPARE
        for t in [*began, *self.crashed_at.values()]:
            rec.t_fail = min(rec.t_fail, t)
        self.start_flush(now)
        return None

    def start_flush(self, now: float) -> None:
        """Ping every live node: a Pong proves it alive and flushes the SnapshotStored it sent before."""
        seq = self.next_seq()
        waiting = {n.node_id for n in self.table.live()}
        self.flush = Flush(seq=seq, deadline=now + self.spec.probe_timeout, waiting=waiting)
        if self.pending is not None:  # (a plan that waited decides again once every node answered)
            self.enter(Phase.DECIDING)
        for node_id in sorted(waiting):
            self.out.send(node_id, p.Ping(seq=seq))

    def node_fenced(self, node_id: str) -> None:
        """A fenced node is not waited for in the probe round."""
        if self.flush is not None:
            self.flush.waiting.discard(node_id)

    def answered(self, node_id: str, seq: int) -> None:
        if self.flush is not None and seq >= self.flush.seq:
            self.flush.waiting.discard(node_id)

    def to_decide(self, now: float, finished: bool) -> Recovery | None:
        """The pending recovery, once every node answered the probe and it is time to plan it."""
        if self.flush is None or self.flush.waiting:
            return None
        if self.pending is not None and not self.pending.failed and now < self.pending.settle_until:
            return None  # every node answered, but a worker's exit report may still arrive: the next tick decides
        self.flush = None
        if self.pending is None or finished:
            return None
        pending, self.pending = self.pending, None
        return pending

    def news(self, now: float) -> None:
        """A plan that waits for restores in flight (its state looked lost) decides again."""
        rec = self.pending
        if rec is not None and rec.restoring_until is not None and rec.waiting_since is None and self.flush is None:
            self.start_flush(now)

    def spare_came(self, now: float) -> None:
        """A node registered as a spare: the recovery that waits for one decides again; a narrow job that
        trains (no recovery under way) plans its growth."""
        if self.pending is not None and self.pending.waiting_since is not None and self.flush is None:
            self.start_flush(now)
        else:
            self.grow_if_due(now)

    def grow_if_due(self, now: float) -> None:
        """A narrow job with a spare to grow onto, and no recovery under way: plan a generation that grows."""
        if (self.timeline.width.narrow and self.pending is None and self.recovery is None
                and not any(self.table.nodes[n].exited_ok for n in self.timeline.layout)  # (training is over)
                and self.reshaping.growth(self.table.with_role(SPARE), now)):
            rec = self.replan(now, GROWS)
            rec.free_replans += 1  # (growing is progress, not a retry)

    def waits_over(self, now: float) -> str | None:
        """What a waiting plan's time says: a wait for a restore ended (decide again), or for a spare (the job
        ends: its message)."""
        rec = self.pending
        if (rec is not None and rec.waiting_since is None and rec.restoring_until is not None
                and now >= rec.restoring_until and self.flush is None):
            self.start_flush(now)  # the restore it waited for did not come: decide (state lost)
        elif rec is not None and rec.waiting_since is not None and self.flush is None:
            if now - rec.waiting_since > self.spec.spare_wait_timeout:
                return (f"no node joined as a spare within {self.spec.spare_wait_timeout:g} s after "
                        f"{', '.join(rec.failed)} failed; start nodes with --rdzv-endpoint to rejoin")
        return None

    def pause(self, seconds: float, now: float) -> None:
        """The controller did not run for `seconds`: the probe's deadline and the plan's waits move on."""
        if self.flush is not None:
            self.flush.deadline += seconds
        rec = self.pending
        if rec is not None and rec.waiting_since is not None:
            rec.waiting_since = min(now, rec.waiting_since + seconds)
        if rec is not None and rec.restoring_until is not None:
            rec.restoring_until += seconds

    def decide(self, rec: Recovery, now: float, paused_lately: bool, safe: tuple[str, int] | None,
               training_over: bool = False) -> Decision:
        """The plan for `rec`, its probe answered: what the job does next (None: it waits, still pending).
        `safe`: the (folder, step) known complete on disk, if any; `training_over`: every rank finished."""
        layout, nodes = self.timeline.layout, self.table.nodes
        failed_slots = [i for i, n in enumerate(layout) if nodes[n].role == FAILED]
        if not failed_slots and not rec.replan:
            return Unchanged()
        if any(nodes[n].exited_ok for n in layout):
            if training_over and not failed_slots:  # (a grow that came as training completed: the end goes on)
                return Unchanged()
            return AfterExits()  # ranks that exited cannot join a new generation: say so rather than wait for them
        spares = self.table.with_role(SPARE)
        shrink: Narrowing | None = None
        if len(spares) < len(failed_slots) and self.spec.on_spare_exhausted == "shrink":
            found = self.reshaping.narrowing(failed_slots, len(spares))
            if not isinstance(found, str):
                shrink = found
            elif not rec.shrink_refused:
                rec.shrink_refused = found
                self.out.publish("shrink_refused", reason=found, fallback=self.spec.shrink_fallback)
        leaving = [] if shrink is None else list(shrink.leaving)
        if shrink is None and len(spares) < len(failed_slots):
            names = ", ".join(f"{layout[i]} (node rank {i}: {nodes[layout[i]].cause})" for i in failed_slots)
            if not self.reshaping.waits_for_spares():
                advice = "; rerun with more --spares"
                if rec.shrink_refused:
                    advice = f"; the job could not shrink: {rec.shrink_refused}{advice}"
                if all(nodes[layout[i]].raised for i in failed_slots):
                    advice = ("; if that error is the script's, fix it (a spare would fail the same way); if it is "
                              "the node's, rerun with more --spares")
                elif paused_lately:  # its nodes left for dprun's own pause (the end says so first):
                    advice = ""  # more spares would not have helped
                return GiveUp(f"node failure with no spare left: {names}{advice}")
            if rec.waiting_since is None:
                rec.waiting_since = now
                self.out.publish("waiting_for_spare", needed=len(failed_slots) - len(spares), failed=names,
                                 timeout_s=self.spec.spare_wait_timeout)
            self.pending = rec  # decided again when a node registers as a spare
            self.enter(Phase.WAITING)
            return None
        grow = [] if shrink else self.reshaping.growth(spares[len(failed_slots):], now)
        if self.spec.restart_mode:
            if self.restarts >= self.spec.max_restarts:
                return GiveUp(f"node {', '.join(rec.failed)} failed and --max-restarts {self.spec.max_restarts} "
                              "restarts are used up: " + "; ".join(nodes[n].cause for n in rec.failed))
            self.restarts += 1
            plan = RestorePlan(step=p.NO_RANK)  # the script restarts from scratch (or its own checkpoint)
        else:
            # a rank whose new node has not restored it yet has its state only on replicas, like a failed one
            failed_ranks = ({r for i in {*failed_slots, *leaving} for r in self.timeline.ranks_of(i)}
                            | self.timeline.unrestored)
            plan = self._plan(failed_ranks, rec)
            if grow:  # the processes that give a rank back: their snapshots must be on replicas the new node reads
                grown = self._plan(failed_ranks | {ranks[0] for ranks in self.timeline.width.assignment
                                                   if len(ranks) > 1}, rec)
                if not grown.lost:
                    plan = grown
                elif rec.why == GROWS and not failed_slots:  # (their copies on no live replica yet: it grows later)
                    return Unchanged()
                else:  # (a recovery goes on without the grow, rather than lose the state it needs)
                    grow = []
        if ((plan.lost and rec.probed_for_lost or not plan.lost and self._adopted_out_of_reach(plan.step))
                and self.reshaping.undo_grow(rec)):
            return self.decide(rec, now, paused_lately, safe, training_over)  # (the width that trained last)
        if plan.lost and not rec.probed_for_lost:
            # "lost" ends the job, so first probe every node once more: a copy stored just after its holder
            # answered the last probe (a restored snapshot re-replicated to a new holder) is reported then
            rec.probed_for_lost = True
            self.pending = rec
            self.start_flush(now)
            return None
        if plan.lost and self.timeline.all_still_restoring(plan.lost, self.table):
            # each rank lost was handed to a live node that has neither restored it nor failed to: its copy may
            # be in flight (fetched from a store lost since). Its WorkerReady, its copy stored again, its
            # RestoreFailed or its PeerError decides again; spec.restore_wait bounds the wait. (One lost rank
            # that no live node restores ends the job at once: nothing can bring that one back.)
            if rec.restoring_until is None:
                rec.restoring_until = now + self.spec.restore_wait
                self.out.publish("waiting_for_restore", ranks=plan.lost,
                                 nodes=sorted({self.timeline.node_of_rank(rank) for rank in plan.lost}),
                                 timeout_s=self.spec.restore_wait)
            if now < rec.restoring_until:
                self.pending = rec
                self.enter(Phase.WAITING)
                return None
        if plan.lost and safe is not None and self.spec.snapshots and not shrink and not grow:
            folder, step = safe
            self.out.publish("restoring_from_disk", ranks=plan.lost, step=step, folder=folder,
                             lost_steps=max(0, max(rec.peak_step, self.timeline.max_step) - step),
                             failed=sorted(nodes[n].node_id for n in rec.failed))
            return FromDisk(failed_slots, spares, folder, step)
        if plan.lost:
            holders = sorted({nodes[n].node_id for n in rec.failed})
            bad = f"; copies found bad: {'; '.join(rec.bad_copies[-6:])}" if rec.bad_copies else ""
            more = (f"rerun with --replicas {self.spec.replicas + 1} (each node's snapshots on more peers survive "
                    "more nodes lost at once) or from a checkpoint on disk"
                    if self.spec.replicas < self.spec.nnodes - 1 else
                    "every node that held a copy failed at once (--replicas cannot exceed --nnodes - 1): go on "
                    "from a checkpoint on disk")
            return GiveUp(f"state lost: ranks {plan.lost} have no usable copy left (failed nodes {holders}{bad}); "
                          f"{more}")
        if not failed_slots and not self.spec.restart_mode and (why := self._one_more_replan(rec)) is not None:
            return GiveUp(why)
        return NextGeneration([i for i in failed_slots if i not in leaving], spares, plan.step, dict(plan.sources),
                              shrink, grow)

    def _plan(self, failed_ranks: set[int], rec: Recovery) -> RestorePlan:
        """The ledger's plan, each rank at each step taken from the snapshots that hold it (Timeline.holding)."""
        timeline, ledger = self.timeline, self.ledger
        holding = StepHolding(timeline, ledger, set(timeline.keys()) - failed_ranks)
        return ledger.plan(timeline.keys(), failed_ranks, timeline.survivor_floors(ledger), rec.no_local, holding)

    def begin_generation(self, rec: Recovery, now: float, failed_slots: list[int], spares: list[Node],
                         step: int, shrink: Narrowing | None = None, grow: list[Node] | None = None,
                         from_disk: bool = False) -> None:
        """The next generation: spares promoted into the failed slots, the nodes of `shrink` out of the layout
        (their ranks trained by the others) or those of `grow` into it, every rank going back to `step`."""
        timeline = self.timeline
        timeline.unrestored |= {r for i in failed_slots for r in timeline.ranks_of(i)}
        if self.spec.nnodes == 1 and len(spares) > len(failed_slots):
            # a single node's snapshots live on spares: promote one that holds none, so that the holder keeps its
            # copy through a second loss while the new node restores
            holding = {node_id for held in timeline.holders.values() for node_id in held}
            spares.sort(key=lambda spare: spare.node_id in holding)
        for i in failed_slots:
            spare = spares.pop(0)
            self.table.set_role(spare, ACTIVE)
            spare.node_rank = i
            rec.promoted[i] = spare.node_id
            timeline.layout[i] = spare.node_id
            self.out.publish("spare_promoted", spare=spare.node_id, node_rank=i, generation=timeline.generation + 1)
        if shrink:
            self.reshaping.shrink(rec, shrink, now)
        if grow:
            self.reshaping.grow(rec, grow)
        rec.peak_step = max(rec.peak_step, timeline.max_step)
        timeline.began(step, now)
        self.crashed_at = {}
        rec.generation = timeline.generation
        rec.t_decide = now
        rec.restore_step = step
        rec.lost_steps = max(0, rec.peak_step - step)
        if step < 0 or from_disk:  # (a restart from scratch, or the stores' copies past `step` replaced by files)
            self.ledger.rollback(step)
        else:
            timeline.abandon_after(self.ledger, step)
        timeline.restoring(self.ledger, step)

    def store_lost(self, node_id: str, cause: str, now: float) -> None:
        """A fenced node's kept store was lost: a rank that the recovery under way restores from it has its plan
        made again at once (its fetch from a dead store would wait out its timeout)."""
        rec = self.recovery
        if rec is not None and any(holder == node_id and rank not in self.timeline.restores_answered
                                   for rank, holder in rec.sources.items()):
            self.replan(now, f"the store of {node_id}, which ranks restored from, was lost: {cause[:200]}")
            self.replanned_for_a_loss()

    def launched(self, rec: Recovery) -> None:
        """`rec`'s generation was sent out: it is complete once every rank stepped past its restore step."""
        self.recovery = rec
        self.enter(Phase.RECOVERING)

    def _one_more_replan(self, rec: Recovery) -> str | None:
        """A generation planned again with no node lost: counted (those owed to a dropped bad copy are not);
        past MAX_REPLANS in a row the job ends (its message). Counted per generation planned, not per time the
        plan was looked at (waits for a restore's news look again and again)."""
        if rec.free_replans:
            rec.free_replans -= 1
            return None
        rec.retries += 1
        if rec.retries > MAX_REPLANS:
            return (f"generation {self.timeline.generation} could not start: planned {rec.retries} times with "
                    f"every node answering probes (last: {rec.why}); check that the nodes reach each "
                    "other on the Gloo/NCCL ports, or raise DP_CONNECT_TIMEOUT")
        return None

    def peer_error(self, node_id: str, msg: p.PeerError, now: float) -> None:
        """A rank's collective failed: in restart mode its crash is held back (the exit follows, or a dead peer
        explains it); else dpstate's rank waits for a new generation: probe (a dead peer is failed) and plan one
        either way, since with every node alive the error was the rank's own (e.g. a connect that timed out)."""
        if self.spec.restart_mode:
            self.crashed_at.setdefault(node_id, now)  # (the failure that follows began no later)
            if self.flush is None:
                self.start_flush(now)
            return
        rec = self.replan(now, f"rank {msg.rank}: {msg.detail[:200]}")
        if not rec.failed:  # the peer that broke the collective may be a worker whose exit is in flight
            rec.settle_until = max(rec.settle_until, now + self.spec.heartbeat_interval)

    def restore_failed(self, node_id: str, msg: p.RestoreFailed, now: float) -> None:
        """A rank could not restore its copy: plan again, without that copy."""
        rec = self.replan(now, f"restoring rank {msg.rank} from {msg.source or 'its local copy'} failed: "
                               f"{msg.reason[:200]}")
        holder: str | None
        if msg.source:
            holder = next((n.node_id for n in self.table.nodes.values() if n.replica_endpoint == msg.source), None)
            dropped = holder is not None and self.ledger.discard(msg.rank, msg.step, holder)
        elif not self._owns(node_id, msg.rank):  # another rank's snapshot that no store was named for: its own
            holder, dropped = f"{node_id} (none named)", False  # process's local copy says nothing of it
        else:  # the rank's own copy: it holds only newer steps (a survivor asked to walk back past its ring)
            holder, dropped = f"{node_id} (local)", rec.no_local.get(msg.rank, -1) < msg.step
            rec.no_local[msg.rank] = max(rec.no_local.get(msg.rank, -1), msg.step)
            self.timeline.restored_local.get(msg.rank, set()).discard(msg.step)
        rec.bad_copies.append(f"rank {msg.rank} step {msg.step} on {holder or msg.source}: {msg.reason[:80]}")
        if dropped:  # each such plan has one copy fewer to choose from: they end, with a plan or "state lost"
            rec.free_replans += 1

    def _adopted_out_of_reach(self, step: int) -> bool:
        """Does a process of this width take a rank from another's snapshot of `step` that no live replica holds
        (its local copy is out of the taker's reach)?"""
        timeline = self.timeline
        return step >= 0 and any(not self.ledger.holders_of(key, step)
                                 for key in set(timeline.adoptions(step).values()))

    def _owns(self, node_id: str, rank: int) -> bool:
        """Is `rank` the own rank of one of the node's processes (the key of its local snapshots)?"""
        node = self.table.nodes.get(node_id)
        return node is None or node.node_rank < 0 or rank in self.timeline.ranks_of(node.node_rank)

    def stepped(self, rank: int, step: int) -> Recovery | None:
        """A rank made `step`: the recovery in flight, once every rank stepped past its restore step."""
        rec = self.recovery
        if rec is not None and step > rec.restore_step:
            rec.stepped.add(rank)
            if len(rec.stepped) == self.timeline.width.processes:
                return rec
        return None

    def ready(self, rank: int, rebuild_s: float, restore_s: float) -> Recovery | None:
        """A rank's worker is ready: in restart mode, the recovery in flight once every rank is (restarted
        scripts report no steps to us)."""
        rec = self.recovery
        if rec is not None:
            rec.ready[rank] = (rebuild_s, restore_s)
            if self.spec.restart_mode and len(rec.ready) == self.timeline.width.processes:
                return rec
        return None

    def complete(self, rec: Recovery, now: float) -> None:
        rebuild = max((r[0] for r in rec.ready.values()), default=0.0)
        restore = max((r[1] for r in rec.ready.values()), default=0.0)
        phases = {
            "detect_s": round(rec.t_detect - rec.t_fail, 4),
            "decide_s": round(rec.t_decide - rec.t_detect, 4),
            "rebuild_s": round(rebuild, 4),
            "restore_s": round(restore, 4),
            "total_s": round(now - rec.t_fail, 4),
        }
        self.out.publish("recovery_complete", mode="restart" if self.spec.restart_mode else "hot-swap",
                         generation=rec.generation, restore_step=rec.restore_step,
                         lost_steps=rec.lost_steps, failed=rec.failed, promoted=rec.promoted, phases=phases,
                         **({"from_disk": rec.from_disk} if rec.from_disk else {}))
        self.recoveries.append(rec)
        self.recovery = None
        self.enter(Phase.TRAINING)
        self.grow_if_due(now)  # a node that joined while the job recovered

