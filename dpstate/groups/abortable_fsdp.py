"""FSDP2's all-gathers over Gloo, waited on so that the abort signal releases them: a survivor leaves an old
generation's all-gather when a newer one is asked for, whatever state Gloo is left in.

Severing (dpstate.groups.severing) releases a waiting collective by closing its connections, and almost always
does. In a few runs in 100 of the saved 3D job under load, a survivor's FSDP2 all-gather kept waiting after
every one of its Gloo connections had closed (ss listed none left): Gloo's op never learnt of it. A wait on the
op's future that the abort signal also ends (AbortSignal.wait_future) does not depend on Gloo learning it.
FSDP2's reduce-scatter keeps torch's wait: Gloo's has no future, and is done only once waited on (torch 2.13).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dpstate.steps.abort import AbortSignal

from .torch_private import fsdp_default_all_gather


def _abortable_all_gather(base: type, abort: AbortSignal) -> Any:
    """An instance of a subclass of FSDP2's default all-gather `base` whose blocking calls wait abortably."""

    class AbortableAllGather(base):
        def __call__(self, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            work = super().__call__(*args, async_op=True, **kwargs)
            if async_op or work is None:
                return work
            abort.wait_future(work.get_future())  # raises Aborted, or the op's own error
            return None

    return AbortableAllGather()


def wait_abortably(module: nn.Module, abort: AbortSignal) -> int:
    """Give every FSDP2 module under `module` an all-gather that `abort` releases; returns how many got it.
    (One whose parameters span several meshes keeps torch's: FSDP2 takes one custom comm per module.)"""
    base = fsdp_default_all_gather()
    if base is None:
        return 0
    from torch.distributed.fsdp import FSDPModule

    all_gather = _abortable_all_gather(base, abort)
    given = 0
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            try:
                sub.set_custom_all_gather(all_gather)
            except ValueError:
                continue
            given += 1
    return given

