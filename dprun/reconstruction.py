"""Reconstruction: what the controller does when a node fails or a plan must change: fence it, probe every
live node, then plan the next generation (spares promoted, restore step and sources) or end the job saying why.

A part of the Controller state machine (it inherits this), kept apart so each file reads in one sitting.
"""

from __future__ import annotations

from dpagent import protocol as p

from .controller_io import Flush, Recovery
from .ledger import RestorePlan
from .nodes import ACTIVE, FAILED, SPARE
from .phase import Phase

MAX_REPLANS = 3  # generations planned again in a row with no node lost before the job gives up


class Reconstruction:
    """The failure and recovery half of dprun.controller.Controller (its state lives there)."""

    def _open_pending(self, now: float) -> bool:
        """Make sure a recovery is pending: a new one, or one that carries on the recovery under way (not
        complete yet). True if it carries one on."""
        if self.pending is not None:
            return False
        self._enter(Phase.DECIDING)
        if self.recovery is None:
            self.pending = Recovery(failed=[], t_fail=now, t_detect=now, peak_step=self.max_step)
            return False
        prior, self.recovery = self.recovery, None
        self.pending = prior.continued()
        return True

    def _replan(self, now: float, why: str) -> None:
        """A new generation is needed even if no node failed: probe every node, then plan it."""
        self._open_pending(now)
        self.pending.replan, self.pending.why = True, why
        if self.flush is None:
            self._start_flush(now)

    def _replanned_for_a_loss(self) -> None:
        """A node or a store was lost: planning again is progress, not a retry, and a new situation to probe."""
        self.pending.retries, self.pending.probed_for_lost = 0, False

    def _node_failed(self, node_id: str, cause: str, now: float, agent_alive: bool = False,
                     since: float | None = None) -> None:
        """Fence the node (its agent told to stop) and plan without it. agent_alive: its agent reported its
        worker's exit, so its replica store may stay for a save (dprun.files). since: when it was last known
        well (its last heartbeat, for a silent node): the recovery's downtime counts from then."""
        node = self.table.get(node_id)
        if node is not None and node.keeps_store:  # fenced already; now its store is lost too
            self._kept_gone(node_id, cause, now)
        if node is None or node.role == FAILED:
            return
        was = node.role
        self.table.set_role(node, FAILED)
        self._background_saved(self.saves.node_lost(node_id, now))
        node.cause = cause
        keep = agent_alive and self._keeps_store(node)
        if not keep:
            self.ledger.holder_lost(node_id)
        self._send(node_id, p.Stop(reason=f"node {node_id} was fenced: {cause}", exit_code=1, keep_store=keep))
        self._publish("node_failed", node=node_id, node_rank=node.node_rank if was == ACTIVE else None,
                      role=was, cause=cause)
        if self.flush is not None:
            self.flush.waiting.discard(node_id)
        if was == SPARE:
            self._publish("spare_lost", node=node_id, spares_left=len(self.table.with_role(SPARE)))
            finishing = any(self.table.nodes[n].exited_ok for n in self.layout)
            if self.phase is Phase.FORMING or finishing or not any(node_id in held for held in self.holders.values()):
                return
        elif self.phase is Phase.FORMING:  # still forming: the slot opens for the next node to register
            return
        elif not (self.spec.snapshots or self.spec.restart_mode or self.all_finished_at is not None):
            if not self.finished:  # (the first of several failed at once says it)
                self._finish(1, f"{node_id} failed ({cause}) and snapshots are off (--snapshot-interval off): "
                                "there is no state to recover its ranks from, so no spare can take over; rerun "
                                "without it")
            return
        if self._open_pending(now):  # a failure during recovery: one recovery covers both
            self._replanned_for_a_loss()
        if not self.pending.failed:  # (one opened by a peer's error, then this node found by the probe: its
            self.pending.t_detect = now  # detection took the probe, not the planning)
        self.pending.failed.append(node_id)
        self.pending.replan |= was == SPARE
        # when it failed: when injected, last heard, or (restart mode) the generation's first crash, its or another's
        heard = now if since is None else since
        for began in [self.faults.injected_at.get(node_id, now), heard, *self.crashed_at.values()]:
            self.pending.t_fail = min(self.pending.t_fail, began)
        self._start_flush(now)

    def _start_flush(self, now: float) -> None:
        """Ping every live node: a Pong proves it alive and flushes the SnapshotStored it sent before."""
        self.seq += 1
        waiting = {n.node_id for n in self.table.live()}
        self.flush = Flush(seq=self.seq, deadline=now + self.spec.probe_timeout, waiting=waiting)
        if self.pending is not None:  # (a plan that waited decides again once every node answered)
            self._enter(Phase.DECIDING)
        for node_id in sorted(waiting):
            self._send(node_id, p.Ping(seq=self.seq))

    def _maybe_decide(self, now: float) -> None:
        if self.flush is None or self.flush.waiting:
            return
        if self.pending is not None and not self.pending.failed and now < self.pending.settle_until:
            return  # every node answered, but a worker's exit report may still arrive: the next tick decides
        self.flush = None
        if self.pending is not None and not self.finished:
            pending, self.pending = self.pending, None
            self._reconstruct(pending, now)

    def _reconstruct(self, rec: Recovery, now: float) -> None:
        failed_slots = [i for i, n in enumerate(self.layout) if self.table.nodes[n].role == FAILED]
        if not failed_slots and not rec.replan:
            self._enter(Phase.TRAINING)
            return
        if any(self.table.nodes[n].exited_ok for n in self.layout):
            # ranks that exited cannot join a new generation: say so rather than wait for them
            self._failed_after_exits(rec, self.max_step)
            return
        spares = self.table.with_role(SPARE)
        if len(spares) < len(failed_slots):
            names = ", ".join(f"{self.layout[i]} (node rank {i}: {self.table.nodes[self.layout[i]].cause})"
                              for i in failed_slots)
            if self.spec.on_spare_exhausted != "wait":
                advice = "; rerun with more --spares"
                if all(self.table.nodes[self.layout[i]].raised for i in failed_slots):
                    advice = ("; if that error is the script's, fix it (a spare would fail the same way); if it is "
                              "the node's, rerun with more --spares")
                elif self._paused_lately():  # its nodes left for dprun's own pause (the end says so first):
                    advice = ""  # more spares would not have helped
                self._finish(1, f"node failure with no spare left: {names}{advice}")
                return
            if rec.waiting_since is None:
                rec.waiting_since = now
                self._publish("waiting_for_spare", needed=len(failed_slots) - len(spares), failed=names,
                              timeout_s=self.spec.spare_wait_timeout)
            self.pending = rec  # decided again when a node registers as a spare
            self._enter(Phase.WAITING)
            return
        if self.spec.restart_mode:
            if self.restarts >= self.spec.max_restarts:
                self._finish(1, f"node {', '.join(rec.failed)} failed and --max-restarts {self.spec.max_restarts} "
                                "restarts are used up: " + "; ".join(self.table.nodes[n].cause for n in rec.failed))
                return
            self.restarts += 1
            plan = RestorePlan(step=p.NO_RANK)  # the script restarts from scratch (or its own checkpoint)
        else:
            # a rank whose new node has not restored it yet has its state only on replicas, like a failed one
            failed_ranks = {r for i in failed_slots for r in self.ranks_of(i)} | self.unrestored
            plan = self.ledger.plan(self.spec.world_size, failed_ranks, self._survivor_floors(), rec.no_local)
        if plan.lost and not rec.probed_for_lost:
            # "lost" ends the job, so first probe every node once more: a copy stored just after its holder
            # answered the last probe (a restored snapshot re-replicated to a new holder) is reported then
            rec.probed_for_lost = True
            self.pending = rec
            self._start_flush(now)
            return
        if plan.lost and self._all_still_restoring(plan.lost):
            # each rank lost was handed to a live node that has neither restored it nor failed to: its copy may
            # be in flight (fetched from a store lost since). Its WorkerReady, its copy stored again, its
            # RestoreFailed or its PeerError decides again; spec.restore_wait bounds the wait. (One lost rank
            # that no live node restores ends the job at once: nothing can bring that one back.)
            if rec.restoring_until is None:
                rec.restoring_until = now + self.spec.restore_wait
                self._publish("waiting_for_restore", ranks=plan.lost,
                              nodes=sorted({self.node_of_rank(rank) for rank in plan.lost}),
                              timeout_s=self.spec.restore_wait)
            if now < rec.restoring_until:
                self.pending = rec
                self._enter(Phase.WAITING)
                return
        if plan.lost and self.saves.safe is not None and self.spec.snapshots:
            self._restore_from_disk(rec, now, failed_slots, spares, plan.lost)
            return
        if plan.lost:
            holders = sorted({self.table.nodes[n].node_id for n in rec.failed})
            bad = f"; copies found bad: {'; '.join(rec.bad_copies[-6:])}" if rec.bad_copies else ""
            more = (f"rerun with --replicas {self.spec.replicas + 1} (each node's snapshots on more peers survive "
                    "more nodes lost at once) or from a checkpoint on disk"
                    if self.spec.replicas < self.spec.nnodes - 1 else
                    "every node that held a copy failed at once (--replicas cannot exceed --nnodes - 1): go on "
                    "from a checkpoint on disk")
            self._finish(1, f"state lost: ranks {plan.lost} have no usable copy left (failed nodes {holders}{bad}); "
                            f"{more}")
            return
        if not failed_slots and not self.spec.restart_mode and not self._one_more_replan(rec):
            return  # (it ended the job)
        self._begin_generation(rec, now, failed_slots, spares, plan.step)
        rec.sources = dict(plan.sources)
        # faults due "during recovery" go out first: a replica corrupted for this plan is damaged before a
        # promoted spare, which fetches as soon as it hears of the plan, can ask for it
        self._fire_faults(now, recovering=True)
        self._reconfigure_all(plan.step, plan.sources, reason="recovery")
        self._publish("reconfigure", generation=self.generation, restore_step=plan.step,
                      layout=list(self.layout), decide_s=round(now - rec.t_detect, 4))
        self.recovery = rec
        self._enter(Phase.RECOVERING)

    def _begin_generation(self, rec: Recovery, now: float, failed_slots: list[int], spares: list, step: int) -> None:
        """The next generation: spares promoted into the failed slots, every rank going back to `step`."""
        self.unrestored |= {r for i in failed_slots for r in self.ranks_of(i)}
        if self.spec.nnodes == 1 and len(spares) > len(failed_slots):
            # a single node's snapshots live on spares: promote one that holds none, so that the holder keeps its
            # copy through a second loss while the new node restores
            holding = {node_id for held in self.holders.values() for node_id in held}
            spares.sort(key=lambda spare: spare.node_id in holding)
        for i in failed_slots:
            spare = spares.pop(0)
            self.table.set_role(spare, ACTIVE)
            spare.node_rank = i
            rec.promoted[i] = spare.node_id
            self.layout[i] = spare.node_id
            self._publish("spare_promoted", spare=spare.node_id, node_rank=i, generation=self.generation + 1)
        self.generation += 1
        self.restores_answered, self.crashed_at = set(), {}
        rec.generation = self.generation
        rec.t_decide = now
        self.last_progress_at, self.stepped = now, False
        rec.restore_step = step
        rec.peak_step = max(rec.peak_step, self.max_step)
        rec.lost_steps = max(0, rec.peak_step - step)
        self.peaks[self.generation - 1] = self.max_step
        self.ledger.rollback(step)
        self.rank_step = {rank: max(step, 0) for rank in range(self.spec.world_size)}
        self.max_step = step

    def _restore_from_disk(self, rec: Recovery, now: float, failed_slots: list[int], spares: list,
                           lost: list[int]) -> None:
        """Some ranks have no copy left in memory, but a step of every rank is safe on disk (background saves, or
        the step this job resumed from): every rank goes back to it. Spares take the failed slots, each node
        reads its ranks' files into its store (dprun.files), then the generation starts from them."""
        folder, step = self.saves.safe
        self._publish("restoring_from_disk", ranks=lost, step=step, folder=folder,
                      lost_steps=max(0, max(rec.peak_step, self.max_step) - step),
                      failed=sorted(self.table.nodes[n].node_id for n in rec.failed))
        self._background_saved(self.saves.abandon(now, "a recovery from disk began"))  # (an event says so)
        self._begin_generation(rec, now, failed_slots, spares, step)
        rec.from_disk = folder
        self._load_from_disk(folder, step, rec)

    def _one_more_replan(self, rec: Recovery) -> bool:
        """A generation planned again with no node lost: counted (those owed to a dropped bad copy are not);
        past MAX_REPLANS in a row the job ends (False). Counted per generation planned, not per time the plan
        was looked at (waits for a restore's news look again and again)."""
        if rec.free_replans:
            rec.free_replans -= 1
            return True
        rec.retries += 1
        if rec.retries > MAX_REPLANS:
            self._finish(1, f"generation {self.generation} could not start: planned {rec.retries} times with "
                            f"every node answering probes (last: {rec.why}); check that the nodes reach each "
                            "other on the Gloo/NCCL ports, or raise DP_CONNECT_TIMEOUT")
            return False
        return True

    def _late_copy(self, msg) -> bool:
        """A copy stored for an older generation, reported late (its sender's put was in flight when a failure
        began a new one), is still taken in while no generation since has trained: it is of the one timeline
        that did, and the store made room for it, so the ledger must know what the store now holds (else an
        older copy counted on may be gone, the newer one unknown, and the state said lost)."""
        return isinstance(msg, p.SnapshotStored) and self.trained_generation <= msg.generation < self.generation

    def _first_step_of_generation(self) -> None:
        """This generation trains from its restore step on: the late copies of steps past it are of an abandoned
        timeline (the stores drop them as this generation's copies come), and the ledger forgets them too. (A
        generation after the first comes of a recovery, in progress until its ranks step past its restore step.)"""
        self.trained_generation = self.generation
        restore_step = self.recovery.restore_step if self.recovery is not None else p.NO_RANK
        for rank, step, holder in self.late_copies:
            if step > restore_step:
                self.ledger.discard(rank, step, holder)
        self.late_copies = []

    def _late_copies_superseded(self, rank: int, step: int, holder: str) -> None:
        """`holder` stored this generation's copy of `rank` at `step` (the restored step sent again, most often):
        its store dropped the older generations' copies of that rank at or past it (ReplicaStore.add), late ones
        too, before this generation trained (else a second failure could plan a late copy that the holder no
        longer holds)."""
        superseded = [copy for copy in self.late_copies if copy[0] == rank and copy[2] == holder and copy[1] >= step]
        for copy in superseded:
            self.late_copies.remove(copy)
            if copy[1] > step:
                self.ledger.discard(*copy)

    def _all_still_restoring(self, ranks: list[int]) -> bool:
        """Is every one of `ranks` one that a live node was handed and has neither restored nor failed to yet?"""
        return all(rank in self.unrestored and rank not in self.restores_answered
                   and self.table.nodes[self.node_of_rank(rank)].role == ACTIVE for rank in ranks)

    def _failed_after_exits(self, rec: Recovery, step: int) -> None:
        """End the job: `rec`'s failures came after some ranks had exited 0. After job.steps()' final barrier
        (RankFinished) training is complete; a rank that exited 0 without it left its peers mid-training."""
        early = sorted(rank for i, n in enumerate(self.layout) for local in self.table.nodes[n].exited_ok
                       if (rank := self.ranks_of(i)[local]) not in self.finished_ranks)
        if early:  # what the others then met (a peer error, most often) is its consequence: not quoted
            then = f" ({', '.join(map(str, rec.failed))} then failed)" if rec.failed else ""
            self._finish(1, f"rank {', '.join(map(str, early))} exited (exit code 0) after step {step} without "
                            f"finishing job.steps(), and the others cannot train on without it{then}; if the "
                            "script stops early (a break out of the loop), it must do so on every rank")
            return
        failed = ", ".join(f"{n} ({self.table.nodes[n].cause})" for n in rec.failed) or rec.why
        step = max(self.finished_ranks.values(), default=step)
        self._finish(1, f"training completed (step {step}), but {failed} failed after other ranks had finished "
                        "and exited; the final state is complete on the surviving ranks")

    def _survivor_floors(self) -> dict[int, int]:
        """A step that each surviving rank still holds locally, from what ranks reported.

        Every rank passes the snapshot gate (dpstate's Job._gate) before the last collective of a step, so
        Progress(P) from any rank means every rank's snapshots before P are acked, and every rank is at P-1
        or later. A worker keeps its newest 2 snapshots, captures every step it submits before it reports
        it (Progress), even when a reconfiguration comes, and is at most a step past what it reported. So
        it holds the snapshot at or before what it reported, and the one at or before P-1: the floor is the
        newer of the two. Snapshots are taken at the same steps on every rank (the grid: Progress says which
        steps are snapshotted, as do replica reports): these hold whatever the replica reports say (those
        from a holder that died with them can be lost in flight: a grid known only from them could lag, and send
        a survivor to a step its ring had dropped).
        """
        top = max(self.rank_step.values(), default=0)
        return {rank: self.ledger.snapshot_step_at_or_before(max(self.rank_step.get(rank, 0), top - 1, 0))
                for rank in range(self.spec.world_size)}

    def _recovery_complete(self, rec: Recovery, now: float) -> None:
        rebuild = max((r[0] for r in rec.ready.values()), default=0.0)
        restore = max((r[1] for r in rec.ready.values()), default=0.0)
        phases = {
            "detect_s": round(rec.t_detect - rec.t_fail, 4),
            "decide_s": round(rec.t_decide - rec.t_detect, 4),
            "rebuild_s": round(rebuild, 4),
            "restore_s": round(restore, 4),
            "total_s": round(now - rec.t_fail, 4),
        }
        self._publish("recovery_complete", mode="restart" if self.spec.restart_mode else "hot-swap",
                      generation=rec.generation, restore_step=rec.restore_step,
                      lost_steps=rec.lost_steps, failed=rec.failed, promoted=rec.promoted, phases=phases,
                      **({"from_disk": rec.from_disk} if rec.from_disk else {}))
        self.recoveries.append(rec)
        self.recovery = None
        self._enter(Phase.TRAINING)
        self._release_kept("the recovery that replaced it completed")
