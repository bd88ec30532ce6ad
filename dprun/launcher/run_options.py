"""What `dprun run` was told (RunArgs, as typer parsed it) made into a checked, frozen JobOptions: every check of
the command line in one place, a bad input an OptionsError holding the one line to print.

options_from_args prints nothing, exits nothing and writes no environment: the job's environment is given to it,
and its settings reach the workers through JobOptions (dprun.launcher.job sets them in the agents' environment). It does
look at the machine, as the checks must: the script, the folders (made, and probed for writing), the events file
(created), the token file, the saved steps of --resume-from, host names and this machine's addresses.
"""

from __future__ import annotations

import os
import socket
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dpagent.output import parse_ranks, parse_std
from dpcommon import fetch_streams, gloo_connect, traffic_class
from dpcommon.save_manifest import resume_steps

from . import option_checks as checks
from dprun.controller import faults
from dprun.controller.vocabulary import OnSpareExhausted, ShrinkFallback
from dprun.slurm import rendezvous as slurm
from dprun.slurm.orphaned_job import OnControllerLost
from .job import JobOptions, is_local, parse_endpoint, uses_dpstate


class OptionsError(ValueError):
    """A bad input of dprun's command line: str(error) is the one line to print (after "dprun: "); exit code 2."""


@dataclass(frozen=True)
class RunArgs:
    """The command line as typer parsed it (the defaults are dprun's): counts in torchrun's text (2, 2:2, auto),
    nothing checked yet. None: not given."""

    script: str
    script_args: tuple[str, ...] = ()
    nnodes: str = "1"
    spares: int = 0
    nproc_per_node: str = "1"
    recovery: str = "auto"
    module: bool = False
    no_python: bool = False
    rdzv_endpoint: str | None = None
    node_rank: int = -1
    token_file: Path | None = None
    local_addr: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout: float = 300.0
    replicas: int = 1
    snapshot_interval: str | None = None
    snapshot_check: str | None = None
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    probe_timeout: float = 1.0
    hang_timeout: float = 600.0
    on_spare_exhausted: str = "fail"
    shrink_fallback: str = "fail"
    spare_wait_timeout: float = 1800.0
    on_controller_lost: str = "cancel"
    max_restarts: int = 3
    inject: tuple[str, ...] = ()
    save_dir: Path | None = None
    save_every: int = 0
    save_interval: str | None = None
    save_keep: int = 2
    resume_from: Path | None = None
    tui: bool | None = None  # None: the dashboard where stdout is a terminal
    status_port: int = 0
    events_file: Path | None = None
    total_steps: int | None = None
    log_dir: Path | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    standalone: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str = "c10d"
    monitor_interval: float | None = None


RECOVERY = ("auto", "hot-swap", "restart")
RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")  # torchrun's; the controller is the rendezvous whatever it says
MASTER_PORT = 29500  # torchrun's default with --master-addr
TIME_FLAGS = (  # (flag, RunArgs field, whether 0 is allowed: --hang-timeout 0 turns the hang check off)
    ("--heartbeat-interval", "heartbeat_interval", False), ("--heartbeat-timeout", "heartbeat_timeout", False),
    ("--probe-timeout", "probe_timeout", False), ("--hang-timeout", "hang_timeout", True),
    ("--monitor-interval", "monitor_interval", False), ("--spare-wait-timeout", "spare_wait_timeout", False),
    ("--rdzv-timeout", "rdzv_timeout", False))


def _check(*problems: str | None) -> None:
    """Raise OptionsError with the first problem a check found, if any."""
    for problem in problems:
        if problem:
            raise OptionsError(problem)


def node_count(text: str, flag: str = "--nnodes") -> int:
    """N, or torchrun's MIN:MAX with MIN == MAX (DeadPool keeps the node count; spares replace nodes)."""
    lo, sep, hi = text.partition(":")
    if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
        raise OptionsError(f"{flag} must be a whole number, got {text!r}")
    if sep and int(lo) != int(hi):
        raise OptionsError(f"{flag} {text}: elastic node counts are not supported; DeadPool keeps {flag} fixed and "
                           "replaces failed nodes from --spares")
    return int(lo)


def workers_per_node(text: str) -> int:
    """--nproc-per-node N, or torchrun's auto (the GPUs, else the CPUs), cpu (the CPUs) or gpu (the GPUs)."""
    if text.strip().isdigit():
        return int(text)
    if text not in ("cpu", "auto", "gpu"):
        raise OptionsError(f"--nproc-per-node must be a whole number, auto, cpu or gpu, got {text!r}")
    gpus = 0
    if text != "cpu":
        import torch  # (slow to import: only for these two)

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and gpus == 0:
            raise OptionsError("--nproc-per-node gpu: no GPU is visible here")
    return gpus or os.cpu_count() or 1


