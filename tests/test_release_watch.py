"""A survivor still in an old generation's step a while after a newer one was asked for says so once, with its
stacks, and ends itself where it waits in torch.distributed all that time; one that let go, or a Stop, says
nothing (dpstate.steps.release_watch, real timers and threads)."""

from __future__ import annotations

import threading
import time

import pytest

from dpcommon.exit_wording import EXIT_UNRELEASED
from dpstate.steps.abort import AbortSignal
from dpstate.steps.release_watch import ReleaseWatch

pytestmark = pytest.mark.timeout(30)


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the watch's timer never fired"
        time.sleep(0.01)


def _watched(in_step: list[bool], main_ident: int | None = None) -> tuple[AbortSignal, ReleaseWatch, list[int]]:
    abort, ended = AbortSignal(), []
    abort.enter(0)
    watch = ReleaseWatch(abort, lambda: in_step[0], lambda: "rank 3 (generation 0)", warn_s=0.05, confirm_s=0.05,
                         end=ended.append, main_ident=main_ident)
    abort.add_callback(watch.on_abort)
    return abort, watch, ended


def test_a_rank_still_in_its_step_says_so_once_with_its_stacks(capfd):
    abort, watch, ended = _watched([True])
    abort.request(1, "node1 failed")
    abort.request(1, "node1 failed")  # the same generation again: no second timer
    _until(lambda: watch.checked == 1)
    err = capfd.readouterr().err
    assert "dpstate: rank 3 (generation 0) is still in its step 0.05 s after generation 1 was asked for" in err
    assert "test_a_rank_still_in_its_step_says_so_once_with_its_stacks" in err  # this thread's stack, waiting
    abort.request(2, "node2 failed")  # a newer one: watched again
    _until(lambda: watch.checked == 2)
    assert watch.warned == 2
    assert ended == []  # its main thread (this one) waits in the test, not in torch.distributed: no hang of ours


# A function that torch.distributed's path names, as a collective's Python frame does: waiting in a C call
TORCH_WAIT = compile("def wait_tensor(held):\n    held.acquire()\n", "/site-packages/torch/distributed/"
                     "_functional_collectives.py", "exec")


def test_a_rank_held_in_a_torch_distributed_wait_ends_itself(capfd):
    namespace: dict = {}
    exec(TORCH_WAIT, namespace)
    held = threading.Lock()
    held.acquire()
    waiter = threading.Thread(target=namespace["wait_tensor"], args=(held,), daemon=True)
    waiter.start()
    abort, watch, ended = _watched([True], main_ident=waiter.ident)
    abort.request(1, "node1 failed")
    _until(lambda: ended)
    held.release()
    assert ended == [EXIT_UNRELEASED]
    err = capfd.readouterr().err
    assert ("dpstate: rank 3 (generation 0): a collective of the old generation never let go (wait_tensor "
            "(distributed/_functional_collectives.py:2), 0.1 s after generation 1 was asked for); this worker ends "
            "itself (exit code 86) so that its node is replaced") in err


def test_a_rank_that_let_go_of_its_step_or_a_stop_says_nothing(capfd):
    in_step = [True]
    abort, watch, ended = _watched(in_step)
    abort.request(1)
    in_step[0] = False  # the step raised and the rank went on to recover
    _until(lambda: watch.checked == 1)
    stopped, quiet, _ = _watched([True])
    stopped.stop("SIGTERM")  # a Stop is no newer generation: nothing is watched
    assert quiet._watching == -1
    assert (watch.warned, quiet.warned) == (0, 0) and ended == []
    assert "still in its step" not in capfd.readouterr().err
