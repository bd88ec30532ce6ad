"""Checks of dprun's options, one rule each, that dprun.launcher.run_options runs before anything starts: each returns
None when the input is fine, else the one line that says what is wrong and what to do (dprun prints it, exits 2)."""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from dprun.controller.faults import FaultSpec

MAX_NPROC_PER_NODE = 1024  # more workers than this per node: their heartbeats outgrow a message (1 MiB)
MAX_LOCAL_NODES = 256  # standalone: nodes + spares, all of them agents on this machine
MAX_LOCAL_WORKERS = 1024  # standalone: (nodes + spares) x workers per node, all on this machine
MAX_NODES = 100_000  # multi-node: --nnodes (and --spares)
RDZV_ID = re.compile(r"[A-Za-z0-9._-]+")
_BUDGET = re.compile(r"[0-9]*\.?[0-9]+%?")
NO_TOKEN = ("multi-node mode needs the job's secret: --token-file FILE (the same file on every node) or DP_JOB_TOKEN "
            "in the environment")  # word for word dprun.launcher.job.run_multinode's (which exits 1, not 2)


def seconds_problem(flag: str, value: float | None, allow_zero: bool = False) -> str | None:
    """A time in seconds must be finite and above 0 (or 0 too, where 0 has a meaning: allow_zero); None: not given."""
    if value is None or math.isfinite(value) and (value > 0 or (allow_zero and value == 0)):
        return None
    wanted = "0 or more" if allow_zero else "more than 0"
    return f"{flag} must be a number of seconds, {wanted} (not nan or inf), got {value:g}"


def heartbeat_problem(interval: float, timeout: float) -> str | None:
    """A node is failed once silent for the timeout, so the timeout must span more than one interval."""
    if timeout > interval:
        return None
    return (f"--heartbeat-timeout {timeout:g} must be larger than --heartbeat-interval {interval:g} (a node "
            "silent for the timeout is failed): give a timeout of several intervals")


def snapshot_interval_problem(text: str) -> str | None:
    """off, N > 0, auto or auto:BUDGET with the budget as dpstate.steps.interval reads it (a fraction, or a percentage
    with %) strictly between 0 and 1."""
    if re.fullmatch(r"off|[1-9][0-9]*|auto", text):
        return None
    given = text[len("auto:"):] if text.startswith("auto:") else None
    if given is None or not _BUDGET.fullmatch(given):
        return (f"--snapshot-interval must be a positive number of steps, auto, auto:BUDGET (e.g. auto:0.02 "
                f"or auto:2%) or off, got {text!r}")
    budget = float(given.rstrip("%")) / (100 if given.endswith("%") else 1)
    if 0 < budget < 1:
        return None
    return (f"--snapshot-interval {text}: the budget is the share of step time that snapshots may cost, more "
            "than 0 and less than 1 (e.g. auto:0.02) or than 100% (e.g. auto:2%)")


def snapshot_check_problem(text: str) -> str | None:
    """full, or N > 0 as dpstate.snapshot.checks reads it: one data parallel block in N is checksummed per snapshot."""
    if re.fullmatch(r"full|[1-9][0-9]*", text):
        return None
    return f"--snapshot-check must be a positive number of blocks (1 in N is checked) or full, got {text!r}"


def replicas_problem(replicas: int, nnodes: int) -> str | None:
    """Each node's snapshots go to the next --replicas training nodes of the ring (a single node's: its spares)."""
    if replicas < 1:
        return f"--replicas must be at least 1, got {replicas}"
    if nnodes > 1 and replicas > nnodes - 1:
        return (f"--replicas {replicas} needs {replicas + 1} nodes or more: each node's snapshots go to the next "
                f"--replicas training nodes of the ring; use --replicas {nnodes - 1} or a larger --nnodes")
    return None


def counts_problem(nnodes: int, spares: int, nproc_per_node: int, standalone: bool) -> str | None:
    """Upper bounds on the job's size: workers per node always; on one machine (standalone) its agents and
    workers; across machines the node count."""
    if nproc_per_node > MAX_NPROC_PER_NODE:
        return f"--nproc-per-node {nproc_per_node} is too many: at most {MAX_NPROC_PER_NODE} workers per node"
    if not standalone:
        for flag, value in (("--nnodes", nnodes), ("--spares", spares)):
            if value > MAX_NODES:
                return f"{flag} {value} is too many: at most {MAX_NODES} in a multi-node job"
        return None
    if nnodes + spares > MAX_LOCAL_NODES:
        return (f"--nnodes {nnodes} + --spares {spares} is too many for one machine: at most {MAX_LOCAL_NODES} "
                "(give --rdzv-endpoint to spread the nodes over machines)")
    if (nnodes + spares) * nproc_per_node > MAX_LOCAL_WORKERS:
        return (f"(--nnodes {nnodes} + --spares {spares}) x --nproc-per-node {nproc_per_node} is "
                f"{(nnodes + spares) * nproc_per_node} workers, too many for one machine: at most "
                f"{MAX_LOCAL_WORKERS} (give --rdzv-endpoint to spread the nodes over machines)")
    return None


def port_problem(flag: str, port: int) -> str | None:
    if 0 <= port <= 65535:
        return None
    return f"{flag} must be a port from 1 to 65535, or 0 for any free one, got {port}"


def rdzv_id_problem(rdzv_id: str | None) -> str | None:
    """The job id names the job's folder under --log-dir, so it must be one plain name (None or "": generated)."""
    if not rdzv_id or RDZV_ID.fullmatch(rdzv_id) and rdzv_id not in (".", ".."):
        return None
    return (f"--rdzv-id {rdzv_id!r}: use only letters, digits, '.', '_' and '-' (not '.' or '..' alone): it "
            "names the job's folder under --log-dir")


