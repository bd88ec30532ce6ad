"""dpstate.watch.FutureWatcher: follow-ups run once a backend future completes, and the polling backs off
while nothing completes (it used to cost ~10 % of a core through every backward) but not after a new watch."""

from __future__ import annotations

import threading

import pytest
import torch

from dpstate.watch import FutureWatcher

pytestmark = pytest.mark.timeout(30)


def test_a_follow_up_runs_once_its_future_completes_and_an_unwatched_one_never_does():
    watcher = FutureWatcher()
    done, forgotten = torch.futures.Future(), torch.futures.Future()
    ran = threading.Event()
    calls: list[object] = []
    watcher.watch(done, lambda fut: (calls.append(fut.value()), ran.set()))
    token = watcher.watch(forgotten, lambda fut: calls.append("forgotten"))
    watcher.unwatch(token)
    forgotten.set_result("late")
    done.set_result(42)
    assert ran.wait(5)
    assert calls == [42]
    assert watcher.pending == 0


def test_polling_backs_off_while_nothing_completes_and_closes_in_again_on_a_new_watch():
    watcher = FutureWatcher(poll_s=0.05, max_poll_s=0.4)  # coarse, so that no scheduling delay can flip it
    pending = torch.futures.Future()
    watcher.watch(pending, lambda fut: None)
    backed_off = threading.Event()

    def check():
        while not backed_off.is_set():
            if watcher._sleep_s >= watcher.max_poll_s:
                backed_off.set()
            threading.Event().wait(0.01)

    checker = threading.Thread(target=check, daemon=True)
    checker.start()
    assert backed_off.wait(5), f"still polling every {watcher._sleep_s * 1e3:.2f} ms"
    checker.join(5)

    second = torch.futures.Future()
    ran = threading.Event()
    watcher.watch(second, lambda fut: ran.set())
    assert watcher._sleep_s <= 1.5 * watcher.poll_s  # the next bucket's op: polled closely from the start
    second.set_result(None)
    assert ran.wait(5)
    pending.set_result(None)