def options_from_args(args: RunArgs, env: Mapping[str, str],
                      stdout_is_terminal: bool = False) -> tuple[JobOptions, list[str]]:
    """(the job's options, the notices to print before it starts) from what typer parsed and the environment dprun
    runs in (DP_JOB_TOKEN, Slurm's variables); OptionsError for the first bad input, in the order dprun checks."""
    notices: list[str] = []
    nnodes, nproc_per_node = node_count(args.nnodes), workers_per_node(args.nproc_per_node)
    _check(*(checks.seconds_problem(flag, getattr(args, name), zero_ok) for flag, name, zero_ok in TIME_FLAGS))
    heartbeat_interval, heartbeat_timeout = args.heartbeat_interval, args.heartbeat_timeout
    if args.monitor_interval is not None:  # torchrun's: how often node health is checked
        heartbeat_interval = args.monitor_interval
        heartbeat_timeout = max(heartbeat_timeout, 10 * args.monitor_interval)
    _check(checks.heartbeat_problem(heartbeat_interval, heartbeat_timeout),
           checks.port_problem("--status-port", args.status_port), checks.rdzv_id_problem(args.rdzv_id))
    rdzv_endpoint = args.rdzv_endpoint
    if args.master_addr and not rdzv_endpoint:
        rdzv_endpoint = f"{args.master_addr}:{args.master_port or MASTER_PORT}"
    _check(_launch_problem(args), traffic_class.env_problem(env), gloo_connect.env_problem(env),
           fetch_streams.env_problem(env))
    try:
        parse_std(args.redirects, "--redirects")
        parse_std(args.tee, "--tee")
        parse_ranks(args.local_ranks_filter)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    _check(_size_problem(nnodes, args.spares, nproc_per_node),
           checks.script_problem(args.script, args.module, args.no_python))
    restart_mode = args.recovery == "restart" or (
        args.recovery == "auto" and not uses_dpstate(args.script, args.module, args.no_python))
    try:
        fault_specs = tuple(faults.parse_fault(text) for text in args.inject)
    except faults.FaultSpecError as exc:
        raise OptionsError(str(exc)) from None
    snapshot_interval = _snapshot_interval(args.snapshot_interval)
    snapshot_check = _snapshot_check(args.snapshot_check)
    _check(checks.replicas_problem(args.replicas, nnodes), _recovery_problem(args, restart_mode),
           checks.save_schedule_problem(args.save_dir, args.save_every, args.save_interval, args.save_keep))
    resume_from, resume_step, resume_older = _resume(args.resume_from, nnodes * nproc_per_node, notices)
    for flag, folder in (("--save-dir", args.save_dir), ("--log-dir", args.log_dir)):  # (the first that fails)
        _check(checks.folder_problem(flag, folder) if folder else None)
    _check(checks.events_file_problem(args.events_file) if args.events_file is not None else None)
    _check(*(checks.fault_problem(spec, restart_mode, nnodes, args.spares, nproc_per_node) for spec in fault_specs))
    token = env.get("DP_JOB_TOKEN")
    if args.token_file is not None:
        token, problem = checks.read_token(args.token_file)
        _check(problem)
    where = _where(args, env, nnodes, rdzv_endpoint, bool(token), notices)
    on_this_machine = where.standalone or not where.rdzv_endpoint  # (run_standalone; else run_multinode)
    _check(checks.counts_problem(nnodes, where.spares, nproc_per_node, on_this_machine),
           None if on_this_machine or token else checks.NO_TOKEN,  # (run_multinode would exit 1)
           checks.combination_problem(on_this_machine, args.on_spare_exhausted, args.save_dir, snapshot_interval,
                                      where.node_rank),
           checks.local_addr_problem(args.local_addr))
    log_dir = args.log_dir
    if (args.redirects.strip() not in ("", "0") or args.tee.strip() not in ("", "0")) and log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="dprun-logs-"))
        notices.insert(0, f"-r/-t without --log-dir: the logs go to {log_dir}")
    options = JobOptions(
        nnodes=nnodes, spares=where.spares, nproc_per_node=nproc_per_node, script=(args.script, *args.script_args),
        events_file=str(args.events_file) if args.events_file else None, faults=fault_specs,
        heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, probe_timeout=args.probe_timeout,
        hang_timeout=args.hang_timeout, replicas=args.replicas,
        on_spare_exhausted=typing.cast(OnSpareExhausted, args.on_spare_exhausted),  # (checked above)
        shrink_fallback=typing.cast(ShrinkFallback, args.shrink_fallback),
        on_controller_lost=typing.cast(OnControllerLost, args.on_controller_lost), slurm=where.slurm,
        spare_wait_timeout=args.spare_wait_timeout,
        snapshot_interval=snapshot_interval, snapshot_check=snapshot_check, rdzv_timeout=args.rdzv_timeout,
        rdzv_endpoint=None if where.standalone else where.rdzv_endpoint, node_rank=where.node_rank,
        rdzv_id=where.rdzv_id, token=token, local_addr=args.local_addr, no_python=args.no_python,
        module=args.module, restart_mode=restart_mode, max_restarts=args.max_restarts,
        log_dir=str(log_dir) if log_dir else None, redirects=args.redirects, tee=args.tee,
        local_ranks_filter=args.local_ranks_filter, tui=stdout_is_terminal if args.tui is None else args.tui,
        status_port=args.status_port, total_steps=args.total_steps,
        save_dir=str(args.save_dir.resolve()) if args.save_dir else "", resume_from=resume_from,
        resume_step=resume_step, resume_older=resume_older, save_every=args.save_every, save_keep=args.save_keep,
        save_interval=checks.parse_duration("--save-interval", args.save_interval) if args.save_interval else 0.0,
    )
    return options, notices


