"""The training script's own failures in the controller. One that follows the work, not the machine
(dprun.controller.repeats): an error that strikes a second node at the same step ends the job saying so, instead of
spending every spare on it; one-off errors still recover. A rank that exits 0 early is told from one that
finished."""

from __future__ import annotations

from dpcommon import protocol as p
from dpcommon.exit_wording import EXIT_UNRELEASED, describe_exit
from dprun.controller.repeats import RepeatedFailures, signature
from dprun.controller.state_machine import Tick
from helpers.controller_harness import Harness, formed, spec

BUG = "[rank1]: ValueError: bad batch at step 5"


def test_signature_ignores_the_rank_prefix_and_addresses_and_signals_have_none():
    assert (signature(1, "[rank1]: RuntimeError: bad tensor at 0x7f3a12")
            == signature(1, "[rank0]: RuntimeError: bad tensor at 0x55e0ff"))
    assert signature(1, "[rank0]: [rank0]: KeyError: 'pos'") == signature(1, "[rank1]: KeyError: 'pos'")
    assert signature(1, "ValueError: a") != signature(1, "ValueError: b")
    assert signature(1, "ValueError: a") != signature(2, "ValueError: a")
    assert signature(1, "") == signature(1, "exit code 1") == "exit code 1"
    assert signature(-9, "Killed") is None and signature(0, "") is None
    assert signature(-9, p.OOM_KILLED) == p.OOM_KILLED  # what the controller passes for WorkerExited.oom_killed
    unreleased = "dpstate: rank 0 (generation 0): a collective of the old generation never let go"
    assert signature(EXIT_UNRELEASED, unreleased) is None  # the backend's state, not the script's
    assert describe_exit(EXIT_UNRELEASED) == "exit code 86 (a collective of an old generation never let go)"


def test_the_same_error_on_another_node_at_the_same_step_is_named_once_seen_twice():
    seen = RepeatedFailures()
    assert seen.seen(1, BUG, "b", 1, 4) is None
    assert seen.seen(1, BUG, "b", 1, 4) is None, "the same node again is no evidence against the node"
    message = seen.seen(1, BUG, "s", 1, 5)
    assert message and "rank 1 failed on b and again on s" in message and "ValueError: bad batch" in message
    assert "after step 4" in message and "training script" in message


def test_the_same_error_at_another_step_or_by_a_signal_is_not_the_script():
    seen = RepeatedFailures()
    assert seen.seen(1, BUG, "b", 1, 4) is None
    assert seen.seen(1, BUG, "s", 1, 30) is None, "26 steps later: a flaky error, which a spare may well outlive"
    assert seen.seen(-9, "", "t", 1, 30) is None and seen.seen(-9, "", "u", 1, 30) is None


def test_spares_failing_alike_leave_the_job_training_until_a_rank_fails_so_too():
    seen = RepeatedFailures()
    assert seen.seen(1, "ImportError: no module x", "s1", -1, 0) is None
    assert seen.seen(1, "ImportError: no module x", "s2", -1, 0) is None, "only the spares: the ranks train on"
    message = seen.seen(1, "[rank0]: ImportError: no module x", "a", 0, 0)
    assert message and message.startswith("s2 (no rank) and rank 0 on a failed")


def _step(h, nodes: dict[str, int], step: int, generation: int) -> None:
    for node, rank in nodes.items():
        h.msg(node, p.Progress(node, generation, rank, step))


def _recover(h) -> None:
    h.pong_all()
    h.feed(Tick(), dt=0.6)


def _rank_1_raised_and_s_took_its_place():
    """Nodes a, b train with spares s, s2; rank 1 raises BUG after step 4; spare s replaces b."""
    h = formed(spec(spares=2))
    h.register("s2", spare=True)
    _step(h, {"a": 0, "b": 1}, 4, 0)
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, BUG))
    _recover(h)
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"] and not h.finish
    return h


