"""Step: one training step of job.steps(); `with step:` swallows the failures a reconfiguration causes, and
step.data_ranks() names the data-parallel ranks whose micro-batches this process computes in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from .abort import classify

if TYPE_CHECKING:
    from .session import Job


class Step:
    """One training step. `with step:` swallows failures caused by a reconfiguration or a lost peer
    (the loop then recovers and repeats from the restore step); any other exception propagates."""

    def __init__(self, job: "Job", number: int):
        self.number = number
        self.metrics: dict[str, Any] = {}
        self.failure: BaseException | None = None
        self.done = False  # its `with` block ended without an exception
        self._job = job

    def log(self, **metrics: Any) -> None:
        """Metrics sent with this step's Progress (numbers; tensors are turned into floats)."""
        self.metrics.update(metrics)

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.done = exc is None
        if exc is None or self._job._standalone or not isinstance(exc, Exception):
            return False
        if classify(exc, self._job._abort) is None and not self._job._abort.stopped:
            return False
        self.failure = exc
        return True

    def __repr__(self) -> str:
        return f"Step({self.number})"

    def data_ranks(self) -> Iterator[int]:
        """The logical data-parallel ranks whose micro-batch this process computes in this step, in order: its
        own, and while the job runs narrow (a replica lost, no spare left) the lost replica's too, so that every
        step sees the samples of the width asked for. Compute each one's forward and backward in the loop body;
        the gradients are summed across ranks after the last, as at full width:

            for rank in step.data_ranks():
                loss = ddp_model(*batches[rank].next())
                loss.backward()
            opt.step()
        """
        return self._job._micro_batches()