def script_problem(script: str, module: bool, no_python: bool) -> str | None:
    """The script (python mode) or the command (--no-python) exists and can run; a module is Python's to find."""
    if module:
        return None
    path = Path(script)
    if not no_python:
        if path.is_dir():
            return f"{script} is a directory, not a script (give the path of a Python file, or -m for a module)"
        if not path.is_file():
            return (f"no such script: {script} (give the path of a Python file, -m for a module, or --no-python "
                    "for a command)")
        return None
    if "/" not in script and os.sep not in script:
        return None if shutil.which(script) else f"no such command: {script} (not on PATH)"
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"no such command: {script} ({exc.strerror})"
    if stat.S_ISDIR(mode):
        return f"{script} is a directory, not a command"
    if not stat.S_ISREG(mode):
        return f"{script} is not a regular file, so not a command to run"
    if not os.access(script, os.X_OK):
        return f"{script} is not executable: chmod +x {script}, or run it with its interpreter"
    return None


def folder_problem(flag: str, folder: Path) -> str | None:
    """Make the folder if need be and write (then delete) a probe file in it: an existing folder nobody may
    write to passes mkdir but not this."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag} {folder}: {exc.strerror}"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dprun-probe-"):
            pass
    except OSError as exc:
        return f"{flag} {folder}: cannot write there ({exc.strerror}); give a folder every node can write"
    return None


def events_file_problem(events_file: Path) -> str | None:
    """The events are appended to the file: open it so (creating it) now, not once the job runs."""
    try:
        with open(events_file, "a"):
            pass
    except OSError as exc:
        return f"--events-file {events_file}: {exc.strerror}"
    return None


def fault_problem(spec: FaultSpec, restart_mode: bool, nnodes: int, spares: int, nproc_per_node: int) -> str | None:
    """An --inject fault must name a node, spare and worker that the job has, and a step only where dprun sees
    steps (a script that uses dpstate)."""
    if restart_mode and spec.trigger == "step":
        return (f"--inject {spec}: this script does not use dpstate, so dprun does not see its steps; trigger it at "
                f"a time instead ({spec.kind}:{spec.node_rank}@t=SECONDS)")
    if spec.on_spare:
        if spec.node_rank >= spares:
            return f"--inject {spec}: spare {spec.node_rank} does not exist with --spares {spares}"
        return None
    if spec.node_rank >= nnodes:
        return f"--inject {spec}: node rank {spec.node_rank} does not exist with --nnodes {nnodes}"
    if spec.local_rank >= nproc_per_node:
        return f"--inject {spec}: local rank {spec.local_rank} does not exist with --nproc-per-node {nproc_per_node}"
    return None


def read_token(token_file: Path) -> tuple[str, str | None]:
    """(the secret in --token-file, None) or ("", the problem): unreadable, not UTF-8 text, or empty."""
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        return "", (f"--token-file {token_file} is not text (UTF-8): write the secret as text, e.g. "
                    f"openssl rand -hex 16 > {token_file}")
    except OSError as exc:
        return "", f"cannot read --token-file {token_file}: {exc.strerror}"
    return token, None if token else f"--token-file {token_file} is empty"


def local_addr_problem(addr: str | None) -> str | None:
    """--local-addr is where this node's peers reach its replica store: an address this machine can listen on
    (else its agent fails at once, and the controller waited --rdzv-timeout for it)."""
    if not addr:
        return None
    try:
        family, kind, proto, _, where = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(where)
    except OSError as exc:
        return (f"--local-addr {addr}: this machine cannot listen there ({exc.strerror or exc}): give the address "
                "of one of its interfaces that the other nodes reach, or leave it out")
    return None


def endpoint_host_problem(host: str) -> str | None:
    if ":" in host:
        return (f"--rdzv-endpoint [{host}]: IPv6 addresses are not supported yet: give an IPv4 address or a host "
                "name")
    return None


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(flag: str, text: str) -> float:
    """'90', '90s', '30m', '2h', '1d' in seconds; ValueError with the one line to print."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{flag} must be a duration above 0 such as 90s, 30m or 2h, got {text!r}")
    return float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]


def save_schedule_problem(save_dir, save_every: int, save_interval: str | None, save_keep: int) -> str | None:
    """--save-every / --save-interval / --save-keep: background saves need a folder, counts must make sense."""
    if (save_every or save_interval) and not save_dir:
        flag = "--save-every" if save_every else "--save-interval"
        return f"{flag} saves into --save-dir: give --save-dir DIR (on storage every node sees)"
    if save_every < 0:
        return f"--save-every must be a number of steps, 1 or more (0: off), got {save_every}"
    if save_keep < 1:
        return f"--save-keep must be 1 or more (the newest complete step is always kept), got {save_keep}"
    if save_interval is not None:
        try:
            parse_duration("--save-interval", save_interval)
        except ValueError as exc:
            return str(exc)
    return None


def combination_problem(standalone: bool, on_spare_exhausted: str, save_dir, snapshot_interval: str | None,
                        node_rank: int) -> str | None:
    """Options that are each fine but cannot work together."""
    if standalone and on_spare_exhausted == "wait":
        return ("--on-spare-exhausted wait waits for a node to join from another machine, which a standalone job "
                "cannot take (its nodes are all here): give every node --rdzv-endpoint, or add --spares")
    if save_dir and snapshot_interval == "off":
        return "--save-dir writes the job's snapshots and --snapshot-interval off takes none: drop one of them"
    if node_rank < -1:
        return f"--node-rank must be 0 or more (or left out), got {node_rank}"
    return None
