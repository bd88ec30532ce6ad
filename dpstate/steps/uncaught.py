"""A hint for an error that ends the script although dpstate would have recovered from it: a peer's failure (or a
reconfiguration's abort) raised outside a step's `with step:` block."""

from __future__ import annotations

import sys
from typing import Any, Callable

from .abort import AbortSignal, classify


def hint_unwrapped_steps(rank: Callable[[], int], abort: AbortSignal) -> None:
    """Chain a sys.excepthook that, after the traceback, says why such an error ended the script. (torch's own,
    set as a process group starts, chains to it in turn: the hint gets its [rankN] prefix too.)"""
    previous = sys.excepthook

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        if classify(exc, abort) is not None:
            print(f"dpstate: rank {rank()}: this error is a peer's failure (or the job reconfiguring), which dpstate "
                  "recovers from only inside a step's `with step:` block: write the loop as `for step in "
                  "job.steps(N):` then `with step:` around the step's work (its collectives included), and the "
                  "ranks that survive a failure go on once a spare takes the failed node's place",
                  file=sys.stderr, flush=True)

    sys.excepthook = hook
