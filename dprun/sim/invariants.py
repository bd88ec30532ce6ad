"""The controller's safety properties, checked by the simulator after every event it feeds the controller.

Each check raises InvariantViolation with what was seen; liveness and "lost only when gone" are judged at
the end of a schedule by `judge_outcome`.
"""

from __future__ import annotations

import re

from dpcommon import protocol as p
from dprun.controller.state_machine import ANY_GENERATION, Finish, Publish, Received, Send
from dprun.controller.nodes import ACTIVE, FAILED
from dprun.controller.phase import Phase
from dprun.controller.repeats import without_rank_prefix


from .shrink_checks import InvariantViolation, WidthChecks, restored_parts

__all__ = ["Checker", "InvariantViolation", "judge_outcome", "restored_parts"]


def fingerprint(controller) -> tuple:
    """The state an older-generation message must not change (liveness timestamps aside)."""
    table = controller.table.nodes
    return (
        controller.timeline.generation,
        tuple(controller.timeline.layout),
        tuple(sorted((n, node.role, node.node_rank) for n, node in table.items())),
        repr(sorted(controller.ledger.held.items())),
        controller.timeline.max_step,
        controller.finished,
        None if controller.reconstruction.recovery is None else controller.reconstruction.recovery.restore_step,
    )


def is_stale(controller, event) -> bool:
    if not isinstance(event, Received):
        return False
    node = controller.table.get(event.node_id)
    if node is not None and node.role == FAILED:  # (a fenced node whose store stays for a save still counts)
        kept = node.keeps_store and isinstance(event.msg, (p.Heartbeat, p.Pong, p.SnapshotFiles, p.Leaving))
        return not kept and not isinstance(event.msg, p.Register)
    generation = getattr(event.msg, "generation", None)
    return (generation is not None and generation < controller.timeline.generation
            and not isinstance(event.msg, ANY_GENERATION) and not controller.timeline.late_copy(event.msg))


def records_of(c) -> Phase:
    """The phase that the controller's records show (its recovery, plan, files, generation): invariant 12 holds
    them equal to its explicit phase after every input."""
    if c.phase is Phase.FINISHED:
        return Phase.FINISHED
    work, rec = c.files.work, c.reconstruction
    if work is not None:
        return Phase.SAVING if work.saving else Phase.LOADING
    if c.timeline.generation < 0:
        return Phase.FORMING
    if rec.pending is not None:
        waits = rec.pending.waiting_since is not None or rec.pending.restoring_until is not None
        return Phase.WAITING if waits and rec.flush is None else Phase.DECIDING
    return Phase.RECOVERING if rec.recovery is not None else Phase.TRAINING


