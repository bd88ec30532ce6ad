"""When a job's Gloo groups connect their ranks: every pair as a group is made (Gloo's full mesh), or each pair on
its first use (lazily). Torch-free, so that dprun checks DP_GLOO_LAZY_CONNECT before anything starts.

The full mesh costs R - 1 connects per rank and R^2 reads of the one TCPStore per group made: 16.8 million reads at
4,096 ranks, minutes of the store's CPU in every recovery (docs/scaling.md). Lazily (torch's TORCH_GLOO_LAZY_INIT,
read at each group's creation) a rank writes its key and reads only those of the peers it talks to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LAZY_CONNECT_FROM = 128  # ranks: where the full mesh's reads start to cost a recovery seconds
CHOICES = ("0", "1", "auto")


def env_problem(env: Mapping[str, str]) -> str | None:
    """None where DP_GLOO_LAZY_CONNECT is unset or one of CHOICES, else the one line that says what to give."""
    raw = env.get("DP_GLOO_LAZY_CONNECT", "auto")
    if raw.strip().lower() in CHOICES:
        return None
    return (f"DP_GLOO_LAZY_CONNECT={raw!r}: give 1 (each pair of ranks connects on its first use), 0 (every pair "
            f"as a group is made) or auto (the default: lazily from {LAZY_CONNECT_FROM} ranks)")


def lazy_connect(world_size: int) -> bool:
    """Do the Gloo groups of a job of `world_size` ranks connect lazily (DP_GLOO_LAZY_CONNECT)? dprun checked it."""
    problem = env_problem(os.environ)
    if problem:
        raise ValueError(problem)
    value = os.environ.get("DP_GLOO_LAZY_CONNECT", "auto").strip().lower()
    return value == "1" or (value == "auto" and world_size >= LAZY_CONNECT_FROM)