def _launch_problem(args: RunArgs) -> str | None:
    """The choices among words: the rendezvous backend, the recovery, how SCRIPT runs; and a restart count."""
    if args.rdzv_backend not in RDZV_BACKENDS:
        return f"--rdzv-backend {args.rdzv_backend!r}: expected c10d or static (the controller is the rendezvous)"
    if args.recovery not in RECOVERY:
        return f"--recovery must be one of {', '.join(RECOVERY)}, got {args.recovery!r}"
    if args.max_restarts < 0:
        return f"--max-restarts must be 0 or more, got {args.max_restarts}"
    if args.module and args.no_python:
        return "-m/--module and --no-python do not go together"
    return None


def _size_problem(nnodes: int, spares: int, nproc_per_node: int) -> str | None:
    """Lower bounds of the job's size (the upper ones depend on where it runs: checks.counts_problem)."""
    if nnodes < 1:
        return f"--nnodes must be at least 1, got {nnodes}"
    if spares < 0:
        return f"--spares must be 0 or more, got {spares}"
    if nproc_per_node < 1:
        return f"--nproc-per-node must be at least 1, got {nproc_per_node}"
    return None


def _snapshot_interval(text: str | None) -> str | None:
    """--snapshot-interval as the workers read it (DP_SNAPSHOT_INTERVAL), or None: not given."""
    if text is None:
        return None
    text = text.strip().lower()
    _check(checks.snapshot_interval_problem(text))
    return text


def _snapshot_check(text: str | None) -> str | None:
    """--snapshot-check as the workers read it (DP_SNAPSHOT_CHECK), or None: not given."""
    if text is None:
        return None
    text = text.strip().lower()
    _check(checks.snapshot_check_problem(text))
    return text


def _recovery_problem(args: RunArgs, restart_mode: bool) -> str | None:
    """When no spare is left, when the controller is lost, and what a script that dprun restarts cannot do."""
    if args.on_spare_exhausted not in typing.get_args(OnSpareExhausted):
        return f"--on-spare-exhausted must be 'fail', 'wait' or 'shrink', got {args.on_spare_exhausted!r}"
    if args.shrink_fallback not in typing.get_args(ShrinkFallback):
        return f"--shrink-fallback must be 'fail' or 'wait', got {args.shrink_fallback!r}"
    if args.shrink_fallback != "fail" and args.on_spare_exhausted != "shrink":
        return ("--shrink-fallback says what --on-spare-exhausted shrink does where the job cannot shrink: give "
                "--on-spare-exhausted shrink too, or leave it out")
    if args.on_controller_lost not in typing.get_args(OnControllerLost):
        return f"--on-controller-lost must be 'cancel' or 'requeue', got {args.on_controller_lost!r}"
    if args.on_controller_lost == "requeue" and not args.save_dir:
        return "--on-controller-lost requeue needs --save-dir: the requeued job goes on from what is saved there"
    if args.on_spare_exhausted == "shrink" and restart_mode:
        return ("--on-spare-exhausted shrink needs a script that uses dpstate (its processes train a lost node's "
                "ranks); this one does not: use fail or wait")
    if args.on_spare_exhausted == "shrink" and (args.save_dir or args.resume_from):
        return ("--on-spare-exhausted shrink cannot be used with --save-dir or --resume-from yet: a narrow job's "
                "snapshots are not written to disk; use wait, or leave out --save-dir")
    if restart_mode and (args.save_dir or args.resume_from):
        return (f"{'--save-dir' if args.save_dir else '--resume-from'} needs a script that uses dpstate (its "
                "snapshots are what is saved); this one does not, so dprun restarts it on a failure (--recovery "
                "restart)")
    return None


