"""The controller when it itself did not run (dprun stopped with SIGSTOP or Ctrl-Z, its VM paused, starved of CPU):
the shell feeds Paused(seconds); no node is failed for that silence, and a job that then ends says why."""

from __future__ import annotations

from dpcommon import protocol as p
from dprun.controller.state_machine import NodeGone, Paused, Tick
from helpers.controller_harness import finished_but_rank_1_lingers, formed, spec


def test_a_pause_of_the_controller_is_not_its_nodes_silence():
    h = formed()
    assert h.c.timeline.generation == 0
    h.feed(Paused(12.0), dt=12.0)  # 12 s without a turn of its loop, past the 5 s heartbeat timeout
    h.feed(Tick(), dt=0.05)
    assert not h.named("node_failed"), "a node blamed for the controller's own pause"
    (paused,) = h.named("controller_paused")
    assert paused == {"event": "controller_paused", "seconds": 12.0, "nodes_left": True}
    h.alive({"a": {}, "b": {}, "s": {}})  # they had not left after all (their host paused with it)
    h.feed(Tick(), dt=4.0)
    assert not h.named("node_failed") and h.finish is None


def test_nodes_that_do_take_it_for_lost_are_failed_as_before_and_the_end_says_why():
    h = formed(spec(save_dir="/saved"))
    h.feed(Paused(8.0), dt=8.0)
    for node in ("s", "a", "b"):  # their agents gave up on it and exited 3 (each saved to /saved on its own)
        h.feed(NodeGone(node, "agent process exited (exit code 3)"))
    assert h.finish is not None and h.finish.exit_code == 1
    assert h.finish.message.startswith(
        "dprun itself did not run for 8.0 s (stopped with SIGSTOP or Ctrl-Z, its machine paused, or starved of CPU), "
        "long enough for its nodes (--heartbeat-timeout 5 s) to take the controller for lost and leave, each "
        "writing the copies it held to /saved; then: ")
    assert h.finish.message.count("did not run for") == 1
    assert "no spare left" in h.finish.message and "more --spares" not in h.finish.message, "more would not help"


def test_a_short_pause_moves_the_deadlines_on_and_is_not_blamed_for_a_later_failure():
    h = formed()
    h.msg("a", p.Heartbeat("a", 0, {}))
    h.feed(Paused(3.0), dt=3.0)  # under the timeout less a ping interval: nodes still wait for the controller
    h.feed(Tick(), dt=2.5)  # a was last heard 5.5 s ago, 3 of them the controller's own
    assert not h.named("node_failed")
    h.feed(Tick(), dt=30.0)  # a really is silent now
    (failed, *_) = h.named("node_failed")
    assert "no heartbeat" in failed["cause"]
    assert h.c.deadlines.paused is None  # under the timeout: no node left for it, so no end message blames it


def test_without_a_pause_silent_nodes_are_failed_at_the_heartbeat_timeout():
    h = formed()
    h.feed(Tick(), dt=12.0)  # the same 12 s, turns of the loop and all: the nodes were silent
    assert {e["node"] for e in h.named("node_failed")} >= {"a", "b"}


def test_a_pause_after_training_finished_does_not_count_against_a_worker_still_exiting():
    h = formed(spec(hang_timeout=20.0))
    statuses = finished_but_rank_1_lingers(h)
    while h.now < 10.0:
        h.alive(statuses)
    h.feed(Paused(25.0), dt=25.0)  # past --hang-timeout, all of it the controller's own
    h.alive(statuses)
    assert h.finish is None, "rank 1 blamed for the controller's own pause"
    while h.finish is None and h.now < 60.0:
        h.alive(statuses)
    assert h.finish and h.finish.exit_code == 1 and "rank 1 on b (pid 4242) did not exit within 20 s" in h.finish.message
    assert h.now >= 45.0, "its own 20 s, the pause not counted"
