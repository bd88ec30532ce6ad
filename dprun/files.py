"""Files: a stopping job's state written to disk by the nodes that hold it (--save-dir), and a resumed job's
read back into its nodes' replica stores (--resume-from), so that the state outlives the job.

A part of the Controller state machine (it inherits this), kept apart so each file reads in one sitting.
While files are written or read, the controller waits for them and little else (`_while_files`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpagent import protocol as p
from dpagent.snapshot_files import step_folder

from .controller_io import NodeGone, Received, Shutdown, Tick
from .ledger import INIT
from .nodes import FAILED

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
    done: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    code: int = 0  # saving: how the job ends once the files are written
    message: str = ""


class Files:
    """The files half of dprun.controller.Controller (its state lives there: files, saved, now)."""

    def _save_first(self, code: int, message: str) -> str | None:
        """A job about to end with an error or a signal, with --save-dir: ask for the newest step that every
        rank can still come back to to be written: by the replica stores that hold it, or where a rank's every
        replica died with its holder, by its worker from its local copy. None: the job ends once they answered;
        else the message to end with now (nothing to save)."""
        if code == 0 or not self.spec.save_dir or self.saved or self.generation < 0 or self.spec.restart_mode:
            return message
        self.saved = True
        failed = {r for i, n in enumerate(self.layout) if self.table.nodes[n].role == FAILED
                  for r in self.ranks_of(i)} | self.unrestored
        plan = self.ledger.plan(self.spec.world_size, failed, self._survivor_floors())
        if plan.lost or plan.step <= 0 or INIT in plan.sources.values():
            return f"{message}; no step of which every rank has a copy was left to save"
        folder = str(step_folder(self.spec.save_dir, plan.step))
        stores: dict[str, list[int]] = {}
        workers: dict[str, list[int]] = {}
        for rank, holder in sorted(plan.sources.items()):
            holder = holder or next(iter(self.ledger.holders_of(rank, plan.step)), "")  # a store's copy first
            if holder:
                stores.setdefault(holder, []).append(rank)
            else:
                workers.setdefault(self.node_of_rank(rank), []).append(rank)
        waiting = {rank: node for asked in (stores, workers) for node, ranks in asked.items() for rank in ranks}
        self.files = FileWork(True, folder, plan.step, waiting, self.now + self.spec.files_timeout,
                              local={rank for ranks in workers.values() for rank in ranks}, code=code, message=message)
        for asked, local in ((stores, False), (workers, True)):
            for node_id, ranks in asked.items():
                self._send(node_id, p.SaveSnapshots(folder, plan.step, ranks, local=local))
        self._publish("saving_state", step=plan.step, folder=folder, ranks=len(waiting))
        return None

    def _load_first(self) -> None:
        """Forming a resumed job: each node reads its own ranks' files into its replica store; the first
        generation starts from them once every node answered (`_files_done`)."""
        folder, step = self.spec.resume_from, self.spec.resume_step
        waiting = {rank: self.node_of_rank(rank) for rank in range(self.spec.world_size)}
        self.files = FileWork(False, folder, step, waiting, self.now + self.spec.files_timeout)
        for i, node_id in enumerate(self.layout):
            self._send(node_id, p.LoadSnapshots(folder, step, list(self.ranks_of(i))))

    def _while_files(self, event, now: float) -> None:
        """Inputs while files are written or read: their answers and what keeps the nodes known alive count;
        a second stop, a lost node or the deadline end the wait."""
        work = self.files
        if isinstance(event, Received) and isinstance(event.msg, WAITING_FOR_FILES):
            self._received(event.node_id, event.msg, now)
        elif isinstance(event, Received) and isinstance(event.msg, p.WorkerExited) and event.msg.exitcode:
            self._worker_lost(event.node_id, event.msg)
        elif isinstance(event, NodeGone):
            self._files_failed(event.node_id, event.cause)
        elif isinstance(event, Shutdown):
            work.errors.append(event.reason)
            self._files_done()
        elif isinstance(event, Tick):
            if now >= work.deadline:
                work.errors.append(f"{', '.join(sorted(set(work.waiting.values())))} did not answer within "
                                   f"{self.spec.files_timeout:g} s")
                self._files_done()
            else:
                self._ping_due(now)

    def _worker_lost(self, node_id: str, msg: p.WorkerExited) -> None:
        """A worker failed while files are written or read: a resume fails; a save loses the rank only if that
        worker was to write it (a replica store's copy does not need its node's workers)."""
        node, work = self.table.get(node_id), self.files
        rank = self.ranks_of(node.node_rank)[msg.local_rank] if node is not None and node.node_rank >= 0 else -1
        if not work.saving or (rank in work.local and work.waiting.get(rank) == node_id):
            self._files_lost([rank], f"{node_id}: its worker {msg.local_rank} {p.describe_exit(msg.exitcode)}")

    def _files_failed(self, node_id: str, cause: str) -> None:
        """A node was lost while files are written (its ranks' files are) or read (the resume fails)."""
        lost = [rank for rank, node in self.files.waiting.items() if node == node_id]
        if lost or not self.files.saving:
            self._files_lost(lost, f"{node_id} failed: {cause}")

    def _files_lost(self, ranks: list[int], why: str) -> None:
        work = self.files
        for rank in ranks:
            work.waiting.pop(rank, None)
        work.errors.append(why)
        if not work.saving or not work.waiting:
            self._files_done()

    def _on_SnapshotFiles(self, node, msg: p.SnapshotFiles, now: float) -> None:
        work = self.files
        if work is None or msg.step != work.step:
            self._drop("unexpected SnapshotFiles")
            return
        for rank_text, error in msg.results.items():
            if work.waiting.get(int(rank_text)) != node.node_id:
                continue
            del work.waiting[int(rank_text)]
            if error:
                work.errors.append(f"{node.node_id}: {error}")
            else:
                work.done.append(int(rank_text))
        if not work.waiting:
            self._files_done()

    def _files_done(self) -> None:
        work, self.files = self.files, None
        complete = sorted(work.done) == list(range(self.spec.world_size)) and not work.errors
        why = "; ".join(work.errors) or f"ranks {sorted(set(range(self.spec.world_size)) - set(work.done))} missing"
        if work.saving:
            said = (f"the state of step {work.step} is saved in {work.folder} (go on from it: dprun ... "
                    f"--resume-from {work.folder})" if complete else
                    f"saving the state of step {work.step} in {work.folder} failed: {why}")
            self._finish(work.code, f"{work.message}; {said}")
        elif not complete:
            self._finish(1, f"cannot resume from {work.folder}: {why}")
        else:  # each rank restores from its own node's store
            self._start_first_generation(work.step, {r: self.node_of_rank(r) for r in range(self.spec.world_size)})
