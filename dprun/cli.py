"""The `dprun` command line (typer): options in torchrun's words, checked before anything starts.

`dprun [OPTIONS] SCRIPT [ARGS]...` runs a job; every bad input ends in one line and a non-zero exit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import faults
from .job import JobOptions, parse_endpoint, run_multinode, run_standalone
from .server import PortInUse

app = typer.Typer(add_completion=False, rich_markup_mode=None)

_RUN_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}


def _fail(message: str, code: int = 2) -> None:
    print(f"dprun: {message}", file=sys.stderr)
    raise typer.Exit(code)


@app.command(context_settings=_RUN_SETTINGS)
def run(
    script: str = typer.Argument(..., help="Training script (or command with --no-python), then its arguments."),
    script_args: Optional[List[str]] = typer.Argument(None, metavar="[ARGS]...", help="Arguments of the script."),
    nnodes: int = typer.Option(1, "--nnodes", help="Active nodes that train."),
    spares: int = typer.Option(0, "--spares", help="Spare nodes kept idle but initialized, promoted on a failure."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", "--nproc_per_node", help="Workers per node."),
    events_file: Optional[Path] = typer.Option(None, "--events-file", help="Append every event as a JSON line."),
    inject: Optional[List[str]] = typer.Option(None, "--inject", help=faults.HELP),
    heartbeat_interval: float = typer.Option(0.5, "--heartbeat-interval", help="Seconds between heartbeats."),
    heartbeat_timeout: float = typer.Option(
        5.0, "--heartbeat-timeout", help="A node silent this long is failed (frozen, partitioned)."),
    probe_timeout: float = typer.Option(
        1.0, "--probe-timeout", help="After a peer error, a node that does not answer a probe this fast is failed."),
    hang_timeout: float = typer.Option(
        600.0, "--hang-timeout",
        help="No training step anywhere for this long: the rank that is not waiting on its peers is failed "
             "(a hung worker); 0 turns it off."),
    replicas: int = typer.Option(1, "--replicas", help="Peer nodes holding each node's snapshots (ring)."),
    on_spare_exhausted: str = typer.Option(
        "fail", "--on-spare-exhausted",
        help="A failure with no spare left: 'fail' (stop with a message) or 'wait' (keep the survivors and "
             "wait for a node to join as a spare: dprun --rdzv-endpoint ... on another machine)."),
    spare_wait_timeout: float = typer.Option(
        1800.0, "--spare-wait-timeout", help="With --on-spare-exhausted wait: give up after this many seconds."),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", "--rdzv_endpoint",
        help="HOST:PORT of the controller (multi-node). Without it, every node runs on this machine."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", "--rdzv_id", help="Job id."),
    rdzv_timeout: float = typer.Option(300.0, "--rdzv-timeout", help="Seconds to wait for every node to register."),
    node_rank: int = typer.Option(-1, "--node-rank", "--node_rank",
                                  help="Multi-node: 0 hosts the controller; >= --nnodes joins as a spare."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="File with the job's secret (multi-node); or set DP_JOB_TOKEN."),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", help="This node's address for replica traffic."),
    standalone: bool = typer.Option(False, "--standalone", help="Every node on this machine (the default)."),
    no_python: bool = typer.Option(False, "--no-python", help="Run SCRIPT as a command, not with Python."),
) -> None:
    """Run SCRIPT on --nnodes nodes with --spares spares; survive node failures by hot-swapping a spare."""
    if nnodes < 1:
        _fail(f"--nnodes must be at least 1, got {nnodes}")
    if spares < 0:
        _fail(f"--spares must be 0 or more, got {spares}")
    if nproc_per_node < 1:
        _fail(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
        _fail("--heartbeat-timeout must be longer than --heartbeat-interval, both positive")
    if not no_python and not Path(script).is_file():
        _fail(f"no such script: {script} (give the path of a Python file, or --no-python for a command)")
    try:
        fault_specs = [faults.parse_fault(text) for text in inject or []]
    except faults.FaultSpecError as exc:
        _fail(str(exc))
    if replicas < 1:
        _fail(f"--replicas must be at least 1, got {replicas}")
    if on_spare_exhausted not in ("fail", "wait"):
        _fail(f"--on-spare-exhausted must be 'fail' or 'wait', got {on_spare_exhausted!r}")
    if hang_timeout < 0:
        _fail(f"--hang-timeout must be 0 (off) or positive, got {hang_timeout:g}")
    for spec in fault_specs:
        if spec.on_spare:
            if spec.node_rank >= spares:
                _fail(f"--inject {spec}: spare {spec.node_rank} does not exist with --spares {spares}")
            continue
        if spec.node_rank >= nnodes:
            _fail(f"--inject {spec}: node rank {spec.node_rank} does not exist with --nnodes {nnodes}")
        if spec.local_rank >= nproc_per_node:
            _fail(f"--inject {spec}: local rank {spec.local_rank} does not exist with --nproc-per-node {nproc_per_node}")
    token = os.environ.get("DP_JOB_TOKEN")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            _fail(f"cannot read --token-file {token_file}: {exc.strerror}")
        if not token:
            _fail(f"--token-file {token_file} is empty")
    if rdzv_endpoint:
        try:
            parse_endpoint(rdzv_endpoint)
        except ValueError as exc:
            _fail(str(exc))
    opts = JobOptions(
        nnodes=nnodes, spares=spares, nproc_per_node=nproc_per_node, script=[script, *(script_args or [])],
        events_file=str(events_file) if events_file else None, faults=fault_specs,
        heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, probe_timeout=probe_timeout,
        hang_timeout=hang_timeout, replicas=replicas, on_spare_exhausted=on_spare_exhausted,
        spare_wait_timeout=spare_wait_timeout,
        rdzv_timeout=rdzv_timeout, rdzv_endpoint=None if standalone else rdzv_endpoint, node_rank=node_rank,
        rdzv_id=rdzv_id, token=token, local_addr=local_addr, no_python=no_python,
    )
    try:
        code = run_multinode(opts) if opts.rdzv_endpoint else run_standalone(opts)
    except PortInUse as exc:
        _fail(str(exc))
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