class Checker:
    """Observer for World: per-event safety invariants 1-3."""

    def __init__(self) -> None:
        self.restore_step_of: dict[int, int] = {}
        self.before: tuple | None = None  # fingerprint() before a stale message, to compare after
        self.checked = 0
        self.taken_in = False  # the event is a worker's exit that the controller will take in
        self.struck: dict[str, set] = {}  # a bug of the script (its line) -> nodes whose exit it took in
        self.owners_checked: tuple | None = None  # (generation, world.owners_changed) last found with one owner each
        self.writers: dict[str, dict[int, str]] = {}  # background save's folder -> rank -> the node asked to write it
        self.safe: tuple[str, int] | None = None  # (folder, step) of the newest state_saved
        self.from_disk: dict[int, tuple[str, int]] = {}  # generation -> (folder, step) it restores from disk
        self.widths = WidthChecks()  # a job that shrinks and grows (invariants 14, 15)

    def before_input(self, world, event) -> None:
        c = world.controller
        self.before = fingerprint(c) if is_stale(c, event) else None
        node = c.table.get(event.node_id) if isinstance(event, Received) else None
        self.taken_in = (isinstance(getattr(event, "msg", None), p.WorkerExited) and not c.finished
                         and node is not None and node.role != FAILED)

    def __call__(self, world, event, actions) -> None:
        self.checked += 1
        c = world.controller
        if self.before is not None and fingerprint(c) != self.before:
            raise InvariantViolation(f"invariant 2: a stale message changed state: {event}")
        if (kept := records_of(c)) != c.phase:
            raise InvariantViolation(f"invariant 12: the controller is {c.phase.name} but its records are those of "
                                     f"{kept.name} after {event}")
        if c.timeline.generation >= 0:
            self._one_owner_per_rank(world)
            self.widths.layout(c.timeline)
        for action in actions:
            if isinstance(action, Send) and isinstance(action.msg, p.Reconfigure):
                self._restore_point(world, action.node_id, action.msg)
                self.widths.reconfigure(world, action.node_id, action.msg)
            elif isinstance(action, Send) and isinstance(action.msg, p.SaveSnapshots) and action.msg.background:
                self._one_writer_per_rank(action.node_id, action.msg)
            elif isinstance(action, Publish) and action.event["event"] in DISK_EVENTS:
                self._disk_event(world, action.event)
            elif isinstance(action, Publish) and action.event["event"] in ("job_shrunk", "job_grew"):
                self.widths.reshaped(world, action.event)
        if self.taken_in:
            self._bug_ends_the_job(world, event, actions)

    def _bug_ends_the_job(self, world, event, actions) -> None:
        """Invariant 6: the exit of a second node raising the script's bug (not a one-off error) ends the job at
        once (dprun.controller.repeats): no more spares go to it."""
        line = without_rank_prefix(event.msg.detail)
        if event.msg.exitcode != 1 or not any(e.detail == line and not e.once for e in world.errors):
            return
        nodes = self.struck.setdefault(line, set())
        ending = any(isinstance(a, Finish) for a in actions) or world.controller.files.work is not None
        if nodes - {event.node_id} and not ending:  # (it ends once its state is saved, with save_dir)
            raise InvariantViolation(f"invariant 6: {sorted(nodes)} and {event.node_id} raised {line!r}, the job "
                                     "goes on")
        nodes.add(event.node_id)

    def _one_owner_per_rank(self, world) -> None:
        c = world.controller
        layout = c.timeline.layout
        in_layout = set(layout)
        if len(layout) * c.spec.nproc_per_node != c.timeline.width.processes or len(in_layout) != len(layout):
            raise InvariantViolation(f"invariant 1: layout {layout} does not give each node rank one node")
        if c.phase not in (Phase.FINISHED, Phase.SAVING, Phase.LOADING) and not c.table.all_in_role(in_layout, ACTIVE):
            if c.reconstruction.pending is None and c.reconstruction.flush is None:
                raise InvariantViolation(f"invariant 1: a failed node still owns ranks with no recovery under way: "
                                         f"{[(n, c.table.nodes[n].role) for n in layout]}")
        # the nodes' side changes only with what world.owners_changed counts: checked again only then
        seen = (c.timeline.generation, world.owners_changed)
        if seen == self.owners_checked:
            return
        self.owners_checked = seen
        owners: dict[tuple[int, int], str] = {}
        for node in world.nodes.values():
            if node.running and node.node_rank >= 0 and node.generation == c.timeline.generation:
                key = (node.generation, node.node_rank)
                if key in owners:
                    raise InvariantViolation(f"invariant 1: {owners[key]} and {node.node_id} both own node rank "
                                             f"{node.node_rank} in generation {node.generation}")
                owners[key] = node.node_id

    def _one_writer_per_rank(self, node_id: str, msg: p.SaveSnapshots) -> None:
        """Invariant 8: one background save asks one node for each rank's file (two would race on it)."""
        writers = self.writers.setdefault(msg.directory, {})
        for rank in msg.ranks:
            if writers.setdefault(rank, node_id) != node_id:
                raise InvariantViolation(f"invariant 8: {writers[rank]} and {node_id} both asked to write rank {rank} "
                                         f"into {msg.directory}")

    def _disk_event(self, world, event: dict) -> None:
        """Invariant 9: a step said saved has every rank's file on disk, each of that step's state; a restore from
        disk goes back to the newest step said saved, still whole on disk, and every rank restores that step."""
        name, folder = event["event"], event.get("folder") or event.get("from_disk")
        if name == "state_saved":
            step = event["step"]
            held = world.disk.files.get(folder, {})
            if not world.disk.complete(folder) or any(held[r] != step for r in range(world.spec.world_size)):
                raise InvariantViolation(f"invariant 9: step {step} said saved in {folder}, but its files hold "
                                         f"{held} and its manifests name {world.disk.manifests.get(folder)}")
            assert folder is not None  # (a state_saved event names its folder)
            self.safe = (folder, step)
        elif name == "restoring_from_disk":
            if (folder, event["step"]) != self.safe:
                raise InvariantViolation(f"invariant 9: restoring step {event['step']} from {folder}; the newest "
                                         f"step said saved is {self.safe}")
            if not world.disk.complete(folder):
                raise InvariantViolation(f"invariant 9: restoring from {folder}, which is not whole on disk any more "
                                         f"(pruned: {world.disk.pruned}; complete: {world.disk.complete_steps()})")
            assert folder is not None  # (the folder of self.safe, checked above)
            self.from_disk[world.controller.timeline.generation] = (folder, event["step"])
        elif name == "recovery_complete" and folder:
            generation = event["generation"]
            if self.from_disk.get(generation) != (folder, event["restore_step"]):
                raise InvariantViolation(f"invariant 9: generation {generation} said restored from {folder} at "
                                         f"step {event['restore_step']}; it was to restore "
                                         f"{self.from_disk.get(generation)}")
            restored = {r: world.workers.restored_at.get((generation, r)) for r in range(world.spec.world_size)}
            if set(restored.values()) != {event["restore_step"]}:
                raise InvariantViolation(f"invariant 9: generation {generation} restored from disk, ranks at "
                                         f"{restored}")

    def _restore_point(self, world, node_id: str, msg: p.Reconfigure) -> None:
        step = msg.restore_step
        seen = self.restore_step_of.setdefault(msg.generation, step)
        if seen != step:
            raise InvariantViolation(f"invariant 3: generation {msg.generation} restores from {seen} and {step}")
        if step < 0:
            return
        disk = self.from_disk.get(msg.generation)
        if disk is not None and (step != disk[1] or set(msg.restore_from.values()) != {f"sim://{node_id}"}):
            raise InvariantViolation(f"invariant 9: generation {msg.generation}, loaded from {disk}, restores "
                                     f"{node_id}'s ranks from step {step} of {msg.restore_from}")
        for rank_text, source in msg.restore_from.items():
            rank = int(rank_text)
            if rank_text in msg.adopt_from:  # its process takes its state from the holder's snapshot (a grow):
                continue  # the source named for its own key is not read (dpstate.steps.restoring)
            if source == "init":
                if step != 0 or any((rank, s) in world.replicated for s in range(1, world.workers.steps + 1)):
                    raise InvariantViolation(f"invariant 3: rank {rank} told to start fresh at step {step}")
                continue
            if not source:  # a survivor's own copy: captured, not necessarily acked yet (the gate comes later); at
                if (rank, step) not in world.workers.captured and step != 0:  # step 0 it may keep its initial state
                    raise InvariantViolation(f"invariant 3: rank {rank} restores its own step {step}, never taken")
                continue
            if (rank, step) not in world.replicated:
                raise InvariantViolation(f"invariant 3: rank {rank} restores step {step}, never replicated")
            holder = world.node_of(source)
            if holder is None or step not in holder.store.get(rank, []) and not _dropped_unbeknown(
                    world, holder.node_id, rank, step):
                raise InvariantViolation(f"invariant 3: {source} does not hold rank {rank} at step {step}")