def test_a_rank_that_fails_the_same_way_on_the_spare_that_replaced_it_ends_the_job_with_spares_left():
    h = _rank_1_raised_and_s_took_its_place()
    _step(h, {"a": 0, "s": 1}, 4, 1)  # replayed from the snapshot, deterministically, to the same error
    h.msg("s", p.WorkerExited("s", 1, 0, 12, 1, BUG))
    assert h.finish and h.finish.exit_code == 1
    assert "rank 1 failed on b and again on s" in h.finish.message
    assert len(h.named("spare_promoted")) == 1 and h.c.table.get("s2").role == "spare", "no second spare spent"
    assert h.sent_to("s2", p.Stop)


def test_every_rank_failing_the_same_way_at_once_ends_the_job_before_any_spare_is_promoted():
    h = formed()
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 1, "[rank0]: ModuleNotFoundError: No module named 'x'"))
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, "[rank1]: ModuleNotFoundError: No module named 'x'"))
    assert h.finish and h.finish.exit_code == 1
    assert "rank 0 on a and rank 1 on b failed" in h.finish.message and "No module named 'x'" in h.finish.message
    assert not h.named("spare_promoted")


def test_a_crash_as_the_rank_exits_on_the_same_error_counts_as_that_error():
    """WorkerExited.raised: the spare's worker printed the same traceback, then aborted while it exited."""
    h = _rank_1_raised_and_s_took_its_place()
    _step(h, {"a": 0, "s": 1}, 4, 1)
    h.msg("s", p.WorkerExited("s", 1, 0, 12, -6, f"{BUG} (then: terminate called without an active exception)",
                              raised=BUG))
    assert h.finish and "rank 1 failed on b and again on s" in h.finish.message, h.finish
    assert len(h.named("spare_promoted")) == 1


def test_the_step_a_worker_made_in_a_generation_since_replaced_still_names_the_same_error_at_the_same_step():
    """The spare trains on in generation 1 to the same error after step 4 while generation 2 is planned (a peer
    error, say): its Progress is then stale and dropped, and its agent reports the exit in generation 2, which
    has made no step. The exit's own step (WorkerExited.step, what its agent heard it make) says 4, as it was
    (simulator seed 716647: before, the step of generation 2's plan was taken and the job went on)."""
    def replanned_as_s_trains_on():
        h = _rank_1_raised_and_s_took_its_place()
        h.msg("a", p.PeerError("a", 1, 0, "Connection reset by peer"))
        h.pong_all()
        h.feed(Tick(), dt=0.6)
        assert h.c.timeline.generation == 2 and h.c.timeline.layout == ["a", "s"] and h.c.timeline.max_step < 3, "planned again, rolled back"
        _step(h, {"s": 1}, 4, 1)  # stale: dropped
        return h

    h = replanned_as_s_trains_on()
    h.msg("s", p.WorkerExited("s", 2, 0, 12, 1, BUG))  # an agent that heard no step: the controller's lag remains
    assert not h.finish, "with no step of its own an exit is placed at its generation's restore step"
    h = replanned_as_s_trains_on()
    h.msg("s", p.WorkerExited("s", 2, 0, 12, 1, BUG, step=4))
    assert h.finish and h.finish.exit_code == 1 and "rank 1 failed on b and again on s" in h.finish.message
    assert "the same way after step 4" in h.finish.message and h.c.table.get("s2").role == "spare"


def test_a_one_off_error_recovers_and_so_does_a_kill_at_the_same_step():
    h = _rank_1_raised_and_s_took_its_place()
    _step(h, {"a": 0, "s": 1}, 5, 1)
    h.msg("s", p.WorkerExited("s", 1, 0, 12, -9))  # the OOM killer, say: a signal says nothing of the script
    _recover(h)
    assert not h.finish and h.c.timeline.generation == 2 and h.c.timeline.layout == ["a", "s2"]


