"""Prefetch: a worker that enters a generation before its script is ready to restore (a promoted spare,
still inside dpstate.init()) starts pulling its restore snapshot at once, while the script builds its model.

The restore then takes the prefetched copy instead of fetching, and reports the bad copies it met on the way
(stores without the step, corrupt copies); a newer plan or no good copy leaves nothing behind, and the
restore fetches as it would have.
"""

from __future__ import annotations

import threading

from .replicator import Replicator, Slot


class Prefetch:
    """One background fetch of (rank, step) for one generation, from the first named store that has it."""

    def __init__(self, replicator: Replicator, generation: int, rank: int, step: int, sources: list[str]):
        self.generation, self.rank, self.step = generation, rank, step
        self._replicator, self._sources = replicator, list(sources)
        self._slot: Slot | None = None
        self.problems: list[tuple[str, str]] = []  # (store endpoint, why its copy was not taken)
        self._thread = threading.Thread(target=self._run, name="dpstate-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._slot = self._replicator.fetch_first(self._sources, self.rank, self.step,
                                                      lambda source, why: self.problems.append((source, why)))
        except Exception:  # aborted (a newer plan) or broken: the restore fetches by itself
            pass

    def take(self, generation: int, rank: int, step: int) -> Slot | None:
        """The fetched slot if it is the one asked for; waits for the fetch (bounded by its timeout, and
        by the abort signal once a newer generation is asked for)."""
        self._thread.join()
        slot = self._slot
        if slot is not None and (generation, rank, step) == (self.generation, self.rank, self.step) \
                and slot.step == step:
            return slot
        self.discard()
        return None

    def discard(self) -> None:
        """Give the slot back (a plan this was started for is superseded). Waits for the fetch to stop."""
        self._thread.join()
        if self._slot is not None and self._slot.step == self.step:
            self._replicator.forget(self._slot)
        self._slot = None
