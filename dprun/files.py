"""Files: a stopping job's state written to disk by the nodes that hold it (--save-dir), and a resumed job's
read back into its nodes' replica stores (--resume-from), so that the state outlives the job.

A part of the Controller state machine (it inherits this), kept apart so each file reads in one sitting.
While files are written or read, the controller waits for them and little else (`_while_files`). A node fenced
for its worker's exit keeps its store for such a save until it is no longer needed (`_keeps_store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpagent import protocol as p
from dpagent.snapshot_files import CANNOT_WRITE, step_folder

from .controller_io import NodeGone, Paused, Received, Recovery, Shutdown, Tick
from .ledger import INIT
from .nodes import FAILED
from .phase import Phase

ANY_STEP = 2**62  # ReplicaLedger.plan's no_local: a rank's own local copy does not count, whatever its step
WAITING_FOR_FILES = (p.SnapshotFiles, p.SnapshotStored, p.Heartbeat, p.Pong, p.Register)


@dataclass
class FileWork:
    """SaveSnapshots or LoadSnapshots sent, the answers awaited."""

    saving: bool  # else loading
    folder: str
    step: int
    waiting: dict[int, str]  # rank -> the node asked for its file, until it answers
    deadline: float
    local: set[int] = field(default_factory=set)  # saving: ranks asked of their workers (own local copies)
    fallbacks: dict[int, list[tuple[str, bool]]] = field(default_factory=dict)  # saving: rank -> (node, local)
    # sources still to ask, in order, should the one asked fail: the other stores holding that step, then its worker
    gone: set[str] = field(default_factory=set)  # nodes lost during the wait
    dead_workers: set[int] = field(default_factory=set)  # ranks whose worker failed during the wait
    done: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)  # saving: ranks whose copies were trained past meanwhile
    errors: list[str] = field(default_factory=list)
    code: int = 0  # saving: how the job ends once the files are written
    message: str = ""
    hurried: bool = False  # saving: out of time (the deadline, a second signal): no older step is tried
    refused: bool = False  # saving: the disk refused a file (full, read-only): no other step is tried either
    recovery: Recovery | None = None  # loading: a running job's recovery from disk (else a resumed job's start)


class Files:
    """The files half of dprun.controller.Controller (its state lives there: files, saved, now)."""

    def _save_first(self, code: int, message: str, before: FileWork | None = None) -> str | None:
        """A job about to end with an error or a signal, with --save-dir: ask for the newest step that every
        rank can still come back to to be written: by the replica stores that hold it, or where a rank's every
        replica died with its holder, by its worker from its local copy. None: the job ends once they answered;
        else the message to end with now (nothing to save). `before`: a save of a newer step that failed (the
        workers and nodes it lost are not asked again)."""
        if code == 0 or not self.spec.save_dir or self.saved or self.phase is Phase.FORMING or self.spec.restart_mode:
            return message
        self.saved = True
        gone, dead = (before.gone, before.dead_workers) if before else (set(), set())
        failed = {r for i, n in enumerate(self.layout) if self.table.nodes[n].role == FAILED or n in gone
                  for r in self.ranks_of(i)} | self.unrestored | dead
        # the newest step that stores hold for every rank: they need no worker (a stopping job's are often dying:
        # the script's error, scancel's signal); else the newest step counting workers' own local copies
        ranks = range(self.spec.world_size)
        plan = self.ledger.plan(self.spec.world_size, failed, no_local=dict.fromkeys(ranks, ANY_STEP))
        if plan.lost or plan.step <= 0:
            plan = self.ledger.plan(self.spec.world_size, failed, self._survivor_floors())
        if plan.lost or plan.step <= 0 or INIT in plan.sources.values():
            if before is not None:  # (what failed is said above, for each step tried)
                return f"{message}; no other step of which every rank has a copy is left to try"
            return f"{message}; no step of which every rank has a copy was left to save"
        folder = str(step_folder(self.spec.save_dir, plan.step))
        deadline = before.deadline if before else self.now + self.spec.files_timeout  # for every step tried
        self.files = FileWork(True, folder, plan.step, {}, deadline, code=code,
                              message=message, gone=set(gone), dead_workers=set(dead))
        self._enter(Phase.SAVING)
        first: dict[tuple[str, bool], list[int]] = {}
        for rank, planned in sorted(plan.sources.items()):
            holders = sorted(self.ledger.holders_of(rank, plan.step), key=lambda holder: holder != planned)
            sources = [(holder, False) for holder in holders]  # a store's copy first: it needs no worker
            if rank not in failed:
                sources.append((self.node_of_rank(rank), True))
            first.setdefault(sources[0], []).append(rank)
            self.files.fallbacks[rank] = sources[1:]
        for (node_id, local), ranks in first.items():
            self._ask_to_save(node_id, local, ranks)
        self._publish("saving_state", step=plan.step, folder=folder, ranks=len(self.files.waiting))
        return None

    def _ask_to_save(self, node_id: str, local: bool, ranks: list[int]) -> None:
        work = self.files
        for rank in ranks:
            work.waiting[rank] = node_id
            (work.local.add if local else work.local.discard)(rank)
        self._send(node_id, p.SaveSnapshots(work.folder, work.step, ranks, local=local,
                                            world_size=self.spec.world_size))

    def _save_if_due(self, now: float) -> None:
        """--save-every / --save-interval: once due, the stores holding the newest step of every rank write it
        (each rank by one of them) while training goes on; one save at a time (dprun.background_saves)."""
        saves = self.saves
        if not saves.enabled or self.phase is not Phase.TRAINING or not saves.due(self.max_step, now):
            return
        ranks = range(self.spec.world_size)
        plan = self.ledger.plan(self.spec.world_size, set(), no_local=dict.fromkeys(ranks, ANY_STEP))
        if plan.lost or plan.step <= 0 or INIT in plan.sources.values() or not saves.due(plan.step, now):
            return
        if saves.in_flight is not None:
            if note := saves.skip(plan.step, now):
                self._publish("save_skipped", step=plan.step, message=note)
            return
        work = saves.begin(plan.step, str(step_folder(self.spec.save_dir, plan.step)), plan.sources, now)
        by_node: dict[str, list[int]] = {}
        for rank, holder in sorted(plan.sources.items()):
            by_node.setdefault(holder, []).append(rank)
        for node_id, node_ranks in by_node.items():
            self._send(node_id, p.SaveSnapshots(work.folder, work.step, node_ranks, world_size=self.spec.world_size,
                                                background=True, keep=saves.keep(self.spec.save_keep)))

    def _background_saved(self, outcome) -> None:
        """A background save ended (None: not yet): an event either way; a failure's line said once per kind."""
        if outcome is None:
            return
        fields = dict(step=outcome.step, folder=outcome.folder, bytes=outcome.nbytes,
                      seconds=round(outcome.seconds, 3), mb_per_s=round(outcome.mb_per_s, 1))
        if outcome.ok:
            self._publish("state_saved", **fields)
        else:
            self._publish("save_failed", **fields, why=outcome.why[:2000],
                          first=self.saves.first_time(outcome.why))

    def _save_elsewhere(self, rank: int, why: str) -> bool:
        """The source asked for `rank`'s file failed (`why`): ask the next one still alive. False: none is
        left (or files are read, which has no second source)."""
        work = self.files
        work.waiting.pop(rank, None)
        while work.saving and work.fallbacks.get(rank):
            node_id, local = work.fallbacks[rank].pop(0)
            if node_id in work.gone or (local and rank in work.dead_workers):
                continue
            self._publish("save_retried", rank=rank, node=node_id, local=local, why=why)
            self._ask_to_save(node_id, local, [rank])
            return True
        return False

    def _keeps_store(self, node) -> bool:
        """A node fenced for its worker's exit (its agent alive): with --save-dir its store stays, its workers
        stopped, until the recovery that replaced it completes or the job ends, so that a job that ends over
        it (the script's error on every rank, no spare left) can still save the copies it holds; meanwhile
        they serve that recovery's restores too (a worker lost on each node at once: each store kept the
        other's only copy)."""
        if not self.spec.save_dir or self.spec.restart_mode or self.phase is Phase.FORMING:
            return False
        node.keeps_store = True
        return True

    def _kept_heard(self, node, msg, now: float) -> bool:
        """A message from a fenced node whose store stays: True if taken (what shows it alive, its files)."""
        if isinstance(msg, (p.Heartbeat, p.Pong)):
            node.last_heard = now
            return True
        if isinstance(msg, p.SnapshotFiles):  # (one that comes after the save is dropped there)
            self._on_SnapshotFiles(node, msg, now)
            return True
        if isinstance(msg, p.Leaving):  # its agent stops after all (a signal of its own): its store goes with it
            self._kept_gone(node.node_id, f"its agent left the job: {msg.reason[:200]}", now)
            return True
        return False

    def _kept_gone(self, node_id: str, cause: str, now: float) -> None:
        """A fenced node whose store stayed was lost too: its copies with it. A rank that the recovery under way
        restores from it has its plan made again at once (its fetch from a dead store would wait out its
        timeout)."""
        self.table.nodes[node_id].keeps_store = False
        self.ledger.holder_lost(node_id)
        if self.files is not None:
            self._files_failed(node_id, cause)
        rec = self.recovery
        if rec is not None and not self.finished and any(holder == node_id and rank not in self.restores_answered
                                   for rank, holder in rec.sources.items()):
            self._replan(now, f"the store of {node_id}, which ranks restored from, was lost: {cause[:200]}")
            self._replanned_for_a_loss()

    def _release_kept(self, reason: str, code: int = 1) -> None:
        """Stop the fenced nodes whose stores stayed: no save needs them any more."""
        for node in self.table.with_role(FAILED):
            if node.keeps_store:
                node.keeps_store = False
                self.ledger.holder_lost(node.node_id)
                self._send(node.node_id, p.Stop(reason=reason, exit_code=code))

    def _load_first(self, folder: str, step: int) -> None:
        """Forming a resumed job: each node reads its own ranks' files into its replica store; the first
        generation starts from them once every node answered (`_files_done`)."""
        self._load(folder, step, 0, None)

    def _load_from_disk(self, folder: str, step: int, rec: Recovery) -> None:
        """A running job's recovery from disk (dprun.reconstruction): as a resume's load, into the stores of the
        new generation's nodes, its copies of that generation; `rec` goes on once every node answered."""
        self._load(folder, step, self.generation, rec)

    def _load(self, folder: str, step: int, generation: int, rec: Recovery | None) -> None:
        """Each node reads its own ranks' files into its replica store. Each node also reads the ranks it is a
        replica holder of, as it would hold their snapshots: a node lost before its first snapshot reached a peer
        is restored from the peer's copy. (Such a read that fails leaves that copy out only.)"""
        waiting = {rank: self.node_of_rank(rank) for rank in range(self.spec.world_size)}
        self.files = FileWork(False, folder, step, waiting, self.now + self.spec.files_timeout, recovery=rec)
        self._enter(Phase.LOADING)
        reads = {node_id: list(self.ranks_of(i)) for i, node_id in enumerate(self.layout)}
        for i, node_id in enumerate(self.layout):
            for holder in self.replica_holders(i):
                if holder != node_id:
                    reads.setdefault(holder, []).extend(self.ranks_of(i))
        for node_id, ranks in reads.items():
            self._send(node_id, p.LoadSnapshots(folder, step, ranks, generation))

    def _while_files(self, event, now: float) -> None:
        """Inputs while files are written or read: their answers and what keeps the nodes known alive count;
        a second stop, a lost node or the deadline end the wait."""
        work = self.files
        if isinstance(event, Received) and isinstance(event.msg, WAITING_FOR_FILES):
            self._received(event.node_id, event.msg, now)
        elif isinstance(event, Received) and isinstance(event.msg, p.WorkerExited):
            if (node := self.table.get(event.node_id)) is not None:
                self._worker_exit_said(node, event.msg)
            self._worker_lost(event.node_id, event.msg)
        elif isinstance(event, NodeGone):
            self._files_failed(event.node_id, event.cause)
        elif isinstance(event, Shutdown):
            work.errors.append(event.reason)
            work.hurried = True
            self._files_done()
        elif isinstance(event, Paused):
            self._paused(event.seconds, now)
        elif isinstance(event, Tick):
            if now >= work.deadline:
                work.hurried = True
                work.errors.append(f"{', '.join(sorted(set(work.waiting.values())))} did not answer within "
                                   f"{self.spec.files_timeout:g} s")
                self._files_done()
                return
            for node_id in self._silent_while_files(now):
                self._files_failed(node_id, f"no heartbeat for {now - self.table.nodes[node_id].last_heard:.1f} s")
                if self.files is not work:
                    return
            self._ping_due(now)

    def _silent_while_files(self, now: float) -> list[str]:
        """Nodes not heard from for the heartbeat timeout during the wait (a node killed while it writes: its
        files are asked elsewhere at once rather than at the files' deadline), each named once."""
        return sorted(n.node_id for n in self.table.nodes.values()
                      if n.node_id not in self.files.gone and now - n.last_heard > self.spec.heartbeat_timeout
                      and (n.role != FAILED or n.keeps_store))

    def _worker_lost(self, node_id: str, msg: p.WorkerExited) -> None:
        """A worker ended while files are written or read: a resume fails if it failed; a save asks the next
        source for its rank if that worker was to write it, even one that finished (exit 0) first: it will not
        answer (a replica store's copy does not need its node's workers)."""
        node, work = self.table.get(node_id), self.files
        rank = self.rank_of(node, msg.local_rank) if node is not None else p.NO_RANK
        if msg.exitcode == 0 and not (work.saving and rank in work.local):
            return
        if work.recovery is not None:
            self._load_interrupted(node_id, p.describe_exit(msg.exitcode), msg)
            return
        work.dead_workers.add(rank)
        how = p.describe_exit(msg.exitcode) + (" before it wrote its file" if msg.exitcode == 0 else "")
        if not work.saving or (rank in work.local and work.waiting.get(rank) == node_id):
            self._files_lost([rank], f"{node_id}: its worker {msg.local_rank} {how}")

    def _files_failed(self, node_id: str, cause: str) -> None:
        """A node was lost while files are written (its ranks' files are asked of the next source) or read
        (the resume fails; a recovery's read is abandoned: `_load_interrupted`)."""
        if self.files.recovery is not None:
            self._load_interrupted(node_id, cause)
            return
        self.files.gone.add(node_id)
        self.ledger.holder_lost(node_id)
        lost = [rank for rank, node in self.files.waiting.items() if node == node_id]
        if lost or not self.files.saving:
            self._files_lost(lost, f"{node_id} failed: {cause}")

    def _load_interrupted(self, node_id: str, cause: str, exited: p.WorkerExited | None = None) -> None:
        """A node (or a worker) was lost while a recovery's files were read: the read is abandoned and the recovery
        carries on as one that a failure interrupted: the loss handled as any other (the node fenced, every node
        probed), then a plan made again (from the copies read so far, or the disk once more), or the job ended
        for want of a spare. A node fenced before the read (a store kept for a save) read nothing: the read goes
        on."""
        work, node = self.files, self.table.get(node_id)
        work.gone.add(node_id)
        if node is None or node.role == FAILED:
            self.ledger.holder_lost(node_id)
            return
        self.files, self.recovery = None, work.recovery  # (the loss carries it on: _open_pending)
        self._enter(Phase.RECOVERING)
        if exited is not None:
            self._received(node_id, exited, self.now)
        else:
            self._node_failed(node_id, cause, self.now)
        if self.pending is None and not self.finished:  # (a spare that held none of the last generation's copies)
            self._replan(self.now, f"{node_id} was lost while the recovery's files were read: {cause[:200]}")
            self._replanned_for_a_loss()

    def _files_lost(self, ranks: list[int], why: str) -> None:
        work = self.files
        if not ranks or not all([self._save_elsewhere(rank, why) for rank in ranks]):
            work.errors.append(why)
        if not work.saving or not work.waiting:
            self._files_done()

    def _on_SnapshotFiles(self, node, msg: p.SnapshotFiles, now: float) -> None:
        work = self.files
        background = self.saves.in_flight is not None and msg.step == self.saves.in_flight.step
        if background:  # (a save on stop of the same step counts a file it wrote too)
            self._background_saved(self.saves.answered(node.node_id, msg.step, msg.results, now))
        if work is None or msg.step != work.step:
            if not background:
                self._drop("unexpected SnapshotFiles")
            return
        for rank_text, error in msg.results.items():
            rank = int(rank_text)
            if work.waiting.get(rank) != node.node_id:
                continue
            if not error:
                del work.waiting[rank]
                work.done.append(rank)
                continue
            if error.startswith(CANNOT_WRITE):  # (its other sources are still asked: they may see other disks)
                work.refused = True
            elif self.ledger.newest_held_by(rank, node.node_id) > work.step:
                # trained past (its newer copy reported before this answer): so did the rank's worker and its
                # other stores; this node stopped its workers for the save, and a newer step is tried instead
                del work.waiting[rank]
                work.passed.append(rank)
                continue
            if not self._save_elsewhere(rank, f"{node.node_id}: {error}"):
                work.errors.append(f"{node.node_id}: {error}")
        if not work.waiting:
            self._files_done()

    def _files_done(self) -> None:
        work, self.files = self.files, None
        complete = sorted(work.done) == list(range(self.spec.world_size)) and not work.errors
        passed = [f"the workers trained on past it (ranks {sorted(work.passed)})"] if work.passed else []
        missing = sorted(set(range(self.spec.world_size)) - set(work.done))
        why = "; ".join(work.errors + passed) or f"ranks {missing} missing"
        if work.saving and complete:
            self.saved_in = work.folder
            self._finish(work.code, f"{work.message}; the state of step {work.step} is saved in {work.folder} "
                                    f"(go on from it: dprun ... --resume-from {work.folder})")
        elif work.saving:
            said = f"{work.message}; saving the state of step {work.step} in {work.folder} failed: {why}"
            if not (work.hurried or work.refused):  # another step instead, if every rank still has a copy of one:
                # a newer one where workers trained on past the copies asked (reported since; the nodes asked
                # stopped their workers for the save), else an older one. Forgetting a step's copies is safe only
                # because the job is ending: no recovery plans with the ledger after a save, and the stores keep
                # the copies
                self.ledger.forget(work.step)
                self.saved = False
                said = self._save_first(work.code, said, before=work)
            if said is not None:
                self._finish(work.code, said)
        elif not complete and work.recovery is None and self.resume_older:  # a damaged file: the step before
            (folder, step), self.resume_older = self.resume_older[0], self.resume_older[1:]
            self._publish("resume_fallback", folder=work.folder, step=work.step, why=why[:2000], next=folder,
                          next_step=step)
            self.ledger.forget(work.step)
            self.resumed_from, self.saves.safe = folder, (folder, step)
            self._load_first(folder, step)
        elif not complete and work.recovery is not None:
            self._finish(1, f"state lost: the failed nodes {work.recovery.failed} took the last copies in memory "
                            f"with them, and restoring every rank from {work.folder} failed: {why}")
        elif not complete:
            self._finish(1, f"cannot resume from {work.folder}: {why}")
        elif work.recovery is not None:
            self._disk_loaded(work.recovery, work.step)
        else:  # each rank restores from its own node's store
            self._start_first_generation(work.step, {r: self.node_of_rank(r) for r in range(self.spec.world_size)})

    def _disk_loaded(self, rec: Recovery, step: int) -> None:
        """A recovery from disk: every node's store holds its ranks' files; the generation starts from them."""
        rec.sources = {rank: self.node_of_rank(rank) for rank in range(self.spec.world_size)}
        self._fire_faults(self.now, recovering=True)
        self._reconfigure_all(step, rec.sources, reason="recovery from disk")
        self._publish("reconfigure", generation=self.generation, restore_step=step, layout=list(self.layout),
                      decide_s=round(self.now - rec.t_detect, 4))
        self.recovery = rec
        self._enter(Phase.RECOVERING)
