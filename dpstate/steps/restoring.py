"""Restoring: a worker's tracked state brought to a generation's restore step, from its own copy, a replica, the
state before training, or (a job that shrank or grew) with other ranks' parts taken from the snapshots that hold them.

A part of the Job (dpstate.steps.session), handed the tracked objects, the replicator and the snapshot sources.
"""

from __future__ import annotations

from dpcommon import protocol as P

from dpstate.groups.carried import Carried
from dpstate.groups.ddp import DataParallel, sync_from_rank0
from dpstate.replication.replicator import Replicator, Slot
from dpstate.replication.sources import SnapshotSources, named_sources
from dpstate.snapshot import packing as S
from dpstate.snapshot.rank_parts import as_own, carried_by, rank_part, with_part
from dpstate.snapshot.state import Tracked

from .abort import AbortSignal

UNTRACKED = ("no model or optimizer is tracked (job.track(model=..., optimizer=...)), so snapshots hold no "
             "training state")


class Restoring:
    def __init__(self, tracked: Tracked, replicator: Replicator, sources: SnapshotSources,
                 proxies: list[DataParallel], abort: AbortSignal):
        self._tracked, self._rep, self._sources, self._proxies, self._abort = (
            tracked, replicator, sources, proxies, abort)

    def restore(self, reconf: P.Reconfigure, carried: Carried, started: bool, world_size: int,
                sharded: bool = False) -> P.RestoredFrom:
        """Bring the tracked state to reconf.restore_step and replicate this generation's snapshot of it (its
        holders keep the copy they have where it is the one restored); returns where the state came from."""
        where, restored, anew = self._restored(reconf, carried, started, world_size, sharded)
        rep = self._rep
        if anew:  # its own rank's state, or a sharded job's shards, came from other snapshots: taken anew
            if restored is not None:
                rep.forget(restored)
            rep.submit(reconf.restore_step, self._tracked.capture(reconf.restore_step), self._tracked.shared_keys)
        elif restored is not None:
            # re-replicated at once, while the other ranks still restore (a survivor otherwise idles at the
            # barrier; sending after it cost 0.13 s of detect -> first step, median of 8 A/B recoveries).
            # The stores the plan names as holding this step keep their copy for this generation instead
            # of receiving it again (they check it first), so a survivor sends it whole only where its
            # holder died; the first step's snapshot gate waits for it, as for any snapshot.
            rep.submit_packed(restored, held_at=named_sources(reconf, carried.ranks[0]))
        return where

    def _restored(self, reconf: P.Reconfigure, carried: Carried, started: bool, world_size: int,
                  sharded: bool) -> tuple[P.RestoredFrom, Slot | None, bool]:
        """The state brought back: where from, the snapshot restored (to be replicated again as it is) and
        whether the step is to be captured anew instead: its own rank's state came from another rank's snapshot,
        or, `sharded`, it took in other ranks' shards. A sharded process that only lets ranks go (the job grows)
        keeps its snapshot as it was: the processes that take them cut their shards out of it, before its put
        or after."""
        step, rep, sources, key = reconf.restore_step, self._rep, self._sources, carried.ranks[0]
        source = reconf.restore_from.get(str(key), "")
        adopt = {int(rank): holder for rank, holder in reconf.adopt_from.items()}
        if step >= 0 and started and not rep.policy.enabled:
            raise RuntimeError(f"dpstate: rank {key} cannot be restored to step {step}: snapshots are off "
                               "(--snapshot-interval off / DP_SNAPSHOT_INTERVAL=off), so a failure cannot be recovered")
        if step < 0:  # fresh start: the state before training, the same on every rank
            slot = rep.local(0)
            if slot is not None:
                self._tracked.restore(self._tree(slot, 0))
            elif started:
                raise RuntimeError("dpstate: fresh start asked, but this worker trained and no longer holds step 0")
            if world_size > 1:
                sync_from_rank0(self._proxies, self._abort)
            rep.forget_after(-1)
            rep.submit(0, self._tracked.capture(0), self._tracked.shared_keys)
            return "", None, False
        if key in adopt:  # this process's own rank was trained by another's (the job grows): from its snapshot
            slot = sources.fetch_any(reconf, adopt[key], {})
            rep.forget_after(step)
            held = self._tree(slot, step)
            self._restore_tree(reconf, as_own(held, key), adopt, carried, [held] if sharded else None)
            return "replica", slot, True  # (another rank's snapshot: let go once this one's is captured)
        slot, bad_copies = sources.take_prefetched(reconf, key)
        where: P.RestoredFrom
        slot, where = (slot, "replica") if slot is not None else (rep.local(step), "local")
        if slot is None and (source == "init" or (step == 0 and not source)):
            # keep the state before training: this process never started (a spare, or a failure came first)
            if started or step != 0:
                raise RuntimeError(f"dpstate: rank {key} cannot keep its initial state as step {step} "
                                   f"(started: {started}, holds {rep.local_steps()})")
            rep.forget_after(-1)
            rep.submit(0, self._tracked.capture(0), self._tracked.shared_keys)
            return "init", None, False
        if slot is None:
            slot, where = sources.fetch_any(reconf, key, bad_copies), "replica"
        if where == "replica" and not self._tracked.holds_training_state():  # a new process would diverge
            raise RuntimeError(f"dpstate: rank {key} cannot be restored to step {step} here: {UNTRACKED}")
        rep.forget_after(step)
        tree = self._tree(slot, step)
        merged = any(rank in adopt for rank in carried.ranks[1:])
        # a sharded job whose process carries other ranks than its snapshot did: its shards are cut anew
        reshard = sharded and (merged or carried_by(tree) != list(carried.ranks))
        whole = self._restore_tree(reconf, tree, adopt, carried, [tree] if reshard else None)
        if merged and not reshard:
            # its snapshot of the step is taken anew: the tree restored, the adopted ranks' parts added. The parts
            # of the ranks it held and no longer trains stay in it, so that a process adopting them from this
            # snapshot (the job changed width again before it trained) finds them, before this put or after it
            with rep.holding(step):  # (its tensors are views of `slot`: no capture writes there, let go once copied)
                rep.submit(step, whole, self._tracked.shared_keys)
                rep.wait_captured()
            rep.forget(slot)
            return where, None, False  # (sent here: nothing left for the caller to replicate)
        # sharded and merged: captured anew; its own shards only cut anew: kept, holding the ranks it let go
        return where, slot, merged

    def _restore_tree(self, reconf: P.Reconfigure, tree: dict, adopt: dict[int, int], carried: Carried,
                      shards: list[dict] | None = None) -> dict:
        """Restore `tree`, with the part of each rank new to this process taken from the snapshot that holds it
        (a shrink: dpstate.snapshot.rank_parts), fetched into a spare buffer and let go once read. `shards`: a
        sharded job's trees whose shards make up this process's (dpstate.snapshot.reshard), to which the
        fetched trees are added. Returns the tree restored, with those parts."""
        for rank in carried.ranks[1:]:
            if rank in adopt:
                held = self._sources.fetch_any(reconf, adopt[rank], {})
                try:
                    other = S.unpack(held.meta, held.data, clone=True)
                finally:
                    self._rep.forget(held)
                tree = with_part(tree, rank, rank_part(other, rank))
                if shards is not None:
                    shards.append(other)
        self._tracked.restore(tree, reshard_from=shards)
        return tree

    @staticmethod
    def _tree(slot: Slot, step: int) -> dict:
        tree = S.unpack(slot.meta, slot.data, clone=False)  # views of the slot: restore() copies into place
        if tree.get("step") != step:
            raise S.SnapshotError(f"the snapshot held for step {step} is of step {tree.get('step')}")
        return tree
