"""What a process trains: the logical data-parallel ranks it carries, the objects kept per rank, and a step's
micro-batches, one per carried rank (dpstate.groups.carried, dpstate.groups.narrow).
"""

from __future__ import annotations

from typing import Callable, Iterator, TypeVar

from torch import nn

from dpstate.groups.carried import Carried, PerRank
from dpstate.groups.ddp import DataParallel
from dpstate.groups.narrow import NarrowStep, RanksRng
from dpstate.groups.narrow_sharded import sharded_micro_batches
from dpstate.snapshot.rank_parts import RANKS_RNG_NAME
from dpstate.snapshot.state import Tracked

from .abort import AbortSignal

T = TypeVar("T")


class DataRanks:
    """The Job's part that knows what it trains; handed the tracked objects and the DataParallel proxies."""

    def __init__(self, tracked: Tracked, proxies: list[DataParallel], abort: AbortSignal):
        self._tracked, self._proxies, self._abort = tracked, proxies, abort
        self.carried: Carried | None = None  # what the Reconfigure said, where it said (None: rank r trains r)
        self._per_rank: list[PerRank] = []
        self._rng = RanksRng()

    def per_rank(self, factory: Callable[[int], T], carried: Carried) -> PerRank[T]:
        per = PerRank(factory, carried.ranks)
        self._per_rank.append(per)
        return per

    def carry(self, carried: Carried, rng: dict[int, dict]) -> None:
        """Train the logical ranks of `carried`; `rng`: the RNG states of ranks new to this process."""
        self.carried = None if carried.in_order else carried
        self._tracked.ranks = carried.ranks
        for per in self._per_rank:
            per.carry(carried.ranks)
        self._rng.carry(carried, rng)
        for proxy in self._proxies:
            proxy.narrow = not carried.in_order
        if len(carried.ranks) > 1:  # (a process of a narrow job that trains its own rank alone has none)
            self._tracked.add(**{RANKS_RNG_NAME: self._rng})
        else:
            self._tracked.remove(RANKS_RNG_NAME)

    def micro_batches(self, carried: Carried, gate: Callable[[], None] | None,
                      sharded: tuple[list[nn.Module], float] | None = None) -> Iterator[int]:
        """At full width this rank alone (DataParallel reduces in its backward); narrow, each carried rank with
        its own RNG, then their gradients reduced with every other process's. `sharded`: a sharded job's FSDP2
        models and gradient scale (dpstate.groups.narrow_sharded)."""
        if carried.in_order:
            yield carried.ranks[0]
            return
        if sharded is not None:
            yield from sharded_micro_batches(sharded[0], carried, self._rng, sharded[1])
            return
        narrow = NarrowStep([p.module for p in self._proxies], carried, self._abort, gate)
        for row, rank in enumerate(carried.ranks):
            with self._rng.as_rank(rank):
                yield rank
            narrow.took(row)
        narrow.reduce()
