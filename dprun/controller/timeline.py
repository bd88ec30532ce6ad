"""The training's timeline as the controller records it: the generation and its layout, the steps ranks made in
it, the ranks a new node has still to restore, and the copies reported late for an older generation.

A part that the controller composes and hands to its other parts (reconstruction, files, endgame): it owns these
records and answers questions of them; the ledger and the node table it is handed when it needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpcommon import protocol as p
from dpcommon.mesh_dims import MeshDims

from .vocabulary import JobSpec, Send
from .ledger import INIT, ReplicaLedger
from .mesh_narrowing import shrink_mesh
from .narrowing import Narrowing, Width
from .nodes import ACTIVE, SPARE, Node, NodeTable
from .retaken import Retaken

PROGRESS_EVERY_S = 1.0  # at most one "progress" event a second: days-long jobs must not flood the events file


class StepHolding:
    """ReplicaLedger.plan's keys_at: the ranks whose snapshots of a step hold the job's state (Timeline.holding,
    `alive`: the keys of live processes with their local copies), and the holders of their copies that hold what
    is taken from them (holders)."""

    def __init__(self, timeline: "Timeline", ledger: ReplicaLedger, alive: set[int]):
        self.timeline, self.ledger, self.alive = timeline, ledger, alive
        self.held: dict[int, dict[int, int]] = {}
        self.local = timeline.restored_local  # rank -> steps its process may hold, whatever no_local says

    def of(self, step: int) -> dict[int, int]:
        if step not in self.held:
            self.held[step] = self.timeline.holding(step, self.ledger, self.alive)
        return self.held[step]

    def __call__(self, step: int) -> list[int]:
        return sorted(set(self.of(step).values()))

    def holders(self, key: int, step: int) -> list[str]:
        return self.timeline.copies(self.ledger, key, step, self.of(step))


@dataclass
class Timeline:
    nproc: int  # ranks per node
    world_size: int
    last_progress_at: float  # when the newest step last grew (hang detection)
    training_since: float | None = None  # when the first generation started
    generation: int = -1  # -1 while the first generation forms
    mesh: str = ""  # the layout of a sharded or 3D-parallel job, as its workers said (WorkerReady.mesh)
    layout: list[str] = field(default_factory=list)  # node rank -> node id
    width: Width = field(default_factory=lambda: Width(()))  # process rank -> its logical ranks (form() sets it)
    # logical rank -> [(from step, the rank whose snapshots hold it from that step on)]: a rank handed to another
    # process is in that process's snapshots only from the first step it trains there
    held_in: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    holders: dict[int, list[str]] = field(default_factory=dict)  # node rank -> nodes holding its replicas
    max_step: int = 0
    stepped: bool = False  # a step was made in this generation: start-up and restores are not hangs
    rank_step: dict[int, int] = field(default_factory=dict)  # newest step each rank reported in this generation
    peaks: dict[int, int] = field(default_factory=dict)  # generation -> its newest step, once a newer was planned
    trained_generation: int = -1  # the newest generation that any rank made a step in
    late_copies: list[tuple[int, int, str]] = field(default_factory=list)  # (rank, step, holder) of an older one
    unrestored: set[int] = field(default_factory=set)  # ranks handed to a new node that has not restored them yet
    restores_answered: set[int] = field(default_factory=set)  # ranks that said restored or failed to, this generation
    retaken: Retaken = field(default_factory=Retaken)  # snapshots of restore steps taken anew with others' parts
    restore_step: int = -1  # this generation's
    # rank -> the steps its process was told to restore since the job last trained: it may hold one of them
    # locally whatever it said of newer steps (a restore goes back: its newer local snapshots are let go)
    restored_local: dict[int, set[int]] = field(default_factory=dict)
    restore_holding: dict[int, int] = field(default_factory=dict)  # this generation's: holding(its restore step)
    last_progress_event: float = float("-inf")  # when a "progress" event was last said
    progress_said: int = 0  # the step it named

    def form(self, layout: list[str], table: NodeTable) -> None:
        """The first generation's layout (node ids by node rank)."""
        self.layout, self.generation = layout, 0
        self.width = Width.full(self.world_size)
        self.held_in = {r: [(0, r)] for r in range(self.world_size)}
        for node_rank, node_id in enumerate(layout):
            table.nodes[node_id].node_rank = node_rank

    def ranks_of(self, node_rank: int) -> list[int]:
        """The own logical ranks of a node's processes, by local rank (the ranks their messages carry)."""
        own = self.width.assignment
        return [own[process][0] for process in range(node_rank * self.nproc, (node_rank + 1) * self.nproc)]

    def without_nodes(self, node_ranks: list[int], mesh: MeshDims | None = None,
                      anchored: frozenset[int] = frozenset()) -> Narrowing | str:
        """The job without the processes of these node ranks (a reason instead where it cannot go on): a sharded
        job's (`mesh`) without their whole data-parallel replicas, keeping the processes of `anchored` ranks
        (dprun.controller.mesh_narrowing)."""
        lost = {p for i in node_ranks for p in range(i * self.nproc, (i + 1) * self.nproc)}
        if mesh is None:
            narrower = self.width.shrink(lost)
            if isinstance(narrower, str):
                return narrower
            return Narrowing(narrower, tuple(i for i in range(len(self.layout)) if i not in node_ranks),
                             tuple(node_ranks))
        shrunk = shrink_mesh(self.width, lost, mesh, self.nproc, set(anchored))
        if isinstance(shrunk, str):
            return shrunk
        nodes = tuple(p // self.nproc for p in shrunk.kept[::self.nproc])
        return Narrowing(shrunk.width, nodes, tuple(i for i in range(len(self.layout)) if i not in nodes))

    def keys(self) -> list[int]:
        """Every process's own logical rank: the ranks whose snapshots hold the job's state (all at full width)."""
        return self.width.own_ranks()

    def holder_key(self, rank: int, step: int) -> int:
        """The rank whose snapshot of `step` holds logical rank `rank`."""
        return [key for since, key in self.held_in[rank] if since <= step][-1]

    def keys_at(self, step: int) -> list[int]:
        """The ranks whose snapshots of `step` hold the job's state."""
        return sorted({self.holder_key(r, step) for r in self.held_in})

    def holding(self, step: int, ledger: ReplicaLedger, alive: set[int]) -> dict[int, int]:
        """Each logical rank -> the rank whose snapshot of `step` it comes back from: the one that held it then,
        else (no copy of that one left on a replica, nor a live process of its own: `alive`) one that took it in
        as it restored `step` and took that step anew (dprun.controller.retaken) where such a copy is left."""
        out = {}
        for r in self.held_in:
            key = self.holder_key(r, step)
            if not ledger.holders_of(key, step) and key not in alive:
                key = next((k for k in self.retaken.holding(r, step) if self.copies(ledger, k, step, {r: k})
                            or (k in alive and (k, step) in self.retaken.local)), key)
            out[r] = key
        return out

    def copies(self, ledger: ReplicaLedger, key: int, step: int, held: dict[int, int]) -> list[str]:
        """The holders of `key`'s copies of `step` that hold the ranks that `held` takes from them: where one of
        those is there only in the snapshot taken anew, the copies of it alone."""
        holders = ledger.holders_of(key, step)
        if any(k == key and self.holder_key(r, step) != key for r, k in held.items()):
            fresh = self.retaken.fresh.get((key, step), set())
            holders = [h for h in holders if h in fresh]
        return holders

    def adoptions(self, step: int, held: dict[int, int] | None = None) -> dict[int, int]:
        """Each logical rank that this generation's process trains but whose state at `step` is in another
        rank's snapshot (`held`: holding's, by default where it was trained) -> that rank (dpstate restores it
        from there: Reconfigure.adopt_from)."""
        return {r: key for ranks in self.width.assignment for r in ranks
                if (key := (held or {}).get(r, self.holder_key(r, step))) != ranks[0]}

    def restoring(self, ledger: ReplicaLedger, step: int) -> None:
        """This generation restores `step`: where each rank comes from, and the snapshots taken anew."""
        self.restore_step, self.restore_holding = step, {}
        for key in self.keys():
            self.restored_local.setdefault(key, set()).add(step)
        if step >= 0:  # (not a fresh start)
            self.restore_holding = self.holding(step, ledger, set(self.keys()) - self.unrestored)
            self.retaken.began(self.generation, step, self.width.assignment,
                               self.adoptions(step, self.restore_holding))

    def reshaped(self, width: Width, layout: list[str], table: NodeTable) -> None:
        """The job goes on at `width` over `layout` (a shrink or a grow). Which snapshots hold a rank changes only
        once the new generation trains (first_step): the copies of later steps until then are the old width's."""
        self.width, self.layout = width, layout
        for node_rank, node_id in enumerate(layout):
            table.nodes[node_id].node_rank = node_rank

    def _trains_from(self, step: int) -> None:
        """This generation trains from `step`: each rank trained by another process than held it is in that
        process's snapshots from the next step on (the attributions of steps past `step` were of an abandoned
        timeline)."""
        for ranks in self.width.assignment:
            for r in ranks:
                kept = [(since, key) for since, key in self.held_in[r] if since <= step]
                if kept[-1:] == [] or kept[-1][1] != ranks[0]:
                    kept.append((step + 1, ranks[0]))
                self.held_in[r] = kept

    def rank_of(self, node: Node, local_rank: int) -> int:
        """The own rank of a node's local worker: NO_RANK where the node holds no node rank (a spare)."""
        return self.ranks_of(node.node_rank)[local_rank] if node.node_rank >= 0 else p.NO_RANK

    def placed(self) -> list[tuple[int, str, int]]:
        """(rank, node id, local rank) of every rank of the generation, in rank order."""
        return [(rank, node_id, local) for node_rank, node_id in enumerate(self.layout)
                for local, rank in enumerate(self.ranks_of(node_rank))]

    def node_of_rank(self, rank: int) -> str:
        """The node of the process whose own rank (or a rank it carries) is `rank`."""
        process = next(p for p, ranks in enumerate(self.width.assignment) if rank in ranks)
        return self.layout[process // self.nproc]

    def replica_holders(self, node_rank: int, replicas: int, spares: list[str]) -> list[str]:
        """Node rank r's snapshots live on node ranks r+1 .. r+replicas (a ring); a single node uses spares."""
        n = len(self.layout)
        if n > 1:
            count = min(replicas, n - 1)
            return [self.layout[(node_rank + k) % n] for k in range(1, count + 1)]
        return spares[:replicas] or [self.layout[node_rank]]

    def progressed(self, rank: int, step: int, now: float) -> None:
        """A rank reported `step` (Progress)."""
        self.rank_step[rank] = max(self.rank_step.get(rank, 0), step)
        if step > self.max_step or not self.stepped:
            self.max_step = max(self.max_step, step)
            self.last_progress_at = now
            self.stepped = True

    def progress_note_due(self, now: float) -> bool:
        """A "progress" event is due (at most one a second), naming the newest step."""
        if now - self.last_progress_event < PROGRESS_EVERY_S:
            return False
        self.last_progress_event, self.progress_said = now, self.max_step
        return True

    def began(self, step: int, now: float) -> None:
        """A new generation was planned, every rank going back to `step`."""
        self.generation += 1
        self.restores_answered = set()
        self.last_progress_at, self.stepped = now, False
        self.peaks[self.generation - 1] = self.max_step
        self.rank_step = dict.fromkeys(self.keys(), max(step, 0))
        self.max_step = step

    def restored(self, rank: int, generation: int) -> None:
        """`rank`'s process restored this generation's step (WorkerReady)."""
        self.unrestored.discard(rank)
        self.restores_answered.add(rank)
        if generation == self.generation:
            self.retaken.restored(rank, generation, self.restore_step)

    def reconfigures(self, spec: JobSpec, table: NodeTable, ledger: ReplicaLedger, restore_step: int,
                     sources: dict[int, str], reason: str) -> list[Send]:
        """This generation's Reconfigure to every node of the layout (its replica holders recorded); a process
        that trains a rank held in another rank's snapshots (the job shrank or grew) is told where it is."""
        spares = [node.node_id for node in table.with_role(SPARE)]
        self.holders = {r: self.replica_holders(r, spec.replicas, spares) for r in range(len(self.layout))}
        endpoint = lambda node_id: table.nodes[node_id].replica_endpoint  # noqa: E731
        adopted = self.adoptions(restore_step, self.restore_holding) if restore_step >= 0 else {}
        carry = [] if self.width.in_order else [list(ranks) for ranks in self.width.assignment]
        sends = []
        for node_rank, node_id in enumerate(self.layout):
            restore_from: dict[str, str] = {}
            restore_also: dict[str, list[str]] = {}
            processes = range(node_rank * self.nproc, (node_rank + 1) * self.nproc)
            adopt_from = {str(r): adopted[r] for p in processes for r in self.width.assignment[p] if r in adopted}
            for rank in self.ranks_of(node_rank):
                source = sources.get(rank, "")
                others = [h for h in self.copies(ledger, rank, restore_step, self.restore_holding) if h != source]
                restore_from[str(rank)] = endpoint(source) if source not in ("", INIT) else source
                if others and source != INIT:
                    restore_also[str(rank)] = [endpoint(h) for h in others]
            for key in set(adopt_from.values()) - set(map(int, restore_from)):  # another process's snapshot:
                holders = self.copies(ledger, key, restore_step, self.restore_holding)  # (never a local copy)
                restore_from[str(key)] = endpoint(holders[0]) if holders else ""
                restore_also[str(key)] = [endpoint(h) for h in holders[1:]]
            sends.append(Send(node_id, p.Reconfigure(
                generation=self.generation, node_rank=node_rank, nnodes=len(self.layout),
                nproc_per_node=spec.nproc_per_node, world_size=self.width.processes,
                restore_step=restore_step, store_endpoint=spec.store_endpoint,
                replica_to=endpoint(self.holders[node_rank][0]), restore_from=restore_from, reason=reason,
                replica_also=[endpoint(h) for h in self.holders[node_rank][1:]], restore_also=restore_also,
                restart_workers=spec.restart_mode, carry=carry, adopt_from=adopt_from,
            )))
        return sends

    def survivor_floors(self, ledger: ReplicaLedger) -> dict[int, int]:
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
        return {rank: ledger.snapshot_step_at_or_before(max(self.rank_step.get(rank, 0), top - 1, 0))
                for rank in self.keys()}

    def late_copy(self, msg: Any) -> bool:
        """A copy stored for an older generation, reported late (its sender's put was in flight when a failure
        began a new one), is still taken in while no generation since has trained: it is of the one timeline
        that did, and the store made room for it, so the ledger must know what the store now holds (else an
        older copy counted on may be gone, the newer one unknown, and the state said lost)."""
        return isinstance(msg, p.SnapshotStored) and self.trained_generation <= msg.generation < self.generation

    def abandon_after(self, ledger: ReplicaLedger, step: int) -> None:
        """A new generation goes back to `step`: the copies of later steps are of the timeline it abandons, but
        they still hold every rank's newest state until it trains (a plan made again before, as when a grow's
        restore step was passed by workers that trained on meanwhile, may need them). Counted on as late
        copies: dropped as their holders store this generation's copies of those ranks, or once it trains."""
        for rank, by_holder in ledger.held.items():
            for holder, steps in by_holder.items():
                self.late_copies.extend((rank, s, holder) for s in steps
                                        if s > step and (rank, s, holder) not in self.late_copies)

    def first_step(self, ledger: ReplicaLedger, restore_step: int | None) -> None:
        """This generation trains from `restore_step` on (None: the first generation): the late copies of steps
        past it are of an abandoned timeline (the stores drop them as this generation's copies come), and the
        ledger forgets them too; the ranks it moved are in their new processes' snapshots from the next step."""
        self.trained_generation = self.generation
        self.restored_local = {}
        if restore_step is None:
            return
        for rank, step, holder in self.late_copies:
            if step > restore_step:
                ledger.discard(rank, step, holder)
        self.late_copies = []
        ledger.trains_from(restore_step)
        self.retaken.trains_from(restore_step)
        self._trains_from(restore_step)

    def copy_stored(self, ledger: ReplicaLedger, msg: p.SnapshotStored, holder: str) -> None:
        """`holder` stored a copy (SnapshotStored), of this generation or a late one of an older generation."""
        self.retaken.stored(msg.rank, msg.step, msg.generation, holder)
        if msg.generation != self.generation:
            self.late_copies.append((msg.rank, msg.step, holder))
        else:
            self._late_copies_superseded(ledger, msg.rank, msg.step, holder)
        ledger.stored(msg.rank, msg.step, holder)

    def _late_copies_superseded(self, ledger: ReplicaLedger, rank: int, step: int, holder: str) -> None:
        """`holder` stored this generation's copy of `rank` at `step` (the restored step sent again, most often):
        its store dropped the older generations' copies of that rank at or past it (ReplicaStore.add), late ones
        too, before this generation trained (else a second failure could plan a late copy that the holder no
        longer holds)."""
        superseded = [copy for copy in self.late_copies if copy[0] == rank and copy[2] == holder and copy[1] >= step]
        for copy in superseded:
            self.late_copies.remove(copy)
            if copy[1] > step:
                ledger.discard(*copy)

    def all_still_restoring(self, ranks: list[int], table: NodeTable) -> bool:
        """Is every one of `ranks` one that a live node was handed and has neither restored nor failed to yet?"""
        return all(rank in self.unrestored and rank not in self.restores_answered
                   and table.nodes[self.node_of_rank(rank)].role == ACTIVE for rank in ranks)
