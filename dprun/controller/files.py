"""Files: a stopping job's state written to disk by the nodes that hold it (--save-dir), and a resumed job's
read back into its nodes' replica stores (--resume-from), so that the state outlives the job; background saves.

A part that the controller composes: it owns the file work in flight and what was saved or resumed from; it is
handed the spec, the node table, the ledger, the timeline, the background saves, the outbox and how to enter a
phase. While files are written or read, the controller waits for them and little else; how the wait ended
(`outcome`) comes back as a value. A node fenced for its worker's exit keeps its store, for the recovery's restores
and for such a save, until it is no longer needed (`keeps_store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from dpcommon import protocol as p
from dpcommon.snapshot_files import CANNOT_WRITE, step_folder

from .background_saves import BackgroundSaves, SaveOutcome
from .vocabulary import JobSpec, Outbox, Recovery
from .ledger import INIT, ReplicaLedger
from .nodes import FAILED, SPARE, Node, NodeTable
from .phase import Phase
from .timeline import Timeline

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



@dataclass(frozen=True)
class FilesEnd:
    """The job ends, with this exit code and message (the files written, or why not)."""

    code: int
    message: str


@dataclass(frozen=True)
class FilesRead:
    """Every node's store holds its ranks' files of `step`: `recovery` goes on from them (None: a resume starts)."""

    step: int
    recovery: Recovery | None


class FilesControl(Protocol):
    """What the files part asks of the job as a wait ends or breaks off."""

    def finish_job(self, code: int, message: str) -> None: ...

    def go_on_from_files(self, step: int, recovery: Recovery | None) -> None:
        """Every node's store holds its ranks' files of `step`: `recovery` goes on (None: a resume starts)."""

    def read_interrupted(self, node_id: str, cause: str, exited: p.WorkerExited | None) -> None:
        """A node (or a worker) was lost while a recovery's files were read."""


