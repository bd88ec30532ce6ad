"""One job run as several `dprun` processes on this host (multi-node mode): a token file, a free rendezvous
endpoint, the head (node rank 0, the controller's) started and listening, then the other nodes one by one."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from conftest import Processes, free_port
from helpers.e2e import controller_up


@dataclass
class MultiNodeJob:
    procs: Processes
    folder: Path  # every dprun's working folder, where the token file is
    endpoint: str  # 127.0.0.1:PORT, the head's --rdzv-endpoint
    events: Path  # the head's --events-file
    common: list  # the options every node is given: --rdzv-endpoint, --token-file and the job's own
    script: list  # the script and its arguments, after the options
    head: subprocess.Popen

    def start(self, *options, **popen) -> subprocess.Popen:
        """Another node: `dprun COMMON OPTIONS SCRIPT` (OPTIONS: its --node-rank, say), its output thrown away
        unless `popen` says otherwise."""
        popen = {"cwd": self.folder, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **popen}
        return self.procs.dprun(*self.common, *options, *self.script, **popen)


def multi_node_job(procs: Processes, folder: Path, *options, script: list, secret: str,
                   events: str = "events.jsonl", head_options: tuple = (), **head_popen) -> MultiNodeJob:
    """Writes `secret` to FOLDER/token, starts the head, `dprun --rdzv-endpoint 127.0.0.1:PORT --token-file TOKEN
    OPTIONS --node-rank 0 HEAD_OPTIONS --events-file FOLDER/EVENTS SCRIPT` (its stdout and stderr piped as text
    unless `head_popen` says otherwise), and waits until its controller listens: other nodes started before
    could take the endpoint's port (see helpers.e2e.controller_up)."""
    token = folder / "token"
    token.write_text(secret)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--rdzv-endpoint", endpoint, "--token-file", token, *options]
    events_file = folder / events
    head_popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **head_popen}
    head = procs.dprun(*common, "--node-rank", "0", *head_options, "--events-file", events_file, *script, cwd=folder,
                       **head_popen)
    controller_up(head, events_file)
    return MultiNodeJob(procs, folder, endpoint, events_file, common, list(script), head)
