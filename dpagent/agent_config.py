"""What a node agent is started with (from dpagent's command line): its controller, its workers' command, the
graces of its shutdown, where its files go. Read by the agent and handed to its parts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .output import OutputSpec
from dpcommon.protocol import NO_RANK, JobTerms


@dataclass
class AgentConfig:
    controller: str
    node_id: str
    token: str
    command: list[str]
    nproc: int = 1
    spare: bool = False
    node_rank: int = NO_RANK
    local_addr: str = "127.0.0.1"
    run_dir: str | None = None
    stop_grace: float = 3.0  # after Stop is relayed, before SIGTERM
    term_grace: float = 2.0  # after SIGTERM, before SIGKILL
    save_timeout: float = 300.0  # the controller lost: how long the workers may take to write their snapshots
    register_timeout: float = 300.0  # no Welcome by then: exit 4
    output: OutputSpec = field(default_factory=OutputSpec)  # log files, console filter (torchrun's -r/-t)
    max_restarts: int = 3  # restart mode: for TORCHELASTIC_MAX_RESTARTS
    terms: JobTerms = field(default_factory=JobTerms)  # Register.terms: what its launcher was told of the job
    # what the death of the dprun that ran it (LAUNCHER_GONE) means: "controller", the controller's (save at
    # once); "member", this node leaves the job (Leaving; its workers killed); "": none is signalled
    launcher: str = ""
    env: dict = field(default_factory=lambda: dict(os.environ))
