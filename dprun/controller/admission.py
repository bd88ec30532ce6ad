"""Whether a registering node belongs in this job, from what its dprun was told (Register.terms).

Refused: a node started for another job shape (--nnodes, --rdzv-id, --nproc-per-node). Admitted with a warning:
one that runs other arguments, or asks for a node rank another node has. Pure functions: the controller decides.
"""

from __future__ import annotations

import shlex
from typing import Iterable

from dpcommon import protocol as p

from .vocabulary import JobSpec


def refusal(spec: JobSpec, msg: p.Register) -> str | None:
    """Why `msg`'s node cannot join this job (it would wait for a rendezvous that never forms, or break the rank
    layout), said so that its user knows what to change; None: it may join."""
    who = f"node {msg.node_id} (host {msg.host})"
    if msg.nproc != spec.nproc_per_node:
        return f"{who} runs {msg.nproc} workers, the job needs {spec.nproc_per_node} per node (--nproc-per-node)"
    nnodes = msg.terms.nnodes
    if nnodes and nnodes != spec.nnodes:
        return (f"{who} was started with --nnodes {nnodes}, the job has {spec.nnodes}: give every node the same "
                "--nnodes")
    rdzv_id = msg.terms.rdzv_id
    if rdzv_id and rdzv_id != spec.job_id:
        return (f"{who} was started for job {rdzv_id!r} (--rdzv-id), this controller runs job {spec.job_id!r}: "
                "give every node the same --rdzv-id")
    return None


def warnings(spec: JobSpec, msg: p.Register, rank_holders: Iterable[tuple[str, int]]) -> list[str]:
    """What is odd about an admitted node: another command than the head's (other --steps leave ranks waiting on
    each other at the end), or a node rank that `rank_holders` (node id, wanted rank) of live nodes already asked
    for (it goes where the job has room, a spare if none)."""
    said = []
    script = msg.terms.script
    if script and spec.command and tuple(script) != spec.command:
        said.append(f"node {msg.node_id} (host {msg.host}) runs `{shlex.join(script)}`, the head "
                    f"`{shlex.join(spec.command)}`: every node should run the same script with the same arguments "
                    "(ranks that disagree on the number of steps wait on each other at the end until --hang-timeout)")
    if 0 <= msg.node_rank < spec.nnodes:
        for node_id, wanted in rank_holders:
            if wanted == msg.node_rank:
                said.append(f"node {msg.node_id} (host {msg.host}) asked for node rank {msg.node_rank}, which node "
                            f"{node_id} asked for first: it takes a free rank or stands by as a spare (give each "
                            "node its own --node-rank)")
                break
    return said
