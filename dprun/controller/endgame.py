"""The job's end game: ranks that finished job.steps(), workers that have still to exit after, ranks whose state
differed from their peers', and why a job whose ranks had exited cannot recover.

A part that the controller composes: it owns those records; it is handed the spec, the node table, the timeline
and the outbox. The end it finds due it returns as a message; the controller ends the job with it.
"""

from __future__ import annotations

from .vocabulary import JobSpec, Outbox, Recovery
from .nodes import Node, NodeTable
from .timeline import Timeline

EXIT_NOTE_EVERY_S = 30.0  # workers not exited this long after training finished, and as often: "waiting_for_exit"


class Endgame:
    def __init__(self, spec: JobSpec, table: NodeTable, timeline: Timeline, out: Outbox):
        self.spec, self.table, self.timeline, self.out = spec, table, timeline, out
        self.finished_ranks: dict[int, int] = {}  # rank -> its last step, once past job.steps()' final barrier
        self.all_finished_at: float | None = None  # when the last rank passed it: then the job waits for exits
        self.exit_notes = 0  # how often it said which workers the finished job still waits for
        self.diverged: dict[int, int] = {}  # rank -> the step at which a holder found it unlike its peers
        self.finished_in = -1  # the newest generation a rank finished in (passed job.steps()' final barrier)

    def rank_finished(self, rank: int, step: int, now: float, generation: int) -> None:
        """The job ends when every active worker has exited 0 (as with torchrun); RankFinished tells a rank that
        finished job.steps() from one that exited 0 early, should the others fail without it."""
        self.finished_ranks[rank] = step
        self.finished_in = max(self.finished_in, generation)
        if self.all_finished_at is None and len(self.finished_ranks) == self.timeline.width.processes:
            self.all_finished_at = now

    def worker_finished(self, node: Node, local_rank: int, now: float,
                        rec: Recovery | None) -> tuple[int, str] | None:
        """An active node's worker exited 0 (its final barrier passed, in any generation): how the job ends, if
        it ends now (every rank exited 0; or a recovery under way, `rec`, can never complete)."""
        node.exited_ok.add(local_rank)
        if self.spec.restart_mode and self.all_finished_at is None:  # no RankFinished: a first exit 0 says it
            self.all_finished_at = now
        if rec is not None and rec.failed:  # the job ended under a recovery that now can never complete
            return 1, self.after_exits(rec, max(rec.peak_step, self.timeline.max_step))
        if rec is not None and self.finished_in == self.timeline.generation - 1 and rec.promoted:
            # a grow that came as the narrow job passed its final barrier (its Reconfigure found those workers
            # gone): training is complete once the narrow generation's workers exited, the joining node's unused
            grown = set(rec.promoted.values())
            if all(len(self.table.nodes[n].exited_ok) == self.spec.nproc_per_node
                   for n in self.timeline.layout if n not in grown):
                return 0, (f"all {self.spec.world_size} ranks finished (trained narrow to the end: the job ended "
                           f"before {', '.join(sorted(grown))} could take its ranks back){self.divergence_note()}")
        if all(len(self.table.nodes[n].exited_ok) == self.spec.nproc_per_node for n in self.timeline.layout):
            return 0, f"all {self.spec.world_size} ranks finished{self.narrow_note()}{self.divergence_note()}"
        return None

    def rank_diverged(self, node_id: str, rank: int, step: int, blocks: list[int]) -> None:
        if rank not in self.diverged:
            self.diverged[rank] = step
            self.out.publish("divergence", node=node_id, rank=rank, step=step, blocks=blocks)

    def narrow_note(self) -> str:
        width = self.timeline.width
        return f" (trained by {width.processes} processes: the job shrank)" if width.narrow else ""

    def divergence_note(self) -> str:
        if not self.diverged:
            return ""
        ranks = sorted(self.diverged)
        named = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        return (f"; but the parameters or optimizer state of rank(s) {named} differed from a data parallel peer's "
                f"(first at step {min(self.diverged.values())}): a faulty GPU or memory on one of their nodes, or "
                "code that changes one rank's copy only; do not trust a model saved from them")

    def pause(self, seconds: float, now: float) -> None:
        """Nor is a worker blamed for not exiting after training finished while the controller did not run."""
        if self.all_finished_at is not None:
            self.all_finished_at = min(now, self.all_finished_at + seconds)

    def waiting_for_exit(self, now: float) -> str | None:
        """Every rank finished job.steps() (in restart mode: a worker exited 0), and some workers have not exited
        yet (what a script does after its loop, a final save, say): said every EXIT_NOTE_EVERY_S; past
        --hang-timeout the job ends with exit 1 (its message; not in restart mode, where dprun waits as torchrun
        does)."""
        assert self.all_finished_at is not None
        spec, nodes = self.spec, self.table.nodes
        running = [(rank, node_id) for rank, node_id, local in self.timeline.placed()
                   if local not in nodes[node_id].exited_ok]
        waited = now - self.all_finished_at
        names = ", ".join(f"rank {rank} on {node_id}{self._pid_of(node_id, rank)}" for rank, node_id in running)
        timeout = 0.0 if spec.restart_mode else spec.hang_timeout
        if timeout > 0 and waited > timeout:
            return (f"training completed (step {max(self.finished_ranks.values())}), but {names} did not "
                    f"exit within {spec.hang_timeout:g} s of it (--hang-timeout); stopped: what the "
                    "script does after job.steps() (a final save?) may not have completed")
        if waited >= (self.exit_notes + 1) * EXIT_NOTE_EVERY_S:
            self.exit_notes += 1
            self.out.publish("waiting_for_exit", ranks=[rank for rank, _ in running], workers=names,
                             since="a worker exited 0" if spec.restart_mode else "training finished",
                             waited_s=round(waited), timeout_s=timeout)
        return None

    def _pid_of(self, node_id: str, rank: int) -> str:
        """" (pid N)" for a rank's worker as its node's last heartbeat told it, or "" where it did not."""
        status = self.table.nodes[node_id].workers.get(str(rank % self.spec.nproc_per_node))
        return f" (pid {status.pid})" if status is not None and status.pid else ""

    def after_exits(self, rec: Recovery, step: int) -> str:
        """Why the job ends: `rec`'s failures came after some ranks had exited 0. After job.steps()' final barrier
        (RankFinished) training is complete; a rank that exited 0 without it left its peers mid-training."""
        nodes = self.table.nodes
        early = sorted(rank for i, n in enumerate(self.timeline.layout) for local in nodes[n].exited_ok
                       if (rank := self.timeline.ranks_of(i)[local]) not in self.finished_ranks)
        if early:  # what the others then met (a peer error, most often) is its consequence: not quoted
            then = f" ({', '.join(map(str, rec.failed))} then failed)" if rec.failed else ""
            return (f"rank {', '.join(map(str, early))} exited (exit code 0) after step {step} without "
                    f"finishing job.steps(), and the others cannot train on without it{then}; if the "
                    "script stops early (a break out of the loop), it must do so on every rank")
        failed = ", ".join(f"{n} ({nodes[n].cause})" for n in rec.failed) or rec.why
        step = max(self.finished_ranks.values(), default=step)
        return (f"training completed (step {step}), but {failed} failed after other ranks had finished "
                "and exited; the final state is complete on the surviving ranks")