DISK_EVENTS = ("state_saved", "restoring_from_disk", "recovery_complete")


def _dropped_unbeknown(world, holder: str, rank: int, step: int) -> bool:
    """The store dropped that copy for a put whose SnapshotStored the controller has not taken in: a fenced
    node's late put that reached the store before the new generation did, or a report still on its way or
    lost. The plan cannot know; the restore finds the copy missing and reports it (RestoreFailed)."""
    cause = world.dropped_by.get((holder, rank, step))
    return cause is not None and cause not in world.reported


def judge_outcome(world) -> str:
    """Liveness (4) and 'lost only when gone' (5). Returns the outcome's name."""
    finish = world.finish
    if finish is None:
        timeline = world.controller.timeline
        raise InvariantViolation(f"liveness: no progress to an end by t={world.now:.1f}s "
                                 f"(generation {timeline.generation}, step {timeline.max_step})")
    saved = re.search(r"the state of step (\d+) is saved", finish.message)
    held = world.disk.files.get(finish.saved_in, {})
    if saved and (not world.disk.complete(finish.saved_in) or set(held.values()) != {int(saved[1])}):
        # (a background save of that step, answered after the job began to stop, counts for it too)
        raise InvariantViolation(f"invariant 7: said saved, but the files in {finish.saved_in!r} are {held}: "
                                 f"{finish.message}")
    _every_save_said(world)
    if finish.exit_code == 0:
        last, parts = world.workers.steps, {}
        rec = world.controller.reconstruction.recovery  # a grow that the job's end came before: its nodes unused
        unused = set(rec.promoted.values()) if rec is not None and not rec.failed else set()
        for node_id in world.controller.timeline.layout:
            for worker in world.nodes[node_id].workers:
                if node_id in unused and worker.phase != "done":
                    continue
                if worker.state != last:
                    raise InvariantViolation(f"finished with rank {worker.rank} at step {worker.state}")
                parts.update(worker.parts)
        if parts != dict.fromkeys(range(world.spec.world_size), last):  # (a narrow job's carried ranks too)
            raise InvariantViolation(f"finished with logical ranks at {parts} (rank: step), not all at {last}")
        return "completed"
    if "state lost" in finish.message:
        _lost_with_a_step_on_disk(world, finish.message)
        c = world.controller
        nproc, width = c.spec.nproc_per_node, c.timeline.width.assignment
        failed_ranks = [r for i, n in enumerate(c.timeline.layout) if c.table.nodes[n].role == FAILED
                        for process in range(i * nproc, (i + 1) * nproc) for r in width[process]]
        failed_ranks += sorted(c.timeline.unrestored)
        # a copy on a node the controller fenced is gone by design (the node is stopped, its store with it)
        usable = [n for n in world.nodes.values()
                  if n.running and (c.table.get(n.node_id) is None or c.table.get(n.node_id).role != FAILED)]
        # a logical rank's copy is wherever a good copy holds its part (a narrow job's carrier's snapshots)
        good: dict[int, set] = {r: set() for r in range(c.spec.world_size)}
        for n in usable:
            for (key, step), parts in n.parts.items():
                if (key, step) not in n.corrupt:
                    for r in parts:
                        good[r].add(step)
        gone = [r for r in failed_ranks if not good[r]]
        if not gone and (world.corrupted or c.spec.on_spare_exhausted == "shrink"):
            # bad copies were met (ever: a store drops a damaged copy once newer ones come), or the job shrank
            # (the failed nodes left the layout; a restore walks back to a step survivors' rings may have
            # passed): walking back past them can leave good copies only at steps that no cut
            # can use any more (survivors dropped them when they restored an older one, or their rings of
            # local copies never reached back that far): lost is the truth when no step has a good copy of
            # every logical rank, on a replica or in a survivor's local ring
            for node_id in c.timeline.layout:
                for w in world.nodes[node_id].workers if world.nodes[node_id].running else []:
                    if w.rank >= 0 and w.rank not in failed_ranks:
                        for step in [s for s in w.local if s <= w.state]:
                            good.update({r: good[r] | {step} for r in w.local_parts[step]})
            cut = set.intersection(*good.values())
            gone = [] if cut else sorted(failed_ranks) or ["no step every rank holds"]
        if not gone:
            raise InvariantViolation(f"invariant 5: state reported lost while every rank has a live copy: "
                                     f"{finish.message}")
        return "state-lost"
    if "after other ranks had finished" in finish.message:
        last = world.workers.steps
        if not any(w.phase == "done" and w.state == last for n in world.nodes.values() for w in n.workers):
            raise InvariantViolation(f"ended as finished before the last step: {finish.message}")
        return "failed-at-exit"
    if "a spare cannot fix it" in finish.message:  # dprun.controller.repeats: named so only if 2 nodes raised it
        nodes_of: dict[str, set] = {}
        for node_id, detail in world.raised:
            nodes_of.setdefault(without_rank_prefix(detail), set()).add(node_id)
        named = [line for line, nodes in nodes_of.items()
                 if len(nodes) > 1 and f"exit code 1: {line})" in finish.message]
        if not named:
            raise InvariantViolation(f"an error taken for the script's that no 2 nodes raised: {finish.message}")
        if _spares_spent_on(world, named[0]) > 1:  # one may go to it: the one that shows it is the script's
            raise InvariantViolation(f"more than one spare promoted in place of a node that raised {named[0]!r}")
        return "script-error"
    if "no node joined as a spare" in finish.message:
        if world.failures <= world.spec.spares:
            raise InvariantViolation(f"waited for a spare after {world.failures} failures with "
                                     f"{world.spec.spares} spares: {finish.message}")
        return "spare-wait-timeout"
    if "no spare left" in finish.message:
        if world.failures <= world.spec.spares:
            raise InvariantViolation(f"no spare left after {world.failures} failures with "
                                     f"{world.spec.spares} spares: {finish.message}")
        refused = any(e["event"] == "shrink_refused" for e in world.events)
        if world.spec.on_spare_exhausted == "shrink" and not refused:
            raise InvariantViolation(f"no spare left, with --on-spare-exhausted shrink and no shrink_refused event "
                                     f"saying why it could not shrink: {finish.message}")
        return "spares-exhausted"
    raise InvariantViolation(f"job ended with {finish.exit_code}: {finish.message}")


