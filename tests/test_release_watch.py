"""A survivor still in an old generation's step a while after a newer one was asked for says so once, with its
stacks, and ends itself where it waits in torch.distributed all that time; one that let go, or a Stop, says
nothing (dpstate.steps.release_watch, real timers and threads)."""

from __future__ import annotations

import sys
import threading

import pytest

from dpcommon.exit_wording import EXIT_UNRELEASED
from dpstate.steps.abort import AbortSignal
from helpers.e2e import wait_for
from dpstate.steps.release_watch import ReleaseWatch, waiting_in_torch_distributed

pytestmark = pytest.mark.timeout(30)


def _watched(in_step: list[bool], main_ident: int | None = None,
             severed: bool = True) -> tuple[AbortSignal, ReleaseWatch, list[int]]:
    abort, ended = AbortSignal(), []
    abort.enter(0)
    watch = ReleaseWatch(abort, lambda: in_step[0], lambda: "rank 3 (generation 0)", lambda: severed, warn_s=0.05,
                         confirm_s=0.05, end=ended.append, main_ident=main_ident)
    abort.add_callback(watch.on_abort)
    return abort, watch, ended


def test_a_rank_still_in_its_step_says_so_once_with_its_stacks(capfd):
    abort, watch, ended = _watched([True])
    counted_while_saying: list[int] = []
    watch._where = lambda: counted_while_saying.append(watch.checked) or "rank 3 (generation 0)"
    abort.request(1, "node1 failed")
    abort.request(1, "node1 failed")  # the same generation again: no second timer
    wait_for(lambda: watch.checked == 1, 10, "the watch's timer")
    assert counted_while_saying == [0]  # a timer is counted once its lines are out: a reader waits on `checked`
    err = capfd.readouterr().err
    assert "dpstate: rank 3 (generation 0) is still in its step 0.05 s after generation 1 was asked for" in err
    assert "test_a_rank_still_in_its_step_says_so_once_with_its_stacks" in err  # this thread's stack, waiting
    abort.request(2, "node2 failed")  # a newer one: watched again
    wait_for(lambda: watch.checked == 2, 10, "the watch's timer")
    assert watch.warned == 2
    assert ended == []  # its main thread (this one) waits in the test, not in torch.distributed: no hang of ours


# Functions that torch's paths name, as a funcol wait's Python frames do: wait_tensor calls torch.ops, whose
# __call__ waits in C (torch 2.13: torch/_ops.py inside torch/distributed/_functional_collectives.py)
TORCH_OPS = compile("def __call__(held):\n    held.acquire()\n", "/site-packages/torch/_ops.py", "exec")
TORCH_WAIT = compile("def wait_tensor(held):\n    __call__(held)\n", "/site-packages/torch/distributed/"
                     "_functional_collectives.py", "exec")
TORCH_NN = compile("def forward(held):\n    held.acquire()\n", "/site-packages/torch/nn/modules/linear.py",
                   "exec")


def _frame_of(function, *args) -> tuple[str | None, threading.Thread, threading.Lock]:
    """waiting_in_torch_distributed() of a thread held in function(lock), and the thread and the lock."""
    held = threading.Lock()
    held.acquire()
    waiter = threading.Thread(target=function, args=(held, *args), daemon=True)
    waiter.start()
    wait_for(lambda: waiter.ident in sys._current_frames() and sys._current_frames()[waiter.ident].f_code.co_name
             in ("__call__", "forward"), 10, "the thread to wait")
    return waiting_in_torch_distributed(sys._current_frames()[waiter.ident]), waiter, held


def test_only_a_wait_in_torch_distributed_counts_as_held_there():
    namespace: dict = {}
    for code in (TORCH_OPS, TORCH_WAIT, TORCH_NN):
        exec(code, namespace)
    where, _, held = _frame_of(namespace["wait_tensor"])
    held.release()
    assert where == "wait_tensor (distributed/_functional_collectives.py:2)"
    where, _, held = _frame_of(namespace["forward"])  # a module computing: no collective
    held.release()
    assert where is None


def test_a_rank_held_in_a_torch_distributed_wait_ends_itself_where_its_connections_were_severed(capfd):
    namespace: dict = {}
    for code in (TORCH_OPS, TORCH_WAIT):
        exec(code, namespace)
    _, waiter, held = _frame_of(namespace["wait_tensor"])
    unsevered, watch_unsevered, not_ended = _watched([True], main_ident=waiter.ident, severed=False)
    abort, watch, ended = _watched([True], main_ident=waiter.ident)
    unsevered.request(1, "node1 failed")  # (a data parallel job: Gloo's timeout ends a wait on a frozen peer)
    abort.request(1, "node1 failed")
    wait_for(lambda: ended and watch_unsevered.warned, 10, "the watch's timer")
    held.release()
    assert ended == [EXIT_UNRELEASED] and not_ended == []
    err = capfd.readouterr().err
    assert ("dpstate: rank 3 (generation 0): a collective of the old generation never let go (wait_tensor "
            "(distributed/_functional_collectives.py:2), 0.1 s after generation 1 was asked for); this worker ends "
            "itself (exit code 86) so that its node is replaced") in err


def test_a_rank_that_let_go_of_its_step_or_a_stop_says_nothing(capfd):
    in_step = [True]
    abort, watch, ended = _watched(in_step)
    abort.request(1)
    in_step[0] = False  # the step raised and the rank went on to recover
    wait_for(lambda: watch.checked == 1, 10, "the watch's timer")
    stopped, quiet, _ = _watched([True])
    stopped.stop("SIGTERM")  # a Stop is no newer generation: nothing is watched
    assert quiet._watching == -1
    assert (watch.warned, quiet.warned) == (0, 0) and ended == []
    assert "still in its step" not in capfd.readouterr().err


def test_of_two_generations_asked_for_in_turn_the_newer_is_the_one_said(capfd):
    abort, watch, _ = _watched([True])
    abort.request(1)
    abort.request(2)  # before generation 1's timer fired
    wait_for(lambda: watch.checked == 2, 10, "the watch's timer")
    err = capfd.readouterr().err
    assert err.count("is still in its step") == 1 and "after generation 2 was asked for" in err, err[:2000]