def _resume(folder: Path | None, world_size: int,
            notices: list[str]) -> tuple[str, int, tuple[tuple[str, int], ...]]:
    """--resume-from: (the step folder to go on from, its step, the older complete ones to fall back on), or
    ("", -1, ()) when not given; the newer steps passed over are said in `notices`."""
    if folder is None:
        return "", -1, ()
    try:
        usable, skipped = resume_steps(folder, world_size)
    except ValueError as exc:
        raise OptionsError(f"--resume-from: {exc}") from None
    for passed in skipped:  # (a save cut short, or one nodes wrote in part)
        notices.append(f"passing over {passed.folder.name}: {passed.problems[0]}")
    if usable[0].folder != folder:
        notices.append(f"resuming from {usable[0].folder} (the newest complete step)")
    older = tuple((str(saved.folder.resolve()), saved.step) for saved in usable[1:])
    return str(usable[0].folder.resolve()), usable[0].step, older


@dataclass(frozen=True)
class _Where:
    """Where the job runs: this machine (standalone) or the controller's endpoint, and this node's place."""

    standalone: bool
    rdzv_endpoint: str | None
    node_rank: int
    rdzv_id: str | None
    spares: int
    slurm: slurm.SlurmJob | None


def _where(args: RunArgs, env: Mapping[str, str], nnodes: int, rdzv_endpoint: str | None, has_token: bool,
           notices: list[str]) -> _Where:
    """The rendezvous: given, or from the srun step dprun runs in (SLURM_NODEID is the node rank, the step's
    first node hosts the controller, nodes past --nnodes are spares); its host resolved; torchrun's
    single-node `--master-port P` / `--rdzv-endpoint localhost:P` taken as standalone."""
    standalone, node_rank, rdzv_id, spares = args.standalone, args.node_rank, args.rdzv_id, args.spares
    in_slurm = None
    if not standalone:
        try:
            in_slurm = slurm.from_environment(dict(env))
        except ValueError as exc:
            raise OptionsError(str(exc)) from None
    derived = in_slurm is not None and not rdzv_endpoint
    if in_slurm is not None:
        rdzv_endpoint = rdzv_endpoint or in_slurm.rdzv_endpoint  # node rank 0 hosts the controller
        node_rank = in_slurm.node_rank if node_rank < 0 else node_rank
        rdzv_id = rdzv_id or in_slurm.job_id
        if in_slurm.nodes < nnodes:
            raise OptionsError(f"the Slurm step has {in_slurm.nodes} node(s), fewer than --nnodes {nnodes}; ask for "
                               "more with -N")
        spares = max(spares, in_slurm.nodes - nnodes)
    elif not (standalone or rdzv_endpoint) and (notice := slurm.outside_step(dict(env))):
        notices.append(notice.removeprefix("dprun: "))
    if rdzv_endpoint:
        host = _resolved_host(rdzv_endpoint, derived)
        if nnodes == 1 and node_rank < 0 and not has_token and is_local(host):
            standalone = True
    if node_rank > 0 and (standalone or not rdzv_endpoint):
        raise OptionsError(f"--node-rank {node_rank} is one node of a multi-node job: give every node "
                           "--rdzv-endpoint HOST:PORT of the node with --node-rank 0 (without it, dprun runs every "
                           "node on this machine)")
    return _Where(standalone, rdzv_endpoint, node_rank, rdzv_id, spares, in_slurm)


def _resolved_host(rdzv_endpoint: str, derived: bool) -> str:
    """The endpoint's host, once it parses and resolves (`derived`: made from the Slurm step, not given)."""
    try:
        host, port = parse_endpoint(rdzv_endpoint)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    _check(checks.endpoint_host_problem(host))
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except ValueError as exc:  # (a name that IDNA cannot encode, as a..b)
        raise OptionsError(str(exc)) from None
    except OSError:
        raise OptionsError(f"cannot resolve {host}, the Slurm step's first node: pass --rdzv-endpoint ADDRESS:PORT "
                           "with its address, the same on every node" if derived
                           else f"--rdzv-endpoint: cannot resolve {host!r}") from None
    return host