def test_the_oom_killer_at_the_same_step_on_the_spare_is_the_scripts_appetite_not_the_node():
    """A SIGKILL that the agent's cgroup counted as an OOM kill (WorkerExited.oom_killed) is named so, and,
    unlike a plain kill, twice at the same step on two nodes ends the job as the script's."""
    h = formed(spec(spares=2))
    h.register("s2", spare=True)
    _step(h, {"a": 0, "b": 1}, 4, 0)
    h.msg("b", p.WorkerExited("b", 0, 0, 11, -9, "step 4 loss 2.1", oom_killed=True))
    (failed,) = h.named("node_failed")
    assert failed["cause"] == ("worker 0 (pid 11) killed by the kernel's OOM killer: out of memory "
                               "(its last line before: step 4 loss 2.1)")
    _recover(h)
    assert h.c.timeline.layout == ["a", "s"] and not h.finish
    _step(h, {"a": 0, "s": 1}, 4, 1)
    h.msg("s", p.WorkerExited("s", 1, 0, 12, -9, "step 4 loss 2.1", oom_killed=True))
    assert h.finish and h.finish.exit_code == 1
    assert "rank 1 failed on b and again on s" in h.finish.message
    assert "(killed by the kernel's OOM killer: out of memory): the training script needs more memory" in \
        h.finish.message
    assert h.c.table.get("s2").role == "spare", "no second spare spent on it"


def test_no_spare_left_after_an_error_exit_says_that_more_spares_fix_only_the_node():
    for code, detail, raised in ((1, BUG, ""), (-9, "", ""), (-6, "terminate called", ""), (-6, "", BUG)):
        h = Harness(spec(spares=0))
        h.register("a", rank=0)
        h.register("b", rank=1)
        h.msg("b", p.WorkerExited("b", 0, 0, 11, code, detail, raised=raised))
        h.pong_all()
        assert h.finish and "no spare left" in h.finish.message
        script = code > 0 or bool(raised)
        assert ("a spare would fail the same way" in h.finish.message) == script, h.finish.message
        assert "rerun with more --spares" in h.finish.message


def test_restart_mode_counts_restarts_not_repeats():
    """Scripts without dpstate report no steps: every error there looks like step 0. --max-restarts decides, as
    with torchrun (a restart reruns the script; a node whose worker failed is swapped for a spare first)."""
    h = formed(spec(spares=2, restart_mode=True, max_restarts=3))
    h.register("s2", spare=True)
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 1, BUG))
    _recover(h)
    assert h.c.timeline.generation == 1 and h.c.timeline.layout == ["a", "s"]
    h.msg("s", p.WorkerExited("s", 1, 0, 12, 1, BUG))
    _recover(h)
    assert not h.finish and h.c.timeline.generation == 2 and h.c.timeline.layout == ["a", "s2"]


def test_a_rank_that_exits_0_without_finishing_is_named_when_the_others_fail_without_it():
    h = formed()
    _step(h, {"a": 0, "b": 1}, 5, 0)
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 0))  # its script left the loop: no final barrier, no RankFinished
    h.msg("a", p.PeerError("a", 0, 0, "Connection closed by peer"))
    _recover(h)
    assert h.finish and h.finish.exit_code == 1
    assert "rank 1 exited (exit code 0) after step 5 without finishing job.steps()" in h.finish.message
    assert "must do so on every rank" in h.finish.message and "training completed" not in h.finish.message
    assert "Connection closed" not in h.finish.message  # the peer error is its consequence: not quoted


def test_the_nodes_that_fail_after_a_rank_exited_0_early_are_named_as_its_consequence():
    h = formed()
    _step(h, {"a": 0, "b": 1}, 5, 0)
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 0))
    h.msg("a", p.WorkerExited("a", 0, 0, 10, 1, "[rank0]: RuntimeError: Connection closed by peer"))
    _recover(h)
    assert h.finish and h.finish.exit_code == 1
    assert "cannot train on without it (a then failed); if the script" in h.finish.message
    assert "Connection closed" not in h.finish.message


