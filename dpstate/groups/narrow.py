"""A narrow step: each logical rank's micro-batch computed with that rank's own RNG, its gradient kept apart, and
the gradients of every process summed in logical rank order, as the full-width job sums them.

DataParallel divides each rank's gradient by the world size and, past two ranks, sums the ranks' rows in rank
order (its deterministic reduction); so does this, with the width asked for, over rows wherever they were
computed. The parameters after a narrow step are then bitwise those of the full-width step: same samples, same
RNG, same sums in the same order. (With DataParallel(deterministic=False) the full-width job sums in Gloo's ring
order instead, and the two agree only to rounding.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dpstate.snapshot.state import rng_state, set_rng_state
from dpstate.steps.abort import AbortSignal

from .carried import Carried
from .ddp import all_gather_flat


class RanksRng:
    """The RNG states of the logical ranks a process trains besides its own (whose state is the process's),
    tracked so that they travel in snapshots; empty at full width."""

    def __init__(self) -> None:
        self.states: dict[int, dict | None] = {}  # None: new here, until restored

    def carry(self, carried: Carried, given: dict[int, dict]) -> None:
        """Keep the states of the other ranks of `carried`: `given` for new ones (else their restore's), ours
        for the rest."""
        self.states = {r: given.get(r, self.states.get(r)) for r in carried.ranks[1:]}

    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """The process's RNG is `rank`'s inside (a rank of its own: unchanged); its own again after."""
        if rank not in self.states:
            yield
            return
        state = self.states[rank]
        if state is None:
            raise RuntimeError(f"dpstate: the RNG state of logical rank {rank}, new to this process, was not restored")
        own = rng_state()
        set_rng_state(state)
        try:
            yield
        finally:
            self.states[rank] = rng_state()
            set_rng_state(own)

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": {str(r): s for r, s in self.states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["per_rank"]
        missing = [r for r in self.states if str(r) not in saved]
        if missing:
            raise KeyError(f"the RNG state of logical ranks {missing} is not in it (it holds {sorted(saved)})")
        self.states = {r: saved[str(r)] for r in self.states}


class NarrowStep:
    """The gradients of one narrow step, as rows per logical rank this process trains (see the module)."""

    def __init__(self, modules: list[nn.Module], carried: Carried, abort: AbortSignal,
                 gate: Callable[[], None] | None):
        self.carried, self.abort, self.gate = carried, abort, gate
        seen: set[int] = set()
        self.groups: dict[tuple, list[nn.Parameter]] = {}  # (dtype, device) -> parameters, flattened together
        for module in modules:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.groups.setdefault((p.dtype, p.device), []).append(p)
        self.rows = {key: torch.zeros(carried.rows, sum(p.numel() for p in params), dtype=key[0], device=key[1])
                     for key, params in self.groups.items()}

    def took(self, row: int) -> None:
        """The backward of the micro-batch of carried.ranks[row] is done: its gradient becomes that row."""
        with torch.no_grad():
            for key, params in self.groups.items():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                self.rows[key][row].copy_(flat.div_(self.carried.logical_world))
                for p in params:
                    p.grad = None

    def reduce(self) -> None:
        """Every process's rows summed in logical rank order into each parameter's .grad."""
        if self.gate is not None:
            self.gate()
        world = dist.get_world_size()
        with torch.no_grad():
            for key, params in self.groups.items():
                mine = self.rows[key]
                gathered = torch.empty((world, *mine.shape), dtype=mine.dtype, device=mine.device)
                if world > 1:
                    work = all_gather_flat(gathered.view(-1), mine.view(-1), async_op=True)
                    self.abort.wait_future(work.get_future())
                else:
                    gathered[0].copy_(mine)
                total = gathered[self.carried.places[0]].clone()
                for place in self.carried.places[1:]:
                    total.add_(gathered[place])
                offset = 0
                for p in params:
                    p.grad = total[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
