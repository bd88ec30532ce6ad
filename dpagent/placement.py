"""This node's place in the job as its controller told it: the Welcome, the newest Reconfigure (its generation,
node rank), a spare's Standby. The agent alone writes it, on those messages; its parts are handed it to read."""

from __future__ import annotations

from dataclasses import dataclass

from dpcommon.protocol import NO_RANK, Reconfigure, Role, Standby, Welcome


@dataclass
class Placement:
    nproc: int  # this node's workers
    role: Role
    generation: int = NO_RANK
    job_id: str = ""
    welcome: Welcome | None = None
    latest: Reconfigure | None = None  # the newest Reconfigure
    standby: Standby | None = None  # a spare's: the snapshot sizes its workers make room for
    restart_mode: bool = False  # Welcome(prespawn=False): workers start, and restart, with their ranks

    def own_ranks(self) -> list[int]:
        """The global ranks of this node's workers in the current generation ([] before one, or on a spare)."""
        reconf = self.latest
        if reconf is None or reconf.node_rank < 0:
            return []
        return list(range(reconf.node_rank * self.nproc, (reconf.node_rank + 1) * self.nproc))

    def rank_of(self, local_rank: int) -> int:
        """The global rank of a local worker in the current generation (NO_RANK before one, or on a spare)."""
        ranks = self.own_ranks()
        return ranks[local_rank] if 0 <= local_rank < len(ranks) else NO_RANK