def test_a_rank_that_finished_in_a_generation_since_replaced_still_counts_as_finished():
    h = formed()
    _step(h, {"a": 0, "b": 1}, 5, 0)
    h.msg("b", p.PeerError("b", 0, 1, "slow peer"))  # a new generation is planned: generation 0 is over ...
    _recover(h)
    assert h.c.timeline.generation == 1
    h.msg("b", p.RankFinished("b", 0, 1, 5))  # ... but b had passed its final barrier: a fact in any generation
    h.msg("b", p.WorkerExited("b", 0, 0, 11, 0))
    h.msg("a", p.WorkerExited("a", 1, 0, 10, -9))
    _recover(h)
    assert h.finish and "training completed (step 5), but a" in h.finish.message


def test_an_error_reported_after_another_failure_rolled_the_job_back_counts_at_the_step_it_struck_after():
    """c's agent leaves at step 8 and the new plan rolls the job back to step 5 before a's worker, still in
    generation 0, reports its error: it struck after step 8, not 5. Its replacement replays to step 8 and fails
    the same way: the job ends (simulator seed 16106: counted at step 5, three steps apart, the job went on)."""
    h = Harness(spec(nnodes=3, spares=2))
    for node, rank in (("a", 0), ("b", 1), ("c", 2)):
        h.register(node, rank=rank)
    h.register("s", spare=True)
    h.register("s2", spare=True)
    ranks = {"a": 0, "b": 1, "c": 2}
    for step in range(1, 9):
        _step(h, ranks, step, 0)
        if step == 5:
            for holder, rank in (("b", 0), ("c", 1), ("a", 2)):
                h.msg(holder, p.SnapshotStored(holder, rank, 5, 0))
    h.msg("c", p.Leaving("c", "received SIGTERM; the controller did not stop the job"))
    _recover(h)
    assert h.c.timeline.generation == 1 and h.c.timeline.max_step == 5
    h.msg("s", p.WorkerReady("s", 1, 2, 0.01, 0.02, "replica"))  # rank 2 restored (from a's store)
    h.msg("a", p.WorkerExited("a", 0, 0, 11, 1, "[rank0]: ValueError: bad batch at step 9"))
    _recover(h)
    assert h.c.timeline.generation == 2 and h.c.timeline.layout == ["s2", "b", "s"] and not h.finish
    for step in range(6, 9):  # replayed from the snapshot, deterministically, to the same error
        _step(h, {"s2": 0, "b": 1, "s": 2}, step, 2)
    h.msg("s2", p.WorkerExited("s2", 2, 0, 12, 1, "[rank0]: ValueError: bad batch at step 9"))
    assert h.finish and h.finish.exit_code == 1, h.events[-3:]
    assert h.finish.message.startswith("rank 0 failed on a and again on s2, which took its place, the same way "
                                       "after step 8")


def test_a_worker_that_ended_itself_on_a_collective_never_let_go_is_the_node_not_the_script():
    """dpstate.steps.release_watch's exit: no spare left, the end names no script error to fix (an exit 1 does),
    and two ranks ending so at one step are no repeated error of the script's."""
    line = "dpstate: rank 1 (generation 0): a collective of the old generation never let go"
    for code, script_advice in ((EXIT_UNRELEASED, False), (1, True)):
        h = Harness(spec(spares=0))
        h.register("a", rank=0)
        h.register("b", rank=1)
        h.msg("b", p.WorkerExited("b", 0, 0, 7, code, line))
        h.pong_all()
        assert h.finish and h.finish.exit_code == 1 and "no spare left" in h.finish.message, h.finish
        assert ("if that error is the script's" in h.finish.message) == script_advice, h.finish.message
    seen = RepeatedFailures()
    assert seen.seen(EXIT_UNRELEASED, line, "a", 0, 4) is None
    assert seen.seen(EXIT_UNRELEASED, line, "s", 0, 4) is None
