"""A mesh's named dims and sizes, outermost first, and a rank's coordinates in it: one definition for the controller
(which plans a sharded job's shrink) and the workers (dpstate.groups.mesh, which build the mesh). No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DATA_DIMS = ("dp", "dp_shard")  # the dims a shrink narrows: the data-parallel replicas that shard the state


@dataclass(frozen=True)
class MeshDims:
    dims: tuple[tuple[str, int], ...]

    @classmethod
    def described(cls, text: str) -> "MeshDims":
        """The dims of describe()'s text ("dp=2 x tp=2", as workers say it in WorkerReady.mesh)."""
        dims = []
        for part in text.split(" x "):
            name, _, size = part.partition("=")
            dims.append((name.strip(), int(size)))
        return cls(tuple(dims))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    @property
    def total(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    @property
    def data_dim(self) -> str | None:
        """The dim a shrink narrows, if the mesh has one."""
        return next((name for name in self.names if name in DATA_DIMS), None)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s coordinate along each dim (ranks run over the dims outermost first)."""
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.names}

    def rank(self, coordinates: dict[str, int]) -> int:
        rank = 0
        for name, size in self.dims:
            rank = rank * size + coordinates[name]
        return rank

    def place(self, rank: int) -> tuple[int, ...]:
        """A rank's coordinates in every dim but the data dim: the ranks of one place form a column."""
        coordinates = self.coordinates(rank)
        return tuple(coordinates[name] for name in self.names if name != self.data_dim)

    def cannot_narrow(self) -> str | None:
        """Why a job of this mesh cannot shrink at all, or None."""
        if self.data_dim is None:
            return f"its mesh ({self.describe()}) has no data-parallel dim (dp or dp_shard) to narrow"
        if self.size("pp") > 1 or self.size("dp_replicate") > 1:
            return (f"its mesh ({self.describe()}) has pipeline-parallel or replicated (HSDP) dims: only a dp (or "
                    "dp_shard) dim with tp can narrow yet")
        if self.size(self.data_dim) < 2:
            return f"its data-parallel dim is of size 1 ({self.describe()}): no replica to go on without"
        return None

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.dims)