def _every_save_said(world) -> None:
    """Invariant 11: each background save ends in one event, state_saved or save_failed (unless still written as
    the job ended)."""
    asked = getattr(world.observer, "writers", {})
    said: dict[str, int] = {}
    for e in world.events:
        if e["event"] in ("state_saved", "save_failed"):
            said[e["folder"]] = said.get(e["folder"], 0) + 1
    in_flight = world.controller.saves.in_flight
    for folder in asked:
        if said.get(folder, 0) != (0 if in_flight is not None and in_flight.folder == folder else 1):
            raise InvariantViolation(f"invariant 11: the background save into {folder} ended in {said.get(folder, 0)} "
                                     f"events (state_saved or save_failed)")


def _lost_with_a_step_on_disk(world, message: str) -> None:
    """Invariant 10: once a step is said saved (state_saved), state lost in memory goes back to it (restoring from
    disk) rather than end the job "state lost": with too few spares the job ends "no spare left" instead, and a
    node or worker lost while the files are read is a failure like any other. Lost is the truth only where those
    files cannot be read (damaged on disk: never in this model) or the job is stopped as they are (no Shutdown
    here)."""
    saved = [e for e in world.events if e["event"] == "state_saved"]
    if saved:
        raise InvariantViolation(f"invariant 10: state lost with step {saved[-1]['step']} saved in "
                                 f"{saved[-1]['folder']}: {message}")


def _spares_spent_on(world, line: str) -> int:
    """Spares promoted in place of a node whose latest failure was the script raising `line`."""
    cause_of: dict[int, str] = {}  # node rank -> the cause of the latest failure there
    spent = 0
    for event in world.events:
        if event["event"] == "node_failed" and event.get("node_rank") is not None:
            cause_of[event["node_rank"]] = event["cause"]
        elif event["event"] == "spare_promoted" and line in cause_of.get(event["node_rank"], ""):
            spent += 1
    return spent