class StateFiles:
    def __init__(self, spec: JobSpec, table: NodeTable, ledger: ReplicaLedger, timeline: Timeline,
                 saves: BackgroundSaves, out: Outbox, enter: Callable[[Phase], None], control: FilesControl):
        self.spec, self.table, self.ledger, self.timeline, self.saves = spec, table, ledger, timeline, saves
        self.out, self.enter, self.control = out, enter, control
        self.work: FileWork | None = None  # snapshot files being written (the job ends) or read (it resumes)
        self.saved = False  # the state was saved (or there was none to save): the job ends as it is
        self.saved_in = ""  # the step folder that save wrote, once every rank's file is there
        self.resumed_from = spec.resume_from  # the step folder a resumed job goes on from (an older one if that was
        # found damaged when read)
        self.resume_older = list(spec.resume_older)  # complete steps to go on from should the newest be damaged

    def save_first(self, code: int, message: str, forming: bool, now: float,
                   before: FileWork | None = None) -> str | None:
        """A job about to end with an error or a signal, with --save-dir: ask for the newest step that every
        rank can still come back to to be written: by the replica stores that hold it, or where a rank's every
        replica died with its holder, by its worker from its local copy. None: the job ends once they answered;
        else the message to end with now (nothing to save). `before`: a save of a newer step that failed (the
        workers and nodes it lost are not asked again)."""
        if code == 0 or not self.spec.save_dir or self.saved or forming or self.spec.restart_mode:
            return message
        self.saved = True
        timeline = self.timeline
        gone, dead = (before.gone, before.dead_workers) if before else (set(), set())
        failed = {r for i, n in enumerate(timeline.layout) if self.table.nodes[n].role == FAILED or n in gone
                  for r in timeline.ranks_of(i)} | timeline.unrestored | dead
        # the newest step that stores hold for every rank: they need no worker (a stopping job's are often dying:
        # the script's error, scancel's signal); else the newest step counting workers' own local copies
        ranks = range(self.spec.world_size)
        plan = self.ledger.plan(self.timeline.keys(), failed, no_local=dict.fromkeys(ranks, ANY_STEP))
        if plan.lost or plan.step <= 0:
            plan = self.ledger.plan(self.timeline.keys(), failed, timeline.survivor_floors(self.ledger))
        if plan.lost or plan.step <= 0 or INIT in plan.sources.values():
            if before is not None:  # (what failed is said above, for each step tried)
                return f"{message}; no other step of which every rank has a copy is left to try"
            return f"{message}; no step of which every rank has a copy was left to save"
        folder = str(step_folder(self.spec.save_dir, plan.step))
        deadline = before.deadline if before else now + self.spec.files_timeout  # for every step tried
        work = self.work = FileWork(True, folder, plan.step, {}, deadline, code=code,
                                    message=message, gone=set(gone), dead_workers=set(dead))
        self.enter(Phase.SAVING)
        first: dict[tuple[str, bool], list[int]] = {}
        for rank, planned in sorted(plan.sources.items()):
            holders = sorted(self.ledger.holders_of(rank, plan.step), key=lambda holder: holder != planned)
            sources = [(holder, False) for holder in holders]  # a store's copy first: it needs no worker
            if rank not in failed:
                sources.append((timeline.node_of_rank(rank), True))
            first.setdefault(sources[0], []).append(rank)
            work.fallbacks[rank] = sources[1:]
        for (node_id, local), node_ranks in first.items():
            self._ask_to_save(work, node_id, local, node_ranks)
        self.out.publish("saving_state", step=plan.step, folder=folder, ranks=len(work.waiting))
        return None

    def _ask_to_save(self, work: FileWork, node_id: str, local: bool, ranks: list[int]) -> None:
        for rank in ranks:
            work.waiting[rank] = node_id
            (work.local.add if local else work.local.discard)(rank)
        self.out.send(node_id, p.SaveSnapshots(work.folder, work.step, ranks, local=local,
                                               world_size=self.spec.world_size))

    def save_if_due(self, now: float, training: bool) -> None:
        """--save-every / --save-interval: once due, the stores holding the newest step of every rank write it
        (each rank by one of them) while training goes on; one save at a time (dprun.controller.background_saves)."""
        saves = self.saves
        if not saves.enabled or not training or not saves.due(self.timeline.max_step, now):
            return
        ranks = range(self.spec.world_size)
        plan = self.ledger.plan(self.timeline.keys(), set(), no_local=dict.fromkeys(ranks, ANY_STEP))
        if plan.lost or plan.step <= 0 or INIT in plan.sources.values() or not saves.due(plan.step, now):
            return
        if saves.in_flight is not None:
            if note := saves.skip(plan.step, now):
                self.out.publish("save_skipped", step=plan.step, message=note)
            return
        work = saves.begin(plan.step, str(step_folder(self.spec.save_dir, plan.step)), plan.sources, now)
        by_node: dict[str, list[int]] = {}
        for rank, holder in sorted(plan.sources.items()):
            by_node.setdefault(holder, []).append(rank)
        for node_id, node_ranks in by_node.items():
            self.out.send(node_id, p.SaveSnapshots(work.folder, work.step, node_ranks,
                                                   world_size=self.spec.world_size, background=True,
                                                   keep=saves.keep(self.spec.save_keep)))

    def background_saved(self, outcome: SaveOutcome | None) -> None:
        """A background save ended (None: not yet): an event either way; a failure's line said once per kind."""
        if outcome is None:
            return
        fields = dict(step=outcome.step, folder=outcome.folder, bytes=outcome.nbytes,
                      seconds=round(outcome.seconds, 3), mb_per_s=round(outcome.mb_per_s, 1))
        if outcome.ok:
            self.out.publish("state_saved", **fields)
        else:
            self.out.publish("save_failed", **fields, why=outcome.why[:2000],
                             first=self.saves.first_time(outcome.why))

    def _save_elsewhere(self, work: FileWork, rank: int, why: str) -> bool:
        """The source asked for `rank`'s file failed (`why`): ask the next one still alive. False: none is
        left (or files are read, which has no second source)."""
        work.waiting.pop(rank, None)
        while work.saving and work.fallbacks.get(rank):
            node_id, local = work.fallbacks[rank].pop(0)
            if node_id in work.gone or (local and rank in work.dead_workers):
                continue
            self.out.publish("save_retried", rank=rank, node=node_id, local=local, why=why)
            self._ask_to_save(work, node_id, local, [rank])
            return True
        return False

    def keeps_store(self, node: Node, forming: bool) -> bool:
        """A node fenced for its worker's exit (its agent alive): its store stays, its workers stopped, until
        the recovery that replaced it completes or the job ends. Its copies serve that recovery's restores (a
        worker lost on each node of a ring of 2: each store kept the other's only copy), and with --save-dir a
        job that ends over it (the script's error on every rank, no spare left) can still save them."""
        if self.spec.restart_mode or forming:
            return False
        node.keeps_store = True
        return True

    def release_kept(self, reason: str, code: int = 1) -> None:
        """Stop the fenced nodes whose stores stayed: no save needs them any more."""
        for node in self.table.with_role(FAILED):
            if node.keeps_store:
                node.keeps_store = False
                self.ledger.holder_lost(node.node_id)
                self.out.send(node.node_id, p.Stop(reason=reason, exit_code=code))

    def kept_gone(self, node_id: str, cause: str, now: float) -> None:
        """A fenced node whose store stayed was lost too: its copies with it (a save asks the next source)."""
        self.table.nodes[node_id].keeps_store = False
        self.ledger.holder_lost(node_id)
        if self.work is not None:
            self.node_failed(node_id, cause, now)

    def load(self, folder: str, step: int, generation: int, rec: Recovery | None, now: float) -> None:
        """Each node reads its own ranks' files into its replica store: a resumed job's first generation (0, no
        `rec`) or a running job's recovery from disk (into the new generation's stores; `rec` goes on once every
        node answered). Each node also reads the ranks it is a replica holder of, as it would hold their
        snapshots: a node lost before its first snapshot reached a peer is restored from the peer's copy. (Such
        a read that fails leaves that copy out only.)"""
        timeline = self.timeline
        waiting = {rank: timeline.node_of_rank(rank) for rank in range(self.spec.world_size)}
        self.work = FileWork(False, folder, step, waiting, now + self.spec.files_timeout, recovery=rec)
        self.enter(Phase.LOADING)
        reads = {node_id: list(timeline.ranks_of(i)) for i, node_id in enumerate(timeline.layout)}
        spares = [node.node_id for node in self.table.with_role(SPARE)]
        for i, node_id in enumerate(timeline.layout):
            for holder in timeline.replica_holders(i, self.spec.replicas, spares):
                if holder != node_id:
                    reads.setdefault(holder, []).extend(timeline.ranks_of(i))
        for node_id, ranks in reads.items():
            self.out.send(node_id, p.LoadSnapshots(folder, step, ranks, generation))

    def abandon(self) -> FileWork:
        """The read is abandoned (a node lost while a recovery's files were read): its work, ended."""
        work, self.work = self.work, None
        assert work is not None
        return work

    def pause(self, seconds: float) -> None:
        if self.work is not None:
            self.work.deadline += seconds

    def silent(self, now: float) -> list[str]:
        """Nodes not heard from for the heartbeat timeout during the wait (a node killed while it writes: its
        files are asked elsewhere at once rather than at the files' deadline), each named once."""
        assert self.work is not None
        gone = self.work.gone
        return sorted(n.node_id for n in self.table.nodes.values()
                      if n.node_id not in gone and now - n.last_heard > self.spec.heartbeat_timeout
                      and (n.role != FAILED or n.keeps_store))

    def stop(self, why: str, now: float) -> None:
        """Out of time (a second stop): the wait ends with what was written."""
        assert self.work is not None
        self.work.errors.append(why)
        self.work.hurried = True
        self._done(now)

    def tick(self, now: float) -> bool:
        """The deadline ends the wait; a node silent for the heartbeat timeout is lost (its files are asked
        elsewhere at once). True: the wait goes on."""
        work = self.work
        assert work is not None
        if now >= work.deadline:
            self.stop(f"{', '.join(sorted(set(work.waiting.values())))} did not answer within "
                      f"{self.spec.files_timeout:g} s", now)
            return False
        for node_id in self.silent(now):
            self.node_failed(node_id, f"no heartbeat for {now - self.table.nodes[node_id].last_heard:.1f} s", now)
            if self.work is not work:
                return False
        return True

    def worker_exited(self, node_id: str, msg: p.WorkerExited, now: float) -> None:
        """A worker ended while files are written or read: a resume fails if it failed; a save asks the next
        source for its rank if that worker was to write it, even one that finished (exit 0) first: it will not
        answer (a replica store's copy does not need its node's workers)."""
        node, work = self.table.get(node_id), self.work
        assert work is not None
        rank = self.timeline.rank_of(node, msg.local_rank) if node is not None else p.NO_RANK
        if msg.exitcode == 0 and not (work.saving and rank in work.local):
            return
        if work.recovery is not None:
            self.control.read_interrupted(node_id, p.describe_exit(msg.exitcode), msg)
            return
        work.dead_workers.add(rank)
        how = p.describe_exit(msg.exitcode) + (" before it wrote its file" if msg.exitcode == 0 else "")
        if not work.saving or (rank in work.local and work.waiting.get(rank) == node_id):
            self._files_lost(work, [rank], f"{node_id}: its worker {msg.local_rank} {how}", now)

    def node_failed(self, node_id: str, cause: str, now: float) -> None:
        """A node was lost while files are written (its ranks' files are asked of the next source) or read (the
        resume fails; a recovery's read is abandoned: FilesControl.read_interrupted)."""
        work = self.work
        assert work is not None
        if work.recovery is not None:
            self.control.read_interrupted(node_id, cause, None)
            return
        work.gone.add(node_id)
        self.ledger.holder_lost(node_id)
        lost = [rank for rank, node in work.waiting.items() if node == node_id]
        if lost or not work.saving:
            self._files_lost(work, lost, f"{node_id} failed: {cause}", now)

    def _files_lost(self, work: FileWork, ranks: list[int], why: str, now: float) -> None:
        if not ranks or not all([self._save_elsewhere(work, rank, why) for rank in ranks]):
            work.errors.append(why)
        if not work.saving or not work.waiting:
            self._done(now)

    def snapshot_files(self, node_id: str, msg: p.SnapshotFiles, now: float) -> bool:
        """A node's SnapshotFiles, for a background save or the wait (False: for neither)."""
        background = self.saves.in_flight is not None and msg.step == self.saves.in_flight.step
        if background:  # (a save on stop of the same step counts a file it wrote too)
            self.background_saved(self.saves.answered(node_id, msg.step, msg.results, now))
        work = self.work
        if work is None or msg.step != work.step:
            return background
        for rank_text, error in msg.results.items():
            rank = int(rank_text)
            if work.waiting.get(rank) != node_id:
                continue
            if not error:
                del work.waiting[rank]
                work.done.append(rank)
                continue
            if error.startswith(CANNOT_WRITE):  # (its other sources are still asked: they may see other disks)
                work.refused = True
            elif self.ledger.newest_held_by(rank, node_id) > work.step:
                # trained past (its newer copy reported before this answer): so did the rank's worker and its
                # other stores; this node stopped its workers for the save, and a newer step is tried instead
                del work.waiting[rank]
                work.passed.append(rank)
                continue
            if not self._save_elsewhere(work, rank, f"{node_id}: {error}"):
                work.errors.append(f"{node_id}: {error}")
        if not work.waiting:
            self._done(now)
        return True

    def _done(self, now: float) -> None:
        outcome = self._outcome(now)
        if isinstance(outcome, FilesEnd):
            self.control.finish_job(outcome.code, outcome.message)
        elif isinstance(outcome, FilesRead):
            self.control.go_on_from_files(outcome.step, outcome.recovery)

    def _outcome(self, now: float) -> FilesEnd | FilesRead | None:
        """The wait is over: how the job goes on (None: another step is written or read instead)."""
        work, self.work = self.work, None
        assert work is not None
        complete = sorted(work.done) == list(range(self.spec.world_size)) and not work.errors
        passed = [f"the workers trained on past it (ranks {sorted(work.passed)})"] if work.passed else []
        missing = sorted(set(range(self.spec.world_size)) - set(work.done))
        why = "; ".join(work.errors + passed) or f"ranks {missing} missing"
        if work.saving and complete:
            self.saved_in = work.folder
            return FilesEnd(work.code, f"{work.message}; the state of step {work.step} is saved in {work.folder} "
                                       f"(go on from it: dprun ... --resume-from {work.folder})")
        if work.saving:
            said = f"{work.message}; saving the state of step {work.step} in {work.folder} failed: {why}"
            if not (work.hurried or work.refused):  # another step instead, if every rank still has a copy of one:
                # a newer one where workers trained on past the copies asked (reported since; the nodes asked
                # stopped their workers for the save), else an older one. Forgetting a step's copies is safe only
                # because the job is ending: no recovery plans with the ledger after a save, and the stores keep
                # the copies
                self.ledger.forget(work.step)
                self.saved = False
                again = self.save_first(work.code, said, False, now, before=work)
                return None if again is None else FilesEnd(work.code, again)
            return FilesEnd(work.code, said)
        if not complete and work.recovery is None and self.resume_older:  # a damaged file: the step before
            (folder, step), self.resume_older = self.resume_older[0], self.resume_older[1:]
            self.out.publish("resume_fallback", folder=work.folder, step=work.step, why=why[:2000], next=folder,
                             next_step=step)
            self.ledger.forget(work.step)
            self.resumed_from, self.saves.safe = folder, (folder, step)
            self.load(folder, step, 0, None, now)
            return None
        if not complete and work.recovery is not None:
            return FilesEnd(1, f"state lost: the failed nodes {work.recovery.failed} took the last copies in memory "
                               f"with them, and restoring every rank from {work.folder} failed: {why}")
        if not complete:
            return FilesEnd(1, f"cannot resume from {work.folder}: {why}")
        return FilesRead(work.step, work.recovery)
