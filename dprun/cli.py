"""The `dprun` command line (typer): `dprun [OPTIONS] SCRIPT [ARGS]...` runs a job, `dprun status` and `dprun
report` watch and explain one. Options in torchrun's words (and its PET_* variables), grouped in help panels.

run parses, dprun.launcher.run_options checks (every bad input ends in one line on stderr and exit code 2),
dprun.launcher.job runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, NoReturn, Optional

import typer
from typer.core import TyperCommand

from dpcommon import stack_dump
from dpcommon.interpreter_exit import exit_quickly

from .launcher import option_checks as checks
from .launcher.job import run_multinode, run_standalone
from .launcher.run_options import OptionsError, RunArgs, options_from_args
from .launcher.controller_shell import PortInUse

app = typer.Typer(add_completion=False, rich_markup_mode=None)
status_app = typer.Typer(add_completion=False, rich_markup_mode=None)
report_app = typer.Typer(add_completion=False, rich_markup_mode=None)


def _click_classes(name: str) -> tuple[type[BaseException], ...]:
    """UsageError / Abort from the click that typer uses (its own copy since typer 0.22, else click)."""
    found: list[type[BaseException]] = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


_TERMS_WIDTH = 30  # click's: a longer option name has its help on the next line


class PanelledCommand(TyperCommand):
    """Plain help (no rich: the same text on any terminal, in a file, in a test) with the options grouped under
    their rich_help_panel, the panels in the order of their first option and aligned alike."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        sections = [(title, records) for title, records in (("Arguments", arguments), *panels.items()) if records]
        width = min(max(len(term) for _, records in sections for term, _ in records), _TERMS_WIDTH)
        for title, records in sections:
            records[0] = (records[0][0].ljust(width), records[0][1])  # (write_dl sizes its column by the longest)
            with formatter.section(title):
                formatter.write_dl(records, col_max=_TERMS_WIDTH)


EPILOG = ("Every option in full: docs/options.md. Also: `dprun status` attaches to a running job's dashboard, "
          "`dprun report EVENTS.jsonl` explains its failures and recoveries (each has --help). Options with a "
          "torchrun twin also read its PET_* environment variable (PET_ and the name in capitals: PET_NNODES, "
          "PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, ...).")

_RUN_SETTINGS = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
_D = RunArgs(script="")  # the defaults
JOB, NODES, FAULTS, SAVING, OUTPUT, TORCHRUN = (
    "Job", "Multi-node", "Fault tolerance", "Saving and resuming", "Output", "torchrun compatibility")


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"dprun: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _option(default: Any, *names: str, panel: str, help: str, **kw: Any) -> Any:
    """An option of `dprun run` in its help panel; a torchrun twin's PET_* variable is said once, in the epilog."""
    return typer.Option(default, *names, rich_help_panel=panel, help=help, show_envvar=False, **kw)


