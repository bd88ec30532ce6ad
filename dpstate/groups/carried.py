"""Which logical data-parallel ranks a process trains: its own, and while the job runs narrow (a replica lost with
no spare to take it) those of the lost replica too; the objects a script keeps per rank (job.per_rank) follow them.

A logical rank is a rank of the job at the width asked for; it keeps its data order and RNG for life, whichever
process trains it. At full width every process trains one, its own rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Carried:
    """ranks: the logical ranks this process trains, its own first; logical_world: the width asked for;
    places[r]: (process rank, row) of logical rank r, row being its place in that process's `ranks`."""

    ranks: tuple[int, ...]
    logical_world: int
    places: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, rank: int, world: int) -> "Carried":
        return cls((rank,), world, tuple((r, 0) for r in range(world)))

    @classmethod
    def assigned(cls, assignment: Sequence[Sequence[int]], process_rank: int) -> "Carried":
        """assignment[p]: the logical ranks process p trains, its own first; together each rank exactly once."""
        places: dict[int, tuple[int, int]] = {}
        for p, ranks in enumerate(assignment):
            for row, rank in enumerate(ranks):
                if rank in places:
                    raise ValueError(f"logical rank {rank} is assigned to processes {places[rank][0]} and {p}")
                places[rank] = (p, row)
        world = len(places)
        if sorted(places) != list(range(world)):
            raise ValueError(f"the logical ranks assigned are {sorted(places)}, not 0..{world - 1}")
        return cls(tuple(assignment[process_rank]), world, tuple(places[r] for r in range(world)))

    @property
    def narrow(self) -> bool:
        """Some process trains more than one logical rank."""
        return any(row > 0 for _, row in self.places)

    @property
    def in_order(self) -> bool:
        """Process r trains logical rank r alone (a job at full width that never shrank, or grew back in order):
        DataParallel's reduction is then the logical one."""
        return all(place == (r, 0) for r, place in enumerate(self.places))

    @property
    def rows(self) -> int:
        """The most logical ranks any one process trains."""
        return 1 + max(row for _, row in self.places)


class PerRank(Generic[T]):
    """batches = job.per_rank(lambda rank: Sampler(..., rank)): one object per logical rank this process trains,
    built when the rank comes to it; `batches[rank]` inside `for rank in step.data_ranks()`. Track it like any
    object: its state dict holds each rank's state under the rank, so a rank's data position follows it."""

    def __init__(self, factory: Callable[[int], T], ranks: Sequence[int]):
        self._factory = factory
        self._objects: dict[int, T] = {}
        self.carry(ranks)

    def carry(self, ranks: Sequence[int]) -> None:
        """Now train `ranks`: build the objects of new ones, drop those of ranks gone to another process."""
        self._objects = {r: self._objects[r] if r in self._objects else self._factory(r) for r in ranks}

    def __getitem__(self, rank: int) -> T:
        try:
            return self._objects[rank]
        except KeyError:
            raise KeyError(f"dpstate: this process trains logical ranks {sorted(self._objects)}, not {rank}: "
                           "index a per_rank object with the ranks of step.data_ranks()") from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._objects)

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": {str(r): _state_of(obj) for r, obj in self._objects.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["per_rank"]
        missing = [r for r in self._objects if str(r) not in saved]
        if missing:
            raise KeyError(f"the state of logical ranks {missing} is not in it (it holds {sorted(saved)})")
        for r, obj in self._objects.items():
            obj.load_state_dict(saved[str(r)])  # type: ignore[attr-defined]


def _state_of(obj: Any) -> Any:
    state_dict = getattr(obj, "state_dict", None)
    if not callable(state_dict):
        raise TypeError(f"job.per_rank(): {type(obj).__qualname__} has no state_dict()/load_state_dict()")
    return state_dict()

