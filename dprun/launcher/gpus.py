"""Which GPUs each node that dprun starts on this host sees, when several nodes (spares too) share one host.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so local nodes get disjoint CUDA_VISIBLE_DEVICES
slices, as separate machines would; where the host has too few GPUs for that, CUDA is hidden from them (CPU, Gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPlan:
    per_node: list[dict[str, str]]  # the extra environment of each local node's agent (and so its workers)
    notice: str = ""  # one line for the user where the plan changes what the workers get


def plan_local_gpus(nodes: int, nproc_per_node: int, visible: list[str], backend: str | None,
                    active: int | None = None) -> GpuPlan:
    """`nodes` local agents (spares included; `active` of them train at once) with `nproc_per_node` workers
    each, on a host whose usable GPUs are `visible` (CUDA_VISIBLE_DEVICES entries); `backend`: DP_BACKEND as
    the user set it, if at all."""
    untouched = GpuPlan([{} for _ in range(nodes)])
    # one training node (its spares replace it, never join it) sees every GPU, as with torchrun; DP_BACKEND: the
    # user's call
    if (nodes if active is None else active) <= 1 or not visible or backend:
        return untouched
    need = nodes * nproc_per_node
    if len(visible) >= need:
        return GpuPlan([{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * nproc_per_node:(i + 1) * nproc_per_node])}
                        for i in range(nodes)])
    notice = (f"dprun: {nodes} local nodes (spares included) x {nproc_per_node} worker(s) need {need} GPUs, one per "
              f"worker as NCCL requires, and {len(visible)} are visible: the workers run on the CPU with Gloo "
              "(start fewer nodes or spares to train on the GPUs; DP_BACKEND=gloo chooses the CPU without this "
              "notice)")
    return GpuPlan([{"CUDA_VISIBLE_DEVICES": ""} for _ in range(nodes)], notice)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices where it is unset)."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is not None and not names.strip():  # none, known without importing torch (seconds before launch)
        return []
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if names is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in names.split(",")][:count]