@app.command(cls=PanelledCommand, context_settings=_RUN_SETTINGS, epilog=EPILOG)
def run(
    script: str = typer.Argument(..., metavar="SCRIPT",
                                 help="Training script (a module with -m, a command with --no-python)."),
    script_args: Optional[List[str]] = typer.Argument(None, metavar="[ARGS]...", help="Arguments of the script."),
    # Job
    nnodes: str = _option(_D.nnodes, "--nnodes", envvar="PET_NNODES", metavar="N", panel=JOB,
                          help="Nodes that train: N, or torchrun's N:N."),
    spares: int = _option(_D.spares, "--spares", metavar="K", panel=JOB,
                          help="Idle nodes that replace failed ones."),
    nproc_per_node: str = _option(_D.nproc_per_node, "--nproc-per-node", "--nproc_per_node",
                                  envvar="PET_NPROC_PER_NODE", metavar="N", panel=JOB,
                                  help="Workers per node: N, auto, cpu or gpu."),
    recovery: str = _option(_D.recovery, "--recovery", metavar="HOW", panel=JOB,
                            help="hot-swap, restart, or auto: hot-swap if SCRIPT uses dpstate."),
    module: bool = _option(_D.module, "-m", "--module", envvar="PET_MODULE", panel=JOB,
                           help="SCRIPT is a Python module (python -m)."),
    no_python: bool = _option(_D.no_python, "--no-python", "--no_python", envvar="PET_NO_PYTHON", panel=JOB,
                              help="Run SCRIPT as a command, not with Python."),
    # Multi-node
    rdzv_endpoint: Optional[str] = _option(_D.rdzv_endpoint, "--rdzv-endpoint", "--rdzv_endpoint",
                                           envvar="PET_RDZV_ENDPOINT", metavar="HOST:PORT", panel=NODES,
                                           help="The controller's address (multi-node)."),
    node_rank: int = _option(_D.node_rank, "--node-rank", "--node_rank", envvar="PET_NODE_RANK", metavar="R",
                             panel=NODES, help="0 hosts the controller; >= --nnodes: a spare."),
    token_file: Optional[Path] = _option(_D.token_file, "--token-file", metavar="FILE", panel=NODES,
                                         help="The job's secret (or set DP_JOB_TOKEN)."),
    local_addr: Optional[str] = _option(_D.local_addr, "--local-addr", "--local_addr", envvar="PET_LOCAL_ADDR",
                                        metavar="ADDR", panel=NODES, help="This node's address for replica traffic."),
    rdzv_id: Optional[str] = _option(_D.rdzv_id, "--rdzv-id", "--rdzv_id", envvar="PET_RDZV_ID", metavar="ID",
                                     panel=NODES, help="Job id (default: Slurm's, or a random one)."),
    rdzv_timeout: float = _option(_D.rdzv_timeout, "--rdzv-timeout", metavar="SECONDS", panel=NODES,
                                  help="Wait this long for every node to register."),
    # Fault tolerance
    replicas: int = _option(_D.replicas, "--replicas", metavar="R", panel=FAULTS,
                            help="Peer nodes holding each node's snapshots."),
    snapshot_interval: Optional[str] = _option(
        _D.snapshot_interval, "--snapshot-interval", metavar="N", panel=FAULTS,
        help="Every N steps (default 1), auto (under 1% of step time; auto:0.02 for 2%) or off."),
    snapshot_check: Optional[str] = _option(_D.snapshot_check, "--snapshot-check", metavar="N", panel=FAULTS,
                                            help="Checksum 1 in N data parallel blocks (default 8), or full."),
    heartbeat_interval: float = _option(_D.heartbeat_interval, "--heartbeat-interval", metavar="SECONDS",
                                        panel=FAULTS, help="Time between heartbeats."),
    heartbeat_timeout: float = _option(_D.heartbeat_timeout, "--heartbeat-timeout", metavar="SECONDS",
                                       panel=FAULTS, help="A node silent this long is failed."),
    probe_timeout: float = _option(_D.probe_timeout, "--probe-timeout", metavar="SECONDS", panel=FAULTS,
                                   help="A probed node this slow to answer is failed."),
    hang_timeout: float = _option(_D.hang_timeout, "--hang-timeout", metavar="SECONDS", panel=FAULTS,
                                  help="No step anywhere this long: a hang; 0: off."),
    on_spare_exhausted: str = _option(_D.on_spare_exhausted, "--on-spare-exhausted", metavar="fail|wait|shrink",
                                      panel=FAULTS, help="No spare left: fail, wait for a node, or go on narrow."),
    shrink_fallback: str = _option(_D.shrink_fallback, "--shrink-fallback", metavar="fail|wait", panel=FAULTS,
                                   help="What --on-spare-exhausted shrink does where the job cannot shrink."),
    spare_wait_timeout: float = _option(_D.spare_wait_timeout, "--spare-wait-timeout", metavar="SECONDS",
                                        panel=FAULTS, help="How long --on-spare-exhausted wait waits."),
    on_controller_lost: str = _option(_D.on_controller_lost, "--on-controller-lost", metavar="cancel|requeue",
                                      panel=FAULTS, help="Under srun: cancel or requeue if the head dies."),
    max_restarts: int = _option(_D.max_restarts, "--max-restarts", "--max_restarts", envvar="PET_MAX_RESTARTS",
                                metavar="N", panel=FAULTS, help="Restarts allowed to a script without dpstate."),
    inject: Optional[List[str]] = _option(None, "--inject", metavar="KIND:NODE@TRIGGER", panel=FAULTS,
                                          help="Rehearse a fault, e.g. kill-node:1@step=20."),
    # Saving and resuming
    save_dir: Optional[Path] = _option(_D.save_dir, "--save-dir", metavar="DIR", panel=SAVING,
                                       help="Where a stopping job saves its newest step."),
    save_every: int = _option(_D.save_every, "--save-every", metavar="N", panel=SAVING,
                              help="Background saves every N steps; 0: off."),
    save_interval: Optional[str] = _option(_D.save_interval, "--save-interval", metavar="DURATION", panel=SAVING,
                                           help="Background saves at most this often (30m)."),
    save_keep: int = _option(_D.save_keep, "--save-keep", metavar="K", panel=SAVING,
                             help="Background saves keep the newest K steps."),
    resume_from: Optional[Path] = _option(_D.resume_from, "--resume-from", metavar="DIR", panel=SAVING,
                                          help="Go on from a --save-dir (or a step-S in it)."),
    # Output
    tui: Optional[bool] = _option(_D.tui, "--tui/--no-tui", panel=OUTPUT,
                                  help="The live dashboard (default on a terminal)."),
    status_port: int = _option(_D.status_port, "--status-port", metavar="PORT", panel=OUTPUT,
                               help="Where `dprun status` attaches (0: any free)."),
    events_file: Optional[Path] = _option(_D.events_file, "--events-file", metavar="FILE", panel=OUTPUT,
                                          help="Append every event as a JSON line."),
    total_steps: Optional[int] = _option(_D.total_steps, "--total-steps", metavar="N", panel=OUTPUT,
                                         help="Steps in the job, for the progress bar."),
    log_dir: Optional[Path] = _option(_D.log_dir, "--log-dir", "--log_dir", envvar="PET_LOG_DIR", metavar="DIR",
                                      panel=OUTPUT, help="Keep every worker's stdout and stderr here."),
    redirects: str = _option(_D.redirects, "-r", "--redirects", envvar="PET_REDIRECTS", metavar="STREAMS",
                             panel=OUTPUT, help="Log files only: 1 stdout, 2 stderr, 3 both."),
    tee: str = _option(_D.tee, "-t", "--tee", envvar="PET_TEE", metavar="STREAMS", panel=OUTPUT,
                       help="To log files and the console: as -r."),
    local_ranks_filter: str = _option(_D.local_ranks_filter, "--local-ranks-filter", "--local_ranks_filter",
                                      envvar="PET_LOCAL_RANKS_FILTER", metavar="RANKS", panel=OUTPUT,
                                      help="Console output of these local ranks only."),
    # torchrun compatibility
    standalone: bool = _option(_D.standalone, "--standalone", envvar="PET_STANDALONE", panel=TORCHRUN,
                               help="Every node on this machine (the default)."),
    master_addr: Optional[str] = _option(_D.master_addr, "--master-addr", "--master_addr", envvar="PET_MASTER_ADDR",
                                         metavar="ADDR", panel=TORCHRUN, help="Same as --rdzv-endpoint ADDR:PORT."),
    master_port: Optional[int] = _option(_D.master_port, "--master-port", "--master_port", envvar="PET_MASTER_PORT",
                                         metavar="PORT", panel=TORCHRUN, help="With --master-addr (default 29500)."),
    rdzv_backend: str = _option(_D.rdzv_backend, "--rdzv-backend", "--rdzv_backend", envvar="PET_RDZV_BACKEND",
                                metavar="NAME", panel=TORCHRUN, help="Accepted; the controller is the rendezvous."),
    monitor_interval: Optional[float] = _option(
        _D.monitor_interval, "--monitor-interval", "--monitor_interval", envvar="PET_MONITOR_INTERVAL",
        metavar="SECONDS", panel=TORCHRUN, help="Sets --heartbeat-interval."),
) -> None:
    """Run SCRIPT on --nnodes nodes with --spares spares; survive node failures by hot-swapping a spare."""
    args = RunArgs(
        script=script, script_args=tuple(script_args or ()), nnodes=nnodes, spares=spares,
        nproc_per_node=nproc_per_node, recovery=recovery, module=module, no_python=no_python,
        rdzv_endpoint=rdzv_endpoint, node_rank=node_rank, token_file=token_file, local_addr=local_addr,
        rdzv_id=rdzv_id, rdzv_timeout=rdzv_timeout, replicas=replicas, snapshot_interval=snapshot_interval,
        snapshot_check=snapshot_check, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
        probe_timeout=probe_timeout, hang_timeout=hang_timeout, on_spare_exhausted=on_spare_exhausted,
        shrink_fallback=shrink_fallback,
        spare_wait_timeout=spare_wait_timeout, on_controller_lost=on_controller_lost, max_restarts=max_restarts,
        inject=tuple(inject or ()), save_dir=save_dir, save_every=save_every, save_interval=save_interval,
        save_keep=save_keep, resume_from=resume_from, tui=tui, status_port=status_port, events_file=events_file,
        total_steps=total_steps, log_dir=log_dir, redirects=redirects, tee=tee,
        local_ranks_filter=local_ranks_filter, standalone=standalone, master_addr=master_addr,
        master_port=master_port, rdzv_backend=rdzv_backend, monitor_interval=monitor_interval)
    try:
        opts, notices = options_from_args(args, dict(os.environ), sys.stdout.isatty())
    except OptionsError as exc:
        _fail(str(exc))
    for notice in notices:
        print(f"dprun: {notice}", file=sys.stderr)
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
    from .monitor.status import attach, find_endpoint

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
    from .monitor.report import run_report

    raise typer.Exit(run_report(events_file, plot, as_json, run))


def main(argv: list[str] | None = None) -> None:
    """`dprun status ...`, `dprun report ...`, `dprun ckpt ...`, or `dprun [OPTIONS] SCRIPT ...`; one line per
    usage error."""
    exit_quickly()
    stack_dump.install()
    args = list(sys.argv[1:] if argv is None else argv)
    target, prog = app, "dprun"
    if args and args[0] in ("status", "report"):
        target, prog = (status_app if args[0] == "status" else report_app), f"dprun {args[0]}"
        args = args[1:]
    elif args and args[0] == "ckpt":
        from .checkpoints.commands import ckpt_app  # (its commands import torch only where they export)

        target, prog, args = ckpt_app, "dprun ckpt", args[1:]
    try:
        code = target(args=args, prog_name=prog, standalone_mode=False)
    except _click_classes("UsageError") as exc:
        said: str = exc.format_message()  # type: ignore[attr-defined]  # (click's UsageError, either copy)
        message = " ".join(said.split()).rstrip(".")
        print(f"{prog}: {message[0].lower() + message[1:] if message else 'bad usage'} (see {prog} --help)",
              file=sys.stderr)
        code = 2
    except _click_classes("Abort") + (KeyboardInterrupt,):
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
