"""Where a rank's restore snapshot comes from: a copy prefetched while the script was getting ready, else the
first good copy among the replica stores the plan names. Every bad copy met is reported (RestoreFailed), and
so is a missing local copy that the plan counted on (source "").
"""

from __future__ import annotations

from typing import Callable

from dpcommon import protocol as P

from .prefetch import Prefetch
from .replicator import ReplicationError, Replicator, Slot


def named_sources(reconf: P.Reconfigure, rank: int) -> list[str]:
    """The replica endpoints the plan names as holding `rank`'s restore step."""
    sources = [reconf.restore_from.get(str(rank), ""), *reconf.restore_also.get(str(rank), [])]
    return [s for s in sources if s and s != "init"]


class SnapshotSources:
    """Owned by the session: at most one prefetch in flight, and the fetch from the named stores."""

    def __init__(self, replicator: Replicator, node_id: str, send: Callable[[P.RestoreFailed], None]):
        self._replicator, self._node_id, self._send = replicator, node_id, send
        self._prefetch: Prefetch | None = None

    def prefetch(self, reconf: P.Reconfigure, rank: int) -> None:
        """Start pulling rank's restore snapshot now (a promoted spare, before its script restores)."""
        step, sources = reconf.restore_step, named_sources(reconf, rank)
        if step >= 0 and sources and self._replicator.policy.enabled and self._replicator.local(step) is None:
            self._prefetch = Prefetch(self._replicator, reconf.generation, rank, step, sources)

    def drop_stale(self, generation: int) -> None:
        """Forget a prefetch made for an older plan (the abort still set for it stops it at once)."""
        if self._prefetch is not None and self._prefetch.generation != generation:
            self._prefetch.discard()
            self._prefetch = None

    def take_prefetched(self, reconf: P.Reconfigure, rank: int) -> tuple[Slot | None, dict[str, str]]:
        """The snapshot prefetched for this plan, if any, and the bad copies met on the way (reported)."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is None:
            return None, {}
        slot = prefetch.take(reconf.generation, rank, reconf.restore_step)
        if prefetch.generation != reconf.generation:
            return None, {}
        bad = dict(prefetch.problems)
        for source, reason in bad.items():
            self._report(reconf, rank, source, reason)
        return slot, bad

    def fetch_any(self, reconf: P.Reconfigure, rank: int, known_bad: dict[str, str]) -> Slot:
        """The first good copy among the named stores (but those known bad, already reported); each bad one is
        reported so the controller can plan without it. None good: ReplicationError (wait for the next plan)."""
        step = reconf.restore_step
        problems = [f"{source}: {reason}" for source, reason in known_bad.items()]

        def bad(source: str, why: str) -> None:
            problems.append(f"{source}: {why}")
            self._report(reconf, rank, source, why)

        sources = [s for s in named_sources(reconf, rank) if s not in known_bad]
        slot = self._replicator.fetch_first(sources, rank, step, bad)
        if slot is not None:
            return slot
        if not reconf.restore_from.get(str(rank)):  # the plan counted on this worker's own copy (source "")
            # its ring keeps the newest few steps: the plan must not bring it back to this step or older
            self._report(reconf, rank, "", f"no local copy of step {step} (holds {self._replicator.local_steps()})")
        raise ReplicationError(f"rank {rank} holds no snapshot of step {step} (holds "
                               f"{self._replicator.local_steps()}) and no replica had a good copy: "
                               + ("; ".join(problems) or "none was named"))

    def _report(self, reconf: P.Reconfigure, rank: int, source: str, reason: str) -> None:
        self._send(P.RestoreFailed(node_id=self._node_id, generation=reconf.generation, rank=rank,
                                   step=reconf.restore_step, source=source, reason=reason[:500]))
