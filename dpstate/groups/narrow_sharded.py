"""A narrow step of a sharded job (FSDP2): the micro-batches of every logical rank a process carries accumulate
their gradients, reduced once over the narrowed data-parallel dim and scaled to the width asked for.

Every process of the narrow mesh carries as many logical ranks as the others (dprun.controller.narrowing), so each
makes the same collectives: FSDP2 all-gathers in each forward, and reduce-scatters only after the last backward
(set_requires_gradient_sync). Its reduction averages over the narrow dim; the full-width job averages over the
width asked for, hence the scale. Measured on dp=2 x tp=2 shrunk to dp=1 x tp=2: bitwise equal parameters.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from .carried import Carried
from .narrow import RanksRng


def fsdp_roots(modules: list[nn.Module]) -> list[nn.Module]:
    """The FSDP2 modules among `modules` (the parts' models): the ones whose gradient reduction is switched."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in modules if isinstance(m, FSDPModule)]


def sharded_micro_batches(roots: list[nn.Module], carried: Carried, rng: RanksRng, scale: float) -> Iterator[int]:
    """Each carried rank in turn, in logical rank order, under its own RNG; gradients reduced after the last,
    then multiplied by `scale` (the narrow data-parallel size over the one asked for)."""
    if not roots:
        raise RuntimeError("dpstate: this sharded job runs narrow, which needs its model sharded with FSDP2 "
                           "(fully_shard) over the data-parallel dim: its gradients cannot be accumulated otherwise")
    last = len(carried.ranks) - 1
    try:
        # in logical rank order, not own first: the processes of a tensor-parallel group carry the same replicas
        # (their own differ) and must compute on the same batch at once
        for row, rank in enumerate(sorted(carried.ranks)):
            for root in roots:
                root.set_requires_gradient_sync(row == last)  # type: ignore[operator]
            with rng.as_rank(rank):
                yield rank
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]
    with torch.no_grad():
        for root in roots:
            for param in root.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
