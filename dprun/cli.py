"""The `dprun` command line (typer): options in torchrun's words (and its PET_* variables), checked before
anything starts. `dprun [OPTIONS] SCRIPT [ARGS]...` runs a job; `dprun status`, `dprun report` watch and explain one.

Every bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import List, Optional

import typer

from dpagent.save_manifest import resume_steps

from . import checks_cli as checks
from . import faults, slurm
from .job import JobOptions, is_local, parse_endpoint, run_multinode, run_standalone, uses_dpstate
from .server import PortInUse

app = typer.Typer(add_completion=False, rich_markup_mode=None)
status_app = typer.Typer(add_completion=False, rich_markup_mode=None)
report_app = typer.Typer(add_completion=False, rich_markup_mode=None)
RECOVERY = ("auto", "hot-swap", "restart")


def _click_classes(name: str) -> tuple[type, ...]:
    """UsageError / Abort from the click that typer uses (its own copy since typer 0.22, else click)."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)

EPILOG = ("Also: `dprun status` attaches to a running job's dashboard, `dprun report EVENTS.jsonl` explains its "
          "failures and recoveries (each has --help). Options with a torchrun twin also read torchrun's PET_* "
          "environment variables (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, ...).")

_RUN_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}


def _fail(message: str, code: int = 2) -> None:
    print(f"dprun: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _check(*problems: str | None) -> None:
    """_fail with the first problem that a check of checks_cli found, if any."""
    for problem in filter(None, problems):
        _fail(problem)


def _count(text: str, flag: str) -> int:
    """--nnodes N or torchrun's MIN:MAX with MIN == MAX (DeadPool keeps the node count; spares replace nodes)."""
    lo, sep, hi = text.partition(":")
    if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
        _fail(f"{flag} must be a whole number, got {text!r}")
    if sep and int(lo) != int(hi):
        _fail(f"{flag} {text}: elastic node counts are not supported; DeadPool keeps {flag} fixed and replaces "
              "failed nodes from --spares")
    return int(lo)


def _nproc(text: str) -> int:
    """--nproc-per-node N, or torchrun's auto / cpu / gpu."""
    if text.strip().isdigit():
        return int(text)
    if text in ("cpu", "auto", "gpu"):
        gpus = 0
        if text != "cpu":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if text == "gpu" and gpus == 0:
                _fail("--nproc-per-node gpu: no GPU is visible here")
        return gpus or os.cpu_count() or 1
    _fail(f"--nproc-per-node must be a whole number, auto, cpu or gpu, got {text!r}")
    return 0


@app.command(context_settings=_RUN_SETTINGS, epilog=EPILOG)
def run(
    script: str = typer.Argument(..., metavar="SCRIPT",
                                 help="Training script (a module with -m, a command with --no-python)."),
    script_args: Optional[List[str]] = typer.Argument(None, metavar="[ARGS]...", help="Arguments of the script."),
    nnodes_text: str = typer.Option("1", "--nnodes", envvar="PET_NNODES",
                                    help="Active nodes that train (N, or torchrun's N:N)."),
    spares: int = typer.Option(0, "--spares", help="Spare nodes kept idle but initialized, promoted on a failure."),
    nproc_text: str = typer.Option("1", "--nproc-per-node", "--nproc_per_node", envvar="PET_NPROC_PER_NODE",
                                   help="Workers per node: a number, or auto / cpu / gpu as in torchrun."),
    events_file: Optional[Path] = typer.Option(None, "--events-file", help="Append every event as a JSON line."),
    inject: Optional[List[str]] = typer.Option(None, "--inject", help=faults.HELP),
    heartbeat_interval: float = typer.Option(0.5, "--heartbeat-interval", help="Seconds between heartbeats."),
    heartbeat_timeout: float = typer.Option(
        5.0, "--heartbeat-timeout", help="A node silent this long is failed (frozen, partitioned)."),
    probe_timeout: float = typer.Option(
        1.0, "--probe-timeout", help="After a peer error, or a connection to the controller closed, a node that "
                                     "does not answer a probe this fast is failed."),
    hang_timeout: float = typer.Option(
        600.0, "--hang-timeout",
        help="No training step anywhere for this long: the rank that is not waiting on its peers is failed "
             "(a hung worker); once training finished, a worker that has not exited this long after ends the "
             "job (exit 1); 0 turns it off."),
    replicas: int = typer.Option(1, "--replicas", help="Peer nodes holding each node's snapshots (ring)."),
    snapshot_interval: Optional[str] = typer.Option(
        None, "--snapshot-interval",
        help="Snapshot every N steps (default 1: every step; a failure costs at most N + 1 steps, 2N on a GPU, "
             "where a snapshot's replication may take up to N steps), 'auto' "
             "(measure a snapshot's cost and take the smallest interval that keeps it under 1% of step time; "
             "auto:0.02 for 2%), or 'off' (no snapshots: a failure cannot be recovered). Workers get it as "
             "DP_SNAPSHOT_INTERVAL."),
    snapshot_check: Optional[str] = typer.Option(
        None, "--snapshot-check",
        help="Of the state that data parallel ranks hold alike (kept by a holder by reference to its own "
             "node's copy), checksum one block in N per snapshot (default 8: a rank whose copy differs from its "
             "peers' is caught within about N snapshots, for an N-th of the CPU), or 'full' (every block of "
             "every snapshot). Workers get it as DP_SNAPSHOT_CHECK."),
    on_spare_exhausted: str = typer.Option(
        "fail", "--on-spare-exhausted",
        help="A failure with no spare left: 'fail' (stop with a message) or 'wait' (keep the survivors and "
             "wait for a node to join as a spare: dprun --rdzv-endpoint ... on another machine)."),
    spare_wait_timeout: float = typer.Option(
        1800.0, "--spare-wait-timeout", help="With --on-spare-exhausted wait: give up after this many seconds."),
    on_controller_lost: str = typer.Option(
        "cancel", "--on-controller-lost",
        help="Under srun, when the controller dies with the node of the batch script: once Slurm takes that node "
             "out of the job and the nodes left have saved to --save-dir, 'cancel' the job (its nodes go back) or "
             "'requeue' it (Slurm runs the batch script again, which goes on with --resume-from)."),
    save_dir: Optional[Path] = typer.Option(
        None, "--save-dir",
        help="A job that stops (a failure it cannot recover, a script error, a signal) first writes its newest "
             "snapshot of every rank here, as DIR/step-S (on storage every node sees), to go on from with "
             "--resume-from."),
    save_every: int = typer.Option(
        0, "--save-every", metavar="N",
        help="Also save in the background every N steps into --save-dir (the agents write the copies they hold; "
             "training never waits): the job then survives losing every node. 0: off."),
    save_interval: Optional[str] = typer.Option(
        None, "--save-interval", metavar="DURATION",
        help="Save in the background at most this often (90s, 30m, 2h), into --save-dir."),
    save_keep: int = typer.Option(
        2, "--save-keep", metavar="K", help="Background saves keep the newest K complete steps in --save-dir."),
    resume_from: Optional[Path] = typer.Option(
        None, "--resume-from",
        help="Go on from a saved step (a --save-dir: its newest complete step, or one of its step-S folders): "
             "every rank starts from step S + 1; a step found damaged when read falls back to the one before. "
             "The job must have as many ranks."),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", "--rdzv_endpoint", envvar="PET_RDZV_ENDPOINT",
        help="HOST:PORT of the controller (multi-node). Without it, every node runs on this machine, "
             "or under `srun` the step's first node hosts it on port 10000 + job id mod 20000."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", "--rdzv_id", envvar="PET_RDZV_ID", help="Job id."),
    rdzv_backend: str = typer.Option("c10d", "--rdzv-backend", "--rdzv_backend", envvar="PET_RDZV_BACKEND",
                                     help="Accepted for torchrun compatibility (c10d or static): the controller "
                                          "is always the rendezvous."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", "--master_addr", envvar="PET_MASTER_ADDR",
                                              help="torchrun's static rendezvous: the same as --rdzv-endpoint "
                                                   "MASTER_ADDR:MASTER_PORT."),
    master_port: Optional[int] = typer.Option(None, "--master-port", "--master_port", envvar="PET_MASTER_PORT",
                                              help="With --master-addr (default 29500)."),
    max_restarts: int = typer.Option(3, "--max-restarts", "--max_restarts", envvar="PET_MAX_RESTARTS",
                                     help="Restart recoveries allowed for scripts that do not use dpstate; "
                                          "hot-swap recoveries are bounded by --spares only."),
    monitor_interval: Optional[float] = typer.Option(
        None, "--monitor-interval", "--monitor_interval", envvar="PET_MONITOR_INTERVAL",
        help="torchrun's: how often node health is checked; sets --heartbeat-interval (worker exits are "
             "seen at once anyway)."),
    recovery: str = typer.Option(
        "auto", "--recovery",
        help="hot-swap (the script uses dpstate: survivors keep running, a spare restores the lost state), "
             "restart (a plain torchrun script: every worker restarts, the spare standing in for the dead "
             "node), or auto: hot-swap when the script's source mentions dpstate."),
    log_dir: Optional[Path] = typer.Option(
        None, "--log-dir", "--log_dir", envvar="PET_LOG_DIR",
        help="Per-rank logs: LOG_DIR/<job>/<node>/attempt_<k>/<local_rank>/{stdout,stderr}.log."),
    redirects: str = typer.Option(
        "0", "-r", "--redirects", envvar="PET_REDIRECTS",
        help="Streams that go to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank "
             "(0:3,1:2). Without --log-dir a temporary one is made."),
    tee: str = typer.Option("0", "-t", "--tee", envvar="PET_TEE",
                            help="Streams that go to the log files and the console (same syntax as -r)."),
    local_ranks_filter: str = typer.Option(
        "", "--local-ranks-filter", "--local_ranks_filter", envvar="PET_LOCAL_RANKS_FILTER",
        help="Only these local ranks' output reaches the console, e.g. 0 (log files still get everything)."),
    module: bool = typer.Option(False, "-m", "--module", envvar="PET_MODULE",
                                help="SCRIPT is a Python module, run as with python -m."),
    tui: Optional[bool] = typer.Option(
        None, "--tui/--no-tui", help="The live dashboard (default when stdout is a terminal) or one line per event."),
    status_port: int = typer.Option(0, "--status-port",
                                    help="Port for `dprun status` to attach to (default: any free port, printed)."),
    total_steps: Optional[int] = typer.Option(
        None, "--total-steps", help="Steps in the job, for the dashboard's progress bar (default: the script's "
                                    "--steps / --max-steps argument)."),
    rdzv_timeout: float = typer.Option(300.0, "--rdzv-timeout", help="Seconds to wait for every node to register."),
    node_rank: int = typer.Option(-1, "--node-rank", "--node_rank", envvar="PET_NODE_RANK",
                                  help="Multi-node: 0 hosts the controller; >= --nnodes joins as a spare. "
                                       "Under `srun`: SLURM_NODEID."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="File with the job's secret (multi-node); or set DP_JOB_TOKEN."),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", "--local_addr", envvar="PET_LOCAL_ADDR",
                                             help="This node's address for replica traffic."),
    standalone: bool = typer.Option(False, "--standalone", envvar="PET_STANDALONE",
                                    help="Every node on this machine (the default)."),
    no_python: bool = typer.Option(False, "--no-python", "--no_python", envvar="PET_NO_PYTHON",
                                   help="Run SCRIPT as a command, not with Python."),
) -> None:
    """Run SCRIPT on --nnodes nodes with --spares spares; survive node failures by hot-swapping a spare."""
    nnodes, nproc_per_node = _count(nnodes_text, "--nnodes"), _nproc(nproc_text)
    _check(*(checks.seconds_problem(flag, seconds, allow_zero) for flag, seconds, allow_zero in (
        ("--heartbeat-interval", heartbeat_interval, False), ("--heartbeat-timeout", heartbeat_timeout, False),
        ("--probe-timeout", probe_timeout, False), ("--hang-timeout", hang_timeout, True),  # 0: no hang check
        ("--monitor-interval", monitor_interval, False), ("--spare-wait-timeout", spare_wait_timeout, False),
        ("--rdzv-timeout", rdzv_timeout, False))))
    if monitor_interval is not None:
        heartbeat_interval = monitor_interval
        heartbeat_timeout = max(heartbeat_timeout, 10 * monitor_interval)
    _check(checks.heartbeat_problem(heartbeat_interval, heartbeat_timeout),
           checks.port_problem("--status-port", status_port), checks.rdzv_id_problem(rdzv_id))
    if master_addr and not rdzv_endpoint:
        rdzv_endpoint = f"{master_addr}:{master_port or 29500}"
    if rdzv_backend not in ("c10d", "static", "etcd", "etcd-v2"):
        _fail(f"--rdzv-backend {rdzv_backend!r}: expected c10d or static (the controller is the rendezvous)")
    if recovery not in RECOVERY:
        _fail(f"--recovery must be one of {', '.join(RECOVERY)}, got {recovery!r}")
    if max_restarts < 0:
        _fail(f"--max-restarts must be 0 or more, got {max_restarts}")
    if module and no_python:
        _fail("-m/--module and --no-python do not go together")
    from dpagent.output import parse_ranks, parse_std

    try:
        parse_std(redirects, "--redirects")
        parse_std(tee, "--tee")
        parse_ranks(local_ranks_filter)
    except ValueError as exc:
        _fail(str(exc))
    if (redirects.strip() not in ("", "0") or tee.strip() not in ("", "0")) and log_dir is None:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="dprun-logs-"))
        print(f"dprun: -r/-t without --log-dir: the logs go to {log_dir}", file=sys.stderr)
    if nnodes < 1:
        _fail(f"--nnodes must be at least 1, got {nnodes}")
    if spares < 0:
        _fail(f"--spares must be 0 or more, got {spares}")
    if nproc_per_node < 1:
        _fail(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    _check(checks.script_problem(script, module, no_python))
    restart_mode = recovery == "restart" or (recovery == "auto" and not uses_dpstate(script, module, no_python))
    try:
        fault_specs = [faults.parse_fault(text) for text in inject or []]
    except faults.FaultSpecError as exc:
        _fail(str(exc))
    if snapshot_interval is not None:
        snapshot_interval = snapshot_interval.strip().lower()
        _check(checks.snapshot_interval_problem(snapshot_interval))
        os.environ["DP_SNAPSHOT_INTERVAL"] = snapshot_interval  # the agents and their workers inherit it
    if snapshot_check is not None:
        snapshot_check = snapshot_check.strip().lower()
        if not re.fullmatch(r"full|[1-9][0-9]*", snapshot_check):
            _fail(f"--snapshot-check must be a positive number of blocks (1 in N is checked) or full, "
                  f"got {snapshot_check!r}")
        os.environ["DP_SNAPSHOT_CHECK"] = snapshot_check
    if replicas < 1:
        _fail(f"--replicas must be at least 1, got {replicas}")
    if nnodes > 1 and replicas > nnodes - 1:  # (a single node's snapshots go to its spares)
        _fail(f"--replicas {replicas} needs {replicas + 1} nodes or more: each node's snapshots go to the next "
              f"--replicas training nodes of the ring; use --replicas {nnodes - 1} or a larger --nnodes")
    if on_spare_exhausted not in ("fail", "wait"):
        _fail(f"--on-spare-exhausted must be 'fail' or 'wait', got {on_spare_exhausted!r}")
    if on_controller_lost not in ("cancel", "requeue"):
        _fail(f"--on-controller-lost must be 'cancel' or 'requeue', got {on_controller_lost!r}")
    if on_controller_lost == "requeue" and not save_dir:
        _fail("--on-controller-lost requeue needs --save-dir: the requeued job goes on from what is saved there")
    if restart_mode and (save_dir or resume_from):
        _fail(f"{'--save-dir' if save_dir else '--resume-from'} needs a script that uses dpstate (its snapshots are "
              "what is saved); this one does not, so dprun restarts it on a failure (--recovery restart)")
    _check(checks.save_schedule_problem(save_dir, save_every, save_interval, save_keep))
    resume_step, resume_older = -1, ()
    if resume_from is not None:
        try:
            usable, skipped = resume_steps(resume_from, nnodes * nproc_per_node)
        except ValueError as exc:
            _fail(f"--resume-from: {exc}")
        for passed in skipped:  # (a save cut short, or one nodes wrote in part)
            print(f"dprun: passing over {passed.folder.name}: {passed.problems[0]}", file=sys.stderr)
        if usable[0].folder != resume_from:
            print(f"dprun: resuming from {usable[0].folder} (the newest complete step)", file=sys.stderr)
        resume_from, resume_step = usable[0].folder, usable[0].step
        resume_older = tuple((str(s.folder.resolve()), s.step) for s in usable[1:])
    for flag, folder in (("--save-dir", save_dir), ("--log-dir", log_dir)):  # (stops at the first that fails)
        _check(checks.folder_problem(flag, folder) if folder else None)
    if events_file is not None:
        try:
            with open(events_file, "a"):  # the events are appended to it
                pass
        except OSError as exc:
            _fail(f"--events-file {events_file}: {exc.strerror}")
    for spec in fault_specs:
        if restart_mode and spec.trigger == "step":
            _fail(f"--inject {spec}: this script does not use dpstate, so dprun does not see its steps; trigger it "
                  f"at a time instead ({spec.kind}:{spec.node_rank}@t=SECONDS)")
        if spec.on_spare:
            if spec.node_rank >= spares:
                _fail(f"--inject {spec}: spare {spec.node_rank} does not exist with --spares {spares}")
            continue
        if spec.node_rank >= nnodes:
            _fail(f"--inject {spec}: node rank {spec.node_rank} does not exist with --nnodes {nnodes}")
        if spec.local_rank >= nproc_per_node:
            _fail(f"--inject {spec}: local rank {spec.local_rank} does not exist with --nproc-per-node "
                  f"{nproc_per_node}")
    token = os.environ.get("DP_JOB_TOKEN")
    if token_file is not None:
        token, problem = checks.read_token(token_file)
        _check(problem)
    in_slurm = None
    if not standalone:
        try:
            in_slurm = slurm.from_environment(dict(os.environ))
        except ValueError as exc:
            _fail(str(exc))
    derived = in_slurm is not None and not rdzv_endpoint
    if in_slurm is not None:  # srun dprun ...: every node of the step runs this; SLURM_NODEID is its node rank
        rdzv_endpoint = rdzv_endpoint or in_slurm.rdzv_endpoint  # node rank 0 hosts the controller
        node_rank = in_slurm.node_rank if node_rank < 0 else node_rank
        rdzv_id = rdzv_id or in_slurm.job_id
        if in_slurm.nodes < nnodes:
            _fail(f"the Slurm step has {in_slurm.nodes} node(s), fewer than --nnodes {nnodes}; ask for more with -N")
        spares = max(spares, in_slurm.nodes - nnodes)
    elif not (standalone or rdzv_endpoint) and (notice := slurm.outside_step(dict(os.environ))):
        print(notice, file=sys.stderr)
    if rdzv_endpoint:
        try:
            host, port = parse_endpoint(rdzv_endpoint)
            _check(checks.endpoint_host_problem(host))
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except ValueError as exc:
            _fail(str(exc))
        except OSError:
            _fail(f"cannot resolve {host}, the Slurm step's first node: pass --rdzv-endpoint ADDRESS:PORT with its "
                  "address, the same on every node" if derived else f"--rdzv-endpoint: cannot resolve {host!r}")
        if nnodes == 1 and node_rank < 0 and not token and is_local(host):
            standalone = True  # torchrun's single-node `--master-port P` / `--rdzv-endpoint localhost:P`
    if node_rank > 0 and (standalone or not rdzv_endpoint):
        _fail(f"--node-rank {node_rank} is one node of a multi-node job: give every node --rdzv-endpoint HOST:PORT "
              "of the node with --node-rank 0 (without it, dprun runs every node on this machine)")
    on_this_machine = standalone or not rdzv_endpoint  # (run_standalone; else run_multinode, which needs a token)
    _check(checks.counts_problem(nnodes, spares, nproc_per_node, on_this_machine),
           None if on_this_machine or token else checks.NO_TOKEN,  # (run_multinode: exit 1)
           checks.combination_problem(on_this_machine, on_spare_exhausted, save_dir, snapshot_interval, node_rank),
           checks.local_addr_problem(local_addr))
    opts = JobOptions(
        nnodes=nnodes, spares=spares, nproc_per_node=nproc_per_node, script=[script, *(script_args or [])],
        events_file=str(events_file) if events_file else None, faults=fault_specs,
        heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, probe_timeout=probe_timeout,
        hang_timeout=hang_timeout, replicas=replicas, on_spare_exhausted=on_spare_exhausted,
        on_controller_lost=on_controller_lost, slurm=in_slurm,
        spare_wait_timeout=spare_wait_timeout, snapshot_interval=snapshot_interval,
        rdzv_timeout=rdzv_timeout, rdzv_endpoint=None if standalone else rdzv_endpoint, node_rank=node_rank,
        rdzv_id=rdzv_id, token=token, local_addr=local_addr, no_python=no_python, module=module,
        restart_mode=restart_mode, max_restarts=max_restarts, log_dir=str(log_dir) if log_dir else None,
        redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter,
        tui=sys.stdout.isatty() if tui is None else tui, status_port=status_port, total_steps=total_steps,
        save_dir=str(save_dir.resolve()) if save_dir else "", resume_step=resume_step,
        resume_from=str(resume_from.resolve()) if resume_from else "", resume_older=resume_older,
        save_every=save_every, save_keep=save_keep,
        save_interval=checks.parse_duration("--save-interval", save_interval) if save_interval else 0.0,
    )
    try:
        code = run_multinode(opts) if opts.rdzv_endpoint else run_standalone(opts)
    except PortInUse as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@status_app.command(context_settings={"help_option_names": ["-h", "--help"]})
def status(
    endpoint: Optional[str] = typer.Option(
        None, "--endpoint", help="HOST:PORT that the job's dprun printed at start (default: the one job "
                                 "running on this machine)."),
    once: bool = typer.Option(False, "--once", help="Print the dashboard once and exit (the default when "
                                                     "stdout is not a terminal)."),
    as_json: bool = typer.Option(False, "--json", help="Print the job's view as one JSON object and exit."),
    timeout: float = typer.Option(10.0, "--timeout", help="Give up after this many seconds without an update."),
) -> None:
    """Attach read-only to a running job and show its live dashboard (Ctrl-C detaches; the job goes on)."""
    from .status import attach, find_endpoint

    try:
        if problem := checks.seconds_problem("--timeout", timeout):
            raise ValueError(problem)
        where = find_endpoint(endpoint)
    except ValueError as exc:
        print(f"dprun status: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    raise typer.Exit(attach(where, once, as_json, timeout))


@report_app.command(context_settings={"help_option_names": ["-h", "--help"]})
def report(
    events_file: Path = typer.Argument(..., metavar="EVENTS.jsonl",
                                       help="The JSON-lines file of a job's --events-file."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Also write a PNG timeline of throughput with failure and recovery marks "
                             "(needs matplotlib: pip install 'deadpool[plot]')."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    run: int = typer.Option(-1, "--run", help="Which run of dprun, where several appended to the file: 1 is the "
                                              "first, -1 the last."),
) -> None:
    """Every failure and recovery of a job (detect / rebuild / restore / total, lost steps) and its goodput."""
    from .report import run_report

    raise typer.Exit(run_report(events_file, plot, as_json, run))


def main(argv: list[str] | None = None) -> None:
    """`dprun status ...`, `dprun report ...`, `dprun ckpt ...`, or `dprun [OPTIONS] SCRIPT ...`; one line per
    usage error."""
    args = list(sys.argv[1:] if argv is None else argv)
    target, prog = app, "dprun"
    if args and args[0] in ("status", "report"):
        target, prog = (status_app if args[0] == "status" else report_app), f"dprun {args[0]}"
        args = args[1:]
    elif args and args[0] == "ckpt":
        from .ckpt_cli import ckpt_app  # (its commands import torch only where they export)

        target, prog, args = ckpt_app, "dprun ckpt", args[1:]
    try:
        code = target(args=args, prog_name=prog, standalone_mode=False)
    except _click_classes("UsageError") as exc:
        message = " ".join(exc.format_message().split()).rstrip(".")
        print(f"{prog}: {message[0].lower() + message[1:] if message else 'bad usage'} (see {prog} --help)",
              file=sys.stderr)
        code = 2
    except (*_click_classes("Abort"), KeyboardInterrupt):
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
