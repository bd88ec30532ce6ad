"""Which bytes of a snapshot are checksummed: the state that data parallel ranks hold alike is laid out first and
only sampled (one block in DP_SNAPSHOT_CHECK), the rest is checksummed whole; a divergence found ends the trust.

Data parallel ranks hold bitwise the same parameters and optimizer state after every step, so a replica holder
keeps a peer's copy of them by reference to its own node's (dpagent.dedup). Digesting all of it on every
snapshot cost 6-7 ms of CPU per 100 MB here, a third of a capture; sampling keeps the check (a rank whose copy
differs is caught within about N snapshots) for an N-th of that. DP_SNAPSHOT_CHECK=full digests every block.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable

import torch

from dpcommon.checksum import CHECKSUM_BLOCK, CheckPlan

from . import packing as S

DEFAULT_CHECK_EVERY = 8


def check_every_from_env() -> int:
    """DP_SNAPSHOT_CHECK (dprun --snapshot-check): N (one data parallel block in N is digested per snapshot;
    default 8) or "full" (every block, as 1)."""
    spec = os.environ.get("DP_SNAPSHOT_CHECK", str(DEFAULT_CHECK_EVERY)).strip().lower()
    if spec == "full":
        return 1
    try:
        every = int(spec)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(f"DP_SNAPSHOT_CHECK must be a positive whole number or 'full', got {spec!r}")
    return every


def tensor_key(t: torch.Tensor) -> tuple[int, int]:
    """What identifies a tensor's bytes across a state_dict() (which returns new tensor objects): where they
    start and how many there are."""
    return t.data_ptr(), t.numel() * t.element_size()


def held_alike_elsewhere(tree: Any, shared_keys: Any) -> bool:
    """May a holder's node hold blocks of this capture bitwise alike (so that it is offered by its digests, not
    sent whole)? Yes unless its model state is sharded (dpstate.snapshot.state's layout lists DTensor shards)
    and none of it was declared data parallel: each rank's shards are its own."""
    layout = tree.get("layout") if isinstance(tree, dict) else None
    return bool(shared_keys) or not (isinstance(layout, dict) and layout.get("shards"))


def replicated_keys(modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> set[tuple[int, int]]:
    """tensor_key of every tensor that data parallel ranks hold alike after a step: the parameters of
    `modules` (their gradients are all-reduced) and those parameters' optimizer state."""
    params = [p for m in modules for p in m.parameters()]
    keys = {tensor_key(p) for p in params}
    ids = {id(p) for p in params}
    for opt in optimizers:
        for param, state in list(opt.state.items()):
            if id(param) in ids:
                keys.update(tensor_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    return keys


class CheckPlanner:
    """Lays out each capture (shared tensors first) and plans its checks; stops trusting on a divergence."""

    def __init__(self, every: int | None = None):
        self.every = check_every_from_env() if every is None else every
        self._cached: tuple[Any, Any, int] = ((), (), 0)  # (specs, flags, shared_key) of the last layout
        self._last_layout: tuple[Any, Any] = (None, None)  # ((flags, dtypes and shapes), layout()'s result)
        self.diverged = False

    def layout(self, tensors: list[torch.Tensor], shared: Callable[[], Any] | Any | None,
               ) -> tuple[list[S.TensorSpec], int, int, list[bool]]:
        """(specs, size, size of the shared part, each tensor's shared flag) of a capture; `shared` gives the
        tensor_keys of the shared tensors (or is a callable that does, evaluated now)."""
        keys = shared() if callable(shared) else shared
        flags = [tensor_key(t) in keys for t in tensors] if keys else [False] * len(tensors)
        key = (flags, [(t.dtype, t.shape) for t in tensors])
        if key != self._last_layout[0]:  # else the very same specs: comparing them later is an identity check
            specs, nbytes, shared_nbytes = S.layout_shared(tensors, flags)
            self._last_layout = (key, (specs, nbytes, shared_nbytes, flags))
        return self._last_layout[1]

    def plan(self, specs: list[S.TensorSpec], flags: list[bool], shared_nbytes: int, step: int) -> CheckPlan | None:
        """The CheckPlan of a capture of `step` whose shared part is `shared_nbytes` (None: nothing shared)."""
        if not shared_nbytes:
            return None
        cached_specs, cached_flags, key = self._cached
        if cached_specs != specs or cached_flags != flags:
            key = S.shared_key(specs, flags)
            self._cached = (specs, flags, key)
        return CheckPlan.for_step(shared_nbytes // CHECKSUM_BLOCK, key, self.every, step)

    def divergence(self, rank: int, step: int, blocks: list) -> bool:
        """A holder found digested shared blocks of this rank's snapshot that differ from its own node's copy:
        say so once (True then) and digest every block from now on."""
        if self.every == 1 and self.diverged:
            return False
        self.diverged, self.every = True, 1
        print(f"dpstate: rank {rank}'s parameters or optimizer state at step {step} differ from a data parallel "
              f"peer's (blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''}); is something changing them on one "
              "rank only? Every block of every snapshot is checksummed from now on", file=sys.stderr, flush=True)
        return True
